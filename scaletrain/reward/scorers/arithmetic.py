"""Scorer of the embedded default task (data_source ``scaletrain/arithmetic``): prompt ``"437+258="``, the
response must be exactly the answer digits (``"695"``) followed by EOS.

Strictness: 1.0 only when the response, stripped of surrounding whitespace, equals the ground truth string;
anything else (extra words, a second number, a missing answer) scores 0.0.

EOS: the response is decoded with ``skip_special_tokens=True``, so the EOS token is not in ``solution_str``. The
reward managers check it instead: they pass a copy of the row's ``extra_info`` with
``extra_info["response_ended_with_eos"]`` set to whether the last valid response token is an EOS id (see
``managers/base.py``). This scorer gives 0.0 when that flag is False, so a response cut off at the length
limit right after the digits earns nothing. Called directly without the flag (e.g. from a user's own
compute_score that drops extra_info), it trusts the string alone.
"""

from __future__ import annotations

from typing import Any

DATA_SOURCE = "scaletrain/arithmetic"
ENDED_WITH_EOS_KEY = "response_ended_with_eos"


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    if extra_info is not None and not extra_info.get(ENDED_WITH_EOS_KEY, True):
        return 0.0
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
