"""``verl.experimental.reward_loop.reward_manager``: register a per-sample reward manager (``RewardManagerBase``)
and look one up; the trainer's ``reward_model.reward_manager`` finds a manager registered here by its name
(scaletrain/reward/managers/reward_loop.py)."""

from scaletrain.compat.verl.experimental.reward_loop.reward_manager.registry import get_reward_manager_cls, register
from scaletrain.reward.managers.reward_loop import LoopDAPORewardManager as DAPORewardManager
from scaletrain.reward.managers.reward_loop import LoopNaiveRewardManager as NaiveRewardManager

__all__ = ["DAPORewardManager", "NaiveRewardManager", "get_reward_manager_cls", "register"]
