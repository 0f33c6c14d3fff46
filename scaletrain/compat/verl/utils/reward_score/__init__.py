"""``verl.utils.reward_score``: the scorer a manager uses when none is configured, picked by data source."""

from scaletrain.reward.scorers.default import default_compute_score

__all__ = ["default_compute_score"]
