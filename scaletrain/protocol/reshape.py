"""Reshaping a DataProto's rows: padding to a divisor, folding rows into groups and back, splitting columns into
rows, per-row repeats; and the process-wide auto-padding switch (``DataProtoConfig``).

Layer 0 (scaletrain/protocol). Functions take the DataProto and build their result with ``type(data)``, so a
subclass stays itself; none imports the class.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from scaletrain.protocol.errors import DataProtoError

AUTO_PADDING_KEY = "_verl_auto_padding"  # meta_info flag (verl's name): this DataProto may chunk unevenly


class _DataProtoConfigMeta(type):
    _auto_padding = False

    @property
    def auto_padding(cls) -> bool:
        """Whether every DataProto may be chunked unevenly (``VERL_AUTO_PADDING=1`` in the environment also turns
        it on, as in verl): a data-parallel dispatch then pads the shares instead of refusing a length that does
        not divide."""
        return cls._auto_padding or os.environ.get("VERL_AUTO_PADDING", "").upper() in ("1", "TRUE")

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(f"auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings: ``DataProtoConfig.auto_padding = True``."""


def pad_dataproto_to_divisor(data: Any, size_divisor: int) -> tuple[Any, int]:
    """``data`` with rows appended (its own, cycling from the first) so its length divides; (padded, pad rows)."""
    return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: Any, pad_size: int) -> Any:
    """``data`` without its last ``pad_size`` rows."""
    return data.unpad(pad_size)


def fold_batch_dim(data: Any, new_batch_size: int) -> Any:
    """Rows (B, ...) -> (new_batch_size, B // new_batch_size, ...): consecutive rows become one group row."""
    rows = len(data)
    if new_batch_size <= 0 or rows % new_batch_size:
        raise DataProtoError(f"fold_batch_dim: {rows} rows do not fold into {new_batch_size} groups")
    batch = None
    if data.batch is not None:
        batch = data.batch.view(new_batch_size, -1)
        batch.auto_batch_size_(batch_dims=1)
    non = {k: np.reshape(v, (new_batch_size, -1, *v.shape[1:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non, meta_info=data.meta_info)


def unfold_batch_dim(data: Any, batch_dims: int = 2) -> Any:
    """The first ``batch_dims`` dimensions of every field flattened into the row dimension (fold's inverse)."""
    batch, rows = None, None
    if data.batch is not None:
        batch = data.batch
        batch.auto_batch_size_(batch_dims=batch_dims)
        batch = batch.view(-1)
        rows = int(batch.batch_size[0])
    non = {}
    for key, val in data.non_tensor_batch.items():
        rows = rows if rows is not None else int(np.prod(val.shape[:batch_dims]))
        non[key] = np.reshape(val, (rows, *val.shape[batch_dims:]))
    return type(data)(batch=batch, non_tensor_batch=non, meta_info=data.meta_info)


def unfold_column_chunks(data: Any, n_split: int, split_keys: list[str] | None = None) -> Any:
    """Each row becomes ``n_split`` rows: the fields in ``split_keys`` are cut along their second dimension into
    ``n_split`` equal pieces, one per new row; the other fields are repeated."""
    split_keys = list(split_keys or [])
    batch = None
    if data.batch is not None:
        tensors = {}
        for key, val in data.batch.items():
            tensors[key] = _split_columns(val, n_split, key) if key in split_keys else val.repeat_interleave(n_split, 0)
        batch = type(data.batch)(tensors, batch_size=[len(data) * n_split], device=data.batch.device)
    non = {}
    for key, val in data.non_tensor_batch.items():
        if key in split_keys:
            non[key] = _split_object_columns(val, n_split, key)
        else:
            non[key] = np.repeat(val, n_split, axis=0)
    return type(data)(batch=batch, non_tensor_batch=non, meta_info=data.meta_info)


def _split_columns(t: torch.Tensor, n_split: int, key: str) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] % n_split:
        raise DataProtoError(f"unfold_column_chunks: '{key}' of shape {tuple(t.shape)} does not split into {n_split}")
    return t.reshape(t.shape[0] * n_split, t.shape[1] // n_split, *t.shape[2:])


def _split_object_columns(arr: np.ndarray, n_split: int, key: str) -> np.ndarray:
    """A 2-D object array is cut as a tensor would be; a column of lists (one per row) is read as the table its
    rows make when they are all of one length (verl's 2-D array of them), else cut row by row."""
    if arr.ndim == 1 and len(arr) and len({len(row) for row in arr}) == 1:
        table = np.empty((len(arr), len(arr[0])), dtype=object)
        for i, row in enumerate(arr):
            table[i, :] = list(row)
        arr = table
    if arr.ndim >= 2:
        if arr.shape[1] % n_split:
            raise DataProtoError(f"unfold_column_chunks: '{key}' of shape {arr.shape} does not split into {n_split}")
        return arr.reshape(arr.shape[0] * n_split, arr.shape[1] // n_split, *arr.shape[2:])
    out = np.empty(len(arr) * n_split, dtype=object)
    for i, row in enumerate(arr):
        if len(row) % n_split:
            raise DataProtoError(
                f"unfold_column_chunks: row {i} of '{key}' ({len(row)} items) does not split into {n_split}"
            )
        size = len(row) // n_split
        for j in range(n_split):
            out[i * n_split + j] = list(row[j * size : (j + 1) * size])
    return out


def sample_level_repeat(data: Any, repeat_times: Any) -> Any:
    """Row i repeated ``repeat_times[i]`` times, in order (a list, array or tensor of counts, one per row)."""
    counts = torch.as_tensor(np.asarray(repeat_times.tolist() if torch.is_tensor(repeat_times) else repeat_times))
    if counts.dim() != 1 or len(counts) != len(data) or bool((counts < 0).any()):
        raise DataProtoError(f"sample_level_repeat needs one count >= 0 per row ({len(data)}), got {repeat_times!r}")
    index = torch.repeat_interleave(torch.arange(len(data)), counts.long())
    return data.select_idxs(index)
