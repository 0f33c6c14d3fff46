"""``multi``: a weighted sum of component scorers, e.g. 0.2 format + 0.7 correctness + 0.1 length.

Config (``scorers``): a list of entries, each ``{name, weight}`` for a built-in component (``format``,
``correctness``, ``length``; see ``scorers/components.py``) or ``{path, name, weight}`` for a function in a
file (``name`` defaults to ``compute_score``). Optional per entry: ``kwargs`` (keyword arguments bound to the
scorer, e.g. ``{target_chars: 400}`` for ``length``) and ``label`` (its key in reward_extra_info; default
``name``). ``correctness`` is the task scorer: the manager's ``compute_score`` when one is configured
(``custom_reward_function``), else ``default_compute_score``.

All components of a sample run in one worker call, so ``compute_score_timeout`` bounds their total; if any component
raises, the sample scores 0 and counts as one error. reward_extra_info holds each component's raw score
under its label.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scaletrain.reward.loader import load_custom_reward_fn
from scaletrain.reward.managers.base import RewardManager, register_reward_manager
from scaletrain.reward.scorers.components import COMPONENT_SCORERS

_ENTRY_KEYS = {"name", "path", "weight", "kwargs", "label"}


@dataclass
class WeightedSum:
    """``sum(weight * component(...))``; returns {"score": total, <label>: component score, ...}."""

    components: list[tuple[str, Callable[..., Any], float]]  # (label, scorer, weight)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
        result: dict[str, float] = {}
        total = 0.0
        for label, scorer, weight in self.components:
            value = scorer(
                data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
            )
            value = float(value["score"] if isinstance(value, Mapping) else value)
            result[label] = value
            total += weight * value
        return {"score": total, **result}


def _score_of(compute_score: Callable[..., Any], **row: Any) -> float:
    value = compute_score(**row)
    return float(value["score"] if isinstance(value, Mapping) else value)


def build_components(
    entries: Sequence[Mapping[str, Any]], compute_score: Callable[..., Any] | None = None
) -> list[tuple[str, Callable[..., Any], float]]:
    """(label, scorer, weight) per config entry; ValueError naming the entry for a malformed one."""
    if not entries:
        raise ValueError("multi reward manager needs scorers=[{name, weight}, ...]")
    components, labels = [], set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"multi scorers[{i}] must be a mapping like {{name, weight}}, got {entry!r}")
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise ValueError(f"multi scorers[{i}] has unknown keys {sorted(unknown)}; allowed {sorted(_ENTRY_KEYS)}")
        if "weight" not in entry:
            raise ValueError(f"multi scorers[{i}] has no 'weight'")
        weight = float(entry["weight"])
        name = entry.get("name")
        if entry.get("path"):
            scorer = load_custom_reward_fn(entry["path"], name)
            name = scorer.name
        elif name == "correctness" and compute_score is not None:
            scorer = functools.partial(_score_of, compute_score)
        elif name in COMPONENT_SCORERS:
            scorer = COMPONENT_SCORERS[name]
        else:
            raise ValueError(
                f"multi scorers[{i}]: unknown component {name!r}; built-in: {sorted(COMPONENT_SCORERS)}, or give "
                "path (+ name) of a function in a file"
            )
        if entry.get("kwargs"):
            scorer = functools.partial(scorer, **dict(entry["kwargs"]))
        label = entry.get("label") or name
        if label in labels:
            raise ValueError(f"multi scorers[{i}]: label {label!r} is used twice; set 'label' to tell them apart")
        if label == "score":
            raise ValueError(f"multi scorers[{i}]: 'score' is reserved for the total; set another 'label'")
        labels.add(label)
        components.append((label, scorer, weight))
    return components


@register_reward_manager("multi")
class MultiRewardManager(RewardManager):
    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        scorers: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ):
        self.components = build_components(scorers or [], compute_score)
        super().__init__(tokenizer, num_examine, WeightedSum(self.components), reward_fn_key, **kwargs)
