"""Rewards: reward managers (batch -> token-level scores), rule scorers, and loading a user's compute_score.

    from scaletrain.reward import build_reward_manager
    with build_reward_manager(tokenizer, "naive", {"path": "my_reward.py", "name": "compute_score"}) as rm:
        out = rm(batch, return_dict=True)  # reward_tensor (B, R), reward_extra_info, metrics

Layout: scorers/ (gsm8k, math, arithmetic, default dispatch, multi components), loader.py (functions from
files), sandbox.py (the timed worker pool every manager scores in), managers/ (base + naive, prime, batch,
dapo, multi), build.py (manager from config).
"""

from scaletrain.reward.build import build_reward_manager
from scaletrain.reward.loader import CustomRewardFn, load_custom_reward_fn
from scaletrain.reward.managers import (
    REWARD_MANAGERS,
    BatchRewardManager,
    DAPORewardManager,
    MultiRewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    RewardManager,
    get_reward_manager,
    register_reward_manager,
)
from scaletrain.reward.sandbox import Outcome, ScoringPool
from scaletrain.reward.scorers import COMPONENT_SCORERS, default_compute_score

__all__ = [
    "COMPONENT_SCORERS",
    "REWARD_MANAGERS",
    "BatchRewardManager",
    "CustomRewardFn",
    "DAPORewardManager",
    "MultiRewardManager",
    "NaiveRewardManager",
    "Outcome",
    "PrimeRewardManager",
    "RewardManager",
    "ScoringPool",
    "build_reward_manager",
    "default_compute_score",
    "get_reward_manager",
    "load_custom_reward_fn",
    "register_reward_manager",
]
