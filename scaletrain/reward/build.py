"""``build_reward_manager``: the reward manager a config asks for (``reward_model.reward_manager``,
``custom_reward_function``, manager kwargs)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from scaletrain.reward.loader import DEFAULT_FN_NAME, DEFAULT_LOAD_TIMEOUT_S, load_custom_reward_fn
from scaletrain.reward.managers import RewardManager, get_reward_manager


def build_reward_manager(
    tokenizer: Any,
    reward_manager: str = "naive",
    custom_reward_function: Mapping[str, Any] | None = None,
    num_examine: int = 0,
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
    **manager_kwargs: Any,
) -> RewardManager:
    """``custom_reward_function``: ``{path, name (default compute_score), reward_kwargs (optional, bound to
    the function)}``; with no path the manager's default scorer is used. ``manager_kwargs`` go to the manager
    (``timeout_s``, ``num_processes``, DAPO's ``overlong_buffer_len``, multi's ``scorers``, ...)."""
    compute_score = None
    if custom_reward_function and custom_reward_function.get("path"):
        compute_score = load_custom_reward_fn(
            custom_reward_function["path"], custom_reward_function.get("name") or DEFAULT_FN_NAME, load_timeout_s
        )
        reward_kwargs = custom_reward_function.get("reward_kwargs")
        if reward_kwargs:
            compute_score = functools.partial(compute_score, **dict(reward_kwargs))
    manager_cls = get_reward_manager(reward_manager)
    return manager_cls(tokenizer, compute_score=compute_score, num_examine=num_examine, **manager_kwargs)


def unknown_manager_kwargs(reward_manager: str, kwargs: Mapping[str, Any]) -> list[str]:
    """The names in ``kwargs`` that reward manager ``reward_manager`` does not take (checked before anything
    starts). A manager whose ``__init__`` forwards ``**kwargs`` takes what its base classes take."""
    accepted: set[str] = set()
    for cls in get_reward_manager(reward_manager).__mro__:
        if "__init__" not in vars(cls):
            continue
        params = inspect.signature(vars(cls)["__init__"]).parameters.values()
        accepted |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return sorted(set(kwargs) - accepted)
    return []
