"""The DataProto class: one batch's row-aligned tensors, non-tensors and batch-wide values (see ``__init__``).

Layer 0 (scaletrain/protocol). The operations that do not need the class live beside it: rows.py (gathers,
repeats), merge.py (unions, concat's meta_info), reshape.py (padding, folding, column splits), tensordict_io.py,
transport.py (Ray) and codec.py (disk).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import numpy as np
import torch
from tensordict import TensorDict

from scaletrain.protocol import codec, merge, reshape, tensordict_io
from scaletrain.protocol.errors import DataProtoError
from scaletrain.protocol.rows import as_index, gather_rows, mini_batch_orders, pad_rows, repeated_rows
from scaletrain.protocol.transport import from_wire, to_wire

logger = logging.getLogger(__name__)


def _to_object_array(value: Any, key: str) -> np.ndarray:
    """A non-tensor column as a numpy array: arrays as given, a list as a 1-D object array of its rows (one value
    per row, whether the rows are ragged or of equal length)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        arr = np.empty(len(value), dtype=object)
        arr[:] = list(value)
        return arr
    raise DataProtoError(f"non-tensor field '{key}' must be a numpy array or list, got {type(value).__name__}")


@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` is a TensorDict with empty batch size, non-tensors are plain values."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {} if self.non_tensor_batch is None else self.non_tensor_batch
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    def check_consistency(self) -> None:
        """One batch dimension; every non-tensor column a numpy array with one entry per row."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise DataProtoError(f"DataProto.batch must have exactly one batch dimension, got {self.batch.batch_size}")
        n = len(self) if (self.batch is not None or self.non_tensor_batch) else 0
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray):
                raise DataProtoError(f"non-tensor field '{key}' must be a numpy array, got {type(val).__name__}")
            if len(val) != n:
                raise DataProtoError(f"non-tensor field '{key}' has {len(val)} rows, expected {n}")

    # ----------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """From named tensors (same first dimension), non-tensor columns (arrays or lists) and batch-wide values.
        ``auto_padding`` lets this DataProto chunk unevenly (reshape.DataProtoConfig)."""
        if num_batch_dims != 1:
            raise DataProtoError(f"a DataProto has exactly one batch dimension, got num_batch_dims={num_batch_dims}")
        tensors = tensors or {}
        non = {k: _to_object_array(v, k) for k, v in (non_tensors or {}).items()}
        batch = None
        if tensors:
            first_key, first = next(iter(tensors.items()))
            for key, t in tensors.items():
                if not isinstance(t, torch.Tensor):
                    raise DataProtoError(f"tensor field '{key}' must be a torch.Tensor, got {type(t).__name__}")
                if t.dim() == 0 or t.shape[0] != first.shape[0]:
                    raise DataProtoError(
                        f"tensor field '{key}' has batch size {tuple(t.shape)[:1]}, expected {first.shape[0]} "
                        f"(from '{first_key}')"
                    )
            batch = TensorDict(dict(tensors), batch_size=[first.shape[0]])
        meta = dict(meta_info or {})
        if auto_padding:
            meta[reshape.AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=non, meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Tensors go to ``batch``, numpy arrays (and lists) to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict[str, Any] | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """From a TensorDict laid out as ``to_tensordict`` makes them (tensordict_io.py)."""
        batch, non, meta = tensordict_io.from_tensordict(tensor_dict, meta_info, num_batch_dims)
        return cls(batch=batch, non_tensor_batch=non, meta_info=meta)

    def to_tensordict(self) -> TensorDict:
        """Tensors, non-tensor columns (NonTensorStack) and meta_info (NonTensorData) in one TensorDict."""
        return tensordict_io.to_tensordict(self.batch, self.non_tensor_batch, self.meta_info)

    # ----------------------------------------------------------------------------------------------- access
    @property
    def tensors(self) -> TensorDict:
        """``batch``, for code that needs the tensors: raises when this DataProto holds none (``batch`` is None)."""
        if self.batch is None:
            raise DataProtoError(f"this DataProto holds no tensors (batch is None); keys: {self.keys()}")
        return self.batch

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for val in self.non_tensor_batch.values():
            return len(val)
        return 0

    @overload
    def __getitem__(self, item: int | np.integer) -> DataProtoItem: ...
    @overload
    def __getitem__(self, item: slice | list | tuple | np.ndarray | torch.Tensor) -> DataProto: ...
    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        if isinstance(item, (int, np.integer)):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"row {item} out of range for DataProto of {n} rows")
            return DataProtoItem(
                batch=self.batch[int(item)] if self.batch is not None else None,
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto cannot be indexed by {type(item).__name__}")

    def keys(self) -> list[str]:
        return (list(self.batch.keys()) if self.batch is not None else []) + list(self.non_tensor_batch)

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` (views of the tensors; meta_info copied)."""
        item = slice(start, end, step)
        return type(self)(
            batch=self.batch[item] if self.batch is not None else None,
            non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows by int indices or a boolean mask (list, numpy array or tensor)."""
        index = as_index(idxs, len(self))
        np_index = index.numpy()
        return type(self)(
            batch=gather_rows(self.batch, index) if self.batch is not None else None,
            non_tensor_batch={k: v[np_index] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A view with only the named fields (None keeps all of that kind)."""
        self._check_keys(batch_keys, non_tensor_batch_keys, meta_info_keys)
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        non = dict(self.non_tensor_batch)
        if non_tensor_batch_keys is not None:
            non = {k: non[k] for k in non_tensor_batch_keys}
        meta = dict(self.meta_info)
        if meta_info_keys is not None:
            meta = {k: meta[k] for k in meta_info_keys}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non, meta = copy.deepcopy(non), copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non, meta_info=meta)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named fields from self and return them as a new DataProto."""
        self._check_keys(batch_keys, non_tensor_batch_keys, meta_info_keys)
        # a DataProto's batch holds plain tensors (from_dict checks it)
        tensors = {k: cast(torch.Tensor, self.tensors.pop(k)) for k in batch_keys} if batch_keys else {}
        non = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys or ()}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys or ()}
        return type(self).from_dict(tensors, non, meta)

    def rename(self, old_keys: str | Sequence[str] | None = None, new_keys: str | Sequence[str] | None = None):
        """Renames tensors (in place, also returned); ``old_keys`` and ``new_keys`` pair up."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise DataProtoError(f"rename: {len(old)} old keys but {len(new)} new keys")
        self._check_keys(old, None, None)
        for a, b in zip(old, new):
            self.tensors[b] = self.tensors.pop(a)
        return self

    def _check_keys(self, batch_keys, non_tensor_batch_keys, meta_info_keys) -> None:
        have_batch = set(self.batch.keys()) if self.batch is not None else set()
        for kind, keys, have in (
            ("batch", batch_keys, have_batch),
            ("non_tensor_batch", non_tensor_batch_keys, set(self.non_tensor_batch)),
            ("meta_info", meta_info_keys, set(self.meta_info)),
        ):
            for key in keys or ():
                if key not in have:
                    raise DataProtoError(f"unknown {kind} key '{key}'; have {sorted(have)}")

    # -------------------------------------------------------------------------------------------- combining
    def union(self, other: DataProto) -> DataProto:
        """Merge other's fields into self (in place, also returned). Shared keys must hold equal values."""
        if len(self) != len(other) and (self.keys() and other.keys()):
            raise DataProtoError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        if other.batch is not None:
            self.batch = other.batch if self.batch is None else merge.union_tensor_dict(self.batch, other.batch)
        merge.union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        merge.union_meta_info(self.meta_info, other.meta_info)
        return self

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Row-wise concatenation; every part needs the same fields. meta_info is merged (merge.merged_meta_info):
        a key several parts hold must agree; the parts' ``metrics`` are gathered into one dict of lists."""
        if not data:
            raise DataProtoError("DataProto.concat needs at least one DataProto")
        first = data[0]
        keys = set(first.keys())
        for i, part in enumerate(data[1:], start=1):
            if set(part.keys()) != keys:
                missing = sorted(keys.symmetric_difference(part.keys()))
                raise DataProtoError(f"concat: part {i} differs from part 0 in keys {missing}")
        # torch.cat dispatches to TensorDict's own concatenation (its stubs only know tensors)
        batch = cast(TensorDict, torch.cat([d.tensors for d in data], dim=0)) if first.batch is not None else None
        non = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        meta = merge.merged_meta_info(d.meta_info for d in data)
        return type(first)(batch=batch, non_tensor_batch=non, meta_info=meta)

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` equal parts. The length must divide unless auto-padding is on (``is_padding_enabled``): then
        the parts are as even as they can be, the first ones one row longer."""
        n = len(self)
        if chunks <= 0 or (n % chunks and not self.is_padding_enabled()):
            raise DataProtoError(f"only support equal chunk: cannot chunk {n} rows into {chunks} parts; pad first")
        bounds = np.cumsum([0] + [n // chunks + (i < n % chunks) for i in range(chunks)])
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Parts of ``split_size`` rows; the last one may be shorter."""
        if split_size <= 0:
            raise DataProtoError(f"split_size must be positive, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: a a b b (interleave) or a b a b (one copy per tensor: repeated_rows)."""
        if repeat_times < 1:
            raise DataProtoError(f"repeat_times must be >= 1, got {repeat_times}")
        batch = None
        if self.batch is not None:
            batch = TensorDict(
                {k: repeated_rows(v, repeat_times, interleave) for k, v in self.batch.items()},
                batch_size=[len(self) * repeat_times],
                device=self.batch.device,
            )
        if interleave:
            non = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            non = {k: np.concatenate([v] * repeat_times) for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non, meta_info=dict(self.meta_info))

    def sample_level_repeat(self, repeat_times: Any) -> DataProto:
        """Row i ``repeat_times[i]`` times, in order."""
        return reshape.sample_level_repeat(self, repeat_times)

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Each row as ``n_split`` rows, the ``split_keys`` fields cut along their second dimension."""
        return reshape.unfold_column_chunks(self, n_split, split_keys)

    def reorder(self, indices: Any) -> None:
        """Permute rows in place."""
        out = self.select_idxs(indices)
        if len(out) != len(self):
            raise DataProtoError(f"reorder needs {len(self)} indices, got {len(out)}")
        self.batch, self.non_tensor_batch = out.batch, out.non_tensor_batch

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches over ``epochs`` passes; shuffled per epoch (reproducibly) when a seed is given or
        ``dataloader_kwargs`` says ``shuffle``. ``mini_batch_size`` must divide the batch."""
        if mini_batch_size <= 0 or len(self) % mini_batch_size:
            raise DataProtoError(f"mini_batch_size {mini_batch_size} does not divide the batch of {len(self)} rows")
        shuffle = bool((dataloader_kwargs or {}).get("shuffle", seed is not None))
        for index in mini_batch_orders(len(self), mini_batch_size, epochs, seed, shuffle):
            part = self.select_idxs(index)
            part.meta_info = dict(self.meta_info)
            yield part

    # -------------------------------------------------------------------------------------------- padding
    def is_padding_enabled(self) -> bool:
        """Whether this DataProto may chunk unevenly: its own meta_info flag or ``DataProtoConfig.auto_padding``."""
        return bool(self.meta_info.get(reshape.AUTO_PADDING_KEY, False)) or reshape.DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Appends ``padding_size`` copies of the first row ("first") or of the last (otherwise), in place."""
        if padding_size:
            row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
            padded = DataProto.concat([self, row.repeat(padding_size)])
            self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def pad_to_divisor(self, size_divisor: int) -> tuple[DataProto, int]:
        """Append rows (cycling from the first) so the length divides; returns (padded, number of pad rows)."""
        extra = pad_rows(len(self), size_divisor)
        if not extra:
            if len(self) == 0:
                logger.warning("padding a DataProto with no rows: nothing to do")
            return self, 0
        return DataProto.concat([self, self.select_idxs(torch.tensor(extra))]), len(extra)

    def unpad(self, pad_size: int) -> DataProto:
        return self[: len(self) - pad_size] if pad_size else self

    # -------------------------------------------------------------------------------------- place and size
    def to(self, device: str | torch.device) -> DataProto:
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def get_data_info(self) -> str:
        """One line per field: name, shape and dtype (tensors) or type (the others)."""
        lines = [f"DataProto of {len(self)} rows"]
        for key, val in self.batch.items() if self.batch is not None else []:
            lines.append(f"  batch.{key}: {tuple(val.shape)} {val.dtype}")
        for key, val in self.non_tensor_batch.items():
            lines.append(f"  non_tensor_batch.{key}: {val.shape} {val.dtype}")
        for key, val in self.meta_info.items():
            lines.append(f"  meta_info.{key}: {type(val).__name__}")
        return "\n".join(lines)

    def print_size(self, prefix: str = "") -> None:
        tensor_mb = sum(t.numel() * t.element_size() for t in self.batch.values()) / 2**20 if self.batch else 0.0
        non_mb = sum(v.nbytes for v in self.non_tensor_batch.values()) / 2**20
        print(f"{prefix}size of tensors: {tensor_mb:.3f} MB, of non-tensor arrays: {non_mb:.3f} MB")

    # ---------------------------------------------------------------------------------------- transport
    def save_to_disk(self, filepath: str) -> None:
        codec.dump_state(to_wire(self.batch, self.non_tensor_batch, self.meta_info), filepath)

    @staticmethod
    def load_from_disk(filepath: str) -> DataProto:
        """A DataProto saved by ``save_to_disk``; a file holding anything but arrays and plain values is refused."""
        batch, non, meta = from_wire(codec.load_state(filepath))
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=meta)

    def __getstate__(self) -> dict[str, Any]:
        return to_wire(self.batch, self.non_tensor_batch, self.meta_info)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch, self.non_tensor_batch, self.meta_info = from_wire(state)
