"""``verl.utils.py_functional``: small dict helpers verl's workers and trainers use for metrics."""

from __future__ import annotations

from typing import Any

from scaletrain.compat.verl.utils.metric import Metric


def append_to_dict(data: dict[str, Any], new_data: dict[str, Any], prefix: str = "") -> None:
    """Appends each ``new_data`` value under ``prefix + key`` in ``data`` (a key already starting with ``prefix``
    keeps its name): into a list, or into a ``Metric`` of the same aggregation when the value is one; a list value
    is spread."""
    for key, value in new_data.items():
        name = key if key.startswith(prefix) else prefix + key
        if name not in data:
            data[name] = value.init_list() if isinstance(value, Metric) else []
        data[name].extend(value) if isinstance(value, list) else data[name].append(value)


__all__ = ["append_to_dict"]
