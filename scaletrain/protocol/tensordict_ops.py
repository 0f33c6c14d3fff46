"""Row operations on TensorDict batches laid out as ``tensordict_io`` makes them (verl 0.9's TensorDict batch API):
dense tensors, jagged nested tensors (one variable-length row each, ragged along any dimension), non-tensor
columns (``NonTensorStack``) and batch-wide values (``NonTensorData``).

Layer 0 (scaletrain/protocol). Every function builds new containers and leaves its inputs as they were. A jagged
tensor is rebuilt from its rows with ``nested_tensor_from_tensor_list``, which keeps the dimension it is ragged
along; a batch-wide value is the first part's on concatenation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from scaletrain.protocol.errors import DataProtoError
from scaletrain.protocol.merge import values_equal
from scaletrain.protocol.rows import mini_batch_orders, pad_rows
from scaletrain.protocol.tensordict_io import non_tensor_stack, plain_value


def nested_tensor_from_tensor_list(tensors: Sequence[torch.Tensor], ragged_idx: int | None = None) -> torch.Tensor:
    """A jagged nested tensor of ``tensors`` (the rows), ragged along row dimension ``ragged_idx - 1`` (default:
    the last); the other dimensions must agree."""
    if not tensors:
        raise DataProtoError("nested_tensor_from_tensor_list needs at least one tensor")
    dims = tensors[0].dim()
    ragged_idx = dims if ragged_idx is None else ragged_idx
    if not 1 <= ragged_idx <= max(dims, 1):
        raise DataProtoError(f"ragged_idx must be in [1, {dims}], got {ragged_idx}")
    if dims == 1:
        return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)
    axis = ragged_idx - 1
    lengths = torch.tensor([t.shape[axis] for t in tensors], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(torch.cat(list(tensors), dim=axis), offsets, jagged_dim=ragged_idx)


def _rows_of(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind(0))


def _rebuild(t: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """``rows`` (of nested tensor ``t``) as a nested tensor ragged where ``t`` is."""
    return nested_tensor_from_tensor_list(rows, ragged_idx=t._ragged_idx)  # type: ignore[attr-defined]


def concat_nested_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Jagged nested tensors' rows, in order, as one."""
    rows = [row for t in tensors for row in _rows_of(t)]
    return _rebuild(tensors[0], rows)


def _rows(td: TensorDict) -> int:
    if len(td.batch_size) == 0:
        raise DataProtoError("this TensorDict has no batch dimension (only batch-wide values)")
    return int(td.batch_size[0])


def index_select_tensor_dict(td: TensorDict, indices: Any) -> TensorDict:
    """The rows ``indices`` (ints: a list, array or tensor) of every column, in that order."""
    index = torch.as_tensor(np.asarray(indices.tolist() if torch.is_tensor(indices) else indices), dtype=torch.long)
    out = TensorDict({}, batch_size=[len(index)])
    for key, val in _entries(td):
        if isinstance(val, NonTensorStack):
            out[key] = non_tensor_stack([plain_value(val[int(i)]) for i in index])
        elif isinstance(val, NonTensorData):
            out[key] = NonTensorData(val.data)
        elif val.is_nested:
            rows = _rows_of(val)
            out[key] = _rebuild(val, [rows[int(i)] for i in index])
        else:
            out[key] = val.index_select(0, index.to(val.device))
    return out


def _entries(td: TensorDict) -> Iterator[tuple[str, Any]]:
    """(key, entry): a tensor, NonTensorStack or NonTensorData (the layout tensordict_io makes; no sub-dicts)."""
    for key, val in td.items():
        if isinstance(val, TensorDict):
            raise DataProtoError(f"'{key}' is a nested TensorDict: batches hold tensors and non-tensor entries only")
        yield key, val


def chunk_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    """``chunks`` consecutive parts (as ``torch.chunk``: the first ones one row longer when the length does not
    divide), nested tensors kept ragged where they were."""
    rows = _rows(td)
    size = -(-rows // chunks)
    return [index_select_tensor_dict(td, list(range(s, min(s + size, rows)))) for s in range(0, rows, size)]


def concat_tensordict(parts: Sequence[TensorDict]) -> TensorDict:
    """The parts' rows in order (dense tensors, nested tensors and non-tensor columns); batch-wide values are the
    first part's."""
    if not parts:
        raise DataProtoError("concat_tensordict needs at least one TensorDict")
    first = parts[0]
    has_rows = len(first.batch_size) > 0
    out = TensorDict({}, batch_size=[sum(_rows(p) for p in parts)] if has_rows else [])
    for key, val in _entries(first):
        values = [p.get(key) for p in parts]
        if isinstance(val, NonTensorData):
            out[key] = NonTensorData(val.data)
        elif isinstance(val, NonTensorStack):
            out[key] = non_tensor_stack([plain_value(item) for v in values for item in v])
        elif val.is_nested:
            out[key] = concat_nested_tensors(values)
        else:
            out[key] = torch.cat(values, dim=0)
    return out


def union_tensor_dict(td1: TensorDict, td2: TensorDict) -> TensorDict:
    """``td2``'s entries added to ``td1`` (in place, also returned); a shared key must hold equal values, and keeps
    ``td1``'s own (so the two do not share one mutable column afterwards)."""
    for key, val in td2.items():
        if key not in td1.keys():
            td1[key] = val
        elif not _entries_equal(td1.get(key), val):
            raise DataProtoError(f"union: '{key}' differs between the two TensorDicts")
    return td1


def _entries_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (NonTensorData, NonTensorStack)) or isinstance(b, (NonTensorData, NonTensorStack)):
        return type(a) is type(b) and values_equal(plain_value(a), plain_value(b))
    if a.is_nested or b.is_nested:
        ra, rb = (_rows_of(a), _rows_of(b)) if a.is_nested and b.is_nested else ([], [None])
        return len(ra) == len(rb) and all(values_equal(x, y) for x, y in zip(ra, rb))
    return values_equal(a, b)


def assert_tensordict_eq(td1: TensorDict, td2: TensorDict) -> None:
    """Raises an AssertionError (a ``DataProtoError``) naming the first key whose entries differ."""
    if set(td1.keys()) != set(td2.keys()):
        raise DataProtoError(f"keys differ: {sorted(set(td1.keys()) ^ set(td2.keys()))}")
    for key in td1.keys():
        if not _entries_equal(td1.get(key), td2.get(key)):
            raise DataProtoError(f"'{key}' differs between the two TensorDicts")


def get(td: TensorDict, key: str, default: Any = None) -> Any:
    """A column (tensor, or a list for a non-tensor column) or a batch-wide value; ``default`` when absent."""
    return plain_value(td.get(key)) if key in td.keys() else default


def pop(td: TensorDict, key: str, default: Any = None) -> Any:
    """As ``get``, removing the entry."""
    return plain_value(td.pop(key)) if key in td.keys() else default


def get_keys(td: TensorDict, keys: Sequence[str]) -> TensorDict:
    """A TensorDict of only ``keys`` (KeyError naming a missing one)."""
    missing = [k for k in keys if k not in td.keys()]
    if missing:
        raise KeyError(f"keys {missing} not in this TensorDict; it has {sorted(td.keys())}")
    out = TensorDict({}, batch_size=td.batch_size)
    for key in keys:
        out[key] = td.get(key)
    return out


def pop_keys(td: TensorDict, keys: Sequence[str]) -> TensorDict:
    """As ``get_keys``, removing them from ``td``."""
    out = get_keys(td, keys)
    for key in keys:
        td.pop(key)
    return out


def assign_non_tensor_stack(td: TensorDict, key: str, values: Sequence[Any] | np.ndarray) -> TensorDict:
    """A non-tensor column (one value per row, any nesting) under ``key``."""
    if len(values) != _rows(td):
        raise RuntimeError(f"'{key}' has {len(values)} rows, the TensorDict {_rows(td)}")
    td[key] = non_tensor_stack(values)
    return td


def assign_non_tensor(td: TensorDict, **values: Any) -> TensorDict:
    """Each value under its name: a list or array as a non-tensor column (one entry per row), a NonTensorStack as
    given, anything else as a batch-wide value."""
    for key, val in values.items():
        if isinstance(val, NonTensorStack):
            if len(val) != _rows(td):
                raise RuntimeError(f"'{key}' has {len(val)} rows, the TensorDict {_rows(td)}")
            td[key] = val
        elif isinstance(val, (list, np.ndarray)):
            assign_non_tensor_stack(td, key, val)
        else:
            td[key] = val if isinstance(val, NonTensorData) else NonTensorData(val)
    return td


def pad_to_divisor(td: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """Rows appended (the TensorDict's own, cycling from the first) so the length divides; (padded, pad rows)."""
    extra = pad_rows(_rows(td), size_divisor)
    if not extra:
        return td, 0
    return concat_tensordict([td, index_select_tensor_dict(td, extra)]), len(extra)


def unpad(td: TensorDict, pad_size: int) -> TensorDict:
    return index_select_tensor_dict(td, list(range(_rows(td) - pad_size))) if pad_size else td


def make_iterator(
    td: TensorDict, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
) -> Iterator[TensorDict]:
    """Mini-batches over ``epochs`` passes, reshuffled per pass (seeded) when ``dataloader_kwargs`` says
    ``shuffle``; a last short batch is kept unless it says ``drop_last``."""
    kwargs = dataloader_kwargs or {}
    shuffle, drop_last = bool(kwargs.get("shuffle")), bool(kwargs.get("drop_last"))
    for index in mini_batch_orders(_rows(td), mini_batch_size, epochs, seed, shuffle, drop_last):
        yield index_select_tensor_dict(td, index)


def contiguous(td: TensorDict) -> TensorDict:
    """A copy whose tensors are contiguous (so ``consolidate`` works); other entries as they are."""
    out = TensorDict({}, batch_size=td.batch_size)
    for key, val in td.items():
        out[key] = val.contiguous() if isinstance(val, torch.Tensor) and not isinstance(val, TensorDict) else val
    return out
