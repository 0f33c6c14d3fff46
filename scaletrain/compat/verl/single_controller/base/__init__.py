"""verl.single_controller.base: the Worker base class and the worker-group base."""

from scaletrain.compat.verl.single_controller.base.worker import Worker
from scaletrain.controller.worker_group import WorkerGroup

__all__ = ["Worker", "WorkerGroup"]
