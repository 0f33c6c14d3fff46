"""``verl.trainer.ppo.core_algos`` over ``scaletrain.algos``: verl's names for the same functions and registries.

The registries are scaletrain's (mutable mappings, as verl's dicts): an estimator registered here with
``@register_adv_est`` is one ``algorithm.adv_estimator`` names in scaletrain's trainer, which calls it by keyword
as verl's does. scaletrain's estimators and losses take verl's positional order, so no adapter is needed for
them; the adapters below are for verl's lookup errors and its KL-controller factory.
"""

from __future__ import annotations

from typing import Any

import torch

from scaletrain.algos import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvantageEstimator,
    FixedKLController,
    agg_loss,
    compute_gae_advantage_return,
    compute_value_loss,
    entropy_from_logits,
    kl_penalty,
)
from scaletrain.algos.advantage import compute_reinforce_plus_plus_advantage, compute_remax_advantage
from scaletrain.algos.group_advantage import (
    compute_gdpo_advantage,
    compute_gpg_advantage,
    compute_grpo_advantage,
    compute_grpo_passk_advantage,
    compute_opo_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_rloo_advantage,
)
from scaletrain.algos.policy_loss import (
    compute_policy_loss_cispo,
    compute_policy_loss_dro,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from scaletrain.algos.policy_loss_bypass import compute_policy_loss_bypass_mode, compute_policy_loss_reinforce
from scaletrain.algos.policy_loss_cov import compute_policy_loss_clip_cov, compute_policy_loss_kl_cov
from scaletrain.algos.policy_loss_trust_region import (
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_geo_mean,
)
from scaletrain.algos.token_baseline import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from scaletrain.utils.registry import register_into, registry_key

ADV_ESTIMATOR_REGISTRY = ADV_ESTIMATORS
POLICY_LOSS_REGISTRY = POLICY_LOSSES

# verl's function names for scaletrain's estimators (verl's "vectorized" twins are the same computation here)
compute_grpo_outcome_advantage = compute_grpo_advantage
compute_grpo_vectorized_outcome_advantage = compute_grpo_advantage
compute_grpo_passk_outcome_advantage = compute_grpo_passk_advantage
compute_rloo_outcome_advantage = compute_rloo_advantage
compute_rloo_vectorized_outcome_advantage = compute_rloo_advantage
compute_opo_outcome_advantage = compute_opo_advantage
compute_reinforce_plus_plus_outcome_advantage = compute_reinforce_plus_plus_advantage
compute_reinforce_plus_plus_baseline_outcome_advantage = compute_reinforce_plus_plus_baseline_advantage
compute_remax_outcome_advantage = compute_remax_advantage
compute_gpg_outcome_advantage = compute_gpg_advantage
compute_gdpo_outcome_advantage = compute_gdpo_advantage


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Any:
    """verl's decorator: registers into whatever ``ADV_ESTIMATOR_REGISTRY`` is now (verl's tests swap it)."""

    def decorator(fn):
        return register_into(ADV_ESTIMATOR_REGISTRY, "advantage estimator", registry_key(name_or_enum), fn)

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Any:
    name = registry_key(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"Unknown advantage estimator simply: {name}")
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str) -> Any:
    """verl's decorator: a later registration under the same name replaces the earlier one, as in verl."""

    def decorator(fn):
        return register_into(POLICY_LOSS_REGISTRY, "policy loss", registry_key(name), fn, override=True)

    return decorator


def get_policy_loss_fn(name: str) -> Any:
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: {list(POLICY_LOSS_REGISTRY.keys())}")
    return POLICY_LOSS_REGISTRY[name]


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """verl's factory over ``algorithm.kl_ctrl`` (type fixed | adaptive, kl_coef, target_kl, horizon)."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_coef=kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        if kl_ctrl.horizon <= 0:
            raise ValueError(f"horizon must be larger than 0. Got {kl_ctrl.horizon}")
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise NotImplementedError(f"unknown kl_ctrl type {kl_ctrl.type!r}; fixed or adaptive")


def compute_rewards(token_level_scores, old_log_prob, ref_log_prob, kl_ratio):
    """verl's in-reward KL: ``scores - kl_ratio * (old_log_prob - ref_log_prob)``."""
    return token_level_scores - kl_penalty(old_log_prob, ref_log_prob, "kl") * kl_ratio


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"):
    """Entropy of ``logits`` (batch, length, vocab), aggregated over the response tokens."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "agg_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "register_adv_est",
    "register_policy_loss",
]
