"""``verl.experimental.reward_loop.reward_manager.registry``: the reward-loop managers' registry, verl's names."""

from __future__ import annotations

from collections.abc import Callable

from scaletrain.compat.verl.workers.reward_manager.registry import registered_manager
from scaletrain.reward.managers.reward_loop import REWARD_LOOP_MANAGERS, RewardManagerBase

__all__ = ["REWARD_MANAGER", "get_reward_manager_cls", "register"]

REWARD_MANAGER = REWARD_LOOP_MANAGERS


def register(name: str) -> Callable[[type[RewardManagerBase]], type[RewardManagerBase]]:
    return REWARD_LOOP_MANAGERS.register(name)


def get_reward_manager_cls(name: str) -> type[RewardManagerBase]:
    return registered_manager(REWARD_LOOP_MANAGERS, name)
