"""MATH-style scoring: take the last ``\\boxed{...}`` of the response and check it against the ground truth
with ``math-verify`` (symbolic equivalence: ``\\frac{1}{2}`` == ``0.5``, ``\\sqrt{2}`` == ``2^{1/2}``).

math-verify guards its own parsing with ``signal.alarm``, which only works in a process's main thread; the
reward managers call scorers in the main thread of their worker processes, so it is on there. In any other
thread it is off, and the caller must bound the time itself.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from math_verify import parse, verify

DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval")
_MATH_VERIFY_TIMEOUT_S = 5


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed x``; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    match = re.match(r"\\(?:boxed|fbox)", rest)
    assert match is not None  # rest starts at the \boxed / \fbox found above
    head = match.end()
    if rest[head : head + 1] == " ":  # "\boxed 5": the token up to the next space or "$"
        return re.split(r"[\s$]", rest[head + 1 :], maxsplit=1)[0] or None
    if rest[head : head + 1] != "{":
        return None
    depth = 0
    for i in range(head, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[head + 1 : i]
    return None  # unbalanced: the answer was cut off


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s).rstrip(".")


def is_equiv(answer: str, ground_truth: str) -> bool:
    """String match after removing whitespace, else math-verify's symbolic check."""
    if _squash(answer) == _squash(ground_truth):
        return True
    in_main = threading.current_thread() is threading.main_thread()
    timeout = _MATH_VERIFY_TIMEOUT_S if in_main else None
    # math-verify annotates parsing_timeout as int; None (documented) disables its signal-based timeout
    gold = parse("\\boxed{" + ground_truth + "}", parsing_timeout=timeout)  # pyright: ignore[reportArgumentType]
    pred = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)  # pyright: ignore[reportArgumentType]
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 if the last boxed answer equals the ground truth (itself a bare answer, or a solution with a
    ``\\boxed{}`` in it), else 0.0 (also when the response has no boxed answer)."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    boxed_truth = last_boxed(truth)
    return 1.0 if is_equiv(answer, boxed_truth if boxed_truth is not None else truth) else 0.0
