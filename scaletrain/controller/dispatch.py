"""Dispatch modes (layer 3): how a worker-group call splits its arguments over workers and combines results.

A dispatch mode is a pair of functions, registered by name with ``register_dispatch_mode``:
  - ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)``: returns every argument as a list with
    one entry per worker (worker i receives entry i);
  - ``collect_fn(worker_group, outputs) -> result``: outputs holds one entry per executed worker, in rank
    order (values, or Ray refs for non-blocking calls).

Data-parallel modes split DataProtos into padded shares (see ``scaletrain.protocol.padded_shares``); the
worker-side wrapper trims the padding off each share's output. Mesh modes ask each worker for its place in a named
mesh: its data-parallel rank and whether its output is collected (e.g. TP rank 0 of the last pipeline stage), so
one mechanism serves every layout. The role workers declare two meshes, ``ENGINE_MESH`` from their training
engine and ``ROLLOUT_MESH`` from their rollout engine, and route by them (scaletrain/workers/dispatch.py). verl's
MEGATRON modes are the same routing under verl's names, so a verl worker that names them runs unchanged:
MEGATRON_COMPUTE(_PROTO) split over the engine's DP ranks, MEGATRON_PP_AS_DP_PROTO (verl's generation layout)
over the rollout engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tensordict import TensorDict

from scaletrain.protocol import DataProto, DataProtoFuture, concat_parts, padded_shares
from scaletrain.protocol.tensordict_ops import chunk_tensordict
from scaletrain.utils.registry import Registry


class Dispatch(str, Enum):
    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    RANK_ZERO = "RANK_ZERO"
    DP_COMPUTE = "DP_COMPUTE"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    DP_COMPUTE_PROTO_WITH_FUNC = "DP_COMPUTE_PROTO_WITH_FUNC"
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"
    MEGATRON_COMPUTE = "MEGATRON_COMPUTE"
    MEGATRON_COMPUTE_PROTO = "MEGATRON_COMPUTE_PROTO"
    MEGATRON_PP_AS_DP_PROTO = "MEGATRON_PP_AS_DP_PROTO"
    DIRECT = "DIRECT"  # one rank at a time, through WorkerGroup.submit (a group call refuses)


class Execute(str, Enum):
    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


@dataclass(frozen=True)
class DispatchSpec:
    name: str
    dispatch_fn: Callable[..., tuple[tuple, dict]]
    collect_fn: Callable[[Any, list], Any]


@dataclass(frozen=True)
class MeshPlace:
    """A worker's place in a named mesh, as the dispatch layer needs it."""

    dp_rank: int
    dp_size: int | None  # None: declared without it (verl's _register_dispatch_collect_info); the group derives it
    is_collect: bool


DISPATCH_MODES = Registry("dispatch mode")
ENGINE_MESH = "engine"  # a worker's place in its training engine's layout (DP rank, size, kept output)
ROLLOUT_MESH = "rollout"  # its place in its rollout engine's layout (one DP rank per engine, TP rank 0 kept)


def register_dispatch_mode(name: str, dispatch_fn: Callable, collect_fn: Callable) -> DispatchSpec:
    """Add a dispatch mode usable as ``@register(dispatch_mode=name)``."""
    spec = DispatchSpec(str(name), dispatch_fn, collect_fn)
    DISPATCH_MODES.register(spec.name)(spec)
    return spec


def get_dispatch_spec(mode: Dispatch | str | dict) -> DispatchSpec:
    """The spec of a registered mode's name, or of verl's inline form ``{"dispatch_fn": f, "collect_fn": g}``."""
    if isinstance(mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(mode)
        if missing:
            raise ValueError(f"a dispatch mode dict needs dispatch_fn and collect_fn; missing {sorted(missing)}")
        return DispatchSpec(getattr(mode["dispatch_fn"], "__name__", "custom"), mode["dispatch_fn"], mode["collect_fn"])
    return DISPATCH_MODES.get(mode.value if isinstance(mode, Dispatch) else str(mode))


def mesh_proto_mode(mesh: str) -> str:
    """The dispatch mode that splits DataProto arguments over the data-parallel ranks of named mesh ``mesh`` and
    concatenates the outputs of its collecting ranks (registered on first use; verl's
    ``make_nd_compute_dataproto_dispatch_fn``)."""
    name = f"MESH_PROTO:{mesh}"
    if name not in DISPATCH_MODES:
        register_dispatch_mode(name, make_mesh_dispatch(mesh, True), make_mesh_collect(mesh, True))
    return name


# ------------------------------------------------------------------------------------------- argument helpers
def _broadcast(n: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def _check_per_worker(n: int, args: tuple, kwargs: dict, what: str) -> None:
    for i, a in enumerate(args):
        if not isinstance(a, (list, tuple)) or len(a) != n:
            raise ValueError(f"{what}: positional argument {i} must be a list of {n} entries (one per worker)")
    for k, v in kwargs.items():
        if not isinstance(v, (list, tuple)) or len(v) != n:
            raise ValueError(f"{what}: argument '{k}' must be a list of {n} entries (one per worker)")


def _shares(value: Any, n: int, name: str, rows: list[int]) -> list[Any]:
    """n padded shares of a DataProto/future; other values are sent whole to every share."""
    if isinstance(value, DataProto):
        rows.append(len(value))
        if len(set(rows)) > 1:
            raise ValueError(f"argument '{name}' has {len(value)} rows but another DataProto argument has {rows[0]}")
        return padded_shares(value, n)
    if isinstance(value, DataProtoFuture):
        return value.chunk(n)
    if isinstance(value, TensorDict):  # verl's TensorDict workers: torch.chunk's split, no padding, jagged rows kept
        shares = chunk_tensordict(value, n)
        if len(shares) != n:
            raise ValueError(
                f"argument '{name}': a TensorDict of {int(value.batch_size[0])} rows makes {len(shares)} shares for "
                f"{n} workers (torch.chunk's split); give it at least {n} rows"
            )
        return shares
    return [value] * n


def split_proto_args(n: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    rows: list[int] = []
    out_args = tuple(_shares(a, n, str(i), rows) for i, a in enumerate(args))
    out_kwargs = {k: _shares(v, n, k, rows) for k, v in kwargs.items()}
    return out_args, out_kwargs


def concat_outputs(outputs: list) -> Any:
    """DataProtos (or TensorDicts) concatenated; Ray refs become a DataProtoFuture."""
    if not outputs:
        return outputs
    if _is_ray_ref(outputs[0]):
        return DataProtoFuture.concat(outputs)
    if all(isinstance(o, (DataProto, TensorDict)) for o in outputs):
        return concat_parts(outputs)
    kinds = sorted({type(o).__name__ for o in outputs})
    raise TypeError(f"a row-collecting dispatch mode got worker outputs of type {kinds}: return DataProto / TensorDict")


def _is_ray_ref(obj: Any) -> bool:
    return type(obj).__name__ == "ObjectRef"


# -------------------------------------------------------------------------------------- data-parallel modes
def dispatch_one_to_all(wg, *args, **kwargs):
    return _broadcast(wg.world_size, args, kwargs)


def dispatch_all_to_all(wg, *args, **kwargs):
    return args, kwargs


def collect_all(wg, outputs):
    return list(outputs)


def collect_rank_zero(wg, outputs):
    return outputs[0]


def dispatch_dp_compute(wg, *args, **kwargs):
    _check_per_worker(wg.world_size, args, kwargs, "DP_COMPUTE")
    return args, kwargs


def dispatch_dp_compute_proto(wg, *args, **kwargs):
    return split_proto_args(wg.world_size, args, kwargs)


def dispatch_dp_compute_proto_with_func(wg, fn, *args, **kwargs):
    if not callable(fn):
        raise ValueError("DP_COMPUTE_PROTO_WITH_FUNC: the first argument must be a function")
    args, kwargs = split_proto_args(wg.world_size, args, kwargs)
    return ([fn] * wg.world_size, *args), kwargs


def collect_dp_compute_proto(wg, outputs):
    return concat_outputs(outputs)


# --------------------------------------------------------------------------------------------- mesh modes
def make_mesh_dispatch(mesh: str, proto: bool) -> Callable:
    """Dispatch over the data-parallel ranks of named mesh ``mesh`` (split DataProtos when ``proto``)."""

    def dispatch(wg, *args, **kwargs):
        places = wg.mesh_places(mesh)
        dp_size = wg.mesh_dp_size(mesh)
        if proto:
            args, kwargs = split_proto_args(dp_size, args, kwargs)
        else:
            _check_per_worker(dp_size, args, kwargs, f"{mesh} mesh dispatch (one entry per data-parallel rank)")
        per_worker = lambda shares: [shares[p.dp_rank] for p in places]  # noqa: E731
        return tuple(per_worker(a) for a in args), {k: per_worker(v) for k, v in kwargs.items()}

    return dispatch


def make_mesh_collect(mesh: str, proto: bool) -> Callable:
    """Collect from the ranks of ``mesh`` that declared is_collect, in DP order (concatenated when ``proto``)."""

    def collect(wg, outputs):
        places = wg.mesh_places(mesh)
        picked = sorted((p.dp_rank, i) for i, p in enumerate(places) if p.is_collect)
        chosen = [outputs[i] for _, i in picked]
        return concat_outputs(chosen) if proto else chosen

    return collect


def dispatch_direct(wg, *args, **kwargs):
    raise TypeError(f"worker group '{wg.name}': a DIRECT method runs on one rank: use group.submit(rank, ...)")


for _mode, _dispatch, _collect in [
    (Dispatch.ONE_TO_ALL, dispatch_one_to_all, collect_all),
    (Dispatch.ALL_TO_ALL, dispatch_all_to_all, collect_all),
    (Dispatch.RANK_ZERO, dispatch_one_to_all, collect_rank_zero),
    (Dispatch.DP_COMPUTE, dispatch_dp_compute, collect_all),
    (Dispatch.DP_COMPUTE_PROTO, dispatch_dp_compute_proto, collect_dp_compute_proto),
    (Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, dispatch_dp_compute_proto_with_func, collect_dp_compute_proto),
    (Dispatch.DP_COMPUTE_METRIC, dispatch_dp_compute_proto, collect_all),
    # verl's names for the engine / rollout mesh routing (see the module docstring)
    (Dispatch.MEGATRON_COMPUTE, make_mesh_dispatch(ENGINE_MESH, False), make_mesh_collect(ENGINE_MESH, False)),
    (Dispatch.MEGATRON_COMPUTE_PROTO, make_mesh_dispatch(ENGINE_MESH, True), make_mesh_collect(ENGINE_MESH, True)),
    (Dispatch.MEGATRON_PP_AS_DP_PROTO, make_mesh_dispatch(ROLLOUT_MESH, True), make_mesh_collect(ROLLOUT_MESH, True)),
    (Dispatch.DIRECT, dispatch_direct, collect_all),
]:
    register_dispatch_mode(_mode.value, _dispatch, _collect)
