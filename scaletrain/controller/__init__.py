"""The single-controller runtime (layer 3): worker groups of SPMD workers driven through registered methods.

    from scaletrain.controller import Worker, register, Dispatch, RayResourcePool, RayClassWithInitArgs, RayWorkerGroup

    class Adder(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def add(self, x):
            return self.rank + x

    group = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(Adder))
    group.add(10)  # [10, 11]
    group.call(Adder.add, 10)  # the same call, naming the worker's method (so an editor can follow it)

The controller knows nothing about PPO or any backend: the trainer composes it with role workers.
"""

from scaletrain.controller.colocate import create_colocated_worker_cls
from scaletrain.controller.decorator import register
from scaletrain.controller.dispatch import (
    ENGINE_MESH,
    ROLLOUT_MESH,
    Dispatch,
    Execute,
    MeshPlace,
    make_mesh_collect,
    make_mesh_dispatch,
    register_dispatch_mode,
)
from scaletrain.controller.ray_worker_group import RayClassWithInitArgs, RayWorkerGroup
from scaletrain.controller.resource_pool import RayResourcePool
from scaletrain.controller.worker import Worker
from scaletrain.controller.worker_group import (
    LocalWorkerGroup,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
)

__all__ = [
    "ENGINE_MESH",
    "ROLLOUT_MESH",
    "Dispatch",
    "Execute",
    "LocalWorkerGroup",
    "MeshPlace",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerTimeoutError",
    "create_colocated_worker_cls",
    "make_mesh_collect",
    "make_mesh_dispatch",
    "register",
    "register_dispatch_mode",
]
