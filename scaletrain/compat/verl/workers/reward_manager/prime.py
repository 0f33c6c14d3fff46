"""``verl.workers.reward_manager.prime``: per-sample scoring in parallel worker processes."""

from scaletrain.reward.managers import PrimeRewardManager

__all__ = ["PrimeRewardManager"]
