"""Ulysses sequence parallelism for the HF-model engines (layer 1): fsdp and deepspeed, on the remove-padding path.

A sequence-parallel (SP) group of ``size`` consecutive ranks holds the same micro-batches; each rank runs the model on
its ``1 / size`` slice of the packed sequence (``SequenceParallel.shard``), so activations scale with the slice.
Attention needs every token, so around it an all-to-all trades the sequence split for a split over attention heads
(each rank attends over the whole sequence with ``heads / size`` heads), and a second all-to-all trades back. The
model's own attention modules call ``ulysses_attention`` (registered with transformers' ``AttentionInterface`` and
set as the model's implementation by ``install``); the shard rides the model call as the ``ulysses`` keyword, which
transformers passes down to every attention call (gradient checkpointing's recompute included).

Attention itself runs one packed sequence at a time (causal, no mask: O(sum of lengths^2), where the packed
block-diagonal mask of the one-rank path is O(total^2)), with the model's sliding window where it has one; with
``flash_attention_2`` the whole sequence goes to transformers' kernel with the full position ids (CUDA only: not
run here).

Each rank's head computes only its slice's outputs (log-probs, entropy, values, scores); ``SequenceShard.gather``
sums them over the group so every rank holds all of them, and its backward sums the gradients over the group too.
The SP ranks then back-propagate the same loss, so the group's gradient is ``size`` times the loss's; the engines
average gradients over all ranks (world = DP x SP) while scaling each micro-batch's loss by the world size over
the units of every rank (backends/accumulation.py, where each SP rank counts its units too): the two factors
cancel, and the step equals the step of one rank per SP group (tests/backends/test_ulysses.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ULYSSES_ATTENTION = "scaletrain_ulysses"  # the attention implementation name registered with transformers


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 (one chunk per rank); the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # before empty_like, which would copy a permuted view's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum; the backward all-reduces the gradients (each rank's loss reads every rank's input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclasses.dataclass
class SequenceShard:
    """One micro-batch's packed sequence as one SP rank holds it: tokens ``[start, end)`` of ``positions``."""

    group: object
    size: int
    start: int
    end: int
    positions: torch.Tensor  # (S,) the whole packed sequence's position ids, S a multiple of size
    attention: str  # the model's attention kernel: sdpa | eager | flash_attention_2
    spans: list[tuple[int, int]]  # the packed sequences as [start, end) spans of the whole sequence

    def take(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices into this rank's slice, which of ``positions`` they are): the packed ``positions`` held here."""
        mine = (positions >= self.start) & (positions < self.end)
        return positions[mine] - self.start, mine

    def gather(self, values: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` (this rank's: the rows of ``mine``) in one (len(mine), ...) tensor (see the module
        docstring for its gradient)."""
        full = values.new_zeros((mine.shape[0], *values.shape[1:]))
        full = full.index_put((mine.nonzero()[:, 0],), values)
        return _SumOverGroup.apply(full, self.group)


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """An engine's SP group: ``size`` consecutive ranks, this rank's ``rank`` in it."""

    group: object
    size: int
    rank: int
    attention: str

    def shard(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, SequenceShard]:
        """This rank's slice of packed (1, total) ``ids`` and ``positions``, padded to a multiple of ``size`` with a
        sequence of its own (token 0, positions 0, 1, ...: no other token attends to it)."""
        total = ids.shape[1]
        pad = -total % self.size
        if pad:
            ids = torch.cat([ids, ids.new_zeros((1, pad))], dim=1)
            positions = torch.cat([positions, torch.arange(pad, device=positions.device).unsqueeze(0)], dim=1)
        local = ids.shape[1] // self.size
        start, end = self.rank * local, (self.rank + 1) * local
        starts = (positions[0] == 0).nonzero()[:, 0].tolist()  # each packed sequence starts at position 0
        bounds = [*starts, positions.shape[1]]
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))  # once per micro-batch, not per attention call
        shard = SequenceShard(self.group, self.size, start, end, positions[0], self.attention, spans)
        return ids[:, start:end], positions[:, start:end], shard


def sequence_parallel(size: int, model: nn.Module) -> SequenceParallel | None:
    """Collective over all ranks: the SP groups of ``size`` consecutive ranks (None for size 1), after checking the
    model can be split (its heads) and switching its attention to ``ulysses_attention``."""
    if size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} must divide the {world} ranks")
    hf: Any = model  # a transformers PreTrainedModel
    config = hf.config.get_text_config()
    heads = config.num_attention_heads  # KV heads that do not split are repeated to these (ulysses_attention)
    if heads % size:
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} must divide the model's {heads} attention heads "
            f"({type(model).__name__})"
        )
    mine = None
    for first in range(0, world, size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    attention = install(model)
    return SequenceParallel(mine, size, rank % size, attention)


def install(model: nn.Module) -> str:
    """Register ``ulysses_attention`` and make it ``model``'s attention; returns the kernel it wraps."""
    from transformers import AttentionInterface

    hf: Any = model  # a transformers PreTrainedModel
    inner = str(hf.config._attn_implementation or "sdpa")
    if inner == ULYSSES_ATTENTION:
        raise ValueError("the model already runs Ulysses attention")
    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    hf.set_attn_implementation(ULYSSES_ATTENTION)
    return inner


def _heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(1, H, s, d) all heads of this rank's slice -> (1, H / size, size * s, d) this rank's heads, every token."""
    _, heads, s, d = x.shape
    out = _AllToAll.apply(x[0].reshape(size, heads // size, s, d), group)
    return out.permute(1, 0, 2, 3).reshape(heads // size, size * s, d).unsqueeze(0)


def _sequence_to_heads(y: torch.Tensor, group, size: int) -> torch.Tensor:
    """(1, S, h, d) this rank's heads, every token -> (1, S / size, size * h, d) every head of this rank's slice."""
    _, total, heads, d = y.shape
    out = _AllToAll.apply(y[0].reshape(size, total // size, heads, d), group)
    return out.permute(1, 0, 2, 3).reshape(total // size, size * heads, d).unsqueeze(0)


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=1)


UNSUPPORTED_KWARGS = ("softcap", "s_aux")  # attention variants this path does not compute (named in the error)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    ulysses: SequenceShard | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (1, heads, s, d) query / key / value of this rank's slice ->
    (1, s, heads, d) output. The mask transformers builds for a slice is ignored: the spans come from the shard."""
    if ulysses is None:
        raise RuntimeError(
            f"{type(module).__name__} runs Ulysses attention but the model was called without its sequence shard "
            "(backends/hf_model.py passes it with use_remove_padding)"
        )
    used = [k for k in UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if used:
        raise ValueError(
            f"Ulysses sequence parallelism does not compute attention with {used} ({type(module).__name__})"
        )
    shard, size = ulysses, ulysses.size
    kv_times = query.shape[1] // key.shape[1] if key.shape[1] % size else 1  # KV heads that do not split: repeat
    q = _heads_to_sequence(query, shard.group, size)
    k = _heads_to_sequence(_repeat_heads(key, kv_times), shard.group, size)
    v = _heads_to_sequence(_repeat_heads(value, kv_times), shard.group, size)
    dropout = dropout if module.training else 0.0
    if shard.attention.startswith("flash_attention"):
        out = _flash(module, q, k, v, shard, dropout, scaling, sliding_window)
    else:
        out = _by_sequence(q, k, v, shard, dropout, scaling, sliding_window)  # (1, S, h, d)
    return _sequence_to_heads(out, shard.group, size), None


def _by_sequence(q, k, v, shard: SequenceShard, dropout: float, scaling, window: int | None) -> torch.Tensor:
    """Causal attention within each packed sequence (sdpa; eager computes the same), (1, S, h, d)."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for a, b in shard.spans:
        mask = _window_mask(b - a, window, q.device)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, a:b],
                k[:, :, a:b],
                v[:, :, a:b],
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=mask is None,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2)


def _window_mask(n: int, window: int | None, device) -> torch.Tensor | None:
    """A causal sliding-window mask (True: attend) when the window is shorter than the sequence; else None."""
    if window is None or n <= window:
        return None
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def _flash(module, q, k, v, shard: SequenceShard, dropout: float, scaling, window) -> torch.Tensor:
    """transformers' flash-attention kernel over the whole sequence, the boundaries from the full position ids."""
    from transformers.integrations.flash_attention import flash_attention_forward

    call: Callable = flash_attention_forward
    out, _ = call(
        module,
        q,
        k,
        v,
        None,
        dropout=dropout,
        scaling=scaling,
        sliding_window=window,
        position_ids=shard.positions.unsqueeze(0),
    )
    return out
