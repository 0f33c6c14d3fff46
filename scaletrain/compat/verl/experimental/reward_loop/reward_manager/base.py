"""``verl.experimental.reward_loop.reward_manager.base``: the per-sample reward manager interface."""

from scaletrain.reward.managers.abstract import RawRewardFn
from scaletrain.reward.managers.reward_loop import RewardManagerBase

__all__ = ["RawRewardFn", "RewardManagerBase"]
