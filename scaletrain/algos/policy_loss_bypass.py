"""The ``bypass_mode`` policy loss: training against the rollout's own log-probs, with the rollout correction done
inside the loss against the current policy (verl's bypass mode).

In bypass mode the trainer skips the old-log-prob forward and hands the rollout's log-probs as ``old_log_prob``, so
the policy being corrected for is the rollout's and the importance ratio is pi_theta / pi_rollout, recomputed at
every micro-batch. The options come from ``policy_loss.rollout_correction`` (the trainer copies
``algorithm.rollout_correction`` there): ``rollout_rs`` (token_k1 | seq_sum_k1, with ``rollout_rs_threshold``)
leaves out the tokens (or sequences) whose ratio falls outside the bounds; then ``loss_type``:

- ``ppo_clip``: PPO's clipped loss (``vanilla``) with pi_rollout as the old policy; its ratio already is the
  importance ratio, so no weights are applied (they would count it twice);
- ``reinforce``: ``-A * sg(w) * log pi`` with w = the ratio truncated at ``rollout_is_threshold`` per token or
  per sequence (``rollout_is``; null: w = 1), optionally rescaled to mean 1 (``rollout_is_batch_normalize``).

Metrics: the loss's own plus the ``rollout_corr/*`` ones of the weights and the rejection.
"""

from __future__ import annotations

from typing import Any

import torch

from scaletrain.algos.masked import masked_mean
from scaletrain.algos.policy_loss import compute_policy_loss_vanilla, finish, option, ppo_kl, register_policy_loss
from scaletrain.algos.rollout_correction import compute_rollout_correction, rs_ratio_bounds

RS_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence"}  # verl's rejection options, by the ratio they bound


def _setting(settings: Any, key: str, default: Any) -> Any:
    value = settings.get(key, default) if isinstance(settings, dict) else getattr(settings, key, default)
    return default if value is None and default is not None else value


def compute_policy_loss_reinforce(
    rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum", config=None, **kwargs
):
    """REINFORCE: ``-A * log pi``, times ``rollout_is_weights`` (detached) when given; ``actor/ppo_kl`` is the
    mean of log pi_rollout - log pi (verl's helper of the same name; not a registered loss)."""
    metrics = {"actor/ppo_kl": ppo_kl(rollout_log_prob, log_prob, response_mask)}
    return finish(-advantages * log_prob, response_mask, loss_agg_mode, kwargs, metrics)


def _rejected(rollout_log_prob, log_prob, response_mask, settings) -> tuple[torch.Tensor, dict]:
    """``response_mask`` with the tokens (sequences) outside the rejection bounds cleared, and its metrics."""
    rs = _setting(settings, "rollout_rs", None)
    if rs is None:
        return response_mask, {}
    if rs not in RS_LEVELS:
        raise ValueError(f"bypass_mode: unsupported rollout_rs '{rs}'; supported: null, {', '.join(RS_LEVELS)}")
    lower, upper = rs_ratio_bounds(_setting(settings, "rollout_rs_threshold", None))
    kept, metrics = compute_rollout_correction(
        log_prob.detach(), rollout_log_prob, response_mask, upper, RS_LEVELS[rs], "mask", lower
    )
    return response_mask * (kept > 0).to(response_mask.dtype), metrics


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """See the module docstring; ``old_log_prob`` holds the rollout's log-probs."""
    settings = option(config, "rollout_correction", None, kwargs)
    if not settings:
        raise ValueError(
            "bypass_mode needs policy_loss.rollout_correction (set algorithm.rollout_correction.bypass_mode=true: the "
            "trainer fills it)"
        )
    loss_type = _setting(settings, "loss_type", "ppo_clip")
    mask, metrics = _rejected(old_log_prob, log_prob, response_mask, settings)
    if loss_type == "ppo_clip":
        loss, loss_metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config
        )
    elif loss_type == "reinforce":
        weights = None
        level = _setting(settings, "rollout_is", None)
        if level is not None:
            threshold = float(_setting(settings, "rollout_is_threshold", 2.0))
            weights, is_metrics = compute_rollout_correction(log_prob.detach(), old_log_prob, mask, threshold, level)
            if _setting(settings, "rollout_is_batch_normalize", False):
                weights = weights / masked_mean(weights, mask).clamp(min=1e-8)
            metrics.update(is_metrics)
        extra = {} if weights is None else {"rollout_is_weights": weights}
        loss, loss_metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, **extra
        )
    else:
        raise ValueError(f"bypass_mode: unsupported loss_type '{loss_type}'; supported: ppo_clip, reinforce")
    return loss, {**loss_metrics, **{k: float(v) for k, v in metrics.items()}}
