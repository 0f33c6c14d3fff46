"""Advantage estimators: the registry, the ``AdvantageEstimator`` names, and the token-level estimators.

Every estimator has the signature::

    fn(token_level_rewards, response_mask, index=None, config=None, **kwargs) -> (advantages, returns)

with (batch, response_length) tensors in and out. ``index`` holds one group id (prompt uid) per row for the
group estimators (see ``group_advantage.py``); ``config`` is the ``algorithm`` config (attributes or dict);
keyword arguments override it. All estimators return zeros at masked positions and run without gradients.

This file: ``gae`` (needs ``values``), ``reinforce_plus_plus`` and ``remax`` (needs ``reward_baselines``), and
the discounted suffix sums behind GAE's and REINFORCE++'s returns (``discounted_suffix_sum``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from scaletrain.algos.masked import masked_whiten
from scaletrain.algos.options import get_option
from scaletrain.utils.registry import Registry

# ------------------------------------------------------------------------------------ discounted suffix sums
# Discounted reverse cumulative sums (the scans behind GAE and REINFORCE++ returns) without a loop over time.
#
# ``y[t] = sum_{s >= t} f**(s - t) * x[s]`` is computed exactly with two small matrix products (no Python loop
# over time steps, no negative powers, so no overflow or underflow for long sequences):
#
# 1. split the time axis into chunks of C steps and take the discounted suffix sum inside each chunk with one
#    (C, C) upper-triangular matrix of powers f**(i - j);
# 2. the value at each chunk start ``S_c`` then satisfies ``A_c = sum_{c' >= c} f**(C (c' - c)) S_{c'}``, another
#    (n_chunks, n_chunks) triangular product, and every position adds ``f**(C - j) * A_{c+1}``.
#
# Work is O(B T C + B (T / C)**2) instead of the O(B T**2) of a full (T, T) decay matrix. On the CPU the products
# run in the input's precision (at least float32: chunks of 32 terms lose nothing worth keeping, and a float32
# product costs a third of a float64 one); on a GPU in float64, so the result does not depend on TF32 settings.


def _decay_matrix(n: int, factor: float, stride: int, device: torch.device) -> torch.Tensor:
    """(n, n) matrix M with M[j, i] = factor**(stride * (i - j)) for i >= j, else 0 (float64)."""
    idx = torch.arange(n, device=device)
    gap = idx[None, :] - idx[:, None]
    powers = torch.tensor(float(factor), dtype=torch.float64, device=device) ** (stride * gap.clamp(min=0))
    return torch.where(gap >= 0, powers, torch.zeros((), dtype=torch.float64, device=device))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.is_cuda else torch.promote_types(x.dtype, torch.float32)


def discounted_suffix_sum(x: torch.Tensor, factor: float, chunk_size: int = 32) -> torch.Tensor:
    """``y[..., t] = sum_{s >= t} factor**(s - t) * x[..., s]`` along the last dim; returns x's dtype.

    ``factor`` must lie in [0, 1] (a discount). ``factor == 0`` returns x, ``factor == 1`` a plain reverse cumsum.
    """
    factor = float(factor)
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"discount factor must be in [0, 1], got {factor}")
    *lead, T = x.shape
    if T == 0:
        return x.clone()
    dtype = _work_dtype(x)
    flat = x.reshape(-1, T).to(dtype)
    C = max(1, min(chunk_size, T))
    n = -(-T // C)
    if n * C != T:
        flat = F.pad(flat, (0, n * C - T))  # zeros at the end do not change earlier suffix sums
    chunks = flat.view(-1, n, C)

    inner = _decay_matrix(C, factor, 1, x.device).to(dtype)  # (C, C)
    local = chunks @ inner.T  # suffix sums inside each chunk
    starts = local[..., 0] @ _decay_matrix(n, factor, C, x.device).to(dtype).T  # full value at each chunk start
    carry = F.pad(starts[:, 1:], (0, 1))  # value at the start of the next chunk
    exps = torch.arange(C, 0, -1, device=x.device)  # position j is C - j steps before the next chunk
    tail = (torch.tensor(factor, dtype=torch.float64, device=x.device) ** exps).to(dtype)
    y = local.view(-1, C).addmm_(carry.reshape(-1, 1), tail.view(1, C))  # + carry * tail: a rank-1 update
    return y.view(-1, n * C)[:, :T].reshape(*lead, T).to(x.dtype)


ADV_ESTIMATORS = Registry("advantage estimator")


class AdvantageEstimator(str, enum.Enum):
    """Names of the built-in estimators (``algorithm.adv_estimator`` in the config)."""

    GAE = "gae"
    GRPO = "grpo"
    GRPO_PASSK = "grpo_passk"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    OPO = "opo"
    GPG = "gpg"
    GRPO_VECTORIZED = "grpo_vectorized"  # verl's name for its vectorized GRPO: grpo here (already vectorized)
    RLOO_VECTORIZED = "rloo_vectorized"  # likewise rloo
    GDPO = "gdpo"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"


@dataclass(frozen=True)
class EstimatorTraits:
    """What the trainer must know of an estimator, stated where it is registered (verl hard-codes these lists)."""

    needs_values: bool = False  # it reads a critic's values: the trainer builds a critic (critic.enable: null)
    group_based: bool = False  # it compares the samples of one prompt: rollout.n must be >= 2
    greedy_baseline: bool = False  # it reads reward_baselines: the score of one greedy response per prompt (ReMax)
    reads_batch: bool = False  # it reads the batch's columns (non_tensor_batch, batch), e.g. reward components
    needs_sum_pi_squared: bool = False  # it reads old_log_probs and sum_pi_squared (the actor's log-prob pass
    # computes each token's sum of squared probabilities for it) and rollout_is_weights when there are any


ESTIMATOR_TRAITS: dict[str, EstimatorTraits] = {}


def register_adv_est(
    name: str | AdvantageEstimator,
    *,
    override: bool = False,
    needs_values: bool = False,
    group_based: bool = False,
    greedy_baseline: bool = False,
    reads_batch: bool = False,
    needs_sum_pi_squared: bool = False,
) -> Callable:
    """Decorator: register an advantage estimator under ``name`` (then usable as ``algorithm.adv_estimator=name``),
    with its traits (``EstimatorTraits``)."""
    register = ADV_ESTIMATORS.register(name, override=override)

    def decorator(fn: Callable) -> Callable:
        register(fn)
        key = name.value if isinstance(name, enum.Enum) else name
        ESTIMATOR_TRAITS[key] = EstimatorTraits(
            needs_values, group_based, greedy_baseline, reads_batch, needs_sum_pi_squared
        )
        return fn

    return decorator


def estimator_traits(name: str) -> EstimatorTraits:
    """The traits registered with estimator ``name`` (none for a name nobody registered: the config check names it)."""
    return ESTIMATOR_TRAITS.get(name, EstimatorTraits())


def get_adv_estimator(name: str | AdvantageEstimator) -> Callable:
    """The estimator registered under ``name``; ValueError listing the registered names otherwise."""
    return ADV_ESTIMATORS.get(name)


@register_adv_est(AdvantageEstimator.GAE, needs_values=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | None = None,
    lam: float | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) with critic ``values``; advantages are whitened.

    Masked positions inside a response (e.g. tool observations) are skipped, not treated as steps: for each
    unmasked token t, the "next" value is the value at the next unmasked token, and rewards and values at masked
    positions never enter the recursion. Equivalently, GAE runs on the unmasked tokens packed to the left.
    ``returns = advantages + values`` (before whitening). ``gamma`` and ``lam`` default to config, then 1.0.
    Positional order as verl's: (token_level_rewards, values, response_mask, gamma, lam).
    """
    opts = {"gamma": gamma, "lam": lam}
    gamma = float(get_option(config, "gamma", 1.0, opts))
    lam = float(get_option(config, "lam", 1.0, opts))

    advantages, returns = _gae_over_kept_tokens(token_level_rewards, values, response_mask, gamma, lam)
    keep = response_mask.to(advantages.dtype)
    advantages = masked_whiten(advantages, keep).mul_(keep)
    return advantages, returns


def _gae_over_kept_tokens(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of GAE over the unmasked tokens (masked ones skipped), 0 at masked positions."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    if _is_prefix_mask(response_mask):  # the usual case: already packed, no gather / scatter
        return _packed_gae(rewards.to(dtype), values.to(dtype), response_mask.to(dtype), gamma, lam)
    return _gae_with_holes(rewards, values, response_mask.bool(), dtype, gamma, lam)


def _is_prefix_mask(mask: torch.Tensor) -> bool:
    """Whether every row of ``mask`` is ones then zeros (no masked token before an unmasked one)."""
    return mask.shape[1] < 2 or bool(torch.diff(mask.float(), dim=1).max() <= 0)


def _packed_gae(
    r: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) for left-packed rows (``keep`` ones then zeros, as a float tensor); 0 beyond.
    In place where it can: on the CPU each fresh (batch, length) tensor costs more than the arithmetic on it."""
    v = v * keep
    deltas = torch.empty_like(v)
    deltas[:, :-1] = v[:, 1:]  # the next value; 0 after the last unmasked token
    deltas[:, -1] = 0.0
    if gamma != 1.0:
        deltas.mul_(gamma)
    deltas.sub_(v).addcmul_(r, keep)  # r + gamma * next_v - v, 0 beyond
    advantages = discounted_suffix_sum(deltas, gamma * lam).mul_(keep)
    return advantages, v.add_(advantages)


def _gae_with_holes(
    rewards: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE where masked tokens sit between unmasked ones: the unmasked tokens of every row packed to the left
    (column T collects the masked ones and is dropped), ``_packed_gae``, and the results put back."""
    B, T = keep.shape
    rank = keep.long().cumsum(-1) - 1
    dest = torch.where(keep, rank, torch.full_like(rank, T))

    def pack(x: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(B, T + 1, dtype=dtype, device=x.device)
        return buf.scatter_(1, dest, torch.where(keep, x.to(dtype), 0.0))[:, :T]

    lengths = keep.sum(-1, keepdim=True)
    packed_keep = (torch.arange(T, device=keep.device) < lengths).to(dtype)
    packed_adv, _ = _packed_gae(pack(rewards), pack(values), packed_keep, gamma, lam)
    advantages = torch.where(keep, packed_adv.gather(1, rank.clamp(min=0)), 0.0)
    return advantages, torch.where(keep, advantages + values.to(dtype), 0.0)


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the batch.

    As in verl 0.9, masked positions inside a response (tool observations) are skipped, not ends: the return
    carries across them (their rewards do not enter it and no discount step is taken there), so a final reward
    reaches the tokens of every earlier turn. It is GAE over the unmasked tokens with zero values and lambda 1.
    """
    gamma = float(get_option(config, "gamma", 1.0, {"gamma": gamma}))
    zero_values = torch.zeros_like(token_level_rewards, dtype=torch.float32)
    returns, _ = _gae_over_kept_tokens(token_level_rewards, zero_values, response_mask, gamma, 1.0)
    keep = response_mask.bool()
    advantages = torch.where(keep, masked_whiten(returns, keep), 0.0)
    return advantages, returns


@register_adv_est(AdvantageEstimator.REMAX, greedy_baseline=True)
@torch.no_grad()
def compute_remax_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): undiscounted return-to-go minus the reward of the greedy response (per row).

    ``reward_baselines`` is (batch,): the score of the greedy decode for that row's prompt.
    """
    keep = response_mask.bool()
    rewards = torch.where(keep, token_level_rewards.float(), 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    returns = torch.where(keep, returns, 0.0)
    advantages = torch.where(keep, returns - reward_baselines.float().reshape(-1, 1), 0.0)
    return advantages, returns
