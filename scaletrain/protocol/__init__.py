"""DataProto: the one batch type that crosses every boundary (driver <-> worker groups <-> engines).

A DataProto holds row-aligned data of one batch:
  - ``batch``: a TensorDict of tensors whose first dimension is the batch (input_ids, attention_mask, ...),
  - ``non_tensor_batch``: a dict of numpy object/str arrays with the same first dimension (data_source, ...),
  - ``meta_info``: a dict of batch-wide values (temperature, metrics, ...), not split with the rows.

Crossing a Ray boundary, tensors travel as numpy buffers (pickle protocol 5 out-of-band) so the object store
holds them without a pickle copy; the receiver copies them once into fresh, writable tensors (transport.py).
The public surface is verl's (method and helper names, arguments, semantics: concat merges meta_info and gathers
the parts' metrics); a refusal raises ``DataProtoError``, a ValueError that is also an AssertionError.

Modules: core.py (the class), collate.py, rows.py, merge.py, reshape.py, tensordict_io.py, transport.py,
codec.py, future.py.
"""

from scaletrain.protocol.codec import (
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
)
from scaletrain.protocol.collate import collate_fn
from scaletrain.protocol.core import DataProto, DataProtoItem
from scaletrain.protocol.errors import DataProtoError
from scaletrain.protocol.future import PAD_ROWS_KEY, DataProtoFuture, concat_parts, padded_shares
from scaletrain.protocol.merge import list_of_dict_to_dict_of_list, union_numpy_dict, union_tensor_dict
from scaletrain.protocol.reshape import (
    DataProtoConfig,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)
from scaletrain.protocol.rows import object_column

__all__ = [
    "PAD_ROWS_KEY",
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "DataProtoItem",
    "collate_fn",
    "concat_parts",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "object_column",
    "padded_shares",
    "serialize_single_tensor",
    "serialize_tensordict",
    "union_numpy_dict",
    "union_tensor_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]
