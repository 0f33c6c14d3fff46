"""HF mixture-of-experts tensors <-> megatron-core MoE layer parameters (local spec, SequentialMLP experts), per
expert-parallel (EP) and expert-tensor-parallel (ETP) rank: the MoE half of backends/megatron/hf_mapping.py, which
calls it for a decoder layer's ``mlp.router.*`` / ``mlp.experts.*`` parameters.

HF names are the model's in memory (transformers 5 fuses the experts, the same names for Qwen3-MoE and Mixtral; the
checkpoint files' per-expert layout is backends/checkpoint/hf_names.py's job), under ``model.layers.L.``:
  megatron (layer i, local expert j)                 HF (expert g)
  decoder.layers.i.mlp.router.weight                 mlp.gate.weight                     (experts, hidden)
  ...mlp.experts.local_experts.j.linear_fc1.weight   mlp.experts.gate_up_proj[g]         [gate_g; up_g]
  ...mlp.experts.local_experts.j.linear_fc2.weight   mlp.experts.down_proj[g]            (hidden, expert width)
where g = ep_rank * (experts / EP) + j (megatron gives each EP rank a contiguous block of experts). Like the dense
MLP, ETP rank t holds rows t of the gate and of the up projection ([gate_t; up_t]) and columns t of the down one;
the router is replicated. Back to HF, each expert's tensors are pieces named ``<fused name>#<g>`` until
``fuse_experts`` stacks a layer's pieces into the fused tensors.
"""

from __future__ import annotations

import re

import torch

ROUTER, GATE_UP, DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_MEGATRON_ROUTER = "mlp.router.weight"


def is_moe_parameter(suffix: str) -> bool:
    """Whether a decoder layer's parameter (name after ``decoder.layers.i.``) belongs to the MoE block."""
    return suffix == _MEGATRON_ROUTER or suffix.startswith("mlp.experts.")


def is_expert_parameter(name: str) -> bool:
    """Whether megatron parameter ``name`` is an expert's (sharded over EP and ETP, reduced over expert DP)."""
    return ".mlp.experts.local_experts." in name


def global_expert(local: int, num_experts: int, ep: int, ep_rank: int) -> int:
    return ep_rank * (num_experts // ep) + local


def moe_layer_names(num_experts: int, ep: int) -> list[str]:
    """A MoE layer's megatron parameter names (after ``decoder.layers.i.``), the same on every EP rank."""
    names = [_MEGATRON_ROUTER]
    for j in range(num_experts // ep):
        names += [
            f"mlp.experts.local_experts.{j}.linear_fc1.weight",
            f"mlp.experts.local_experts.{j}.linear_fc2.weight",
        ]
    return names


def hf_to_moe(
    suffix: str, hf: dict[str, torch.Tensor], prefix: str, place: tuple[int, int, int, int, int]
) -> torch.Tensor:
    """This rank's shard of a MoE parameter (``suffix`` after ``decoder.layers.i.``; ``prefix`` the HF layer's
    ``model.layers.L.``) at ``place`` = (experts, EP, EP rank, ETP, ETP rank)."""
    num_experts, ep, ep_rank, etp, etp_rank = place
    if suffix == _MEGATRON_ROUTER:
        return hf[prefix + ROUTER].clone()
    m = _EXPERT.match(suffix)
    if not m:
        raise KeyError(f"no HF source for megatron MoE parameter '{suffix}'")
    g = global_expert(int(m.group(1)), num_experts, ep, ep_rank)
    if m.group(2) == "linear_fc1":
        gate, up = hf[prefix + GATE_UP][g].chunk(2)
        return torch.cat([gate.chunk(etp)[etp_rank], up.chunk(etp)[etp_rank]]).clone()
    return hf[prefix + DOWN][g].chunk(etp, dim=1)[etp_rank].clone()


def moe_to_hf(
    suffix: str, shards: list[torch.Tensor], prefix: str, place: tuple[int, int, int]
) -> list[tuple[str, torch.Tensor]]:
    """The router's HF tensor, or an expert's piece (``<fused name>#<g>``, for ``fuse_experts``), from its ETP
    shards (in ETP-rank order) at ``place`` = (experts, EP, EP rank)."""
    num_experts, ep, ep_rank = place
    if suffix == _MEGATRON_ROUTER:
        return [(prefix + ROUTER, shards[0])]
    m = _EXPERT.match(suffix)
    if not m:
        raise KeyError(f"no HF name for megatron MoE parameter '{suffix}'")
    g = global_expert(int(m.group(1)), num_experts, ep, ep_rank)
    if m.group(2) == "linear_fc1":
        halves = [s.chunk(2) for s in shards]
        piece = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        return [(f"{prefix}{GATE_UP}#{g}", piece)]
    return [(f"{prefix}{DOWN}#{g}", torch.cat(shards, dim=1))]


def fuse_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """``tensors`` with the expert pieces (``<fused name>#<g>``, g = 0..num_experts-1) stacked into their fused
    tensors; a missing expert raises naming it."""
    out, pieces = {}, {}
    for name, t in tensors.items():
        fused, mark, g = name.rpartition("#")
        if mark:
            pieces.setdefault(fused, {})[int(g)] = t
        else:
            out[name] = t
    for fused, by_expert in pieces.items():
        missing = sorted(set(range(num_experts)) - set(by_expert))
        if missing:
            raise KeyError(f"{fused}: no tensor for experts {missing}")
        out[fused] = torch.stack([by_expert[g] for g in range(num_experts)])
    return out
