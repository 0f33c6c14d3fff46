"""Reward managers, one per file, each registered by name; importing this package registers them all."""

from scaletrain.reward.managers.abstract import AbstractRewardManager
from scaletrain.reward.managers.base import (
    REWARD_MANAGERS,
    RewardManager,
    Rows,
    get_reward_manager,
    register_reward_manager,
)
from scaletrain.reward.managers.batch import BatchRewardManager
from scaletrain.reward.managers.dapo import DAPORewardManager
from scaletrain.reward.managers.multi import MultiRewardManager
from scaletrain.reward.managers.naive import NaiveRewardManager
from scaletrain.reward.managers.prime import PrimeRewardManager
from scaletrain.reward.managers.reward_loop import REWARD_LOOP_MANAGERS, RewardManagerBase, reward_manager_class

__all__ = [
    "REWARD_LOOP_MANAGERS",
    "REWARD_MANAGERS",
    "AbstractRewardManager",
    "BatchRewardManager",
    "DAPORewardManager",
    "MultiRewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RewardManager",
    "RewardManagerBase",
    "Rows",
    "get_reward_manager",
    "register_reward_manager",
    "reward_manager_class",
]
