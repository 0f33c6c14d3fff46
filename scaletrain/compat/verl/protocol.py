"""``verl.protocol`` over ``scaletrain.protocol``: DataProto and its helpers, with verl's names and semantics."""

from scaletrain.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    DataProtoItem,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "union_numpy_dict",
    "union_tensor_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]
