"""Outcome-reward estimators that compare the responses sampled for the same prompt (a "group").

``index`` holds one group id per row (np.ndarray of prompt uids, each repeated n times; a list or an integer
tensor works too). Each row's score is the sum of its token-level rewards; the per-row advantage is broadcast
over the row's response tokens. Group statistics use scatter/index ops: no Python loop over rows or groups.

Singleton groups (a prompt with one response) follow verl: their mean is 0 and their std is 1, so the row keeps
its raw score (GRPO: score / (1 + eps)); RLOO, OPO and REINFORCE++-baseline likewise subtract 0.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from scaletrain.algos.advantage import AdvantageEstimator, register_adv_est
from scaletrain.algos.masked import masked_whiten
from scaletrain.algos.options import get_option

logger = logging.getLogger(__name__)


def group_ids(index: Any, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to (dense ids 0..G-1 as a LongTensor on ``device``, G)."""
    if index is None:
        raise ValueError("this advantage estimator needs index=<one group id (prompt uid) per row>")
    if isinstance(index, torch.Tensor):
        uniq, inverse = torch.unique(index, return_inverse=True)
        gid, num_groups = inverse.to(device), int(uniq.numel())
    else:
        uniq, inverse = np.unique(np.asarray(index), return_inverse=True)
        gid, num_groups = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device), len(uniq)
    if num_groups == gid.numel() > 1:
        logger.warning(
            "every group holds a single response (rollout n=1?): group estimators then use mean 0 and "
            "std 1, i.e. no baseline"
        )
    return gid, num_groups


def group_mean_std(
    scores: torch.Tensor, gid: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group mean, unbiased group std, group size); singleton groups get mean 0 and std 1."""
    if gid.numel() != scores.numel():
        raise ValueError(f"index has {gid.numel()} group ids for {scores.numel()} rows")
    zeros = scores.new_zeros(num_groups)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = zeros.index_add(0, gid, scores) / count
    sq_dev = zeros.index_add(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    single = count < 2
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    return mean[gid], std[gid], count[gid]


def _scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """One outcome score per row: the sum of its token-level rewards (padding holds zero reward)."""
    return token_level_rewards.float().sum(-1)


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_row[:, None] * response_mask.to(per_row.dtype)
    return adv, adv


@register_adv_est(AdvantageEstimator.GRPO, group_based=True)
@torch.no_grad()
def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float | None = None,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): (score - group mean) / (group std + eps), std unbiased; eps defaults to 1e-6.

    ``norm_adv_by_std_in_grpo=False`` skips the division (Dr. GRPO, Liu et al. 2025).
    """
    opts = {"norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "epsilon": epsilon}
    norm = bool(get_option(config, "norm_adv_by_std_in_grpo", True, opts))
    eps = float(get_option(config, "epsilon", 1e-6, opts))
    scores = _scores(token_level_rewards)
    gid, G = group_ids(index, scores.device)
    mean, std, _ = group_mean_std(scores, gid, G)
    adv = scores - mean
    if norm:
        adv = adv / (std + eps)
    return _broadcast(adv, response_mask)


@register_adv_est(AdvantageEstimator.GRPO_PASSK, group_based=True)
@torch.no_grad()
def compute_grpo_passk_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float | None = None,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: only the best response of each group gets a non-zero advantage,
    (best - second best) [/ (group std + eps)]. Every group needs at least 2 responses.

    With a tie for the best score the advantage is 0 whichever row holds it (the lowest row index is used).
    """
    opts = {"norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "epsilon": epsilon}
    norm = bool(get_option(config, "norm_adv_by_std_in_grpo", True, opts))
    eps = float(get_option(config, "epsilon", 1e-6, opts))
    scores = _scores(token_level_rewards)
    gid, G = group_ids(index, scores.device)
    mean, std, count = group_mean_std(scores, gid, G)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per group (set rollout n >= 2)")

    neg_inf = torch.full((G,), -torch.inf, device=scores.device)
    best = neg_inf.scatter_reduce(0, gid, scores, "amax")
    rows = torch.arange(scores.numel(), device=scores.device)
    is_best = scores == best[gid]
    # one winner per group: the lowest row index that reaches the group maximum
    winner = torch.full((G,), scores.numel(), device=scores.device).scatter_reduce(
        0, gid, torch.where(is_best, rows, scores.numel()), "amin"
    )
    won = rows == winner[gid]
    second = neg_inf.scatter_reduce(0, gid, torch.where(won, -torch.inf, scores), "amax")
    adv = best[gid] - second[gid]
    if norm:
        adv = adv / (std + eps)
    return _broadcast(torch.where(won, adv, 0.0), response_mask)


@register_adv_est(AdvantageEstimator.RLOO, group_based=True)
@torch.no_grad()
def compute_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): score minus the mean score of the *other* responses of the group."""
    scores = _scores(token_level_rewards)
    gid, G = group_ids(index, scores.device)
    mean, _, count = group_mean_std(scores, gid, G)
    n = count.clamp(min=2)
    adv = torch.where(count > 1, (scores - mean) * n / (n - 1), scores)
    return _broadcast(adv, response_mask)


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, group_based=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline: (score - group mean), then whitened over all response tokens."""
    scores = _scores(token_level_rewards)
    gid, G = group_ids(index, scores.device)
    mean, _, _ = group_mean_std(scores, gid, G)
    keep = response_mask.bool()
    adv = (scores - mean)[:, None].expand(keep.shape)
    adv = torch.where(keep, masked_whiten(adv, keep), 0.0)
    return adv, adv


@register_adv_est(AdvantageEstimator.OPO, group_based=True)
@torch.no_grad()
def compute_opo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): score minus the length-weighted group mean sum(len * score) / sum(len)."""
    scores = _scores(token_level_rewards)
    lengths = response_mask.float().sum(-1)
    gid, G = group_ids(index, scores.device)
    zeros = scores.new_zeros(G)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    baseline = zeros.index_add(0, gid, lengths * scores) / zeros.index_add(0, gid, lengths).clamp(min=1e-8)
    baseline = torch.where(count > 1, baseline, 0.0)
    return _broadcast(scores - baseline[gid], response_mask)


@register_adv_est(AdvantageEstimator.GPG)
@torch.no_grad()
def compute_gpg_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float | None = None,
    f_norm: float | None = None,
    alpha: float | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): alpha * (score - group mean) / f_norm with alpha = batch / #rows with non-zero score.

    alpha rescales the gradient when many rows have zero reward; ``f_norm`` defaults to 1. ``epsilon`` and
    ``alpha`` are in verl's signature only: verl's GPG also computes alpha from the batch and uses no epsilon.
    """
    f_norm = float(get_option(config, "f_norm", 1.0, {"f_norm": f_norm}))
    scores = _scores(token_level_rewards)
    gid, G = group_ids(index, scores.device)
    mean, _, _ = group_mean_std(scores, gid, G)
    batch_alpha = scores.numel() / (scores != 0).sum().clamp(min=1)
    return _broadcast(batch_alpha * (scores - mean) / f_norm, response_mask)


@register_adv_est(AdvantageEstimator.GDPO, group_based=True, reads_batch=True)
@torch.no_grad()
def compute_gdpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: dict | None = None,
    batch: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv:2601.05242): each reward component normalised within its group on its own (GRPO per component),
    then summed with ``gdpo_reward_weights`` (default 1 each) and whitened over the batch. The components are the
    ``non_tensor_batch`` columns ``config.gdpo_reward_keys`` names (the reward's extra info, one value per row);
    without config and batch, the one component is the row's score. Returns (advantages, advantages)."""
    components = [_scores(token_level_rewards)]
    weights: list[float] | None = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = get_option(config, "gdpo_reward_keys", None)
        if not keys:
            raise ValueError("gdpo needs algorithm.gdpo_reward_keys: the reward components compute_score returns")
        missing = [key for key in keys if key not in non_tensor_batch]
        if missing:
            raise ValueError(
                f"gdpo reward keys {missing} are not in the batch (its columns: {sorted(non_tensor_batch)}); "
                "compute_score must return a dict holding them"
            )
        device = token_level_rewards.device
        components = [torch.as_tensor(np.asarray(non_tensor_batch[k], dtype=np.float32), device=device) for k in keys]
        weights = get_option(config, "gdpo_reward_weights", None)
        if weights is not None and len(weights) != len(keys):
            raise ValueError(f"gdpo_reward_weights has {len(weights)} weights for {len(keys)} gdpo_reward_keys")
    total = torch.zeros_like(token_level_rewards, dtype=torch.float32)
    for k, component in enumerate(components):
        normalised, _ = compute_grpo_advantage(
            component[:, None], response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
        )
        total = total + (1.0 if weights is None else float(weights[k])) * normalised
    advantages = masked_whiten(total, response_mask) * response_mask
    return advantages, advantages


# verl's names for its vectorized twins of grpo and rloo: the same computation here, which has no Python loop
register_adv_est(AdvantageEstimator.GRPO_VECTORIZED, group_based=True)(compute_grpo_advantage)
register_adv_est(AdvantageEstimator.RLOO_VECTORIZED, group_based=True)(compute_rloo_advantage)
