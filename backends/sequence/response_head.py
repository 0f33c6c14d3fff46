"""The LM head fused with the losses' per-token outputs (layer 1): log-probs and entropy straight from the hidden
states, a chunk of tokens at a time, so no (tokens x vocabulary) logits tensor exists in the forward or the backward.

A causal LM's largest tensors in a step are its logits: (response tokens x vocabulary) in the forward, kept for the
backward, and their gradient of the same size (a 150k vocabulary at 8k tokens: 4.9 GB each in fp32). Here the
head runs inside ``_HeadLogProbs``, an autograd function that walks the rows ``chunk_size`` at a time: the forward
keeps only each row's label log-prob, entropy and log-sum-exp; the backward recomputes a chunk's logits from the
saved hidden states and head weight and accumulates the gradients of both. A chunk's logits are bounded in
elements (``CHUNK_ELEMENTS``), so a larger vocabulary means fewer rows per chunk. Only the positions that predict a
response token reach the head (the model's ``logits_to_keep``), prompt tokens never do.

``fused_response_head(model, labels, temperature, entropy)``: a context in which the model's output embedding (an
``nn.Linear``) returns, instead of logits, (..., 2) rows of (label log-prob, entropy) for the hidden states it is
given, ``labels`` holding one token id per such row. The head module is still called by the model, so FSDP2's and
ZeRO-3's hooks gather its weight as for a plain forward. ``supports_fused_head`` says where that is safe: a text
causal LM whose head is a plain linear layer and whose logits nothing rescales after the head (no soft-capping);
elsewhere the engines take the logits path (scaletrain/algos/entropy.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FUSED_OUTPUTS = ("log_probs", "entropy")
PADDED_LOGIT = -1e30  # a vocabulary shard's padding ids (megatron pads the vocabulary to a TP multiple)
# a chunk's logits hold at most this many elements (32 MiB in fp32; a few such temporaries exist at once), so the
# rows per chunk shrink with the vocabulary: 64 rows at 131k, 2048 at 4k (capped by the caller's chunk_size)
CHUNK_ELEMENTS = 8 << 20


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's LM head module (a PEFT model's base model's), None when it has none."""
    get_base: Any = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    get: Any = getattr(base, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def supports_fused_head(model: nn.Module, config, outputs: tuple[str, ...]) -> bool:
    """Whether ``fused_response_head`` gives ``outputs`` of ``model`` exactly (see the module docstring)."""
    if not set(outputs) <= set(FUSED_OUTPUTS):
        return False
    if getattr(config, "final_logit_softcapping", None) is not None:
        return False
    return type(output_head(model)) is nn.Linear


@contextlib.contextmanager
def fused_response_head(
    model: nn.Module, labels: torch.Tensor, temperature: float, entropy: bool, chunk_size: int = 1024
) -> Iterator[None]:
    """Within it, the model's head returns (..., 2) rows of (label log-prob, entropy) (see the module docstring)."""
    head = output_head(model)
    assert isinstance(head, nn.Linear), "supports_fused_head decides where this applies"

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.shape[0] != labels.numel():
            raise ValueError(f"the head got {flat.shape[0]} positions for {labels.numel()} labels")
        out = head_log_probs(flat, head.weight, head.bias, labels.reshape(-1), temperature, chunk_size, entropy)
        return out.view(*hidden.shape[:-1], 2)

    # an instance attribute: nn.Module.__call__ (and the FSDP2 / ZeRO-3 hooks around it) still run
    head.forward = forward  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        del head.forward


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """A tensor-parallel head's slice of the vocabulary: ids [start, start + rows of its weight) of ``vocab_size``
    real ones (ids past it are padding, never predicted), the slices spread over ``group``."""

    group: Any
    start: int
    vocab_size: int


def head_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int,
    entropy: bool,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """(n, 2) rows of (label log-prob, entropy) of (n, H) ``hidden`` under the head ``weight`` (V or V/tp, H), a
    bounded chunk of rows at a time (see the module docstring); ``shard``: the weight is a vocabulary slice, the
    softmax spans the slices of ``shard.group`` (megatron's tensor parallelism; the hidden states' gradient is
    summed over the group, as a column-parallel layer's input gradient is)."""
    rows = max(1, min(chunk_size, CHUNK_ELEMENTS // weight.shape[0]))
    return _HeadLogProbs.apply(hidden, weight, bias, labels.long(), float(temperature), rows, entropy, shard)


def _logits(hidden, weight, bias, temperature: float, shard: VocabShard | None):
    """A chunk's logits in float32 (float64 for a float64 model: the tests' exact reference); a shard's padding
    ids at a large negative logit (probability 0, and p * logit stays 0)."""
    logits = nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if shard is not None and shard.start + logits.shape[-1] > shard.vocab_size:
        ids = torch.arange(shard.start, shard.start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(ids >= shard.vocab_size, PADDED_LOGIT)
    return logits


def _sum(x: torch.Tensor, shard: VocabShard | None, op=None) -> torch.Tensor:
    """``x`` all-reduced over the shard's group (sum, or ``op``); itself without a shard."""
    if shard is not None:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=shard.group)
    return x


def _label_logits(z: torch.Tensor, labels: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
    """Each row's logit of its label (0 on the shards that do not hold the label: the sum over shards is it)."""
    if shard is None:
        return z.gather(-1, labels[:, None]).squeeze(-1)
    local = labels - shard.start
    held = (local >= 0) & (local < z.shape[-1])
    return z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1) * held


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature: float, chunk_size: int, entropy: bool, shard):
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.zeros(n, 2, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        expected = torch.zeros(n, dtype=dtype, device=hidden.device)  # E_p[logit], the entropy's gradient needs it
        for start in range(0, n, chunk_size):
            end = start + chunk_size
            z = _logits(hidden[start:end], weight, bias, temperature, shard)
            m = _sum(z.max(dim=-1).values, shard, dist.ReduceOp.MAX)
            e = torch.exp(z - m[:, None])
            # one all-reduce of the sum of exp, the label's logit and the sum of exp * logit
            sums = _sum(torch.stack([e.sum(-1), _label_logits(z, labels[start:end], shard), (e * z).sum(-1)]), shard)
            lse[start:end] = m + torch.log(sums[0])
            out[start:end, 0] = sums[1] - lse[start:end]
            expected[start:end] = sums[2] / sums[0]
            if entropy:
                out[start:end, 1] = lse[start:end] - expected[start:end]
        ctx.save_for_backward(hidden, weight, bias, labels, lse, expected)
        ctx.temperature, ctx.chunk_size, ctx.entropy, ctx.shard = temperature, chunk_size, entropy, shard
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, bias, labels, lse, expected = ctx.saved_tensors
        shard = ctx.shard
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        dtype = lse.dtype
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if want_bias else None
        g = grad_out.to(dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            z = _logits(h, weight, bias, ctx.temperature, shard)
            p = torch.exp(z - lse[start:end, None])
            # d logp[label] / dz_k = 1[k == label] - p_k;  d entropy / dz_k = p_k (E_p[z] - z_k)
            dz = -g[start:end, :1] * p
            local = labels[start:end] - (0 if shard is None else shard.start)
            held = (local >= 0) & (local < z.shape[-1])
            dz.scatter_add_(-1, local.clamp(0, z.shape[-1] - 1)[:, None], (g[start:end, 0] * held)[:, None])
            if ctx.entropy:
                dz += g[start:end, 1:] * p * (expected[start:end, None] - z)
            dz /= ctx.temperature
            if grad_hidden is not None:
                grad_hidden[start:end] = (dz @ weight.to(dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += dz.T @ h.to(dtype)
            if grad_bias is not None:
                grad_bias += dz.sum(0)
        if grad_hidden is not None:
            _sum(grad_hidden, shard)  # each vocabulary slice's part of the hidden states' gradient
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None
