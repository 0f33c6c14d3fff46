"""``batch``: one call of a batch scorer for the whole batch,
``compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=) -> list[float | dict]`` (by
keyword, as verl calls it), in a worker process. ``compute_score_timeout`` bounds the whole call: on timeout or
error every row scores 0 and is counted (so ``reward/timeouts`` is the batch size). A returned list of the wrong
length counts as an error for every row; a bad element only for its row. Without a compute_score,
``default_compute_score`` is applied row by row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.reward.managers.base import RewardManager, Rows, register_reward_manager
from scaletrain.reward.sandbox import ERROR, OK, Outcome
from scaletrain.reward.scorers.default import default_compute_score


@dataclass
class RowByRow:
    """A batch scorer made of a per-sample one (picklable, unlike a closure)."""

    compute_score: Callable[..., Any]

    def __call__(self, data_sources, solution_strs, ground_truths, extra_infos) -> list[Any]:
        keys = ("data_source", "solution_str", "ground_truth", "extra_info")
        rows = zip(data_sources, solution_strs, ground_truths, extra_infos)
        return [self.compute_score(**dict(zip(keys, row))) for row in rows]


@register_reward_manager("batch")
class BatchRewardManager(RewardManager):
    def default_scorer(self) -> Callable[..., Any]:
        return RowByRow(default_compute_score)

    def score_rows(self, rows: Rows) -> list[Outcome]:
        call = (
            (),
            {
                "data_sources": list(rows.data_sources),
                "solution_strs": list(rows.response_strs),
                "ground_truths": list(rows.ground_truths),
                "extra_infos": list(rows.extra_infos),
            },
        )
        (outcome,) = self.pool.map([call], self.step_timeout_s)
        if outcome.status != OK:
            return [outcome] * len(rows)
        values = outcome.value
        if not isinstance(values, (list, tuple)) or len(values) != len(rows):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            error = f"batch scorer returned {got}; expected a list of {len(rows)}"
            return [Outcome(ERROR, error=error)] * len(rows)
        return [Outcome(OK, value=value) for value in values]
