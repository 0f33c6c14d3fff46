"""``default_compute_score``: the scorer used when no ``custom_reward_function`` is configured. It dispatches
on ``data_source``: an exact name in ``SCORERS_BY_DATA_SOURCE``, else the first prefix in
``SCORERS_BY_PREFIX`` it starts with (``reasoning_gym/<task>``); an unknown source raises NotImplementedError
naming it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scaletrain.reward.scorers import arithmetic, gsm8k, math, reasoning_gym, visual


def _gsm8k(solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="strict")


def _math(solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    return math.compute_score(solution_str, ground_truth)


def _arithmetic(solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    return arithmetic.compute_score(solution_str, ground_truth, extra_info)


# verl's code data sources: scored by running the code (scaletrain/reward/sandbox_fusion.py, reward.sandbox_fusion)
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
SCORERS_BY_DATA_SOURCE: dict[str, Callable[[str, Any, dict | None], float]] = {
    "openai/gsm8k": _gsm8k,
    **{source: _math for source in math.DATA_SOURCES},
    arithmetic.DATA_SOURCE: _arithmetic,
}
# families of sources sharing one scorer, which also receives the data_source (it names the task)
SCORERS_BY_PREFIX: dict[str, Callable[[str, str, Any, dict | None], float | dict]] = {
    reasoning_gym.DATA_SOURCE_PREFIX: reasoning_gym.compute_score,
    visual.DATA_SOURCE_PREFIX: visual.compute_score,
}


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
    **kwargs: Any,
) -> float | dict:
    """verl's signature: the last three (and ``kwargs``) serve verl's code-execution data sources, which score
    through ``reward.sandbox_fusion`` (scaletrain/reward/sandbox_fusion.py, asynchronously): here they are
    accepted and unused, and such a data source is refused naming that key."""
    scorer = SCORERS_BY_DATA_SOURCE.get(data_source) if isinstance(data_source, str) else None
    if scorer is not None:
        return scorer(solution_str, ground_truth, extra_info)
    for prefix, family_scorer in SCORERS_BY_PREFIX.items():
        if isinstance(data_source, str) and data_source.startswith(prefix):
            return family_scorer(data_source, solution_str, ground_truth, extra_info)
    if data_source in CODE_DATA_SOURCES:
        raise NotImplementedError(
            f"data_source {data_source!r} is scored by running the code: set reward.sandbox_fusion.url (a "
            "SandboxFusion service, or `python -m scaletrain.reward.sandbox_server`)"
        )
    raise NotImplementedError(
        f"default_compute_score has no scorer for data_source {data_source!r} (known: "
        f"{sorted(SCORERS_BY_DATA_SOURCE)}, or any starting with {sorted(SCORERS_BY_PREFIX)}); set "
        "custom_reward_function.path/name to score it"
    )
