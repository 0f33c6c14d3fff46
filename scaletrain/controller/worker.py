"""Worker: the base class of every SPMD worker a worker group drives (layer 3).

A worker knows its ``rank`` and ``world_size`` from the environment the group sets (WORLD_SIZE, RANK,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so it can form a torch.distributed group with its peers. Rank 0 picks the
rendezvous address when none is given (a worker made outside a group). Workers that run a model-parallel layout
declare their place in a named mesh (``register_mesh``; ``set_megatron_mesh`` for verl-style workers) so mesh
dispatch modes know where each data share goes and whose output to collect.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from scaletrain.controller.dispatch import ENGINE_MESH, ROLLOUT_MESH, MeshPlace
from scaletrain.controller.stacks import arm_stack_dump
from scaletrain.utils.errors import InvalidInput
from scaletrain.utils.gc_tuning import settle
from scaletrain.utils.net import free_port


class MeshConflict(InvalidInput):
    """A mesh place registered twice, or asked for and never registered."""


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:  # pragma: no cover
        return None


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a hard dependency, but workers may run without it
        pass
    return "127.0.0.1"


class Worker:
    # methods the group calls on every worker, in addition to the @register ones (colocation forwards them)
    CONTROL_METHODS = ("get_mesh_place", "worker_info")

    def __init__(self) -> None:
        self._rank = int(os.environ.get("RANK", "0"))
        self._world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self._rank == 0 and "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = _node_ip()
            os.environ["MASTER_PORT"] = str(free_port())
        self._mesh_places: dict[str, MeshPlace] = {}
        settle()  # the worker's classes are imported: later collections leave them out
        if "SCALETRAIN_WORKER_GROUP" in os.environ:  # a group's process: the driver may ask for its stacks
            arm_stack_dump()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    # ------------------------------------------------------------------------------------------------- meshes
    def register_mesh(self, name: str, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        """Declare this worker's data-parallel rank in mesh ``name`` and whether its output is collected."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"mesh '{name}': dp_rank {dp_rank} outside [0, {dp_size})")
        self._mesh_places[name] = MeshPlace(dp_rank, dp_size, bool(is_collect))

    # verl's spelling of mesh places: the data-parallel size is left to the group (the ranks it sees + 1)
    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        if mesh_name in self._mesh_places:
            raise MeshConflict(f"mesh_name {mesh_name} has been registered")
        self._mesh_places[mesh_name] = MeshPlace(int(dp_rank), None, bool(is_collect))

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """This worker's places as verl hands them between workers: {dispatch_dp_rank: {mesh: rank}, collect_dp_rank:
        {mesh: is_collect}}."""
        return {
            "dispatch_dp_rank": {name: p.dp_rank for name, p in self._mesh_places.items()},
            "collect_dp_rank": {name: p.is_collect for name, p in self._mesh_places.items()},
        }

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]
    ) -> None:
        """Takes another worker's place (``get_dispatch_collect``) as this worker's place in ``mesh_name``: a fused
        worker routes its roles' calls by them."""
        if mesh_name in self._mesh_places:
            raise MeshConflict(f"{mesh_name} is already registered, {sorted(self._mesh_places)}")
        if len(dispatch_dp_rank) != 1 or len(collect_dp_rank) != 1:
            raise MeshConflict(
                f"set_dispatch_collect takes one mesh's place, got {dispatch_dp_rank}, {collect_dp_rank}"
            )
        (rank,), (collect,) = dispatch_dp_rank.values(), collect_dp_rank.values()
        self._mesh_places[mesh_name] = MeshPlace(int(rank), None, bool(collect))

    def _query_dispatch_info(self, mesh_name: str) -> int:
        return self._place(mesh_name).dp_rank

    def _query_collect_info(self, mesh_name: str) -> bool:
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        return self._place(mesh_name).is_collect

    def _place(self, mesh_name: str) -> MeshPlace:
        if mesh_name not in self._mesh_places:
            raise MeshConflict(f"{mesh_name} is not registered in {type(self).__name__}")
        return self._mesh_places[mesh_name]

    def set_megatron_mesh(
        self, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, dp_rank: int, dp_size: int
    ) -> None:
        """Declare a (TP, PP, DP) place as the engine mesh (MEGATRON_COMPUTE*: DP shares, output of TP rank 0 of the
        last stage) and the rollout mesh as verl's generation layout (MEGATRON_PP_AS_DP_PROTO: PP stages as DP)."""
        if tp_size * pp_size * dp_size != self._world_size:
            raise ValueError(f"TP {tp_size} x PP {pp_size} x DP {dp_size} != world size {self._world_size}")
        last_stage = pp_rank == pp_size - 1
        self.register_mesh(ENGINE_MESH, dp_rank, dp_size, tp_rank == 0 and last_stage)
        self.register_mesh(ROLLOUT_MESH, dp_rank * pp_size + pp_rank, dp_size * pp_size, tp_rank == 0)

    def get_mesh_place(self, name: str) -> MeshPlace | None:
        return self._mesh_places.get(name)

    # ------------------------------------------------------------------------------------------------ control
    def worker_info(self) -> dict[str, Any]:
        return {
            "rank": self._rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "ip": _node_ip(),
            "node_id": _node_id(),
        }
