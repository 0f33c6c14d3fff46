"""Policy losses whose trust region is not PPO's ratio clip: DPPO's divergence masks (``dppo_tv``, ``dppo_kl``) and
GMPO's clipped geometric-mean ratio (``geo_mean``). Signature and metrics as in ``policy_loss.py``; the option
names are verl's (``clip_ratio``, ``clip_ratio_low`` / ``clip_ratio_high``, ``clip_ratio_c``), read the same way.
"""

from __future__ import annotations

import torch

from scaletrain.algos.agg import agg_loss
from scaletrain.algos.masked import masked_mean
from scaletrain.algos.policy_loss import clip_bounds, finish, log_ratio, option, ppo_kl, register_policy_loss

DPPO_TRUNCATION = 20.0  # DPPO's default importance-weight cap (clip_ratio_c), large on purpose (paper, sec. 5.4)


def _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, kwargs, outside):
    """-A * sg(min(ratio, clip_ratio_c)) * log pi on the tokens ``outside(log_prob, old_log_prob, low, high)`` does not
    drop: a token whose probability already moved past the divergence bound in its advantage's direction gets no
    gradient. ``actor/pg_clipfrac``: share of dropped tokens; ``actor/pg_clipfrac_lower``: share of kept tokens
    whose weight the cap truncated."""
    low, high = clip_bounds(config, kwargs)
    cap = float(option(config, "clip_ratio_c", DPPO_TRUNCATION, kwargs))
    ratio = torch.exp(log_ratio(log_prob, old_log_prob))
    dropped_up, dropped_down = outside(log_prob, old_log_prob, low, high)
    kept = torch.where(advantages > 0, ~dropped_up, ~dropped_down).detach().float()
    weight = torch.clamp(ratio, max=cap).detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean(1.0 - kept, response_mask),
        "actor/pg_clipfrac_lower": masked_mean((ratio > cap).float() * kept, response_mask),
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
    }
    return finish(-advantages * weight * log_prob * kept, response_mask, loss_agg_mode, kwargs, metrics)


def _tv_outside(log_prob, old_log_prob, low, high):
    """Binary total variation |pi - pi_old| past the bound, upwards (for A > 0) and downwards (A <= 0)."""
    moved = torch.exp(log_prob) - torch.exp(old_log_prob)
    return moved > high, moved < -low


def _kl_outside(log_prob, old_log_prob, low, high):
    """Binary KL(pi_old || pi) of the token's Bernoulli past the bound, with pi moving up (A > 0) or down."""
    eps = 1e-8
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + eps) / (1.0 - prob + eps)
    )
    return (binary_kl > high) & (prob > old_prob), (binary_kl > low) & (prob < old_prob)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """DPPO-Binary-TV (arXiv:2602.04879): the clip widths bound how far each token's probability may move
    (``clip_ratio_high`` up for positive advantages, ``clip_ratio_low`` down otherwise) instead of its ratio."""
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, kwargs, _tv_outside)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """DPPO-Binary-KL (arXiv:2602.04879): as dppo_tv, with the token's binary KL as the divergence."""
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, kwargs, _kl_outside)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """GMPO (arXiv:2507.20673): one ratio per sequence, the geometric mean of its token ratios after each token's
    log-ratio is clipped to [-clip_ratio_low, clip_ratio_high] in its advantage's direction; loss
    ``-mean_t(A) * ratio`` per sequence, averaged over sequences whatever ``loss_agg_mode`` says (verl's too; use
    ``seq-mean-token-mean`` so gradient accumulation weighs micro-batches by sequences). ``rollout_is_weights``
    enter as their per-sequence geometric mean."""
    low, high = clip_bounds(config, kwargs)
    mask = response_mask.to(log_prob.dtype)
    lengths = mask.sum(-1) + 1e-8
    diff = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clipped = torch.clamp(diff, -low, high)
    pessimistic = sign * torch.minimum(sign * diff, sign * clipped)
    ratio = torch.exp((pessimistic * mask).sum(-1) / lengths)
    seq_losses = -(advantages * mask).sum(-1) / lengths * ratio
    weights = kwargs.get("rollout_is_weights")
    if weights is not None:
        seq_losses = seq_losses * torch.exp((torch.log(weights.detach() + 1e-10) * mask).sum(-1) / lengths)
    was_clipped = diff != clipped
    metrics = {
        "actor/pg_clipfrac": masked_mean((was_clipped & (advantages > 0)).float(), response_mask),
        "actor/pg_clipfrac_lower": masked_mean((was_clipped & (advantages < 0)).float(), response_mask),
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
    }
    per_token = seq_losses[:, None].expand_as(log_prob)
    loss = agg_loss(per_token, torch.ones_like(response_mask), "seq-mean-token-mean")
    return loss, {"actor/pg_loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}
