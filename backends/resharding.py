"""Pure tensor-parallel (TP) resharding of HF-named weights (Qwen2 / Llama naming); no distributed code.

Layout of each name (``shard_spec``):

- column-parallel, split dim 0: ``{q,k,v}_proj.{weight,bias}``, ``{gate,up}_proj.{weight,bias}``;
- row-parallel, split dim 1: ``o_proj.weight``, ``down_proj.weight``;
- vocab-parallel, split dim 0: ``embed_tokens.weight``, ``lm_head.weight`` (no padding: vocab % tp must be 0;
  ``rank_shard(..., vocab_padding=64)`` gives vLLM's padded split instead, see ``vocab_rows``);
- replicated: everything else (norms, row-parallel biases, ...): every rank holds the same tensor.

GQA rule for ``k_proj`` / ``v_proj`` (applied when a ``config`` with the head counts is given):

- ``tp <= num_kv_heads``: contiguous split of the kv heads (``num_kv_heads % tp == 0``);
- ``tp > num_kv_heads``: kv heads are replicated, rank ``r`` gets kv head ``r * num_kv_heads // tp``, which is
  exactly the kv head its q heads ``[r * nh / tp, (r + 1) * nh / tp)`` use (``tp % num_kv_heads == 0``).
  Merging such shards keeps one replica per kv head (ranks ``0, tp/nkv, 2 tp/nkv, ...``).

Without a config, k/v are split like any column-parallel tensor (head-agnostic).

``rank_shard`` is one rank's shard with its place in the full tensor: what a rollout TP rank receives in a weight
sync (backends/rollout/vllm_engine.py).

Fused vLLM layouts are per rank: ``qkv_proj = [q_r; k_r; v_r]`` and ``gate_up_proj = [gate_r; up_r]`` (dim 0).

Outputs may share storage with the inputs and with each other (dim-0 chunks are views, replicated tensors and
replicated kv heads are the same storage on every rank): clone before mutating in place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch

_COLUMN = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"(?:^|\.)(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.weight$")
_KV = re.compile(r"(?:^|\.)(k_proj|v_proj)\.(weight|bias)$")
_Q = re.compile(r"(?:^|\.)q_proj\.(weight|bias)$")


def shard_spec(name: str) -> tuple[str, int | None]:
    """``("column", 0) | ("row", 1) | ("vocab", 0) | ("replicated", None)`` for an HF parameter name."""
    if _COLUMN.search(name):
        return ("column", 0)
    if _ROW.search(name):
        return ("row", 1)
    if _VOCAB.search(name):
        return ("vocab", 0)
    return ("replicated", None)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _heads(config: Any) -> tuple[int, int, int] | None:
    """(num_heads, num_kv_heads, head_dim) from a HF-like config or mapping; None when config is None."""
    if config is None:
        return None
    nh = int(_get(config, "num_attention_heads"))
    nkv = int(_get(config, "num_key_value_heads", nh) or nh)
    hd = _get(config, "head_dim") or int(_get(config, "hidden_size")) // nh
    return nh, nkv, int(hd)


def _check_tp(tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")


def _chunk(name: str, full: torch.Tensor, dim: int, tp: int) -> list[torch.Tensor]:
    if full.dim() <= dim:
        raise ValueError(f"{name}: cannot split dim {dim} of a tensor of shape {tuple(full.shape)}")
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} is not divisible by tp={tp}")
    return [c.contiguous() for c in torch.chunk(full, tp, dim=dim)]


def _split_kv(name: str, full: torch.Tensor, nkv: int, hd: int, tp: int) -> list[torch.Tensor]:
    """Split k or v by kv heads (contiguous, or replicated when tp > nkv)."""
    if full.shape[0] != nkv * hd:
        raise ValueError(f"{name}: dim 0 is {full.shape[0]}, expected num_kv_heads*head_dim = {nkv}*{hd}")
    if tp <= nkv:
        if nkv % tp:
            raise ValueError(f"{name}: num_key_value_heads={nkv} is not divisible by tp={tp}")
        return _chunk(name, full, 0, tp)
    if tp % nkv:
        raise ValueError(f"{name}: tp={tp} > num_key_value_heads={nkv} but is not a multiple of it")
    heads = torch.chunk(full, nkv, dim=0)  # views, one per kv head
    return [heads[r * nkv // tp] for r in range(tp)]


def split_tensor(name: str, full: torch.Tensor, tp: int, config: Any = None) -> list[torch.Tensor]:
    """Split the full tensor ``name`` into ``tp`` per-rank shards (see the module docstring for the layouts).

    Raises ValueError naming the tensor when a split dimension (or a head count, given ``config``) is not
    divisible by ``tp``.
    """
    _check_tp(tp)
    kind, dim = shard_spec(name)
    if kind == "replicated":
        return [full] * tp
    heads = _heads(config)
    if heads is not None and _KV.search(name):
        return _split_kv(name, full, heads[1], heads[2], tp)
    if heads is not None and _Q.search(name) and heads[0] % tp:
        raise ValueError(f"{name}: num_attention_heads={heads[0]} is not divisible by tp={tp}")
    assert dim is not None  # shard_spec: only a replicated tensor has none
    return _chunk(name, full, dim, tp)


def vocab_rows(vocab: int, tp: int, rank: int, padding: int) -> tuple[int, int]:
    """Rows [start, end) of a vocab-parallel tensor held by ``rank`` when the vocabulary is first padded to a
    multiple of ``padding`` and the padded size split evenly (vLLM's VocabParallelEmbedding pads to 64): the last
    ranks may hold fewer real rows, even none."""
    padded = -(-vocab // padding) * padding
    if padded % tp:
        raise ValueError(f"padded vocabulary {padded} is not divisible by tp={tp}")
    start = min(rank * (padded // tp), vocab)
    return start, min(start + padded // tp, vocab)


def rank_shard(
    name: str, full: torch.Tensor, tp: int, rank: int, config: Any = None, vocab_padding: int | None = None
) -> tuple[torch.Tensor, int | None, int]:
    """``(shard, dim, start)``: ``rank``'s shard of ``full`` and where it sits in it (``full.narrow(dim, start,
    shard.shape[dim])``); ``dim`` is None for a replicated tensor (the shard is ``full``). Vocab-parallel tensors
    follow ``vocab_rows`` when ``vocab_padding`` is given, else the even split of ``split_tensor``."""
    kind, dim = shard_spec(name)
    if kind == "replicated":
        return full, None, 0
    if kind == "vocab" and vocab_padding is not None:
        start, end = vocab_rows(full.shape[0], tp, rank, vocab_padding)
        return full[start:end], 0, start
    shard = split_tensor(name, full, tp, config)[rank]
    heads = _heads(config)
    if heads is not None and _KV.search(name) and tp > heads[1]:
        return shard, 0, (rank * heads[1] // tp) * heads[2]  # the replicated kv head this rank holds
    assert dim is not None  # shard_spec: only a replicated tensor has none
    return shard, dim, rank * shard.shape[dim]


def merge_shards(name: str, shards: Sequence[torch.Tensor], config: Any = None) -> torch.Tensor:
    """Inverse of ``split_tensor``: the full tensor from its ``len(shards)`` per-rank shards."""
    shards = list(shards)
    if not shards:
        raise ValueError(f"{name}: no shards to merge")
    tp = len(shards)
    kind, dim = shard_spec(name)
    if kind == "replicated":
        return shards[0]
    if tp == 1:
        return shards[0]
    heads = _heads(config)
    if heads is not None and _KV.search(name) and tp > heads[1]:
        nkv = heads[1]
        if tp % nkv:
            raise ValueError(f"{name}: tp={tp} > num_key_value_heads={nkv} but is not a multiple of it")
        shards = shards[:: tp // nkv]  # one replica per kv head
    assert dim is not None  # shard_spec: only a replicated tensor has none
    return torch.cat(shards, dim=dim)


def split_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, tp: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per-rank ``(q_r, k_r, v_r)`` (weights or biases) with GQA grouping kept.

    Rank r gets q heads ``[r * num_heads / tp, (r + 1) * num_heads / tp)``; k/v follow the module rule
    (contiguous if ``tp <= num_kv_heads``, else kv head ``r * num_kv_heads // tp``, replicated).
    """
    _check_tp(tp)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    if q.shape[0] != num_heads * head_dim:
        raise ValueError(f"q_proj: dim 0 is {q.shape[0]}, expected num_heads*head_dim = {num_heads}*{head_dim}")
    if num_heads % tp:
        raise ValueError(f"q_proj: num_attention_heads={num_heads} is not divisible by tp={tp}")
    qs = _chunk("q_proj", q, 0, tp)
    ks = _split_kv("k_proj", k, num_kv_heads, head_dim, tp)
    vs = _split_kv("v_proj", v, num_kv_heads, head_dim, tp)
    return list(zip(qs, ks, vs))


def _per_rank_cat(*parts: Any) -> Any:
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)
    n = {len(p) for p in parts}
    if len(n) != 1:
        raise ValueError(f"per-rank lists of different lengths: {[len(p) for p in parts]}")
    return [torch.cat(ranks, dim=0) for ranks in zip(*parts)]


def fuse_qkv(q: Any, k: Any, v: Any) -> Any:
    """vLLM ``qkv_proj`` of one rank: ``[q_r; k_r; v_r]`` (dim 0). Lists of per-rank shards give a list."""
    return _per_rank_cat(q, k, v)


def fuse_gate_up(gate: Any, up: Any) -> Any:
    """vLLM ``gate_up_proj`` of one rank: ``[gate_r; up_r]`` (dim 0). Lists of per-rank shards give a list."""
    return _per_rank_cat(gate, up)


def reshard_one(name: str, shards: Sequence[torch.Tensor], k: int, m: int, config: Any = None) -> list[torch.Tensor]:
    """Shards of ``name`` from TP size k to TP size m; with k == m the same tensor objects come back."""
    _check_tp(k)
    _check_tp(m)
    if len(shards) != k:
        raise ValueError(f"{name}: expected {k} shards, got {len(shards)}")
    if k == m:
        return list(shards)
    full = merge_shards(name, shards, config)
    out = split_tensor(name, full, m, config)
    del full  # only the outputs (views or copies) keep its storage
    return out


def reshard(
    named_shards: Mapping[str, Sequence[torch.Tensor]], k: int, m: int, config: Any = None
) -> dict[str, list[torch.Tensor]]:
    """Every name from TP size k to TP size m (k == m: shard-to-shard, the same tensor objects, no gather).

    Names are processed one at a time (merge one, split it, drop it), so peak memory beyond the inputs held by
    the caller is the outputs produced so far plus at most one gathered full tensor. Dim-0 outputs are views of
    that full tensor, so for them the gathered tensor *is* the output storage (no extra copy).
    """
    return {name: reshard_one(name, shards, k, m, config) for name, shards in named_shards.items()}


def _nbytes(shards: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in shards)


def iter_resharded_buckets(
    named_shards_iter: Iterable[tuple[str, Sequence[torch.Tensor]]] | Mapping[str, Sequence[torch.Tensor]],
    k: int,
    m: int,
    config: Any,
    bucket_bytes: int,
) -> Iterator[list[tuple[str, list[torch.Tensor]]]]:
    """Reshard lazily and yield buckets ``[(name, m shards), ...]`` whose output bytes are <= ``bucket_bytes``.

    Output bytes count every rank's shard (what is sent). A name bigger than the bound is its own bucket.
    Only one name is resharded at a time, so at most one full tensor plus one bucket is alive here.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    items = named_shards_iter.items() if isinstance(named_shards_iter, Mapping) else named_shards_iter
    # isinstance(..., Mapping) also narrows the pairs' Iterable to a Mapping keyed by pairs, which never reaches here
    items = cast(Iterable[tuple[str, Sequence[torch.Tensor]]], items)
    bucket: list[tuple[str, list[torch.Tensor]]] = []
    used = 0
    for name, shards in items:
        out = reshard_one(name, shards, k, m, config)
        size = _nbytes(out)
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, out))
        used += size
        if used >= bucket_bytes:
            yield bucket
            bucket, used = [], 0
    if bucket:
        yield bucket
