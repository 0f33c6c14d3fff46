"""Reducing a per-token loss matrix (batch, response_length) to the scalar that is back-propagated.

Modes (``actor.loss_agg_mode``), with verl's names, arguments and semantics:

- ``token-mean``: mean over all unmasked tokens of the batch (every token weighs the same; DAPO).
- ``token-sum``: the sum over all unmasked tokens (direct calls only: see ``agg_count``).
- ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences.
- ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences (GRPO paper, GSPO).
- ``seq-mean-token-sum-norm``: seq-mean-token-sum divided by a constant ``loss_scale_factor`` (the padded response
  length unless given): a divisor with no length bias (Dr. GRPO).

The seq-mean modes average over sequences that have at least one unmasked token; an empty mask gives 0.

verl's global-batch arguments: ``batch_num_tokens`` (token-mean) / ``global_batch_size`` (seq-mean modes) are the
whole mini-batch's counts over all ``dp_size`` data-parallel ranks; the local loss is then the local sum over that
global count times ``dp_size``, so the DP-averaged gradient is the global mean's. Without them (``dp_size`` 1) the
counts are the local ones.

scaletrain's engines reach the same global mean another way: every mode but token-sum is a mean over some units
(tokens, sequences with a token), ``agg_count`` counts them, and an engine weights each micro-batch's aggregate by
its count over the mini-batch's (all micro-batches, all DP ranks: see backends/accumulation.py).
"""

from __future__ import annotations

import torch

from scaletrain.algos.masked import masked_sum

# the modes a training engine can accumulate (means: agg_count counts their units); agg_loss also takes token-sum
ENGINE_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSS_AGG_MODES = (*ENGINE_AGG_MODES, "token-sum")


def _local_count(count: torch.Tensor, dp_size: int, name: str) -> torch.Tensor:
    if dp_size > 1:
        raise ValueError(f"(global) {name} is required when dp_size > 1")
    return count


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` over the tokens where ``loss_mask`` is set, according to ``loss_agg_mode``."""
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = _local_count(mask.sum(), dp_size, "batch_num_tokens")
        return masked_sum(loss_mat, mask) / torch.as_tensor(batch_num_tokens).clamp(min=1e-8) * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; expected one of: {', '.join(LOSS_AGG_MODES)}")
    token_sum = (loss_mat * mask).sum(-1)
    token_count = mask.sum(-1)
    seq_loss = token_sum / (token_count + 1e-8) if loss_agg_mode == "seq-mean-token-mean" else token_sum
    has_tokens = (token_count > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        global_batch_size = _local_count(has_tokens.sum(), dp_size, "global_batch_size")
    loss = masked_sum(seq_loss, has_tokens) / torch.as_tensor(global_batch_size).clamp(min=1e-8) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
    return loss


def agg_count(loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> float:
    """How many units ``agg_loss`` averages over for this mask: valid tokens (token-mean), sequences with at least
    one valid token (the seq-mean modes). token-sum is a sum, not a mean: an engine's micro-batch weighting would
    average it, so the trainer refuses it with this error."""
    if loss_agg_mode == "token-mean":
        return float(loss_mask.sum())
    if loss_agg_mode in ENGINE_AGG_MODES:
        return float((loss_mask.sum(-1) > 0).sum())
    if loss_agg_mode == "token-sum":
        raise ValueError(
            "loss_agg_mode 'token-sum' is a sum, which scaletrain's engines cannot accumulate over "
            "micro-batches; use token-mean (the same gradient direction)"
        )
    raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; expected one of: {', '.join(LOSS_AGG_MODES)}")
