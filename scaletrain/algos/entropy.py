"""Per-token entropy, label log-probabilities and sums of squared probabilities from logits, in chunks of rows.

A (batch, seq, vocab) softmax in float32 is the largest tensor of an LLM step (e.g. 8 x 4096 x 152k x 4 bytes =
20 GB). Both functions here walk the flattened rows ``chunk_size`` at a time, in float32, and are custom autograd
functions whose backward recomputes the softmax chunk by chunk, so neither pass keeps a full-size softmax; only
the incoming logits and the gradient w.r.t. them (unavoidably full size) exist at once.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 1024


class _ChunkedEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk_size):
            chunk = flat[start : start + chunk_size].float()
            lse = torch.logsumexp(chunk, dim=-1, keepdim=True)
            p = torch.exp(chunk - lse)
            out[start : start + chunk_size] = lse.squeeze(-1) - (p * chunk).sum(-1)
        ctx.save_for_backward(logits)
        ctx.chunk_size = chunk_size
        return out.view(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            chunk = flat[start:end].float()
            p = torch.softmax(chunk, dim=-1)
            mean_logit = (p * chunk).sum(-1, keepdim=True)
            # dH/dl_k = p_k * (E_p[l] - l_k)
            grad[start:end] = (g[start:end, None].float() * p * (mean_logit - chunk)).to(grad.dtype)
        return grad.view(logits.shape), None


class _ChunkedLabelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1, 1)
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk_size):
            chunk = flat[start : start + chunk_size].float()
            picked = chunk.gather(-1, flat_labels[start : start + chunk_size]).squeeze(-1)
            out[start : start + chunk_size] = picked - torch.logsumexp(chunk, dim=-1)
        ctx.save_for_backward(logits, labels)
        ctx.chunk_size = chunk_size
        return out.view(labels.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1, 1)
        g = grad_out.reshape(-1, 1).float()
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            # d logp[label] / d l_k = 1[k == label] - p_k
            chunk = -g[start:end] * torch.softmax(flat[start:end].float(), dim=-1)
            chunk.scatter_add_(-1, flat_labels[start:end], g[start:end])
            grad[start:end] = chunk.to(grad.dtype)
        return grad.view(logits.shape), None, None


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, shape ``logits.shape[:-1]``, float32; differentiable."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedEntropy.apply(logits, int(chunk_size))


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """log softmax(logits)[label] for every position, shape ``labels.shape``, float32; differentiable.

    ``labels`` are token ids (all valid; mask padding afterwards). Uses logsumexp, never a full log-softmax.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}")
    return _ChunkedLabelLogProb.apply(logits, labels.long(), int(chunk_size))


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 over the last dim, shape ``logits.shape[:-1]``, without gradient (the
    optimal-token-baseline estimators read it from the old policy); float32, or float64 for float64 logits.
    exp(logsumexp(2 l) - 2 logsumexp(l)) per chunk: no probability is squared, so tiny ones do not underflow and
    huge logits do not overflow."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].to(dtype)
        out[start : start + chunk_size] = torch.exp(
            torch.logsumexp(2.0 * chunk, dim=-1) - 2.0 * torch.logsumexp(chunk, dim=-1)
        )
    return out.view(logits.shape[:-1])
