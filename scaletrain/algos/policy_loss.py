"""Policy-gradient losses: the registry and the ratio-based losses (vanilla PPO, GSPO, GPG, CISPO, SAPO).

Every loss has the signature::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, **kwargs) -> (loss, metrics)

with (batch, response_length) tensors; ``log_prob`` carries the gradient. ``config`` is the actor config
(attributes or dict; loss-specific keys may also sit under ``config.policy_loss``). Extra per-token inputs
arrive as keyword arguments; all losses accept ``rollout_is_weights`` (see ``rollout_correction.py``), which
multiplies the per-token losses. ``metrics`` maps names to floats and always holds ``actor/pg_loss``,
``actor/pg_clipfrac`` (share of tokens whose gradient a clip removed; 0 for losses without a hard clip) and
``actor/ppo_kl`` (mean of old_log_prob - log_prob, the k1 estimate of KL(old || new)).

Covariance-based losses (clip_cov, kl_cov) are in ``policy_loss_cov.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scaletrain.algos.agg import agg_loss
from scaletrain.algos.masked import masked_mean
from scaletrain.algos.options import get_option
from scaletrain.utils.registry import Registry

POLICY_LOSSES = Registry("policy loss")


def register_policy_loss(name: str, *, override: bool = False) -> Callable:
    """Decorator: register a policy loss under ``name`` (then usable as ``actor.policy_loss.loss_mode=name``)."""
    return POLICY_LOSSES.register(name, override=override)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered under ``name``; ValueError listing the registered names otherwise."""
    return POLICY_LOSSES.get(name)


def option(config: Any, key: str, default: Any, kwargs: dict | None = None) -> Any:
    """A loss option: keyword argument, else ``config.key``, else ``config.policy_loss.key``, else default."""
    return get_option(config, key, default, kwargs, section="policy_loss")


def clip_bounds(config: Any, kwargs: dict | None = None) -> tuple[float, float]:
    """(low, high) clip widths: ``clip_ratio_low`` / ``clip_ratio_high``, each falling back to ``clip_ratio`` (0.2)."""
    clip_ratio = float(option(config, "clip_ratio", 0.2, kwargs))
    low = float(option(config, "clip_ratio_low", clip_ratio, kwargs))
    high = float(option(config, "clip_ratio_high", clip_ratio, kwargs))
    return low, high


def log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) per token, clamped to [-20, 20] so exp() stays finite."""
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def finish(
    pg_losses: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, kwargs: dict, metrics: dict
) -> tuple[torch.Tensor, dict]:
    """Apply ``rollout_is_weights`` (if given), aggregate, and add ``actor/pg_loss`` to the float metrics."""
    weights = kwargs.get("rollout_is_weights")
    if weights is not None:
        pg_losses = pg_losses * weights.detach()
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    out = {"actor/pg_loss": float(loss.detach())}
    out.update({k: float(v) for k, v in metrics.items()})
    return loss, out


def ppo_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_mean((old_log_prob - log_prob).detach(), response_mask)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip (``clip_ratio_low/high``, DAPO) and
    dual clip (Ye et al. 2020): for negative advantages the loss is capped at ``-A * clip_ratio_c`` (default 3;
    a very large value effectively disables it). Extra metric:
    ``actor/pg_clipfrac_lower`` (share of tokens where the dual clip binds).
    """
    low, high = clip_bounds(config, kwargs)
    clip_c = float(option(config, "clip_ratio_c", 3.0, kwargs))
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_c}")
    ratio = torch.exp(log_ratio(log_prob, old_log_prob))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_loss = torch.maximum(loss_unclipped, loss_clipped)
    dual_cap = -advantages * clip_c
    pg_losses = torch.where(advantages < 0, torch.minimum(clip_loss, dual_cap), clip_loss)
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
        "actor/pg_clipfrac_lower": masked_mean(((clip_loss > dual_cap) & (advantages < 0)).float(), response_mask),
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
    }
    return finish(pg_losses, response_mask, loss_agg_mode, kwargs, metrics)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None, **kwargs
):
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, s = exp(mean_t log(pi / pi_old)), clipped
    like PPO (paper widths are small, e.g. 3e-4 / 4e-4). Each token's gradient is s * grad log pi(token)
    (token-level form: s_t = sg(s) * pi_t / sg(pi_t)). The paper aggregates with ``seq-mean-token-mean``.
    """
    low, high = clip_bounds(config, kwargs)
    mask = response_mask.to(log_prob.dtype)
    diff = log_prob - old_log_prob
    seq_log_ratio = (diff * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
        "actor/gspo_seq_ratio_mean": torch.exp(seq_log_ratio.detach()).mean(),
    }
    return finish(pg_losses, response_mask, loss_agg_mode, kwargs, metrics)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """GPG (Chu et al. 2025): plain policy gradient -A * log pi, no ratio and no clip (pair with the gpg estimator)."""
    metrics = {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask)}
    return finish(-advantages * log_prob, response_mask, loss_agg_mode, kwargs, metrics)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """CISPO (MiniMax-M1, 2025): -sg(clip(ratio, 1 - low, 1 + high)) * A * log pi. The clip bounds the
    importance weight but, unlike PPO, never drops a token's gradient. MiniMax sets no lower bound (use a
    ``clip_ratio_low`` of 1 or more for that). ``actor/pg_clipfrac`` counts tokens whose weight was clipped.
    """
    low, high = clip_bounds(config, kwargs)
    ratio = torch.exp(log_ratio(log_prob, old_log_prob)).detach()
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    metrics = {
        "actor/pg_clipfrac": masked_mean((weight != ratio).float(), response_mask),
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
    }
    return finish(-advantages * weight * log_prob, response_mask, loss_agg_mode, kwargs, metrics)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """SAPO (Qwen team 2025, arXiv:2511.20347): a soft gate instead of a hard clip,
    loss = -A * (4 / tau) * sigmoid(tau (r - 1)),
    tau = ``tau_pos`` (1.0) for A > 0 and ``tau_neg`` (1.05) otherwise. At r = 1 the gradient equals PPO's; it
    fades smoothly as r leaves 1. ``actor/sapo_gate`` is the mean gradient weight 4 s (1 - s) relative to PPO's
    unclipped gradient (1 on-policy).
    """
    tau_pos = float(option(config, "tau_pos", 1.0, kwargs))
    tau_neg = float(option(config, "tau_neg", 1.05, kwargs))
    ratio = torch.exp(log_ratio(log_prob, old_log_prob))
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    pg_losses = -advantages * gate * (4.0 / tau)
    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask),
        "actor/sapo_gate": masked_mean((4.0 * gate * (1.0 - gate)).detach(), response_mask),
    }
    return finish(pg_losses, response_mask, loss_agg_mode, kwargs, metrics)


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kwargs
):
    """DRO (Direct Reward Optimization, Richemond et al. 2024): ``-(log pi * A - beta / 2 * (log pi - log
    pi_old)**2)``, a quadratic penalty on the log-ratio instead of a clip. ``policy_loss.dro_beta`` must be > 0."""
    beta = option(config, "dro_beta", None, kwargs)
    if beta is None or float(beta) <= 0:
        raise ValueError(f"policy_loss.dro_beta must be a positive value when using DRO, got {beta!r}")
    ratio_log = log_ratio(log_prob, old_log_prob)
    pg_losses = -(log_prob * advantages - 0.5 * float(beta) * ratio_log.square())
    return finish(
        pg_losses, response_mask, loss_agg_mode, kwargs, {"actor/ppo_kl": ppo_kl(old_log_prob, log_prob, response_mask)}
    )
