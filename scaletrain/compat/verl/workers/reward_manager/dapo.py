"""``verl.workers.reward_manager.dapo``: per-sample scoring with DAPO's overlong penalty (``overlong_buffer_cfg``)."""

from scaletrain.reward.managers import DAPORewardManager

__all__ = ["DAPORewardManager"]
