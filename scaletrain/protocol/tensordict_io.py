"""A DataProto as one TensorDict and back: tensors as they are, each non-tensor column a ``NonTensorStack`` (one
``NonTensorData`` per row, so ragged lists, dicts and nests of them keep their shape), each meta_info value a
``NonTensorData`` (verl's TensorDict batch layout).

Layer 0 (scaletrain/protocol).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from scaletrain.protocol.errors import DataProtoError


def non_tensor_stack(values: Any) -> NonTensorStack:
    """One ``NonTensorData`` per row, stacked (a list or array of rows)."""
    rows: list = [NonTensorData(item) for item in values]  # from_list's stub names only mappings
    return NonTensorStack.from_list(rows)


def get_tensordict(tensor_dict: dict[str, Any], non_tensor_dict: dict[str, Any] | None = None) -> TensorDict:
    """A TensorDict of ``tensor_dict``'s row-aligned columns (tensors; lists and arrays become NonTensorStacks) and
    ``non_tensor_dict``'s batch-wide values (NonTensorData). Every column needs the same number of rows."""
    columns: dict[str, Any] = {}
    rows = None
    for key, val in tensor_dict.items():
        if isinstance(val, (list, np.ndarray)):
            if any(isinstance(v, torch.Tensor) for v in val):
                raise DataProtoError(f"'{key}': a list column holds tensors; pass them as one tensor or as numpy")
            val = non_tensor_stack(val)
        if not isinstance(val, (torch.Tensor, NonTensorStack)):
            raise DataProtoError(f"'{key}' is a {type(val).__name__}; columns are tensors, lists or numpy arrays")
        if isinstance(val, torch.Tensor) and val.is_nested and val.layout != torch.jagged:
            raise DataProtoError(f"'{key}': nested tensors must be jagged (layout=torch.jagged)")
        n = len(val) if isinstance(val, NonTensorStack) else val.shape[0]
        if rows is not None and n != rows:
            raise DataProtoError(f"'{key}' has {n} rows, expected {rows}")
        rows, columns[key] = n, val
    td = TensorDict(columns, batch_size=[rows] if rows is not None else [])
    for key, val in (non_tensor_dict or {}).items():
        if key in columns:
            raise DataProtoError(f"'{key}' is both a column and a batch-wide value")
        td[key] = NonTensorData(val)
    return td


def to_tensordict(batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray], meta_info: dict) -> TensorDict:
    columns: dict[str, Any] = dict(batch.items()) if batch is not None else {}
    common = set(columns) & set(non_tensor_batch)
    if common:
        raise DataProtoError(f"tensors and non-tensors share keys {sorted(common)}")
    for key, val in non_tensor_batch.items():
        columns[key] = non_tensor_stack(val)
    return get_tensordict(columns, meta_info)


def from_tensordict(
    td: TensorDict, meta_info: dict | None, num_batch_dims: int
) -> tuple[TensorDict | None, dict[str, np.ndarray], dict[str, Any]]:
    """(batch, non_tensor_batch, meta_info) of a TensorDict laid out as ``to_tensordict`` makes them."""
    if num_batch_dims < 1:
        raise DataProtoError(f"num_batch_dims must be >= 1, got {num_batch_dims}")
    meta = dict(meta_info or {})
    tensors, non = {}, {}
    for key, val in td.items():
        if isinstance(val, torch.Tensor):
            tensors[key] = val
        elif isinstance(val, NonTensorStack):
            if num_batch_dims != 1:
                raise DataProtoError("non-tensor columns need num_batch_dims=1")
            column = np.empty(len(val), dtype=object)
            column[:] = [plain_value(item) for item in val.tolist()]
            non[key] = column
        elif isinstance(val, NonTensorData):
            meta[key] = val.data
        else:
            raise DataProtoError(f"'{key}' is a {type(val).__name__}: not a tensor, NonTensorStack or NonTensorData")
    batch = None
    if tensors:
        batch_size = next(iter(tensors.values())).shape[:num_batch_dims]
        batch = TensorDict(tensors, batch_size=batch_size)
    return batch, non, meta


def plain_value(item: Any) -> Any:
    """A row's value as plain Python (NonTensorData unwrapped, stacks to lists)."""
    if isinstance(item, NonTensorData):
        return item.data
    if isinstance(item, NonTensorStack):
        return [plain_value(x) for x in item.tolist()]
    return item
