"""What a Ray cluster holds right now, read from its GCS (Ray's state API needs the dashboard, which tests turn
off): the alive actors and the placement groups not removed, for tests that a run frees what it placed."""

from __future__ import annotations


def alive_actors() -> dict[str, str]:
    """actor id -> class name, of every alive actor on the connected cluster (any job's)."""
    from ray._private import state

    return {aid: a["ActorClassName"] for aid, a in state.actors().items() if a["State"] == "ALIVE"}


def placed_groups() -> dict[str, str]:
    """placement group id -> name, of every placement group not removed."""
    from ray.util import placement_group_table

    return {pid: pg["name"] for pid, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
