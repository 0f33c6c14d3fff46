"""``verl.experimental.reward_loop.reward_manager.naive``: one sample scored with its data source's scorer."""

from scaletrain.reward.managers.reward_loop import LoopNaiveRewardManager as NaiveRewardManager

__all__ = ["NaiveRewardManager"]
