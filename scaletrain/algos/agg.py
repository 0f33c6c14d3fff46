"""Reducing a per-token loss matrix (batch, response_length) to the scalar that is back-propagated.

Modes (``actor.loss_agg_mode``):

- ``token-mean``: mean over all unmasked tokens of the batch (every token weighs the same; DAPO).
- ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences.
- ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences (GRPO paper, GSPO).
- ``seq-mean-token-sum-norm``: each sequence's token sum divided by a fixed length (the padded response
  length unless ``norm_length`` is given), then the mean over all rows: sum / (rows * length), a constant
  divisor with no length bias (Dr. GRPO). verl divides by the length only (not by the rows); here the result
  stays a per-sequence average so it is on the same scale as the other modes.

The seq-mean modes average over sequences that have at least one unmasked token; an empty mask gives 0.

Every mode is a mean over some units: tokens (token-mean), sequences with a token (seq-mean-token-sum/-mean), rows
(seq-mean-token-sum-norm, whose length divisor is a constant). ``agg_count`` counts them; a training engine weights
each micro-batch's aggregate by its count over the mini-batch's (all micro-batches, all DP ranks: see
backends/accumulation.py), which makes the mini-batch loss and gradient exactly this function's on the whole
mini-batch.
"""

from __future__ import annotations

import torch

from scaletrain.algos.masked import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean", norm_length: float | None = None
) -> torch.Tensor:
    """Aggregate ``loss_mat`` over the tokens where ``loss_mask`` is set, according to ``loss_agg_mode``."""
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        length = float(norm_length) if norm_length is not None else float(loss_mat.shape[-1])
        num_seqs = max(loss_mat.shape[0], 1)
        return (loss_mat * mask).sum() / (num_seqs * length)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        token_sum = (loss_mat * mask).sum(-1)
        token_count = mask.sum(-1)
        seq_loss = token_sum if loss_agg_mode == "seq-mean-token-sum" else token_sum / token_count.clamp(min=1)
        has_tokens = (token_count > 0).to(loss_mat.dtype)
        return masked_mean(seq_loss, has_tokens)
    raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; expected one of: {', '.join(LOSS_AGG_MODES)}")


def agg_count(loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> float:
    """How many units ``agg_loss`` averages over for this mask: valid tokens (token-mean), sequences with at least
    one valid token (seq-mean-token-sum / seq-mean-token-mean) or rows (seq-mean-token-sum-norm)."""
    if loss_agg_mode == "token-mean":
        return float(loss_mask.sum())
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float((loss_mask.sum(-1) > 0).sum())
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return float(loss_mask.shape[0])
    raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; expected one of: {', '.join(LOSS_AGG_MODES)}")
