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
        batch.tensors["token_level_scores"],
        batch.tensors["old_log_probs"],
        batch.tensors["ref_log_prob"],
        batch.tensors["response_mask"],
        kl_ctrl,
        kl_penalty,
    )
    batch.tensors["token_level_rewards"] = rewards
    return metrics


def compute_advantage(batch: DataProto, config: AlgorithmConfig) -> None:
    """Adds ``advantages`` and ``returns`` (B, R) with the registered estimator."""
    estimator = get_adv_estimator(config.adv_estimator)
    kwargs = {"gamma": config.gamma, "lam": config.lam, "norm_adv_by_std_in_grpo": config.norm_adv_by_std_in_grpo}
    if "values" in batch.tensors.keys():
        kwargs["values"] = batch.tensors["values"]
    if "reward_baselines" in batch.tensors.keys():
        kwargs["reward_baselines"] = batch.tensors["reward_baselines"]
    index = batch.non_tensor_batch.get("uid")
    advantages, returns = estimator(
        batch.tensors["token_level_rewards"],
        batch.tensors["response_mask"],
        index=np.asarray(index) if index is not None else None,
        config=config,
        **kwargs,
    )
    batch.tensors["advantages"], batch.tensors["returns"] = advantages, returns
