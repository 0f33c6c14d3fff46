"""Scorer of the synthetic visual tasks (data_source ``scaletrain/visual/<task>``, written by
``scaletrain/data/preprocess/visual.py``): the response must be exactly the answer (a digit, ``left`` or ``right``)
followed by EOS, the embedded arithmetic task's rule (``arithmetic.compute_score``)."""

from __future__ import annotations

from typing import Any

from scaletrain.data.preprocess.visual import DATA_SOURCE_PREFIX
from scaletrain.reward.scorers import arithmetic

__all__ = ["DATA_SOURCE_PREFIX", "compute_score"]


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    return arithmetic.compute_score(solution_str, ground_truth, extra_info)
