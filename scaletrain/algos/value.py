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
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max((v - R)**2, (clip(v, v_old - c, v_old + c) - R)**2), aggregated over the response tokens.

    ``vpreds`` are the critic's current predictions, ``values`` the predictions made when the batch was
    collected, ``returns`` the targets. ``cliprange_value=None`` disables clipping. Returns (loss, clipfrac):
    the fraction of tokens where the clipped term is the larger one (a 0-d tensor). The last four arguments are
    ``agg_loss``'s global-batch ones (verl's signature).
    """
    global_batch = {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    losses = (vpreds - returns).square()
    if cliprange_value is None:
        return 0.5 * agg_loss(losses, response_mask, loss_agg_mode, **global_batch), torch.zeros(())
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    clipped_losses = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(losses, clipped_losses), response_mask, loss_agg_mode, **global_batch)
    clipfrac = masked_mean((clipped_losses > losses).float(), response_mask)
    return loss, clipfrac
