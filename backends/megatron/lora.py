"""LoRA on the megatron engine (layer 1, the megatron engine's): PEFT's adapters trained on megatron's GPTModel.

The engine builds the HF model through PEFT as the HF engines do (backends/lora.py: a fresh adapter seeded alike on
every rank, or the trained one at ``lora_adapter_path``), so the adapters start as PEFT's, and keeps PEFT's names,
config and scalings (backends/lora_weights.py). Each megatron linear that holds HF linears (``linear_qkv``: q, k, v;
``linear_proj``: o; ``linear_fc1``: gate, up; ``linear_fc2``: down) gets a torch parametrization: its weight reads
as W + this rank's shard of the HF deltas B @ A x scale, mapped by the function that maps the HF weights themselves
(hf_mapping.hf_to_megatron), so the fused, group-interleaved and TP-split layouts need nothing of their own, and
sequence parallelism nothing either (a weight is not split along the sequence). Reading the weight outside a step
gives the merged weight, which is what the export sends to the rollout engines.

A and B are whole on every TP rank; each rank's backward gives them the gradient of its own shard only, so the
engine sums their gradients over TP after each backward (``reduce_grads``); megatron's gradient norm counts a
parameter that is not tensor-parallel once. Each step computes every adapted weight's delta in full (a weight-sized
temporary per adapted linear; the activation-side form x A^T B^T is not implemented).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from backends.lora import ADAPTER
from backends.lora_weights import Item, LoraLayout, adapter_name
from backends.megatron.hf_mapping import Layout, hf_to_megatron

# megatron's linear weights (per decoder layer) and the HF linears each holds, in the HF modules' order
ADAPTED = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass
class PeftParts:
    """What the engine keeps of the PEFT-wrapped HF model: the plain model (PEFT's layers removed, its weights
    unmerged), the adapter tensors under PEFT's state-dict names, and the adapters' layout and config."""

    model: nn.Module
    adapters: dict[str, torch.Tensor]
    layout: LoraLayout
    config: object  # peft.LoraConfig


def split_peft_model(peft_model) -> PeftParts:
    """The parts of a PEFT model (backends/lora.py wrap_lora); the model comes back unwrapped (PEFT's ``unload``)."""
    adapters = {k: v.detach() for k, v in peft_model.state_dict().items() if adapter_name(k) is not None}
    layout, config = LoraLayout.of(peft_model), peft_model.peft_config[ADAPTER]
    return PeftParts(peft_model.unload(), adapters, layout, config)


def check_adaptable(parts: PeftParts) -> None:
    """Every adapter sits on a linear megatron maps (the dense decoder layers' seven): a ValueError naming the
    others (an embedding, the head, a mixture of experts' experts)."""
    known = {f".{hf}." for hf in (p for members in ADAPTED.values() for p in members)}
    stray = sorted({k.split(".lora_")[0] for k in parts.adapters if not any(m in k for m in known)})
    if stray:
        raise ValueError(
            f"model.target_modules: the megatron backend trains LoRA adapters on the decoder layers' attention and "
            f"MLP linears only; these have adapters too: {stray[:4]}; leave them out (or use backend=fsdp)"
        )


class LoraDelta(nn.Module):
    """The parametrization of one megatron weight (a decoder layer's ``name``, local index): W + this rank's shard
    of the HF deltas of its adapted members; the weight itself when ``enabled`` is False (the base model)."""

    def __init__(self, name: str, members: dict[str, tuple], adapters: dict[str, tuple], place: tuple):
        """``members``: each HF weight the megatron weight holds -> its shape; ``adapters``: each adapted member ->
        (A, B, scale); ``place``: (Layout, tp_rank, pp_rank)."""
        super().__init__()
        self.name, self.members, self.place = name, members, place
        self.adapted = list(adapters)
        self.scales = [scale for _, _, scale in adapters.values()]
        self.lora_A = nn.ParameterList([nn.Parameter(a.clone()) for a, _, _ in adapters.values()])
        self.lora_B = nn.ParameterList([nn.Parameter(b.clone()) for _, b, _ in adapters.values()])
        self.enabled = True

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return weight
        deltas = {}
        for member, shape in self.members.items():
            if member not in self.adapted:
                deltas[member] = weight.new_zeros(shape)
        for member, a, b, scale in zip(self.adapted, self.lora_A, self.lora_B, self.scales):
            deltas[member] = (b @ a) * scale
        lo, tp_rank, pp_rank = self.place
        return weight + hf_to_megatron(f"{self.name}.weight", deltas, lo, tp_rank, pp_rank).to(weight.dtype)


def attach_lora(module: nn.Module, parts: PeftParts, shapes: dict, place: tuple[Layout, int, int]) -> MegatronLora:
    """A LoraDelta on each adapted linear of this stage's decoder layers (their adapters trainable, the rest of
    ``module`` frozen); ``shapes``: each HF weight's; ``place``: (Layout, tp_rank, pp_rank)."""
    from torch.nn.utils import parametrize

    lo, _, pp_rank = place
    if lo.num_experts:
        raise ValueError(
            "model.lora_rank > 0 with a mixture-of-experts model: LoRA on megatron is not implemented for it "
            "(PEFT leaves the fused experts without adapters); use backend=fsdp|deepspeed or model.lora_rank=0"
        )
    check_adaptable(parts)
    module.requires_grad_(False)
    deltas = []
    for name, linear in list(module.named_modules()):  # the registrations below add modules
        m = _LAYER.match(name)
        if not m or m.group(2) not in ADAPTED:
            continue
        prefix = f"model.layers.{int(m.group(1)) + pp_rank * lo.layers_per_stage}."
        members = {f"{prefix}{p}.weight": shapes[f"{prefix}{p}.weight"] for p in ADAPTED[m.group(2)]}
        adapters = {}
        for p in ADAPTED[m.group(2)]:
            peft = f"base_model.model.{prefix}{p}"
            if f"{peft}.lora_A.{ADAPTER}.weight" in parts.adapters:
                a, b = (parts.adapters[f"{peft}.lora_{x}.{ADAPTER}.weight"] for x in "AB")
                adapters[f"{prefix}{p}.weight"] = (a, b, parts.layout.scales[peft])
        if adapters:
            delta = LoraDelta(name, members, adapters, place)
            parametrize.register_parametrization(linear, "weight", delta, unsafe=True)
            deltas.append(delta)
    return MegatronLora(deltas, parts, lo, pp_rank)


class MegatronLora:
    """The LoRA state of one megatron engine: its parametrizations, the PEFT layout and config, the adapters'
    names in PEFT's adapter file (every stage's, in HF order) and which stage holds each."""

    def __init__(self, deltas: list[LoraDelta], parts: PeftParts, lo: Layout, pp_rank: int):
        self.deltas, self.config = deltas, parts.config
        self.scales = parts.layout.scales  # the checkpoint meta's (backends/checkpoint/meta.py)
        per_stage = lo.layers_per_stage
        self.names = []  # (adapter-file name, shape, dtype, owning stage)
        for key, value in parts.adapters.items():
            name = adapter_name(key)
            assert name is not None  # split_peft_model keeps the adapter tensors only
            layer = int(key.split("model.layers.")[1].split(".")[0])
            self.names.append((name, tuple(value.shape), value.dtype, layer // per_stage))
        own = {}
        for delta in deltas:
            for member, a, b in zip(delta.adapted, delta.lora_A, delta.lora_B):
                peft = "base_model.model." + member.removesuffix(".weight")
                own[f"{peft}.lora_A.weight"], own[f"{peft}.lora_B.weight"] = a, b
        self.own, self.pp_rank = own, pp_rank

    def parameters(self) -> Iterator[nn.Parameter]:
        for delta in self.deltas:
            yield from delta.lora_A
            yield from delta.lora_B

    def reduce_grads(self, tp_group) -> None:
        """Each adapter's gradient summed over the TP ranks (each rank's backward saw its own shard of the deltas)."""
        for p in self.parameters():
            # megatron DDP gives each trained parameter ``main_grad``, a view of its gradient buffer
            dist.all_reduce(p.main_grad, group=tp_group)  # pyright: ignore[reportAttributeAccessIssue]

    @contextlib.contextmanager
    def disabled(self, off: bool):
        """The base model (every delta off) for the duration, when ``off``."""
        if not off:
            yield
            return
        for delta in self.deltas:
            delta.enabled = False
        try:
            yield
        finally:
            for delta in self.deltas:
                delta.enabled = True

    def nbytes(self) -> int:
        return sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype, _ in self.names)

    def items(self, device: torch.device, pp_group, stage_rank) -> Iterator[Item]:
        """(adapter-file name, nbytes, get) of every adapter in HF order; ``get`` broadcasts it from its stage over
        the pipeline group (collective: every rank draws every item; ``stage_rank(stage)``: its global rank)."""
        for name, shape, dtype, stage in self.names:

            def get(name=name, shape=shape, dtype=dtype, stage=stage):
                if stage == self.pp_rank:
                    t = self.own[name].detach().to(dtype).contiguous()
                else:
                    t = torch.empty(shape, dtype=dtype, device=device)
                if pp_group is not None:
                    dist.broadcast(t, src=stage_rank(stage), group=pp_group)
                return t.clone() if stage == self.pp_rank else t

            yield name, torch.Size(shape).numel() * dtype.itemsize, get
