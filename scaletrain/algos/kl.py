"""KL divergence to the reference policy: per-token estimators, the in-reward penalty and its controllers,
and the KL loss term.

Estimators of KL(pi || pi_ref) from samples of pi, with d = logprob - ref_logprob (Schulman, "Approximating KL
divergence"):

- ``k1`` (alias ``kl``): d                       - unbiased, high variance, can be negative
- ``abs``: |d|
- ``k2`` (alias ``mse``): d**2 / 2
- ``k3`` (alias ``low_var_kl``): exp(-d) + d - 1 - unbiased, non-negative, low variance; clamped to [-10, 10]

A trailing ``+`` (``k1+``, ``k3+``, ...) keeps the value of the named estimator but takes the gradient of k2
(straight-through: ``k2 - k2.detach() + value.detach()``), whose gradient is an unbiased KL gradient.
"""

from __future__ import annotations

import numpy as np
import torch

from scaletrain.algos.agg import agg_loss
from scaletrain.algos.masked import masked_mean

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def _kl_value(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    diff = logprob - ref_logprob
    if name in ("k1", "kl"):
        return diff
    if name == "abs":
        return diff.abs()
    if name in ("k2", "mse"):
        return 0.5 * diff.square()
    if name in ("k3", "low_var_kl"):
        neg = torch.clamp(-diff, min=-20.0, max=20.0)  # log(ref / pi), clamped so exp cannot overflow
        return torch.clamp(neg.exp() - neg - 1.0, min=-10.0, max=10.0)
    allowed = ", ".join(KL_ESTIMATORS + tuple(n + "+" for n in KL_ESTIMATORS))
    raise ValueError(f"unknown kl_penalty '{name}'; expected one of: {allowed}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "k1") -> torch.Tensor:
    """Per-token KL estimate between the policy (``logprob``) and the reference (``ref_logprob``)."""
    if kl_penalty.endswith("+"):
        value = _kl_value(logprob, ref_logprob, kl_penalty[:-1])
        grad_source = _kl_value(logprob, ref_logprob, "k2")
        return grad_source - grad_source.detach() + value.detach()
    return _kl_value(logprob, ref_logprob, kl_penalty)


_per_token_kl = kl_penalty  # apply_kl_penalty_to_rewards has a parameter named kl_penalty


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict]:
    """KL to the reference as a loss term (``actor.use_kl_loss``); the caller multiplies by its coefficient."""
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    loss = agg_loss(kld, response_mask, loss_agg_mode)
    return loss, {"actor/kl_loss": float(loss.detach())}


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): move the coefficient so the measured KL tracks ``target_kl``.

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be positive, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(
    kl_type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """``algorithm.kl_ctrl`` config -> controller (``type`` is "fixed" or "adaptive")."""
    if kl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl controller type '{kl_type}'; expected fixed or adaptive")


@torch.no_grad()
def apply_kl_penalty_to_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict]:
    """In-reward KL penalty: ``rewards = scores - beta * KL`` per token, then ``kl_ctrl.update``.

    The batch KL passed to the controller is the mean over rows of each row's mean token KL. The coefficient
    used (and reported) is the one before the update.
    """
    kld = _per_token_kl(old_log_prob, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
