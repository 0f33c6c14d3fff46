"""Pure tensor RL algorithms: advantage estimators, policy / value / KL losses, loss aggregation, entropy.

Imports nothing from the layers above (trainer, controller, workers, backends); only torch, numpy and
``scaletrain.utils``. Tensors are (batch, response_length) with a ``response_mask`` unless said otherwise.

Files: advantage.py (estimator registry, GAE, REINFORCE++, ReMax, discounted sums), group_advantage.py (GRPO and other
group-baseline estimators, GDPO), token_baseline.py (the optimal-token-baseline estimators), policy_loss.py (loss
registry, PPO, GSPO, GPG, CISPO, SAPO, DRO), policy_loss_cov.py (clip_cov, kl_cov), policy_loss_trust_region.py
(dppo_tv, dppo_kl, geo_mean), policy_loss_bypass.py (bypass_mode), agg.py (loss aggregation modes), kl.py (KL
estimators, in-reward penalty, controllers), value.py (critic loss), entropy.py (chunked entropy / log-probs /
sum of squared probabilities from logits), rollout_correction.py (rollout-vs-trainer importance weights),
masked.py (masked statistics), options.py (reading options from a config).

Extending: decorate a function with ``@register_adv_est("name")`` or ``@register_policy_loss("name")`` and name
it in the config (``algorithm.adv_estimator`` / ``actor.policy_loss.loss_mode``).
"""

from scaletrain.algos import (
    policy_loss_bypass,  # noqa: F401  (registers bypass_mode)
    policy_loss_cov,  # noqa: F401  (registers clip_cov, kl_cov)
    policy_loss_trust_region,  # noqa: F401  (registers dppo_tv, dppo_kl, geo_mean)
    token_baseline,  # noqa: F401  (registers optimal_token_baseline, tir_optimal_token_baseline)
)
from scaletrain.algos.advantage import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    compute_gae_advantage_return,
    discounted_suffix_sum,
    get_adv_estimator,
    register_adv_est,
)
from scaletrain.algos.agg import ENGINE_AGG_MODES, LOSS_AGG_MODES, agg_count, agg_loss
from scaletrain.algos.entropy import entropy_from_logits, logprobs_from_logits
from scaletrain.algos.group_advantage import group_ids, group_mean_std
from scaletrain.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    build_kl_controller,
    compute_kl_loss,
    kl_penalty,
)
from scaletrain.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from scaletrain.algos.policy_loss import POLICY_LOSSES, get_policy_loss, register_policy_loss
from scaletrain.algos.rollout_correction import compute_mismatch_metrics, compute_rollout_correction
from scaletrain.algos.value import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageEstimator",
    "register_adv_est",
    "get_adv_estimator",
    "compute_gae_advantage_return",
    "group_ids",
    "group_mean_std",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss",
    "ENGINE_AGG_MODES",
    "LOSS_AGG_MODES",
    "agg_count",
    "agg_loss",
    "kl_penalty",
    "compute_kl_loss",
    "apply_kl_penalty_to_rewards",
    "FixedKLController",
    "AdaptiveKLController",
    "build_kl_controller",
    "compute_value_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "compute_rollout_correction",
    "compute_mismatch_metrics",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "discounted_suffix_sum",
]
