"""``verl.single_controller.base.worker``: scaletrain's Worker, which also takes verl's mesh-place calls
(``_register_dispatch_collect_info``, ``get_dispatch_collect`` / ``set_dispatch_collect``)."""

from scaletrain.controller.worker import Worker

__all__ = ["Worker"]
