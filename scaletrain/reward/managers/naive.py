"""``naive``: one scorer call per sample, one sample at a time in a single worker process (each call bounded
by ``compute_score_timeout``). The reference behaviour; ``prime`` is the same with several workers."""

from __future__ import annotations

from scaletrain.reward.managers.base import RewardManager, register_reward_manager


@register_reward_manager("naive")
class NaiveRewardManager(RewardManager):
    """Per-sample scoring in one worker; see RewardManager for the arguments."""
