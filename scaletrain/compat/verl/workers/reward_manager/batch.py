"""``verl.workers.reward_manager.batch``: one scorer call for the whole batch."""

from scaletrain.reward.managers import BatchRewardManager

__all__ = ["BatchRewardManager"]
