"""Covariance-based policy losses (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

Entropy collapses when tokens with a high covariance between advantage and log-probability dominate the update.
Both losses find those tokens, centring advantages and (detached) log-probs over the unmasked tokens of the batch:

- ``clip_cov``: detach the gradient of a random ``clip_cov_ratio`` share of the tokens whose covariance lies in
  (``clip_cov_lb``, ``clip_cov_ub``) and that the PPO clip did not already remove;
- ``kl_cov``: add ``ppo_kl_coef * |log pi - log pi_old|`` to the loss of the top ``kl_cov_ratio`` share of tokens.

Selecting the tokens needs their count on the host (one device sync per call).
"""

from __future__ import annotations

import torch

from scaletrain.algos.masked import masked_mean
from scaletrain.algos.policy_loss import clip_bounds, finish, log_ratio, option, ppo_kl, register_policy_loss


def _centred_cov(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    adv = advantages.detach()
    lp = log_prob.detach()
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """PPO clipped surrogate (no dual clip) where max(1, int(clip_cov_ratio * #tokens)) eligible tokens, chosen
    uniformly at random (``generator=`` kwarg for reproducibility), get no gradient.

    Options: ``clip_cov_ratio`` (2e-4), ``clip_cov_lb`` (1.0), ``clip_cov_ub`` (5.0), plus the clip widths.
    Metrics: ``actor/pg_clipfrac`` (PPO clip), ``actor/pg_cov_clipfrac`` (covariance detach).
    """
    low, high = clip_bounds(config, kwargs)
    ratio_share = float(option(config, "clip_cov_ratio", 2e-4, kwargs))
    lb = float(option(config, "clip_cov_lb", 1.0, kwargs))
    ub = float(option(config, "clip_cov_ub", 5.0, kwargs))
    if ratio_share <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {ratio_share}")
    valid = response_mask.bool()
    ratio = torch.exp(log_ratio(log_prob, old_log_prob))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped_by_ppo = (loss_clipped > loss_unclipped) & valid

    cov = _centred_cov(advantages, log_prob, response_mask)
    eligible = valid & ~clipped_by_ppo & (cov > lb) & (cov < ub)
    n_pick = min(max(int(ratio_share * int(valid.sum())), 1), int(eligible.sum()))
    keep = torch.ones_like(log_prob)
    if n_pick > 0:
        # a uniform random subset of size n_pick: the n_pick smallest random keys among the eligible tokens
        keys = torch.rand(eligible.shape, generator=kwargs.get("generator"), device=eligible.device)
        keys = torch.where(eligible, keys, 2.0)
        picked = torch.topk(keys.flatten(), n_pick, largest=False).indices
        keep.view(-1)[picked] = 0.0
    pg_losses = torch.maximum(loss_unclipped, loss_clipped) * keep
    metrics = {
        "actor/pg_clipfrac": masked_mean(clipped_by_ppo.float(), response_mask),
        "actor/pg_cov_clipfrac": masked_mean((keep == 0).float(), response_mask),
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
    }
    return finish(pg_losses, response_mask, loss_agg_mode, kwargs, metrics)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """Unclipped surrogate -A * ratio, plus ``ppo_kl_coef`` (1.0) * |log pi - log pi_old| on the
    max(1, int(kl_cov_ratio * #tokens)) tokens (``kl_cov_ratio``, 2e-4) with the largest covariance.

    Metrics: ``actor/ppo_kl_abs`` (mean |log-ratio|), ``actor/kl_cov_frac`` (share of penalised tokens).
    """
    ratio_share = float(option(config, "kl_cov_ratio", 2e-4, kwargs))
    coef = float(option(config, "ppo_kl_coef", 1.0, kwargs))
    valid = response_mask.bool()
    diff = log_ratio(log_prob, old_log_prob)
    abs_kl = diff.abs()
    pg_losses = -advantages * torch.exp(diff)
    n_valid = int(valid.sum())
    n_pick = max(int(n_valid * ratio_share), 1) if (ratio_share > 0 and n_valid > 0) else 0
    penalised = torch.zeros_like(log_prob)
    if n_pick > 0:
        cov = torch.where(valid, _centred_cov(advantages, log_prob, response_mask), -torch.inf)
        picked = torch.topk(cov.flatten(), n_pick).indices
        penalised.view(-1)[picked] = 1.0
        pg_losses = pg_losses + penalised * coef * abs_kl
    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
        "actor/ppo_kl_abs": masked_mean(abs_kl.detach(), response_mask),
        "actor/kl_cov_frac": masked_mean(penalised, response_mask),
    }
    return finish(pg_losses, response_mask, loss_agg_mode, kwargs, metrics)
