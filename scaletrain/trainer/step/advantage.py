"""Driver-side algorithm steps of fit() (layer 4): in-reward KL penalty and advantage estimation.

Pure functions on the step's DataProto; the math lives in ``scaletrain.algos``, chosen by the config's
registered names (``algorithm.adv_estimator``).
"""

from __future__ import annotations

import numpy as np

from scaletrain.algos import apply_kl_penalty_to_rewards, get_adv_estimator
from scaletrain.algos.advantage import estimator_traits
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
    """Adds ``advantages`` and ``returns`` (B, R) with the registered estimator.

    Called by keyword as verl's trainer calls a registered estimator (token_level_rewards, response_mask, config;
    index when the batch has uids, reward_baselines when it has them, values to one registered with needs_values,
    the batch's columns to one registered with reads_batch, old_log_probs / sum_pi_squared / rollout_is_weights to
    one registered with needs_sum_pi_squared),
    so an estimator written for verl runs here unchanged; gamma, lam and norm_adv_by_std_in_grpo come from
    ``config``."""
    estimator = get_adv_estimator(config.adv_estimator)
    tensors = batch.tensors
    kwargs = {"token_level_rewards": tensors["token_level_rewards"], "response_mask": tensors["response_mask"]}
    traits = estimator_traits(config.adv_estimator)
    if traits.needs_values:
        kwargs["values"] = tensors["values"]
    if "reward_baselines" in tensors.keys():
        kwargs["reward_baselines"] = tensors["reward_baselines"]
    if "uid" in batch.non_tensor_batch:
        kwargs["index"] = np.asarray(batch.non_tensor_batch["uid"])
    if traits.reads_batch:  # verl hands GDPO the whole batch
        kwargs["non_tensor_batch"], kwargs["batch"] = batch.non_tensor_batch, tensors
    if traits.needs_sum_pi_squared:
        kwargs["old_log_probs"], kwargs["sum_pi_squared"] = tensors["old_log_probs"], tensors["sum_pi_squared"]
        kwargs["rollout_is_weights"] = tensors["rollout_is_weights"] if "rollout_is_weights" in tensors.keys() else None
    advantages, returns = estimator(config=config, **kwargs)
    batch.tensors["advantages"], batch.tensors["returns"] = advantages, returns
