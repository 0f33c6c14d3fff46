"""Rule-based scorers: ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``.

gsm8k.py, math.py, arithmetic.py, reasoning_gym.py and visual.py score one task family each; default.py dispatches on
``data_source``;
components.py holds the small scorers (format, correctness, length) that the ``multi`` manager weights.
"""

from scaletrain.reward.scorers.components import COMPONENT_SCORERS, correctness_score, format_score, length_score
from scaletrain.reward.scorers.default import SCORERS_BY_DATA_SOURCE, default_compute_score

__all__ = [
    "COMPONENT_SCORERS",
    "SCORERS_BY_DATA_SOURCE",
    "correctness_score",
    "default_compute_score",
    "format_score",
    "length_score",
]
