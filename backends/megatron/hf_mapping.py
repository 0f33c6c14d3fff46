"""HF Qwen2/Qwen3/Llama tensors <-> Megatron-core GPTModel parameters (local layer spec), per TP rank and PP stage;
the mixture-of-experts layers of Qwen3-MoE / Mixtral per EP and ETP rank through backends/megatron/moe_mapping.py.

Pure tensor functions (no process groups), so the mapping is testable in one process for any (tp, pp) layout.
``check_mappable`` says which HF configs map (model types, activation, biases, RoPE); ``rope_settings`` turns the
HF RoPE (theta, scaling) into megatron's.

Megatron parameter names (local spec, layer index local to the PP stage) and their HF sources:
  embedding.word_embeddings.weight            model.embed_tokens.weight       rows padded to the vocab, split by TP
  decoder.layers.i.input_layernorm.weight     model.layers.L.input_layernorm.weight            replicated
  decoder.layers.i.self_attention.linear_qkv  q/k/v_proj (weight, bias)   fused per query group, groups split by TP
  decoder.layers.i.self_attention.linear_proj o_proj.weight                                     columns split by TP
  decoder.layers.i.self_attention.q_layernorm q_norm.weight (Qwen3: RMSNorm over each head)        replicated
  decoder.layers.i.self_attention.k_layernorm k_norm.weight (Qwen3)                                 replicated
  decoder.layers.i.pre_mlp_layernorm.weight   post_attention_layernorm.weight                  replicated
  decoder.layers.i.mlp.linear_fc1.weight      gate_proj + up_proj: TP shard t = [gate_t; up_t]
  decoder.layers.i.mlp.linear_fc2.weight      down_proj.weight                                  columns split by TP
  decoder.final_layernorm.weight              model.norm.weight                                 replicated
  output_layer.weight                         lm_head.weight (embed_tokens when tied)   padded rows, split by TP
  value_head.weight / value_head.bias         score.weight / score.bias (value models)          replicated
where L = layer_offset + i. The fused QKV of query group g is [q heads of g; k_g; v_g] (GQA interleave); TP rank t
holds groups t*G/tp .. (t+1)*G/tp - 1. Megatron needs the vocabulary divisible by TP: the embedding and output
rows are zero-padded to ``padded_vocab_size`` (the engine masks the padded logits) and cut off again on export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from backends.megatron.moe_mapping import (
    fuse_experts,
    hf_to_moe,
    is_expert_parameter,
    is_moe_parameter,
    moe_layer_names,
    moe_to_hf,
)
from backends.moe import num_experts


@dataclass(frozen=True)
class Layout:
    """What the mapping needs from the HF config and the parallel layout of one rank."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    tp: int = 1
    pp: int = 1
    kind: str = "causal_lm"  # causal_lm | value
    qk_norm: bool = False  # Qwen3: RMSNorm of each query / key head before RoPE
    num_experts: int = 0  # experts per MoE layer (0: a dense model); every layer is a MoE layer when > 0
    ep: int = 1  # expert parallelism: ranks the experts of a layer are split over
    etp: int = 1  # expert tensor parallelism: 1 or the TP size (each expert split as the dense MLP)

    @property
    def padded_vocab(self) -> int:
        return padded_vocab_size(self.vocab_size, self.tp)

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "mixtral")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# megatron's llama3 RoPE scaling (RotaryEmbedding._apply_scaling) fixes these; only the factor is a parameter
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_mappable(hf_config) -> None:
    """Raise a ValueError naming the model type and what is supported when the HF config has a feature this
    mapping (megatron's local spec: RMSNorm, SwiGLU, RoPE, bias on QKV only) cannot reproduce."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the megatron backend maps model types {list(SUPPORTED_MODEL_TYPES)} (Qwen2 / Qwen3 / Llama / "
            f"Qwen3-MoE / Mixtral causal LMs and their value heads), not model_type '{model_type}'"
        )
    problems = []
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{hf_config.hidden_act}' (supported: silu)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True (supported: no MLP bias)")
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        # their attention_bias also puts a bias on o_proj; megatron has a linear_proj bias only together with MLP
        # biases (add_bias_linear)
        problems.append(f"attention_bias=True (biases on q/k/v/o_proj; supported: none on {model_type})")
    if getattr(hf_config, "use_sliding_window", False) or (
        model_type == "mixtral" and getattr(hf_config, "sliding_window", None)
    ):
        problems.append("sliding-window attention (supported: full attention)")
    problems += _moe_problems(hf_config)
    if problems:
        raise ValueError(f"the megatron backend cannot map this {model_type} model: {'; '.join(problems)}")
    rope_settings(hf_config)


def _moe_problems(hf_config) -> list[str]:
    """What of a MoE config the mapping (every layer routed, no router noise) does not carry."""
    problems = []
    if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) not in (1, None):
        problems.append(
            f"dense layers among the MoE ones (mlp_only_layers {hf_config.mlp_only_layers}, decoder_sparse_step "
            f"{hf_config.decoder_sparse_step}; supported: every layer a MoE layer)"
        )
    if getattr(hf_config, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise {hf_config.router_jitter_noise} (supported: 0)")
    return problems


def rope_settings(hf_config) -> dict:
    """GPTModel keyword arguments reproducing the HF model's RoPE: base theta and scaling (default, linear, llama3).

    transformers >= 5 keeps both in ``rope_parameters``; 4.x has ``rope_theta`` and an optional ``rope_scaling``."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = rope.get("rope_theta") or getattr(hf_config, "rope_theta", None)
    if not theta:
        raise ValueError(f"the {hf_config.model_type} config has no rope_theta")
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not mapped to megatron (supported: 1.0)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    settings = {"rotary_base": float(theta)}  # HF computes theta ** (2i / d) with a float theta
    if kind == "linear":  # HF divides the frequencies by the factor, megatron the positions: the same angles
        settings["seq_len_interpolation_factor"] = float(rope["factor"])
    elif kind == "llama3":
        differs = {
            k: rope.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if rope.get(k) is None or float(rope[k]) != v
        }
        if differs:
            raise ValueError(
                f"llama3 rope scaling with {differs} is not mapped to megatron (it fixes "
                f"{_MEGATRON_LLAMA3_ROPE}; only the factor may vary)"
            )
        settings.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    elif kind != "default":
        raise ValueError(f"rope_type '{kind}' ({rope}) is not mapped to megatron (supported: default, linear, llama3)")
    return settings


def layout_from_hf(
    hf_config, tp: int = 1, pp: int = 1, kind: str = "causal_lm", ep: int = 1, etp: int | None = None
) -> Layout:
    """The mapping layout of an HF config (checked with ``check_mappable``) on a TP x PP grid, its experts split
    over ``ep`` ranks and ``etp`` (default: ``tp``) tensor-parallel ranks."""
    check_mappable(hf_config)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return Layout(
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tp=tp,
        pp=pp,
        kind=kind,
        qk_norm=hf_config.model_type in QK_NORM_MODEL_TYPES,
        num_experts=num_experts(hf_config),
        ep=ep,
        etp=tp if etp is None else etp,
    )


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LAYER_HF = {  # megatron suffix -> HF suffix (for the 1:1 parameters)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # split along columns (dim 1)


def _split(t: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank].clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _fuse_qkv(q, k, v, lo: Layout) -> torch.Tensor:
    """(q, k, v) HF weights or biases -> Megatron's group-interleaved fused tensor."""
    groups, per_group = lo.num_kv_heads, lo.num_heads // lo.num_kv_heads
    rest = q.shape[1:]
    parts = [
        q.reshape(groups, per_group * lo.head_dim, *rest),
        k.reshape(groups, lo.head_dim, *rest),
        v.reshape(groups, lo.head_dim, *rest),
    ]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _unfuse_qkv(fused, lo: Layout):
    groups, per_group = lo.num_kv_heads, lo.num_heads // lo.num_kv_heads
    rest = fused.shape[1:]
    g = fused.reshape(groups, (per_group + 2) * lo.head_dim, *rest)
    q, k, v = g.split([per_group * lo.head_dim, lo.head_dim, lo.head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


# ------------------------------------------------------------------------------------------ HF -> megatron
def hf_to_megatron(
    name: str, hf: dict[str, torch.Tensor], lo: Layout, tp_rank: int, pp_rank: int, ep_rank: int = 0
) -> torch.Tensor:
    """This rank's shard of Megatron parameter ``name`` (local layer index) from the full HF tensors ``hf``
    (an expert's: of EP rank ``ep_rank``, split over ETP as ``lo.etp`` says)."""
    tp = lo.tp
    if name == "embedding.word_embeddings.weight":
        return _split(_pad_rows(hf["model.embed_tokens.weight"], lo.padded_vocab), tp, tp_rank)
    if name == "output_layer.weight":
        src = hf["model.embed_tokens.weight"] if lo.tie_embeddings else hf["lm_head.weight"]
        return _split(_pad_rows(src, lo.padded_vocab), tp, tp_rank)
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"].clone()
    if name in ("value_head.weight", "value_head.bias"):
        return hf["score." + name.split(".")[1]].clone()
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF source for megatron parameter '{name}'")
    layer = int(m.group(1)) + pp_rank * lo.layers_per_stage
    suffix, prefix = m.group(2), f"model.layers.{layer}."
    if is_moe_parameter(suffix):
        etp_rank = tp_rank if lo.etp > 1 else 0
        return hf_to_moe(suffix, hf, prefix, (lo.num_experts, lo.ep, ep_rank, lo.etp, etp_rank))
    if suffix in _LAYER_HF:
        full = hf[prefix + _LAYER_HF[suffix]]
        if suffix in _ROW_PARALLEL:
            return _split(full, tp, tp_rank, dim=1)
        return full.clone()
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]  # weight | bias
        q, k, v = (hf[f"{prefix}self_attn.{p}_proj.{kind}"] for p in "qkv")
        return _split(_fuse_qkv(q, k, v, lo), tp, tp_rank)
    if suffix == "mlp.linear_fc1.weight":
        gate, up = hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"]
        return torch.cat([_split(gate, tp, tp_rank), _split(up, tp, tp_rank)])
    raise KeyError(f"no HF source for megatron parameter '{name}'")


# ------------------------------------------------------------------------------------------ megatron -> HF
def megatron_to_hf(
    name: str, shards: list[torch.Tensor], lo: Layout, pp_rank: int, ep_rank: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors from the TP shards (in TP-rank order) of Megatron parameter ``name`` of stage ``pp_rank``
    (an expert's: its ETP shards, of EP rank ``ep_rank``, giving a piece of the fused tensor that
    ``moe_mapping.fuse_experts`` stacks).

    The output layer of a tied model maps to nothing (the embedding is exported as both names)."""
    if name == "embedding.word_embeddings.weight":
        full = torch.cat(shards)[: lo.vocab_size]
        out = [("model.embed_tokens.weight", full)]
        return out + ([("lm_head.weight", full)] if lo.tie_embeddings and lo.kind == "causal_lm" else [])
    if name == "output_layer.weight":
        return [] if lo.tie_embeddings else [("lm_head.weight", torch.cat(shards)[: lo.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    if name in ("value_head.weight", "value_head.bias"):
        return [("score." + name.split(".")[1], shards[0])]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF name for megatron parameter '{name}'")
    layer = int(m.group(1)) + pp_rank * lo.layers_per_stage
    suffix, prefix = m.group(2), f"model.layers.{layer}."
    if is_moe_parameter(suffix):
        return moe_to_hf(suffix, shards, prefix, (lo.num_experts, lo.ep, ep_rank))
    if suffix in _LAYER_HF:
        full = torch.cat(shards, dim=1) if suffix in _ROW_PARALLEL else shards[0]
        return [(prefix + _LAYER_HF[suffix], full)]
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = _unfuse_qkv(torch.cat(shards), lo)
        return [
            (f"{prefix}self_attn.q_proj.{kind}", q),
            (f"{prefix}self_attn.k_proj.{kind}", k),
            (f"{prefix}self_attn.v_proj.{kind}", v),
        ]
    if suffix == "mlp.linear_fc1.weight":
        halves = [s.chunk(2) for s in shards]
        return [
            (prefix + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves])),
            (prefix + "mlp.up_proj.weight", torch.cat([h[1] for h in halves])),
        ]
    raise KeyError(f"no HF name for megatron parameter '{name}'")


def is_tensor_parallel(name: str) -> bool:
    """Whether the parameter is sharded over TP (else every TP rank holds the same full tensor); an expert's is
    sharded over ETP instead (``is_expert_parameter``)."""
    if is_expert_parameter(name):
        return False
    return (
        name in ("embedding.word_embeddings.weight", "output_layer.weight")
        or ".linear_qkv." in name
        or name.endswith(_ROW_PARALLEL)
        or name.endswith("linear_fc1.weight")
    )


def stage_parameter_names(lo: Layout, pp_rank: int, hf_names: list[str]) -> list[str]:
    """The Megatron parameter names stage ``pp_rank`` owns (local layer indices), in forward order."""
    first, last = pp_rank == 0, pp_rank == lo.pp - 1
    names = ["embedding.word_embeddings.weight"] if first else []
    has_bias = "model.layers.0.self_attn.q_proj.bias" in hf_names
    for i in range(lo.layers_per_stage):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        names += [p + "self_attention.linear_qkv.bias"] if has_bias else []
        names += (
            [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"] if lo.qk_norm else []
        )
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        mlp = (
            moe_layer_names(lo.num_experts, lo.ep)
            if lo.num_experts
            else ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        )
        names += [p + n for n in mlp]
    if last:
        names.append("decoder.final_layernorm.weight")
        if lo.kind == "value":
            names += ["value_head.weight"] + (["value_head.bias"] if "score.bias" in hf_names else [])
        elif not lo.tie_embeddings or lo.pp > 1:
            names.append("output_layer.weight")
    return names


def hf_to_rank(
    hf: dict[str, torch.Tensor], lo: Layout, tp_rank: int, pp_rank: int, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """All of one rank's Megatron parameters from full HF tensors."""
    names = stage_parameter_names(lo, pp_rank, list(hf))
    return {n: hf_to_megatron(n, hf, lo, tp_rank, pp_rank, ep_rank) for n in names}


def ranks_to_hf(shards: dict[tuple[int, int, int], dict[str, torch.Tensor]], lo: Layout) -> dict[str, torch.Tensor]:
    """Full HF tensors from every rank's parameters ``shards[(tp_rank, pp_rank, ep_rank)]`` (the inverse of
    hf_to_rank)."""
    out = {}
    for pp_rank in range(lo.pp):
        for name in shards[(0, pp_rank, 0)]:
            for ep_rank in range(lo.ep if is_expert_parameter(name) else 1):
                tp_ranks = range(lo.etp if is_expert_parameter(name) else lo.tp)
                per_tp = [shards[(t, pp_rank, ep_rank)][name] for t in tp_ranks]
                out.update(megatron_to_hf(name, per_tp, lo, pp_rank, ep_rank))
    return fuse_experts(out, lo.num_experts)
