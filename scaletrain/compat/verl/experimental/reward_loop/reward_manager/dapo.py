"""``verl.experimental.reward_loop.reward_manager.dapo``: one sample scored, plus DAPO's overlong penalty (its
settings in ``config.reward.reward_kwargs``: ``max_resp_len``, ``overlong_buffer_cfg``)."""

from scaletrain.reward.managers.reward_loop import LoopDAPORewardManager as DAPORewardManager

__all__ = ["DAPORewardManager"]
