"""``verl.single_controller.base.decorator``: ``register``, the dispatch and execute modes, verl's dispatch helpers.

``make_nd_compute_dataproto_dispatch_fn(mesh_name)`` is scaletrain's mesh dispatch mode for that mesh (DataProto
shares to each data-parallel rank a worker declared with ``_register_dispatch_collect_info``, outputs of the
collecting ranks concatenated); a ``{"dispatch_fn", "collect_fn"}`` dict is taken as a dispatch mode, as in verl.
"""

from scaletrain.controller.decorator import register
from scaletrain.controller.dispatch import (
    Dispatch,
    Execute,
    collect_all,
    collect_dp_compute_proto,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_proto,
    dispatch_one_to_all,
    mesh_proto_mode,
)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> str:
    """The dispatch mode over mesh ``mesh_name``'s data-parallel ranks (DataProto or TensorDict shares)."""
    return mesh_proto_mode(mesh_name)


# verl's names for the same dispatch and collect functions
collect_all_to_all = collect_all
collect_dp_compute = collect_all

__all__ = [
    "Dispatch",
    "Execute",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_proto",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_proto",
    "dispatch_one_to_all",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
]
