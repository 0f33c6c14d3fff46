"""``verl.workers.reward_manager.registry``: verl's names for scaletrain's reward manager registry.

``REWARD_MANAGER_REGISTRY`` is the registry the trainer's ``reward_model.reward_manager`` reads: a manager
registered here is one the trainer can run. verl's lookup error text is kept (its tests match it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from scaletrain.reward.managers import REWARD_MANAGERS, AbstractRewardManager, register_reward_manager

__all__ = ["REWARD_MANAGER_REGISTRY", "get_reward_manager_cls", "register"]

REWARD_MANAGER_REGISTRY = REWARD_MANAGERS


def register(name: str) -> Callable[[type[AbstractRewardManager]], type[AbstractRewardManager]]:
    """Class decorator: register a reward manager under ``name`` (the same class again is allowed; another
    class under a taken name is a ValueError)."""
    return register_reward_manager(name)


def get_reward_manager_cls(name: str) -> type[AbstractRewardManager]:
    return registered_manager(REWARD_MANAGER_REGISTRY, name)


def registered_manager(registry: Mapping[str, type], name: str) -> type:
    """``registry[name]``; verl's ValueError text when it has none (the reward-loop registry's lookup too)."""
    if name not in registry:
        raise ValueError(f"Unknown reward manager: {name}")
    return registry[name]
