"""GSM8K-style scoring: the answer is the number after the last ``#### `` (strict) or the last number (flexible)."""

from __future__ import annotations

import re

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)


def _normalize(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as a normalized number string (no commas or ``$``), or None when there is none.

    ``strict``: the number after the last ``####``. ``flexible``: the last number anywhere in the text.
    """
    if method == "strict":
        found = _STRICT.findall(solution_str)
    elif method == "flexible":
        found = _ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    return _normalize(found[-1]) if found else None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if an answer was found but is
    wrong, 0.0 if no answer was found. Numbers compare by value ("18.0" == "18")."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, _normalize(str(ground_truth).strip())) else format_score
