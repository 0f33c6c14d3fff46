"""``build_reward_manager``: the reward manager a config asks for (``reward_model.reward_manager``,
``custom_reward_function``, manager kwargs)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from scaletrain.reward.judge import Judge
from scaletrain.reward.loader import DEFAULT_FN_NAME, DEFAULT_LOAD_TIMEOUT_S, load_custom_reward_fn
from scaletrain.reward.managers import RewardManager
from scaletrain.reward.managers.external import ExternalRewardManager
from scaletrain.reward.managers.reward_loop import RewardLoopAdapter, RewardManagerBase, reward_manager_class
from scaletrain.reward.sandbox_fusion import SandboxFusion

logger = logging.getLogger(__name__)


def build_reward_manager(
    tokenizer: Any,
    reward_manager: str = "naive",
    custom_reward_function: Mapping[str, Any] | None = None,
    num_examine: int = 0,
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
    offered: Mapping[str, Any] | None = None,
    judge: Judge | None = None,
    sandbox: SandboxFusion | None = None,
    **manager_kwargs: Any,
) -> RewardManager | ExternalRewardManager:
    """``custom_reward_function``: ``{path, name (default compute_score), reward_kwargs (optional, bound to
    the function)}``; with no path the manager's default scorer is used. ``manager_kwargs`` go to the manager
    (``compute_score_timeout``, ``num_processes``, DAPO's ``overlong_buffer_cfg``, multi's ``scorers``, ...);
    ``offered`` ones only if the manager takes them (the trainer's settings, which a manager written for verl
    may not take: those it does not take are logged). The manager is built with keywords, as verl's trainer
    builds it; one that implements only verl's interface is wrapped in ExternalRewardManager. A reward-loop
    manager (verl 0.9's per-sample interface, reward_loop.py) is built from ``(config, tokenizer, compute_score)``
    with ``manager_kwargs`` as its ``config.reward.reward_kwargs``. ``judge`` (reward/judge.py) and ``sandbox``
    (reward/sandbox_fusion.py) go to a scaletrain manager, bound to its compute_score; another manager takes
    neither (ValueError)."""
    compute_score = None
    if custom_reward_function and custom_reward_function.get("path"):
        compute_score = load_custom_reward_fn(
            custom_reward_function["path"], custom_reward_function.get("name") or DEFAULT_FN_NAME, load_timeout_s
        )
        reward_kwargs = custom_reward_function.get("reward_kwargs")
        if reward_kwargs:
            compute_score = functools.partial(compute_score, **dict(reward_kwargs))
    manager_cls = reward_manager_class(reward_manager)
    for key, service in (("judge", judge), ("sandbox", sandbox)):
        if service is not None:
            if not issubclass(manager_cls, RewardManager):
                what = f"a remote service ({service!r})"
                raise ValueError(f"reward manager '{reward_manager}' does not score with {what}")
            manager_kwargs[key] = service
    if issubclass(manager_cls, RewardManagerBase):
        config = OmegaConf.create({"reward": {"reward_kwargs": dict(manager_kwargs)}})
        loop_manager = manager_cls(config=config, tokenizer=tokenizer, compute_score=compute_score)
        return ExternalRewardManager(RewardLoopAdapter(loop_manager))
    kwargs = dict(offered or {})
    not_taken = unknown_manager_kwargs(reward_manager, kwargs)
    if not_taken:
        logger.info("reward manager '%s' does not take %s: its own code decides that", reward_manager, not_taken)
    kwargs = {k: v for k, v in kwargs.items() if k not in not_taken} | manager_kwargs
    manager = manager_cls(tokenizer=tokenizer, num_examine=num_examine, compute_score=compute_score, **kwargs)
    return manager if isinstance(manager, RewardManager) else ExternalRewardManager(manager)


def unknown_manager_kwargs(reward_manager: str, kwargs: Mapping[str, Any]) -> list[str]:
    """The names in ``kwargs`` that reward manager ``reward_manager`` does not take (checked before anything
    starts). A manager whose ``__init__`` forwards ``**kwargs`` takes what its base classes take; a reward-loop
    manager takes any (they are its config's ``reward.reward_kwargs``)."""
    manager_cls = reward_manager_class(reward_manager)
    if issubclass(manager_cls, RewardManagerBase):
        return []
    accepted: set[str] = set()
    for cls in manager_cls.__mro__:
        if "__init__" not in vars(cls):
            continue
        params = inspect.signature(vars(cls)["__init__"]).parameters.values()
        accepted |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return sorted(set(kwargs) - accepted)
    return []
