"""``verl.single_controller.ray.base``: scaletrain's Ray worker group, resource pool and colocation."""

from scaletrain.controller.colocate import create_colocated_worker_cls, create_colocated_worker_raw_cls
from scaletrain.controller.ray_worker_group import RayClassWithInitArgs, RayWorkerGroup
from scaletrain.controller.resource_pool import RayResourcePool

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "create_colocated_worker_cls",
    "create_colocated_worker_raw_cls",
]
