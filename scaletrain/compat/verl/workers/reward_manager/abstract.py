"""``verl.workers.reward_manager.abstract``: the reward manager interface."""

from scaletrain.reward.managers.abstract import AbstractRewardManager, RawRewardFn

__all__ = ["AbstractRewardManager", "RawRewardFn"]
