"""``verl.utils.ray_utils``: putting many objects in Ray's object store at once; this thread's event loop."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from scaletrain.reward.managers.reward_loop import get_event_loop
from scaletrain.utils.errors import InvalidInput


def parallel_put(data_list: list[Any], max_workers: int | None = None) -> list[Any]:
    """``ray.put`` of each item from a few threads (large objects serialise in parallel); refs in order."""
    import ray

    if not data_list:
        raise InvalidInput("parallel_put needs at least one object")
    workers = max(1, min(len(data_list), max_workers or 16))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(ray.put, data_list))


__all__ = ["get_event_loop", "parallel_put"]
