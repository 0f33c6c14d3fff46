"""Streaming the Megatron engine's weights out as full HF tensors, bucketed, on every rank.

The HF state dict is walked in export groups (the embedding, each decoder layer, the final norm, the head), which
a plan (``ExportPlan``) orders into steps, each one collective where the floor is one:
- a dense model's decoder layers go one local layer index at a time: every PP stage's layer of that index at once,
  each rank packing its TP shards of its stage's layer into one flat buffer, and one all-gather over the TP x PP
  ranks (megatron's model-parallel group) hands every rank every stage's layer, mapped to HF tensors
  (backends/megatron/hf_mapping.py) where it lands. The stages' layers have the same local names and shapes, so the
  buffers match;
- the embedding, final norm and head (one stage each, different sizes), and every group of a mixture-of-experts
  model: the owning stage all-gathers the TP shards of each parameter and each tensor is broadcast over the
  pipeline group. An expert's shards are all-gathered over the expert-TP group, then over the EP group.
Every rank holds at most one step (one layer per stage) plus the current bucket, never the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from backends.base import bucketed
from backends.megatron.hf_mapping import Layout, is_tensor_parallel, megatron_to_hf, stage_parameter_names
from backends.megatron.moe_mapping import fuse_experts, is_expert_parameter
from scaletrain.utils.byte_layout import aligned_offsets


@dataclass(frozen=True)
class ExportGroup:
    stage: int  # PP stage owning the Megatron parameters
    megatron: tuple[str, ...]  # their names (local layer indices)
    hf: tuple[str, ...]  # the HF names produced, in HF state-dict order
    layer: int | None = None  # the decoder layer (global index) the group is, None for the others


def export_groups(lo: Layout, hf_names: list[str]) -> list[ExportGroup]:
    """Groups covering exactly ``hf_names`` (checked), in their order."""
    groups = []
    stage_names = {s: stage_parameter_names(lo, s, hf_names) for s in range(lo.pp)}
    embed = ("embedding.word_embeddings.weight",)
    groups.append(ExportGroup(0, embed, ("model.embed_tokens.weight",)))
    for layer in range(lo.num_layers):
        stage, local = divmod(layer, lo.layers_per_stage)
        names = tuple(n for n in stage_names[stage] if n.startswith(f"decoder.layers.{local}."))
        hf = tuple(n for n in hf_names if n.startswith(f"model.layers.{layer}."))
        groups.append(ExportGroup(stage, names, hf, layer))
    last = lo.pp - 1
    groups.append(ExportGroup(last, ("decoder.final_layernorm.weight",), ("model.norm.weight",)))
    if lo.kind == "value":
        head = tuple(n for n in stage_names[last] if n.startswith("value_head."))
        groups.append(ExportGroup(last, head, tuple("score." + n.split(".", 1)[1] for n in head)))
    elif "lm_head.weight" in hf_names:
        groups.append(
            ExportGroup(0, embed, ("lm_head.weight",))
            if lo.tie_embeddings
            else ExportGroup(last, ("output_layer.weight",), ("lm_head.weight",))
        )
    covered = [n for g in groups for n in g.hf]
    if covered != list(hf_names):
        missing, extra = sorted(set(hf_names) - set(covered)), sorted(set(covered) - set(hf_names))
        raise ValueError(f"HF <-> megatron mapping does not cover the checkpoint: missing {missing}, extra {extra}")
    return groups


def module_name(name: str) -> str:
    """The module's own name of mapped parameter ``name`` (the value head lives in the output layer's place)."""
    return "output_layer." + name.split(".", 1)[1] if name.startswith("value_head.") else name


def _param(engine, name: str) -> torch.Tensor:
    """Parameter ``name`` as the model computes with it: a LoRA-adapted weight reads W + its adapters' delta
    (backends/megatron/lora.py), the merged weight."""
    module, _, attribute = module_name(name).rpartition(".")
    with torch.no_grad():
        return getattr(engine.module.get_submodule(module), attribute).detach()


def group_hf_tensors(group: ExportGroup, lo: Layout, shards_of) -> dict[str, torch.Tensor]:
    """HF tensors of ``group`` from ``shards_of(name, ep_rank)``: the TP shards of each of its Megatron parameters,
    in TP-rank order (one for a parameter every TP rank holds whole; an expert's: the ETP shards of EP rank
    ``ep_rank``, asked for each EP rank; a layer's experts are stacked into the fused HF tensors). The engine
    gathers them; the offline reader (checkpoint_reader.py) reads them from the rank files."""
    out = {}
    for name in group.megatron:
        for ep_rank in range(lo.ep if is_expert_parameter(name) else 1):
            out.update(megatron_to_hf(name, shards_of(name, ep_rank), lo, group.stage, ep_rank))
    return fuse_experts(out, lo.num_experts)


def _gather_group(engine, group: ExportGroup) -> dict[str, torch.Tensor]:
    """HF tensors of ``group`` on its owning stage (TP all-gather per parameter)."""

    lo, experts = engine.layout, {}

    def gathered(name: str, ep_rank: int) -> list[torch.Tensor]:
        local = _param(engine, name).contiguous()
        if is_expert_parameter(name):
            if name not in experts:
                experts[name] = _gather_expert(local, lo.etp, lo.ep)
            return experts[name][ep_rank]
        if not (is_tensor_parallel(name) and lo.tp > 1):
            return [local]
        return _all_gather(local, lo.tp, engine.tp_group)

    return group_hf_tensors(group, lo, gathered)


def _all_gather(local: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return shards


def _gather_expert(local: torch.Tensor, etp: int, ep: int) -> list[list[torch.Tensor]]:
    """[EP rank][ETP rank] shards of one local expert parameter (each EP rank's expert of the same local index)."""
    from megatron.core import parallel_state as ps

    per_etp = _all_gather(local, etp, ps.get_expert_tensor_parallel_group()) if etp > 1 else [local]
    if ep == 1:
        return [per_etp]
    per_ep = [_all_gather(shard, ep, ps.get_expert_model_parallel_group()) for shard in per_etp]
    return [[per_ep[t][e] for t in range(etp)] for e in range(ep)]


@dataclass(frozen=True)
class ExportStep:
    """Groups exported together: one per PP stage, the same local layer on each, by one all-gather over the TP x PP
    ranks (``paired``), or a single group by its owning stage's TP gathers and a broadcast over PP."""

    groups: tuple[ExportGroup, ...]
    paired: bool


def export_steps(groups: list[ExportGroup], lo: Layout) -> list[ExportStep]:
    """The steps of an export: every group once, a dense model's decoder layers paired across the stages by local
    index where TP x PP > 1 (in place of the first layer), each other group alone, in ``groups``' order."""
    pairs = lo.num_experts == 0 and lo.tp * lo.pp > 1
    layers = {g.layer: g for g in groups if g.layer is not None}
    steps, per_stage = [], lo.layers_per_stage
    for group in groups:
        if group.layer is None or not pairs:
            steps.append(ExportStep((group,), False))
        elif group.layer == 0:
            for local in range(per_stage):
                paired = tuple(layers[stage * per_stage + local] for stage in range(lo.pp))
                if len({g.megatron for g in paired}) != 1:
                    raise ValueError(f"the stages' layers {[g.layer for g in paired]} have different parameters")
                steps.append(ExportStep(paired, True))
    return steps


class ExportPlan:
    """An engine's export steps and, where a step is paired, the model-parallel group it all-gathers over with
    each member's (PP stage, TP rank), agreed once (collective: every rank builds its plan together)."""

    def __init__(self, groups: list[ExportGroup], lo: Layout, pp_rank: int, tp_rank: int, device: torch.device):
        self.steps = export_steps(groups, lo)
        self.group: dist.ProcessGroup | None = None
        self.slots: dict[tuple[int, int], int] = {}
        if any(step.paired for step in self.steps):
            from megatron.core import parallel_state as ps

            group = ps.get_model_parallel_group()
            assert isinstance(group, dist.ProcessGroup)  # megatron annotates its getters loosely (int / list)
            self.group = group
            world = dist.get_world_size(self.group)
            mine = torch.tensor([pp_rank, tp_rank], dtype=torch.int64, device=device)
            places = torch.empty(2 * world, dtype=torch.int64, device=device)
            dist.all_gather_into_tensor(places, mine, group=self.group)
            pairs = places.view(world, 2).tolist()
            self.slots = {(stage, tp): slot for slot, (stage, tp) in enumerate(pairs)}  # (stage, tp) -> member


def _gather_paired(engine, step: ExportStep) -> dict[str, torch.Tensor]:
    """HF tensors of every group of a paired step, on every rank: this rank's local parameters of its stage's
    group packed into one flat byte buffer, one all-gather over the model-parallel group, and each stage's TP
    shards read out of the gathered buffers in place."""
    lo, plan = engine.layout, engine.export_plan
    names = step.groups[engine.pp_rank].megatron
    mine = [_param(engine, name).contiguous() for name in names]
    offsets, size = aligned_offsets(t.numel() * t.element_size() for t in mine)
    flat = torch.empty(size, dtype=torch.uint8, device=engine.device)
    for t, offset in zip(mine, offsets):
        flat[offset : offset + t.numel() * t.element_size()].copy_(t.view(-1).view(torch.uint8))
    gathered = torch.empty(len(plan.slots) * size, dtype=torch.uint8, device=engine.device)
    dist.all_gather_into_tensor(gathered, flat, group=plan.group)
    # the stages' groups have the same local names, so this rank's offsets and shapes are every member's
    where = {name: (offset, t) for name, offset, t in zip(names, offsets, mine)}

    def shard(stage: int, tp: int, name: str) -> torch.Tensor:
        offset, like = where[name]
        start = plan.slots[(stage, tp)] * size + offset
        return gathered[start : start + like.numel() * like.element_size()].view(like.dtype).view(like.shape)

    out = {}
    for stage, group in enumerate(step.groups):

        def shards_of(name: str, _ep_rank: int, stage: int = stage) -> list[torch.Tensor]:
            return [shard(stage, tp, name) for tp in (range(lo.tp) if is_tensor_parallel(name) else range(1))]

        out.update(group_hf_tensors(group, lo, shards_of))
    return out


def gather_hf_buckets(engine, bucket_bytes: int, skip=()):
    """Buckets of (HF name, full tensor) of at most ``bucket_bytes`` (a larger tensor is a bucket alone)."""
    items = ((name, t.numel() * t.element_size(), lambda t=t: t) for name, t in _hf_tensors(engine) if name not in skip)
    return bucketed(items, bucket_bytes)


def _hf_tensors(engine):
    """(HF name, full tensor) for every HF parameter on every rank, one export step at a time (collective: every
    name is gathered on every rank, skipped or not)."""
    for step in engine.export_plan.steps:
        if step.paired:
            tensors = _gather_paired(engine, step)
            for name in (n for group in step.groups for n in group.hf):
                yield name, _checked(engine, name, tensors[name].to(engine.hf_meta[name][1]).contiguous())
        else:
            yield from _broadcast_group(engine, step.groups[0])


def _broadcast_group(engine, group: ExportGroup):
    """(HF name, full tensor) of ``group``: gathered over TP on its owning stage, each tensor broadcast over PP."""
    pp, stage = engine.layout.pp, engine.pp_rank
    tensors = _gather_group(engine, group) if group.stage == stage else {}
    for name in group.hf:
        shape, dtype = engine.hf_meta[name]
        if group.stage == stage:
            t = tensors[name].to(dtype).contiguous()  # the HF dtype (parameters may be bf16 under bf16 compute)
        else:
            t = torch.empty(shape, dtype=dtype, device=engine.device)
        if pp > 1:
            dist.broadcast(t, src=stage_rank(group.stage), group=engine.pp_group)
        yield name, _checked(engine, name, t)


def _checked(engine, name: str, t: torch.Tensor) -> torch.Tensor:
    if tuple(t.shape) != engine.hf_meta[name][0]:
        raise ValueError(f"exported {name} has shape {tuple(t.shape)}, the HF model {engine.hf_meta[name][0]}")
    return t


def stage_rank(stage: int) -> int:
    """Global rank of ``stage`` in this rank's pipeline group."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    # megatron annotates its group getters loosely (int / list for other layouts); here it is a ProcessGroup
    return dist.get_global_rank(group, stage)  # pyright: ignore[reportArgumentType]
