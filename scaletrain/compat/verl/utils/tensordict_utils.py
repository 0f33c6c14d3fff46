"""``verl.utils.tensordict_utils``: verl 0.9's TensorDict batch API over scaletrain.protocol's implementation
(``tensordict_io`` builds the layout, ``tensordict_ops`` operates on it)."""

from scaletrain.protocol.tensordict_io import get_tensordict
from scaletrain.protocol.tensordict_ops import (
    assert_tensordict_eq,
    assign_non_tensor,
    assign_non_tensor_stack,
    chunk_tensordict,
    concat_nested_tensors,
    concat_tensordict,
    contiguous,
    get,
    get_keys,
    index_select_tensor_dict,
    make_iterator,
    nested_tensor_from_tensor_list,
    pad_to_divisor,
    pop,
    pop_keys,
    union_tensor_dict,
    unpad,
)

__all__ = [
    "assert_tensordict_eq",
    "assign_non_tensor",
    "assign_non_tensor_stack",
    "chunk_tensordict",
    "concat_nested_tensors",
    "concat_tensordict",
    "contiguous",
    "get",
    "get_keys",
    "get_tensordict",
    "index_select_tensor_dict",
    "make_iterator",
    "nested_tensor_from_tensor_list",
    "pad_to_divisor",
    "pop",
    "pop_keys",
    "union_tensor_dict",
    "unpad",
]
