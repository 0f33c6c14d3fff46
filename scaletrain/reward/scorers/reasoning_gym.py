"""Scorer of reasoning-gym tasks (data_source ``reasoning_gym/<task>``, written by
``scaletrain.data.preprocess.reasoning_gym``): the response's final answer is its LAST ``<answer>...</answer>``.

- No complete ``<answer>...</answer>`` pair: score 0.0.
- Otherwise the task's own scorer, ``dataset.score_answer(answer, entry)``, on the extracted answer and the entry
  stored in ``extra_info["entry"]`` (JSON), with the task built from ``extra_info["task_kwargs"]`` (JSON) as the
  data was. Some tasks give partial credit (countdown: 0.05 for a wrong expression that uses the right numbers;
  basic_arithmetic: ``len(truth) / len(answer)`` when the answer contains the truth).
- A row without a stored entry: 1.0 if the answer equals ``ground_truth`` after whitespace normalisation, else 0.0.

Returns ``{"score", "acc", "pred"}``: ``acc`` is 1.0 only for a full score, ``pred`` the extracted answer ("" when
there is none); the reward managers put ``acc`` and ``pred`` into ``reward_extra_info``. A task scorer that raises
is not caught here: the manager counts the sample in ``reward/errors``.

reasoning-gym is imported on the first reasoning-gym row only (it takes seconds), and each (task, kwargs) dataset
is built once per process.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from scaletrain.data.preprocess.reasoning_gym import DATA_SOURCE_PREFIX, ENTRY_KEY, TASK_KWARGS_KEY

# the same extraction as reasoning_gym.utils.extract_answer (last pair; one optional space inside each tag is
# dropped, the rest stripped), without importing reasoning-gym for it
_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract_answer(solution_str: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` in the text; None when there is none."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


@functools.lru_cache(maxsize=64)
def task_dataset(task: str, task_kwargs_json: str) -> Any:
    """The reasoning-gym dataset object whose ``score_answer`` scores ``task`` (built once per process)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(task_kwargs_json))


def _normalise(text: str) -> str:
    return " ".join(text.split())


def result(score: float, pred: str) -> dict[str, Any]:
    return {"score": score, "acc": 1.0 if score >= 1.0 else 0.0, "pred": pred}


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """Score one response to a ``reasoning_gym/<task>`` row; see the module docstring."""
    pred = extract_answer(solution_str)
    if pred is None:
        return result(0.0, "")
    extra_info = extra_info or {}
    entry_json = extra_info.get(ENTRY_KEY)
    if not entry_json:
        return result(1.0 if _normalise(pred) == _normalise(str(ground_truth)) else 0.0, pred)
    task = data_source[len(DATA_SOURCE_PREFIX) :]
    dataset = task_dataset(task, extra_info.get(TASK_KWARGS_KEY) or "{}")
    return result(float(dataset.score_answer(pred, json.loads(entry_json))), pred)
