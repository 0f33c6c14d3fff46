"""Critic (value function) loss with PPO-style value clipping."""

from __future__ import annotations

import torch

from scaletrain.algos.agg import agg_loss
from scaletrain.algos.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, float]:
    """0.5 * max((v - R)**2, (clip(v, v_old - c, v_old + c) - R)**2), aggregated over the response tokens.

    ``vpreds`` are the critic's current predictions, ``values`` the predictions made when the batch was
    collected, ``returns`` the targets. ``cliprange_value=None`` disables clipping. Returns (loss, clipfrac):
    the fraction of tokens where the clipped term is the larger one.
    """
    losses = (vpreds - returns).square()
    if cliprange_value is None:
        return 0.5 * agg_loss(losses, response_mask, loss_agg_mode), 0.0
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    clipped_losses = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(losses, clipped_losses), response_mask, loss_agg_mode)
    clipfrac = masked_mean((clipped_losses > losses).float(), response_mask)
    return loss, float(clipfrac)
