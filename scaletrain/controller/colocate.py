"""Colocation: several roles (actor, critic, ref, ...) in one process per rank (layer 3).

``create_colocated_worker_cls({"actor": RayClassWithInitArgs(A, ...), "critic": ...})`` builds one Worker class
whose instance holds one instance of each role class; each role's registered methods appear on it as
``<role>_<method>``. ``RayWorkerGroup(pool, that).spawn(prefix_set=[...])`` then gives one worker group per role
over the same actors, so the roles share the processes (and the GPU) rank by rank; ``fuse`` sets them as the
group's attributes instead (verl's fused workers: ``create_colocated_worker_raw_cls`` gives the class to subclass).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from scaletrain.controller.decorator import REGISTERED_ATTR, get_registration
from scaletrain.controller.ray_worker_group import RayClassWithInitArgs
from scaletrain.controller.worker import Worker


def _forward(role: str, name: str, fn: Callable) -> Callable:
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker_dict[role], name)(*args, **kwargs)

    functools.update_wrapper(method, fn)
    method.__name__ = f"{role}_{name}"
    info = get_registration(fn)
    if info is not None:
        setattr(method, REGISTERED_ATTR, info)
    else:  # not a group method of the combined class: only role views call it
        method.__dict__.pop(REGISTERED_ATTR, None)
    return method


def create_colocated_worker_raw_cls(class_dict: dict[str, Any]) -> type:
    """The combined Worker class of ``class_dict`` (role -> RayClassWithInitArgs or class), to subclass: an instance
    holds one instance of each role, as ``self.<role>`` too, so a subclass's own methods can call across roles
    (verl's fused worker)."""
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    specs = _specs(class_dict)
    role_classes = {role: spec.user_cls for role, spec in specs.items()}
    init_args = {role: (spec.args, spec.kwargs) for role, spec in specs.items()}

    class WorkerDict(Worker):
        ROLE_CLASSES = role_classes
        ROLE_OPTIONS = {k: v for spec in specs.values() for k, v in spec._options.items()}

        def __init__(self) -> None:
            super().__init__()
            self.worker_dict = {}
            for role, cls in role_classes.items():
                args, kwargs = init_args[role]
                self.worker_dict[role] = cls(*args, **kwargs)
                setattr(self, role, self.worker_dict[role])

    for role, cls in role_classes.items():
        for name in dir(cls):
            fn = getattr(cls, name, None)
            # a registered method, or one of Worker's control methods: never None
            if fn is not None and (get_registration(fn) is not None or name in Worker.CONTROL_METHODS):
                setattr(WorkerDict, f"{role}_{name}", _forward(role, name, fn))
    WorkerDict.__name__ = WorkerDict.__qualname__ = "WorkerDict_" + "_".join(role_classes)
    return WorkerDict


def create_colocated_worker_cls(class_dict: dict[str, Any]) -> RayClassWithInitArgs:
    """One class holding every role of ``class_dict`` (role -> RayClassWithInitArgs or class), ready to start."""
    raw = create_colocated_worker_raw_cls(class_dict)
    combined = RayClassWithInitArgs(raw)
    combined.update_options(raw.ROLE_OPTIONS)
    return combined


def _specs(class_dict: dict[str, Any]) -> dict[str, RayClassWithInitArgs]:
    return {
        role: spec if isinstance(spec, RayClassWithInitArgs) else RayClassWithInitArgs(spec)
        for role, spec in class_dict.items()
    }
