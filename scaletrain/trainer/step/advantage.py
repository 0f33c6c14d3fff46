"""Driver-side algorithm steps of fit() (layer 4): in-reward KL penalty and advantage estimation.

Pure functions on the step's DataProto; the math lives in ``scaletrain.algos``, chosen by the config's
registered names (``algorithm.adv_estimator``).
"""

from __future__ import annotations

import numpy as np

from scaletrain.algos import apply_kl_penalty_to_rewards, get_adv_estimator
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import AlgorithmConfig


def apply_kl_penalty(batch: DataProto, kl_ctrl, kl_penalty: str) -> dict[str, float]:
    """token_level_rewards = scores - beta * KL(old || ref); updates the controller; returns metrics."""
    rewards, metrics = apply_kl_penalty_to_rewards(
        batch.batch["token_level_scores"],
        batch.batch["old_log_probs"],
        batch.batch["ref_log_prob"],
        batch.batch["response_mask"],
        kl_ctrl,
        kl_penalty,
    )
    batch.batch["token_level_rewards"] = rewards
    return metrics


def compute_advantage(batch: DataProto, config: AlgorithmConfig) -> None:
    """Adds ``advantages`` and ``returns`` (B, R) with the registered estimator."""
    estimator = get_adv_estimator(config.adv_estimator)
    kwargs = {"gamma": config.gamma, "lam": config.lam, "norm_adv_by_std_in_grpo": config.norm_adv_by_std_in_grpo}
    if "values" in batch.batch.keys():
        kwargs["values"] = batch.batch["values"]
    if "reward_baselines" in batch.batch.keys():
        kwargs["reward_baselines"] = batch.batch["reward_baselines"]
    index = batch.non_tensor_batch.get("uid")
    advantages, returns = estimator(
        batch.batch["token_level_rewards"],
        batch.batch["response_mask"],
        index=np.asarray(index) if index is not None else None,
        config=config,
        **kwargs,
    )
    batch.batch["advantages"], batch.batch["returns"] = advantages, returns
