"""``verl.workers.reward_manager.naive``: the per-sample manager and its in-process timeout."""

from scaletrain.reward.in_process import score_timeout as _score_timeout
from scaletrain.reward.managers import NaiveRewardManager

__all__ = ["NaiveRewardManager", "_score_timeout"]
