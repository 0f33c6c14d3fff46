"""DataProtoFuture (Ray refs of DataProtos for non-blocking worker-group calls) and the padded shares a
data-parallel dispatch sends. Imports Ray lazily, so engines can use DataProto without Ray (layer 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict

from scaletrain.protocol.core import DataProto
from scaletrain.protocol.errors import DataProtoError
from scaletrain.protocol.tensordict_ops import concat_tensordict

# meta_info key set on each dispatched chunk: how many trailing rows of the chunk are padding. The worker-side
# wrapper pops it and trims the method's output by as many rows (see controller/decorator.py).
PAD_ROWS_KEY = "dispatch/pad_rows"


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
        return DataProtoFuture(collect_fn=concat_parts, futures=list(futures))

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


def concat_parts(parts: list[Any]) -> Any:
    """Workers' row-aligned outputs as one: DataProtos concatenated (DataProto.concat), TensorDicts (verl's
    TensorDict workers) along their batch dimension."""
    if all(isinstance(p, DataProto) for p in parts):
        return DataProto.concat(parts)
    if parts and all(isinstance(p, TensorDict) for p in parts):
        return concat_tensordict(parts)  # jagged columns stay jagged, non-tensor columns are joined
    kinds = sorted({type(p).__name__ for p in parts})
    raise DataProtoError(f"row-aligned outputs to concatenate are of type {kinds}: return DataProto or TensorDict")


def padded_shares(data: DataProto, shares: int) -> list[DataProto]:
    """Split into ``shares`` equal parts, padding first; each part records its trailing pad rows in meta_info."""
    padded, pad = data.pad_to_divisor(shares)
    size = len(padded) // shares
    parts = [padded.slice(i * size, (i + 1) * size) for i in range(shares)]
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
