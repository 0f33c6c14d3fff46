"""Tests of backends/resharding.py: TP k -> m resharding of a tiny Qwen2-like state dict against an independent
reference (plain ``torch.chunk`` / indexing written here), round trips, identity for k == m, GQA replication,
fused qkv / gate_up layouts, divisibility errors and bucket bounds. Pure CPU, no distributed code."""

from __future__ import annotations

import itertools

import pytest
import torch

from backends.resharding import (
    fuse_gate_up,
    fuse_qkv,
    iter_resharded_buckets,
    merge_shards,
    rank_shard,
    reshard,
    shard_spec,
    split_qkv,
    split_tensor,
    vocab_rows,
)

HIDDEN, HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 8, 8, 96, 128, 2
TPS = (1, 2, 4)


def make_config(nkv):
    return dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=nkv, head_dim=HEAD_DIM)


def make_state(nkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        "model.norm.weight": r(HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.q_proj.bias": r(HEADS * HEAD_DIM),
                p + "self_attn.k_proj.weight": r(nkv * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.bias": r(nkv * HEAD_DIM),
                p + "self_attn.v_proj.weight": r(nkv * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.bias": r(nkv * HEAD_DIM),
                p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
                p + "mlp.gate_proj.weight": r(INTER, HIDDEN),
                p + "mlp.up_proj.weight": r(INTER, HIDDEN),
                p + "mlp.down_proj.weight": r(HIDDEN, INTER),
                p + "input_layernorm.weight": r(HIDDEN),
                p + "post_attention_layernorm.weight": r(HIDDEN),
            }
        )
    return sd


def ref_split(name, full, tp, nkv):
    """Independent reference: direct slicing of the full weight into tp per-rank parts."""
    if "norm" in name:
        return [full for _ in range(tp)]
    if "o_proj" in name or "down_proj" in name:
        return list(torch.chunk(full, tp, dim=1))
    if ("k_proj" in name or "v_proj" in name) and tp > nkv:
        heads = [full[h * HEAD_DIM : (h + 1) * HEAD_DIM] for h in range(nkv)]
        per = tp // nkv  # ranks sharing one kv head
        return [heads[rank // per] for rank in range(tp)]
    return list(torch.chunk(full, tp, dim=0))


def ref_shards(sd, tp, nkv):
    return {n: ref_split(n, t, tp, nkv) for n, t in sd.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert len(a[n]) == len(b[n]), n
        for x, y in zip(a[n], b[n]):
            assert x.shape == y.shape and torch.equal(x, y), n


def test_shard_spec():
    assert shard_spec("model.layers.3.self_attn.q_proj.weight") == ("column", 0)
    assert shard_spec("model.layers.3.self_attn.v_proj.bias") == ("column", 0)
    assert shard_spec("model.layers.0.mlp.up_proj.weight") == ("column", 0)
    assert shard_spec("model.layers.0.mlp.down_proj.weight") == ("row", 1)
    assert shard_spec("model.layers.0.self_attn.o_proj.weight") == ("row", 1)
    assert shard_spec("model.embed_tokens.weight") == ("vocab", 0)
    assert shard_spec("lm_head.weight") == ("vocab", 0)
    assert shard_spec("model.norm.weight") == ("replicated", None)
    assert shard_spec("model.layers.1.input_layernorm.weight") == ("replicated", None)


@pytest.mark.parametrize("nkv", [2, 4])
@pytest.mark.parametrize("k,m", list(itertools.product(TPS, TPS)))
def test_reshard_matches_reference_and_round_trips(nkv, k, m):
    sd, cfg = make_state(nkv), make_config(nkv)
    src = ref_shards(sd, k, nkv)
    out = reshard(src, k, m, cfg)
    assert_same(out, ref_shards(sd, m, nkv))
    assert_same(reshard(out, m, k, cfg), src)
    for n, full in sd.items():  # merge is the inverse of split
        assert torch.equal(merge_shards(n, out[n], cfg), full)


@pytest.mark.parametrize("tp", TPS)
def test_reshard_same_tp_returns_same_objects(tp):
    sd, cfg = make_state(2), make_config(2)
    src = {n: split_tensor(n, t, tp, cfg) for n, t in sd.items()}
    out = reshard(src, tp, tp, cfg)
    for n in src:
        assert all(x is y for x, y in zip(out[n], src[n]))


def test_gqa_replication_explicit():
    nkv, tp, group = 2, 4, HEADS // 2
    sd = make_state(nkv)
    q, kk, v = (sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    kh = [kk[0:8], kk[8:16]]
    vh = [v[0:8], v[8:16]]
    expected_kv_head = [0, 0, 1, 1]  # written out for rank 0..3
    ranks = split_qkv(q, kk, v, HEADS, nkv, HEAD_DIM, tp)
    assert len(ranks) == tp
    for r, (qr, kr, vr) in enumerate(ranks):
        assert torch.equal(qr, q[r * 16 : (r + 1) * 16])  # 2 q heads of 8 rows each
        assert torch.equal(kr, kh[expected_kv_head[r]]) and torch.equal(vr, vh[expected_kv_head[r]])
        # every q head on this rank uses the kv head this rank holds
        for j in range(r * 2, r * 2 + 2):
            assert j // group == expected_kv_head[r]
    # split_tensor with a config follows the same rule; merging keeps one replica per head
    ks = split_tensor("model.layers.0.self_attn.k_proj.weight", kk, tp, make_config(nkv))
    assert [torch.equal(a, kh[h]) for a, h in zip(ks, expected_kv_head)] == [True] * 4
    assert torch.equal(merge_shards("model.layers.0.self_attn.k_proj.weight", ks, make_config(nkv)), kk)


def test_split_qkv_contiguous_when_tp_le_kv():
    sd = make_state(4)
    q, kk, v = (sd[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    for r, (qr, kr, vr) in enumerate(split_qkv(q, kk, v, HEADS, 4, HEAD_DIM, 2)):
        assert torch.equal(qr, q[r * 32 : (r + 1) * 32])
        assert torch.equal(kr, kk[r * 16 : (r + 1) * 16]) and torch.equal(vr, v[r * 16 : (r + 1) * 16])


@pytest.mark.parametrize("nkv,tp", [(2, 1), (2, 2), (2, 4), (4, 4)])
def test_fused_layouts_per_rank(nkv, tp):
    sd = make_state(nkv)
    p = "model.layers.1."
    q, kk, v = (sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    gate, up = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
    ranks = split_qkv(q, kk, v, HEADS, nkv, HEAD_DIM, tp)
    qs, ks, vs = ref_split("q_proj", q, tp, nkv), ref_split("k_proj", kk, tp, nkv), ref_split("v_proj", v, tp, nkv)
    fused_list = fuse_qkv(qs, ks, vs)
    for r, (qr, kr, vr) in enumerate(ranks):
        fused = fuse_qkv(qr, kr, vr)
        assert fused.shape == (HEADS * HEAD_DIM // tp + 2 * HEAD_DIM * max(nkv // tp, 1), HIDDEN)
        assert torch.equal(fused, torch.cat([qs[r], ks[r], vs[r]]))
        assert torch.equal(fused_list[r], fused)
    gs, us = torch.chunk(gate, tp), torch.chunk(up, tp)
    fused_gu = fuse_gate_up(list(gs), list(us))
    for r in range(tp):
        assert torch.equal(fuse_gate_up(gs[r], us[r]), torch.cat([gs[r], us[r]]))
        assert torch.equal(fused_gu[r], torch.cat([gs[r], us[r]]))
        assert fused_gu[r].shape == (2 * INTER // tp, HIDDEN)


def test_divisibility_errors_name_tensor():
    name = "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match=r"gate_proj\.weight"):
        split_tensor(name, torch.zeros(90, 8), 4)
    with pytest.raises(ValueError, match=r"down_proj\.weight"):
        split_tensor("model.layers.0.mlp.down_proj.weight", torch.zeros(8, 90), 4)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight"):
        split_tensor("model.embed_tokens.weight", torch.zeros(126, 8), 4)
    cfg = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*tp=2"):
        split_tensor("model.layers.0.self_attn.k_proj.weight", torch.zeros(24, 48), 2, cfg)
    with pytest.raises(ValueError, match=r"q_proj\.weight"):
        split_tensor("model.layers.0.self_attn.q_proj.weight", torch.zeros(48, 48), 4, cfg)
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        reshard({"lm_head.weight": [torch.zeros(3, 4)]}, 1, 2)


@pytest.mark.parametrize("bucket_bytes", [1, 4096, 20000, 10**9])
def test_buckets_bounded_and_complete(bucket_bytes):
    nkv, k, m = 2, 2, 4
    sd, cfg = make_state(nkv), make_config(nkv)
    src = ref_shards(sd, k, nkv)
    buckets = list(iter_resharded_buckets(iter(src.items()), k, m, cfg, bucket_bytes))
    seen = []
    for b in buckets:
        assert b
        size = sum(t.numel() * t.element_size() for _, shards in b for t in shards)
        assert size <= bucket_bytes or len(b) == 1
        seen.extend(b)
    assert [n for n, _ in seen] == list(src)
    assert_same(dict(seen), ref_shards(sd, m, nkv))
    if bucket_bytes == 10**9:
        assert len(buckets) == 1
    with pytest.raises(ValueError):
        next(iter_resharded_buckets(src, k, m, cfg, 0))


@pytest.mark.parametrize("nkv,tp", [(2, 2), (2, 4), (1, 4), (4, 2)])
def test_rank_shard_places_each_shard_in_the_full_tensor(nkv, tp):
    """Each rank's shard equals the reference split and sits where (dim, start) say; the ranks cover the tensor."""
    sd, config = make_state(nkv), make_config(nkv)
    for name, full in sd.items():
        for rank in range(tp):
            shard, dim, start = rank_shard(name, full, tp, rank, config)
            assert torch.equal(shard, ref_split(name, full, tp, nkv)[rank]), (name, rank)
            if dim is None:
                assert shard is full
            else:
                assert torch.equal(full.narrow(dim, start, shard.shape[dim]), shard), (name, rank)


def test_vocab_rows_pad_then_split():
    """vLLM pads the vocabulary to a multiple of 64 before splitting: 99 rows over 2 ranks are 64 + 35."""
    assert [vocab_rows(99, 2, r, 64) for r in range(2)] == [(0, 64), (64, 99)]
    assert [vocab_rows(100, 4, r, 64) for r in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert [vocab_rows(10, 4, r, 64) for r in range(4)] == [(0, 10), (10, 10), (10, 10), (10, 10)]
    full = torch.arange(99 * 3.0).view(99, 3)
    shard, dim, start = rank_shard("lm_head.weight", full, 2, 1, vocab_padding=64)
    assert (dim, start) == (0, 64) and torch.equal(shard, full[64:])
