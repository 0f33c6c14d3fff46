"""Optimal-token-baseline estimators (verl's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``).

Where GRPO subtracts one baseline per response, these subtract one per token position, chosen per prompt group to
minimise the policy gradient's variance: with ``G_t`` the reward-to-go and ``W_t`` the cumulative path-variance
proxy ``sum_{j<=t} (1 - 2 pi_j + sum_v pi_v^2)`` (the squared norm of the score function at each sampled token,
from the old policy's probability ``pi_j`` of that token and the sum of squared probabilities over the vocabulary),

    B_t = sum_group G_t W_t / (sum_group W_t + epsilon),       A_t = G_t - B_t.

With rollout importance weights ``rho`` each step's term is scaled by ``rho^2``. A group of one response keeps its
return (no baseline). ``handle_zero_tail``: where one response of a group is longer than all the others, its
positions past the second-longest see no other sample, so its baseline there is zero.

The multi-turn variant (``tir_``) aligns the responses by their count of trained tokens instead of by position, so
masked observation spans (tool results) do not shift one turn against another, and leaves empty responses out of
their group. For right-padded single-turn responses both give the same advantages.

The trainer hands both ``old_log_probs`` and ``sum_pi_squared`` (the actor's log-prob pass computes it for an
estimator registered with ``needs_sum_pi_squared``) and ``rollout_is_weights`` when the rollout correction made them.
"""

from __future__ import annotations

import numpy as np
import torch

from scaletrain.algos.advantage import AdvantageEstimator, register_adv_est
from scaletrain.algos.group_advantage import group_ids


def _path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights) -> torch.Tensor:
    """W_t: the cumulative sum over the response's trained tokens of 1 - 2 pi_t + sum pi^2 (times rho_t^2)."""
    step = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        step = step * rollout_is_weights**2
    return (step * mask).cumsum(dim=-1)


def _zero_lone_tails(baselines: torch.Tensor, lengths: torch.Tensor, gid: torch.Tensor, member: torch.Tensor) -> None:
    """In each group of two or more members, a response longer than every other member gets a zero baseline past
    the second-longest length (in place)."""
    for group in torch.unique(gid[member]).tolist():
        rows = torch.nonzero((gid == group) & member).flatten()
        if rows.numel() < 2:
            continue
        group_lengths = lengths[rows]
        top2 = torch.topk(group_lengths, 2).values
        if top2[0] > top2[1]:
            longest = rows[int(torch.argmax(group_lengths))]
            baselines[longest, int(top2[1]) :] = 0.0


def _group_baselines(returns, path_var, mask, index, handle_zero_tail, epsilon, members) -> torch.Tensor:
    """B_t per row and aligned position over each group's ``members`` (rows of single-member groups: 0)."""
    gid, num_groups = group_ids(index, device=returns.device)
    weight = path_var * mask * members[:, None].to(path_var.dtype)
    numerator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, gid, returns * weight)
    denominator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, gid, weight)
    size = torch.bincount(gid[members], minlength=num_groups)
    baselines = numerator[gid] / (denominator[gid] + epsilon) * (size[gid] > 1)[:, None].to(returns.dtype)
    if handle_zero_tail:
        _zero_lone_tails(baselines, mask.sum(-1), gid, members & (size[gid] > 1))
    return baselines


def _returns(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t: the undiscounted reward-to-go over the response's trained tokens."""
    return (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


@register_adv_est(AdvantageEstimator.OPTIMAL_TOKEN_BASELINE, group_based=True, needs_sum_pi_squared=True)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns): G_t - B_t per token position (see the module docstring), returns G_t."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _returns(token_level_rewards, mask)
    path_var = _path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    everyone = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    baselines = _group_baselines(returns, path_var, mask, index, handle_zero_tail, epsilon, everyone)
    return (returns - baselines) * mask, returns


def _aligned_order(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the column order that puts its trained tokens first, in their order (a stable sort)."""
    return torch.sort((mask <= 0).to(torch.int8), dim=-1, stable=True).indices


@register_adv_est(AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE, group_based=True, needs_sum_pi_squared=True)
@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) with the responses aligned by trained-token count (see the module docstring)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _returns(token_level_rewards, mask)
    path_var = _path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    order = _aligned_order(mask)
    lengths = mask.sum(-1)
    aligned_mask = (torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]).to(mask.dtype)
    aligned_returns = returns.gather(1, order) * aligned_mask
    aligned_var = path_var.gather(1, order) * aligned_mask
    baselines = _group_baselines(
        aligned_returns, aligned_var, aligned_mask, index, handle_zero_tail, epsilon, lengths > 0
    )
    aligned_adv = (aligned_returns - baselines) * aligned_mask
    advantages = torch.zeros_like(returns).scatter_(1, order, aligned_adv)
    return advantages * mask, returns
