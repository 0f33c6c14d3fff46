"""Built-in component scorers for the ``multi`` manager (same signature as compute_score, each in [0, 1]):

- ``format``: the response states a final answer in the form its task expects.
- ``correctness``: the task's own score (``default_compute_score``; the multi manager swaps in the configured
  custom compute_score when there is one).
- ``length``: 1.0 up to ``target_chars`` characters, falling linearly to 0.0 at twice that.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from scaletrain.reward.scorers import arithmetic, gsm8k, math, reasoning_gym
from scaletrain.reward.scorers.default import default_compute_score

_BARE_INTEGER = re.compile(r"-?\d+")


def format_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 if the answer is in the expected form: a bare integer for ``scaletrain/arithmetic``, ``#### n`` for
    GSM8K, ``\\boxed{}`` for MATH, ``<answer>...</answer>`` for ``reasoning_gym/*``; for other sources
    ``#### n`` or ``\\boxed{}``. Else 0.0."""
    if data_source == arithmetic.DATA_SOURCE:
        ok = _BARE_INTEGER.fullmatch(solution_str.strip()) is not None
    elif data_source == "openai/gsm8k":
        ok = gsm8k.extract_answer(solution_str, "strict") is not None
    elif data_source in math.DATA_SOURCES:
        ok = math.last_boxed(solution_str) is not None
    elif isinstance(data_source, str) and data_source.startswith(reasoning_gym.DATA_SOURCE_PREFIX):
        ok = reasoning_gym.extract_answer(solution_str) is not None
    else:
        ok = gsm8k.extract_answer(solution_str, "strict") is not None or math.last_boxed(solution_str) is not None
    return 1.0 if ok else 0.0


def correctness_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    result = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return float(result["score"] if isinstance(result, dict) else result)


def length_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    target_chars: int = 1000,
) -> float:
    if target_chars <= 0:
        raise ValueError(f"length_score target_chars must be positive, got {target_chars}")
    excess = max(0, len(solution_str) - target_chars)
    return max(0.0, 1.0 - excess / target_chars)


COMPONENT_SCORERS: dict[str, Callable[..., float]] = {
    "format": format_score,
    "correctness": correctness_score,
    "length": length_score,
}
