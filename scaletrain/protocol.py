"""DataProto: the one batch type that crosses every boundary (driver <-> worker groups <-> engines).

A DataProto holds row-aligned data of one batch:
  - ``batch``: a TensorDict of tensors whose first dimension is the batch (input_ids, attention_mask, ...),
  - ``non_tensor_batch``: a dict of numpy object/str arrays with the same first dimension (data_source, ...),
  - ``meta_info``: a dict of batch-wide values (temperature, metrics, ...), not split with the rows.

Crossing a Ray boundary, tensors travel as numpy buffers (pickle protocol 5 out-of-band) so the object store
holds them without a pickle copy; the receiver copies them once into fresh, writable tensors
(scaletrain/protocol_transport.py).

``DataProtoFuture`` wraps Ray object refs of DataProtos for non-blocking worker-group calls; it imports Ray
lazily, so engines can use this module without Ray.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import numpy as np
import torch
from tensordict import TensorDict

from scaletrain.protocol_rows import as_index, gather_rows, repeated_rows
from scaletrain.protocol_transport import from_wire, to_wire

# meta_info key set on each dispatched chunk: how many trailing rows of the chunk are padding. The worker-side
# wrapper pops it and trims the method's output by as many rows (see controller/decorator.py).
PAD_ROWS_KEY = "dispatch/pad_rows"


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(_values_equal(x, y) for x, y in zip(a.tolist(), b.tolist()))
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # ambiguous truth value of arrays nested in objects
        return a is b


def _to_object_array(value: Any, key: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        arr = np.empty(len(value), dtype=object)
        arr[:] = list(value)
        return arr
    raise ValueError(f"non-tensor field '{key}' must be a numpy array or list, got {type(value).__name__}")


@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` is a TensorDict with empty batch size, non-tensors are plain values."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any]


@dataclass
class DataProto:
    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(f"DataProto.batch must have exactly one batch dimension, got {self.batch.batch_size}")
        n = len(self) if (self.batch is not None or self.non_tensor_batch) else 0
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray):
                raise ValueError(f"non-tensor field '{key}' must be a numpy array, got {type(val).__name__}")
            if len(val) != n:
                raise ValueError(f"non-tensor field '{key}' has {len(val)} rows, expected {n}")

    # ----------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        tensors = tensors or {}
        non = {k: _to_object_array(v, k) for k, v in (non_tensors or {}).items()}
        batch = None
        if tensors:
            first_key, first = next(iter(tensors.items()))
            n = first.shape[0]
            for key, t in tensors.items():
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"tensor field '{key}' must be a torch.Tensor, got {type(t).__name__}")
                if t.dim() == 0 or t.shape[0] != n:
                    raise ValueError(
                        f"tensor field '{key}' has batch size {tuple(t.shape)[:1]}, expected {n} (from '{first_key}')"
                    )
            batch = TensorDict(dict(tensors), batch_size=[n])
        return cls(batch=batch, non_tensor_batch=non, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Tensors go to ``batch``, numpy arrays (and lists) to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non, meta_info)

    # ----------------------------------------------------------------------------------------------- access
    @property
    def tensors(self) -> TensorDict:
        """``batch``, for code that needs the tensors: raises when this DataProto holds none (``batch`` is None)."""
        if self.batch is None:
            raise ValueError(f"this DataProto holds no tensors (batch is None); keys: {self.keys()}")
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
            return DataProto(
                batch=self.batch[item] if self.batch is not None else None,
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=dict(self.meta_info),
            )
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto cannot be indexed by {type(item).__name__}")

    def keys(self) -> list[str]:
        return (list(self.batch.keys()) if self.batch is not None else []) + list(self.non_tensor_batch)

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows by int indices or a boolean mask (list, numpy array or tensor)."""
        index = as_index(idxs, len(self))
        np_index = index.numpy()
        return DataProto(
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
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=meta)

    def pop(
        self,
        batch_keys: Sequence[str] = (),
        non_tensor_batch_keys: Sequence[str] = (),
        meta_info_keys: Sequence[str] = (),
    ) -> DataProto:
        """Remove the named fields from self and return them as a new DataProto."""
        self._check_keys(batch_keys, non_tensor_batch_keys, meta_info_keys)
        # a DataProto's batch holds plain tensors (from_dict checks it)
        tensors = {k: cast(torch.Tensor, self.tensors.pop(k)) for k in batch_keys} if batch_keys else {}
        non = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataProto.from_dict(tensors, non, meta)

    def _check_keys(self, batch_keys, non_tensor_batch_keys, meta_info_keys) -> None:
        have_batch = set(self.batch.keys()) if self.batch is not None else set()
        for kind, keys, have in (
            ("batch", batch_keys, have_batch),
            ("non_tensor_batch", non_tensor_batch_keys, set(self.non_tensor_batch)),
            ("meta_info", meta_info_keys, set(self.meta_info)),
        ):
            for key in keys or ():
                if key not in have:
                    raise ValueError(f"unknown {kind} key '{key}'; have {sorted(have)}")

    # -------------------------------------------------------------------------------------------- combining
    def union(self, other: DataProto) -> DataProto:
        """Merge other's fields into self (in place, also returned). Shared keys must hold equal values."""
        if len(self) != len(other) and (self.keys() and other.keys()):
            raise ValueError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for key, val in other.batch.items():
                    if key in self.batch.keys() and not _values_equal(self.batch[key], val):
                        raise ValueError(f"union: batch key '{key}' differs between the two DataProtos")
                    self.batch[key] = val
        for key, val in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _values_equal(self.non_tensor_batch[key], val):
                raise ValueError(f"union: non_tensor_batch key '{key}' differs between the two DataProtos")
            self.non_tensor_batch[key] = val
        for key, val in other.meta_info.items():
            if key in self.meta_info and not _values_equal(self.meta_info[key], val):
                raise ValueError(f"union: meta_info key '{key}' differs between the two DataProtos")
            self.meta_info[key] = val
        return self

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Row-wise concatenation; every part needs the same fields. meta_info is taken from the first part."""
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        first = data[0]
        keys = set(first.keys())
        for i, part in enumerate(data[1:], start=1):
            if set(part.keys()) != keys:
                missing = sorted(keys.symmetric_difference(part.keys()))
                raise ValueError(f"concat: part {i} differs from part 0 in keys {missing}")
        # torch.cat dispatches to TensorDict's own concatenation (its stubs only know tensors)
        batch = cast(TensorDict, torch.cat([d.tensors for d in data], dim=0)) if first.batch is not None else None
        non = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=dict(first.meta_info))

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` equal parts; the length must divide (see ``pad_to_divisor``)."""
        if chunks <= 0 or len(self) % chunks:
            raise ValueError(f"cannot chunk {len(self)} rows into {chunks} equal parts; pad first")
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Parts of ``split_size`` rows; the last one may be shorter."""
        if split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: a a b b (interleave) or a b a b (one copy per tensor: repeated_rows)."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
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
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=dict(self.meta_info))

    def reorder(self, indices: Any) -> None:
        """Permute rows in place."""
        out = self.select_idxs(indices)
        if len(out) != len(self):
            raise ValueError(f"reorder needs {len(self)} indices, got {len(out)}")
        self.batch, self.non_tensor_batch = out.batch, out.non_tensor_batch

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, seed: int | None = None, shuffle: bool | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches over ``epochs`` passes; shuffled per epoch when a seed is given (reproducibly)."""
        if mini_batch_size <= 0 or len(self) % mini_batch_size:
            raise ValueError(f"mini_batch_size {mini_batch_size} does not divide the batch of {len(self)} rows")
        shuffle = seed is not None if shuffle is None else shuffle
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        for _ in range(epochs):
            order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
            for start in range(0, len(self), mini_batch_size):
                part = self.select_idxs(order[start : start + mini_batch_size])
                part.meta_info = dict(self.meta_info)
                yield part

    # -------------------------------------------------------------------------------------------- padding
    def pad_to_divisor(self, size_divisor: int) -> tuple[DataProto, int]:
        """Append rows (cycling from the first) so the length divides; returns (padded, number of pad rows)."""
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty DataProto")
        pad = (-n) % size_divisor
        if pad == 0:
            return self, 0
        return DataProto.concat([self, self.select_idxs(torch.arange(pad) % n)]), pad

    def unpad(self, pad_size: int) -> DataProto:
        return self[: len(self) - pad_size] if pad_size else self

    def to(self, device: str | torch.device) -> DataProto:
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    # ---------------------------------------------------------------------------------------- transport
    def __getstate__(self) -> dict[str, Any]:
        return to_wire(self.batch, self.non_tensor_batch, self.meta_info)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch, self.non_tensor_batch, self.meta_info = from_wire(state)


@dataclass
class DataProtoFuture:
    """Deferred DataProto: Ray refs of the parts, how to combine them, and (for a dispatched share) which share.

    ``get()`` fetches the parts, applies ``collect_fn`` (e.g. DataProto.concat) and then ``dispatch_fn`` (e.g.
    take chunk i of n). Worker methods registered with ``materialize_futures=True`` call it on arrival.
    """

    collect_fn: Callable[[list[Any]], Any]
    futures: list[Any]
    dispatch_fn: Callable[[Any], Any] | None = None

    @staticmethod
    def concat(futures: list[Any]) -> DataProtoFuture:
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(futures))

    def then(self, fn: Callable[[Any], Any]) -> DataProtoFuture:
        """A future whose value is ``fn`` applied to this one's."""
        return DataProtoFuture(
            self.collect_fn, self.futures, fn if self.dispatch_fn is None else _Compose(self.dispatch_fn, fn)
        )

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """Share i of ``chunks`` equal shares, padded on materialisation when the length does not divide."""
        return [self.then(_PaddedShare(chunks, i)) for i in range(chunks)]

    def get(self) -> Any:
        import ray  # lazy: engines use DataProto without Ray

        output = self.collect_fn(ray.get(self.futures))
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output


def padded_shares(data: DataProto, shares: int) -> list[DataProto]:
    """Split into ``shares`` equal parts, padding first; each part records its trailing pad rows in meta_info."""
    padded, pad = data.pad_to_divisor(shares)
    parts = padded.chunk(shares)
    size = len(padded) // shares
    for i, part in enumerate(parts):
        part.meta_info = dict(data.meta_info)
        part.meta_info[PAD_ROWS_KEY] = max(0, min(size, (i + 1) * size - len(data)))
    return parts


@dataclass
class _Compose:
    first: Callable[[Any], Any]
    second: Callable[[Any], Any]

    def __call__(self, data: Any) -> Any:
        return self.second(self.first(data))


@dataclass
class _PaddedShare:
    """'Take share i of n' for futures, as a plain object so its repr says what it does."""

    shares: int
    index: int

    def __call__(self, data: DataProto) -> DataProto:
        return padded_shares(data, self.shares)[self.index]
