"""``verl.workers.reward_manager``: register a reward manager, look one up, and the managers verl ships.

A manager written for verl (subclassing ``AbstractRewardManager``, registered with ``register``) runs in
scaletrain's trainer as ``reward_model.reward_manager=<its name>`` (scaletrain/reward/managers/external.py).
"""

from scaletrain.compat.verl.workers.reward_manager.registry import get_reward_manager_cls, register
from scaletrain.reward.managers import (
    AbstractRewardManager,
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
)

__all__ = [
    "AbstractRewardManager",
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "get_reward_manager_cls",
    "register",
]
