"""Per-token outputs of the Megatron model without gathering the vocabulary: vocab-parallel log-probs (megatron's
``vocab_parallel_cross_entropy``) and entropy (all-reduce of max / sum-exp / sum p*logit over the TP group), both
differentiable, the sum of squared probabilities (no gradient), plus the micro-batch layout the Megatron model is fed.

Layout. Megatron's RoPE uses positions 0..S-1 of the sequence it is given, so each row is rolled left until its
first valid token sits in column 0: valid tokens then have exactly the HF position ids (0, 1, ...), and the
left-padding moved behind them is never attended to (the mask is causal). Response token j of row i, at column
T-R+j, is predicted at rolled column T-R+j-1-first_i. Rows and columns may be padded (equal shapes for pipeline
parallelism, a sequence divisible by TP for sequence parallelism); padded rows are dropped before the loss.

Logits only where they count: within ``response_positions_only`` the output layer of a causal LM takes only the
hidden states at the positions that predict response tokens, so its output is (rows, R, V/tp), not (rows, S, V/tp),
and no prompt position's logits exist. With ``FusedHead`` (log-probs and entropy only) it goes further: the layer
returns (rows, R, 2) rows of (label log-prob, entropy), computed a bounded chunk of rows at a time over the
vocabulary slices of the TP ranks (backends/sequence/response_head.py), so no (rows x R x V/tp) logits exist either.
With sequence parallelism the layer's input is this rank's slice of the sequence, which the layer would gather
itself: it is gathered first (its gradient split back to the slices) and the layer runs as a plain column-parallel
one (its input gradient all-reduced over TP), as megatron's own inference path does for the last token; the fused
head all-reduces that gradient itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from backends.base import MODEL_INPUTS
from backends.sequence.response_head import FUSED_OUTPUTS, VocabShard, head_log_probs

PADDED_LOGIT = -1e30  # logits of vocabulary padding rows: zero probability, no NaN in p * logit


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, group) -> torch.Tensor:
        logits = logits.float()
        m = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(logits - m)
        s = e.sum(-1, keepdim=True)
        dist.all_reduce(s, group=group)
        p = e / s
        pl = (p * logits).sum(-1, keepdim=True)
        dist.all_reduce(pl, group=group)
        ctx.save_for_backward(p, logits, pl)
        return (torch.log(s) + m - pl).squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, logits, pl = ctx.saved_tensors
        # dH/dl_k = p_k * (E_p[l] - l_k); each TP rank holds its own vocabulary slice of the gradient
        return grad.unsqueeze(-1) * p * (pl - logits), None


def vocab_parallel_entropy(logits: torch.Tensor, group) -> torch.Tensor:
    return _VocabParallelEntropy.apply(logits, group)


@torch.no_grad()
def vocab_parallel_sum_pi_squared(logits: torch.Tensor, group) -> torch.Tensor:
    """sum_v p_v^2 over the whole vocabulary from this rank's slice: all-reduce of the max, then of sum exp(l - m)
    and sum exp(2 (l - m)); the ratio of the second to the first squared. No gradient (the optimal-token-baseline
    estimators read it from the old policy)."""
    logits = logits.float()
    m = logits.max(dim=-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(logits - m)
    sums = torch.stack([e.sum(-1), (e * e).sum(-1)])
    dist.all_reduce(sums, group=group)
    return sums[1] / sums[0] ** 2


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron's cross entropy works in place on its input: give it a copy
    return -vocab_parallel_cross_entropy(logits.float().clone(), labels)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Logits of this rank's vocabulary slice with the padding rows (ids >= vocab_size) set to PADDED_LOGIT."""
    shard = logits.shape[-1]
    start = tp_rank * shard
    if start + shard <= vocab_size:
        return logits
    ids = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, PADDED_LOGIT)


def prepare_micro_batch(tensors: dict[str, torch.Tensor], rows: int, seq_multiple: int, pad_id: int = 0) -> dict:
    """Model inputs (rolled, padded to ``rows`` rows and a length divisible by ``seq_multiple``) and the gather
    index of the positions predicting each response token; see the module docstring."""
    ids, mask, pos = tensors["input_ids"], tensors["attention_mask"].long(), tensors["position_ids"]
    b, T = ids.shape
    dev = ids.device  # every index built here lives with the batch (the GPU in training)
    R = tensors["responses"].shape[1] if "responses" in tensors else 0
    first = mask.argmax(-1)  # first valid column of each row
    index = (torch.arange(T, device=dev)[None, :] + first[:, None]) % T
    rolled_ids, rolled_mask = ids.gather(1, index), mask.gather(1, index)
    rolled_pos = pos.gather(1, index)
    expected = torch.arange(T, device=dev)[None, :].expand(b, T)
    if bool(((rolled_pos != expected) & rolled_mask.bool()).any()):
        raise ValueError(
            "the megatron backend needs each row's valid position ids to be 0, 1, 2, ... "
            "(left-padded prompt + right-padded response)"
        )
    S = -(-T // seq_multiple) * seq_multiple
    model_ids = torch.full((rows, S), pad_id, dtype=ids.dtype, device=dev)
    model_ids[:b, :T] = rolled_ids
    predict_at = (torch.arange(R, device=dev)[None, :] + (T - R - 1) - first[:, None]).clamp(min=0)
    last = T - 1 - mask.flip(-1).argmax(-1)  # last valid column of each row
    padding = torch.ones((rows, S), dtype=torch.bool, device=dev)  # True at pads: megatron's MoE routers skip them
    padding[:b, :T] = ~rolled_mask.bool()
    return {
        "input_ids": model_ids,
        "padding_mask": padding,
        "position_ids": torch.arange(S, device=dev)[None, :].expand(rows, S).contiguous(),
        "predict_at": predict_at,
        "resp_valid": mask[:, T - R :].bool(),
        "rows": b,
        "last_at": last - first,
        "responses": tensors["responses"] if R else None,
    }


@dataclasses.dataclass(frozen=True)
class FusedHead:
    """The head fused with the log-probs (and entropy) of ``labels`` (rows, R), ``temperature`` applied; the head's
    weight is this TP rank's vocabulary slice of ``vocab_size`` real ids (megatron pads the vocabulary)."""

    labels: torch.Tensor
    temperature: float
    entropy: bool
    chunk_size: int
    tp_group: Any
    tp_rank: int
    vocab_size: int


@contextlib.contextmanager
def response_positions_only(
    output_layer: nn.Module, prepared: dict, sequence_parallel: bool, tp_group, fused: FusedHead | None = None
) -> Iterator[None]:
    """Within it, ``output_layer`` (megatron's ColumnParallelLinear) computes the logits of ``prepared``'s
    predicting positions only, or with ``fused`` their (log-prob, entropy) rows (see the module docstring)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    layer: Any = output_layer
    forward = layer.forward

    def at_predictions(input_: torch.Tensor, weight=None, runtime_gather_output=None):
        hidden = input_
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=tp_group)
        at = torch.zeros((hidden.shape[1], prepared["predict_at"].shape[1]), dtype=torch.long, device=hidden.device)
        at[: prepared["rows"]] = prepared["predict_at"].to(hidden.device)  # padded rows: any position
        picked = hidden.gather(0, at.T[..., None].expand(-1, -1, hidden.shape[-1]))  # (R, rows, H)
        if fused is not None:
            return _fused(picked, layer.weight if weight is None else weight, fused), None
        layer.sequence_parallel = False
        try:
            return forward(picked, weight=weight, runtime_gather_output=runtime_gather_output)
        finally:
            layer.sequence_parallel = sequence_parallel

    layer.forward = at_predictions  # an instance attribute: nn.Module.__call__ and its hooks still run
    try:
        yield
    finally:
        del layer.forward


def _fused(picked: torch.Tensor, weight: torch.Tensor, fused: FusedHead) -> torch.Tensor:
    """(R, rows, 2) (log-prob, entropy) rows of (R, rows, H) hidden states (the labels padded to the rows)."""
    R, rows, H = picked.shape
    labels = torch.zeros((rows, R), dtype=torch.long, device=picked.device)
    labels[: fused.labels.shape[0]] = fused.labels.to(picked.device)
    flat, flat_labels = picked.reshape(R * rows, H), labels.T.reshape(-1)
    # the weight is given at call time when tied to the embedding: its slice's first id from its rows
    shard = VocabShard(fused.tp_group, fused.tp_rank * weight.shape[0], fused.vocab_size)
    out = head_log_probs(flat, weight, None, flat_labels, fused.temperature, fused.chunk_size, fused.entropy, shard)
    return out.view(R, rows, 2)


def response_outputs(
    output: torch.Tensor,
    prepared: dict,
    outputs: tuple[str, ...],
    kind: str,
    temperature: float,
    vocab_size: int,
    tp_rank: int,
    tp_group,
    at_predictions: bool = False,
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """(b, R) log_probs / entropy (causal_lm) or values (value), or (b,) scores (reward: the head's output at each
    row's last valid token, as HF's sequence classifier pools), from the model output (rows, S, V/tp or 1);
    ``at_predictions``: the output is (rows, R, V/tp), computed at the predicting positions only
    (``response_positions_only``); ``fused``: it is (rows, R, 2), the log-probs and entropy themselves."""
    dev = output.device
    b, predict_at, valid = prepared["rows"], prepared["predict_at"].to(dev), prepared["resp_valid"].to(dev)
    if kind == "reward":
        return {"scores": output[torch.arange(b, device=dev), prepared["last_at"].to(dev), 0].float()}
    rows = torch.arange(b, device=dev)[:, None]
    picked = output[:b] if at_predictions else output[:b][rows, predict_at]  # (b, R, V/tp) or (b, R, 1)
    valid_f = valid.to(torch.float32)
    if fused:
        return {k: picked[..., i].float() * valid_f for i, k in enumerate(FUSED_OUTPUTS) if k in outputs}
    if kind == "value":
        return {"values": picked[..., 0].float() * valid_f}
    logits = picked.float()
    if temperature != 1.0:
        logits = logits / temperature
    logits = mask_padded_vocab(logits, vocab_size, tp_rank)
    result = {}
    if "log_probs" in outputs:
        result["log_probs"] = vocab_parallel_log_probs(logits, prepared["responses"].to(dev)) * valid_f
    if "entropy" in outputs:
        result["entropy"] = vocab_parallel_entropy(logits, tp_group) * valid_f
    if "sum_pi_squared" in outputs:
        result["sum_pi_squared"] = vocab_parallel_sum_pi_squared(logits, tp_group) * valid_f
    return result


def prepared_micros(
    batch, parts, device: torch.device, rows: int, seq_multiple: int, pad_id: int
) -> list[tuple[int, Any, dict[str, torch.Tensor]]]:
    """(index, micro-batch on ``device``, its model inputs) per part of ``batch``: ``prepare_micro_batch`` with at
    least ``rows`` rows and lengths a multiple of ``seq_multiple``."""
    keys = [k for k in MODEL_INPUTS if k in batch.tensors.keys()]
    micros = []
    for i, part in enumerate(parts):
        micro = batch.select_idxs(part).to(device)  # the loss reads its tensors beside the model's outputs
        prepared = prepare_micro_batch({k: micro.tensors[k] for k in keys}, max(rows, len(part)), seq_multiple, pad_id)
        micros.append((i, micro, prepared))
    return micros


def head_mode(engine, outputs: tuple[str, ...]) -> tuple[bool, bool]:
    """(whether the megatron engine's LM head runs on the positions predicting response tokens only, whether fused
    with the log-probs and entropy): a causal LM's last stage, fused when nothing else is asked."""
    at = engine.response_head_only and engine.model_config.kind == "causal_lm" and engine.ps.is_pipeline_last_stage()
    return at, at and set(outputs) <= set(FUSED_OUTPUTS)


def response_head(engine, prepared: dict, at_predictions: bool, fused: tuple[tuple[str, ...], float] | None):
    """A context in which the engine's LM head computes the logits of the positions predicting response tokens only,
    or with ``fused`` (the outputs, the temperature) their log-probs and entropy (``response_positions_only``);
    nothing when ``at_predictions`` is False."""
    if not at_predictions:
        return contextlib.nullcontext()
    spec = None
    if fused is not None:
        outputs, temperature = fused
        chunk, vocab = engine.engine_config.entropy_chunk_size, engine.layout.vocab_size
        tp = (engine.tp_group, engine.tp_rank)
        spec = FusedHead(prepared["responses"], temperature, "entropy" in outputs, chunk, *tp, vocab)
    head: Any = engine.module.output_layer
    return response_positions_only(head, prepared, engine.parallel.sequence_parallel, engine.tp_group, spec)


def from_last_stage(engine, obj: Any) -> Any:
    """``obj`` of the last PP stage, on every stage of the engine's pipeline (small: metrics, (B, R) outputs)."""
    if engine.layout.pp == 1:
        return obj
    holder = [obj]
    last = engine.ps.get_pipeline_model_parallel_last_rank()
    # megatron annotates its group getters loosely (int / list for other layouts); here it is a ProcessGroup
    dist.broadcast_object_list(holder, src=last, group=engine.pp_group)  # pyright: ignore[reportArgumentType]
    return holder[0]
