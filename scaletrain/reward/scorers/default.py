"""``default_compute_score``: the scorer used when no ``custom_reward_function`` is configured. It dispatches
on ``data_source``; an unknown source raises NotImplementedError naming it."""
from __future__ import annotations

from typing import Any, Callable

from scaletrain.reward.scorers import arithmetic, gsm8k, math


def _gsm8k(solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="strict")


def _math(solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    return math.compute_score(solution_str, ground_truth)


def _arithmetic(solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    return arithmetic.compute_score(solution_str, ground_truth, extra_info)


SCORERS_BY_DATA_SOURCE: dict[str, Callable[[str, Any, dict | None], float]] = {
    "openai/gsm8k": _gsm8k,
    **{source: _math for source in math.DATA_SOURCES},
    arithmetic.DATA_SOURCE: _arithmetic,
}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    try:
        scorer = SCORERS_BY_DATA_SOURCE[data_source]
    except (KeyError, TypeError):
        raise NotImplementedError(
            f"default_compute_score has no scorer for data_source {data_source!r} (known: "
            f"{sorted(SCORERS_BY_DATA_SOURCE)}); set custom_reward_function.path/name to score it"
        ) from None
    return scorer(solution_str, ground_truth, extra_info)
