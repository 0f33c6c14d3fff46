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

A component may be an ``async def`` awaiting a generative judge (``reward.judge``): the judge is bound to each
component that takes it (``judge`` or ``reward_router_address``), and the samples are then scored concurrently on an
event loop (async_scorer.py), each sample's components one after another. The code sandbox (``reward.sandbox_fusion``)
is not offered to components.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scaletrain.reward.async_scorer import is_async_scorer, target_function
from scaletrain.reward.judge import JUDGE_PARAMETERS, Judge, bind_judge
from scaletrain.reward.loader import load_custom_reward_fn
from scaletrain.reward.managers.base import RewardManager, register_reward_manager
from scaletrain.reward.scorers.components import COMPONENT_SCORERS

_ENTRY_KEYS = {"name", "path", "weight", "kwargs", "label"}


def _summed(values: list[tuple[str, float, Any]]) -> dict:
    """{"score": the weighted total, <label>: each component's score} of (label, weight, component result)."""
    result = {label: float(v["score"] if isinstance(v, Mapping) else v) for label, _, v in values}
    return {"score": sum(weight * result[label] for label, weight, _ in values), **result}


@dataclass
class WeightedSum:
    """``sum(weight * component(...))``; returns {"score": total, <label>: component score, ...}."""

    components: list[tuple[str, Callable[..., Any], float]]  # (label, scorer, weight)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
        row = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth}
        return _summed(
            [(label, weight, scorer(**row, extra_info=extra_info)) for label, scorer, weight in self.components]
        )


async def weighted_sum_async(
    components: list[tuple[str, Callable[..., Any], float]],
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
) -> dict:
    """``WeightedSum`` of components some of which are async (awaited, one after another)."""
    row = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth}
    values = []
    for label, scorer, weight in components:
        value = scorer(**row, extra_info=extra_info)
        values.append((label, weight, await value if inspect.isawaitable(value) else value))
    return _summed(values)


def _score_of(compute_score: Callable[..., Any], **row: Any) -> float:
    value = compute_score(**row)
    return float(value["score"] if isinstance(value, Mapping) else value)


async def _async_score_of(compute_score: Callable[..., Any], **row: Any) -> float:
    value = await compute_score(**row)
    return float(value["score"] if isinstance(value, Mapping) else value)


def takes_judge(fn: Callable[..., Any]) -> bool:
    return any(name in inspect.signature(target_function(fn)).parameters for name in JUDGE_PARAMETERS)


def build_components(
    entries: Sequence[Mapping[str, Any]], compute_score: Callable[..., Any] | None = None, judge: Judge | None = None
) -> list[tuple[str, Callable[..., Any], float]]:
    """(label, scorer, weight) per config entry, ``judge`` bound to each scorer that takes it (ValueError when
    none does); ValueError naming the entry for a malformed one."""
    if not entries:
        raise ValueError("multi reward manager needs scorers=[{name, weight}, ...]")
    judged: list[int] = []  # the entries whose scorer the judge is bound to
    judged_score = False  # whether the configured compute_score (the correctness component's) calls the judge
    if judge is not None and compute_score is not None and takes_judge(compute_score):
        compute_score, judged_score = bind_judge(compute_score, judge), True
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
            if judge is not None and takes_judge(scorer):
                scorer = bind_judge(scorer, judge)
                judged.append(i)
        elif name == "correctness" and compute_score is not None:
            judged += [i] if judged_score else []
            score_of = _async_score_of if is_async_scorer(compute_score) else _score_of
            scorer = functools.partial(score_of, compute_score)
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
    if judge is not None and not judged:
        raise ValueError(f"reward.judge.base_url is set but no multi component takes one of {list(JUDGE_PARAMETERS)}")
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
        self.components = build_components(scorers or [], compute_score, kwargs.get("judge"))
        if any(is_async_scorer(scorer) for _, scorer, _ in self.components):
            total: Callable[..., Any] = functools.partial(weighted_sum_async, self.components)
        else:
            total = WeightedSum(self.components)
        super().__init__(tokenizer, num_examine, total, reward_fn_key, **kwargs)

    def bind_services(self, fn: Callable[..., Any], is_default: bool) -> Callable[..., Any]:
        """The judge is bound to the components that take it (``build_components``), not to their sum."""
        if self.sandbox is not None:
            raise ValueError("the multi reward manager does not offer reward.sandbox_fusion to its components")
        return fn
