"""``verl.utils.metric``: metric values that carry how they aggregate over micro-batches and ranks.

A worker appends per-micro-batch values to lists (``append_to_dict``) and ``reduce_metrics`` turns each list into
one number: a ``Metric`` by its own aggregation, a plain list by its key (``max`` / ``min`` in the name, else the
mean), as verl's do. scaletrain's own engines weight micro-batches instead (backends/accumulation.py); this is
for verl-written worker code.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import torch


class AggregationType(enum.Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_REDUCE = {
    AggregationType.MEAN: np.mean,
    AggregationType.SUM: np.sum,
    AggregationType.MIN: np.min,
    AggregationType.MAX: np.max,
}
_NUMERIC = (int, float, np.number, np.ndarray, torch.Tensor)


class Metric:
    """Values of one metric and their aggregation (a name or an ``AggregationType``)."""

    def __init__(self, aggregation: str | AggregationType, value: Any = None) -> None:
        try:
            self.aggregation = AggregationType(aggregation)
        except ValueError:
            raise ValueError(f"Unsupported aggregation type: {aggregation!r}") from None
        self.values: list[Any] = []
        if value is not None:
            self.extend(value) if isinstance(value, (list, tuple)) else self.append(value)

    def append(self, value: Any) -> None:
        if isinstance(value, Metric):
            self.extend(value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"a metric value must be a scalar, got a tensor of shape {tuple(value.shape)}")
            value = value.detach().item()
        if not isinstance(value, _NUMERIC):
            raise ValueError(f"Unsupported value type: {type(value).__name__}")
        self.values.append(value)

    def extend(self, values: Any) -> None:
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(f"Aggregation type mismatch: {self.aggregation} != {values.aggregation}")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> Any:
        return _REDUCE[self.aggregation](self.values)

    @classmethod
    def aggregate_dp(cls, metric_lists: list[Metric]) -> Any:
        """One value from every DP rank's list: sums and means average the ranks position by position first (each
        rank holds the same micro-batch steps); min / max take all values."""
        if not metric_lists:
            raise ValueError("Cannot aggregate an empty list of metrics.")
        lengths = [len(m.values) for m in metric_lists]
        if len(set(lengths)) != 1:
            raise ValueError(f"All Metric instances must have the same number of values for dp aggregation: {lengths}")
        table = np.array([m.values for m in metric_lists])
        aggregation = metric_lists[0].aggregation
        if aggregation in (AggregationType.SUM, AggregationType.MEAN):
            return _REDUCE[aggregation](table.mean(axis=0))
        return _REDUCE[aggregation](table.ravel())

    @classmethod
    def from_dict(cls, data: dict[str, Any], aggregation: str | AggregationType) -> dict[str, Metric]:
        return {key: cls(aggregation, value) for key, value in data.items()}

    def init_list(self) -> Metric:
        return Metric(self.aggregation)


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Each entry reduced to one value, in place (and returned)."""
    for key, value in metrics.items():
        if isinstance(value, Metric):
            metrics[key] = value.aggregate()
        elif "max" in key:
            metrics[key] = np.max(value)
        elif "min" in key:
            metrics[key] = np.min(value)
        else:
            metrics[key] = np.mean(value)
    return metrics


__all__ = ["AggregationType", "Metric", "reduce_metrics"]
