"""Streaming the Megatron engine's weights out as full HF tensors, bucketed, on every rank.

The HF state dict is walked in its own order as groups (the embedding, each decoder layer, the final norm, the
head). For each group the owning PP stage all-gathers the TP shards of the group's Megatron parameters and maps
them to HF tensors (backends/megatron/hf_mapping.py); each tensor is then broadcast over the pipeline group, so
every rank holds at most one group (one layer) plus the current bucket, never the whole model. An expert's shards
are all-gathered over the expert-TP group, then over the EP group (each EP rank holds other experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from backends.base import bucketed
from backends.megatron.hf_mapping import Layout, is_tensor_parallel, megatron_to_hf, stage_parameter_names
from backends.megatron.moe_mapping import fuse_experts, is_expert_parameter


@dataclass(frozen=True)
class ExportGroup:
    stage: int  # PP stage owning the Megatron parameters
    megatron: tuple[str, ...]  # their names (local layer indices)
    hf: tuple[str, ...]  # the HF names produced, in HF state-dict order


def export_groups(lo: Layout, hf_names: list[str]) -> list[ExportGroup]:
    """Groups covering exactly ``hf_names`` (checked), in their order."""
    groups = []
    stage_names = {s: stage_parameter_names(lo, s, hf_names) for s in range(lo.pp)}
    embed = ("embedding.word_embeddings.weight",)
    groups.append(ExportGroup(0, embed, ("model.embed_tokens.weight",)))
    for layer in range(lo.num_layers):
        stage, local = divmod(layer, lo.layers_per_stage)
        names = tuple(n for n in stage_names[stage] if n.startswith(f"decoder.layers.{local}."))
        groups.append(ExportGroup(stage, names, tuple(n for n in hf_names if n.startswith(f"model.layers.{layer}."))))
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


def gather_hf_buckets(engine, bucket_bytes: int, skip=()):
    """Buckets of (HF name, full tensor) of at most ``bucket_bytes`` (a larger tensor is a bucket alone)."""
    items = ((name, t.numel() * t.element_size(), lambda t=t: t) for name, t in _hf_tensors(engine) if name not in skip)
    return bucketed(items, bucket_bytes)


def _hf_tensors(engine):
    """(HF name, full tensor) for every HF parameter on every rank, one export group at a time (collective: every
    name is gathered over TP on its owning stage and broadcast over PP, skipped or not)."""
    pp, stage = engine.layout.pp, engine.pp_rank
    for group in engine.groups:
        tensors = _gather_group(engine, group) if group.stage == stage else {}
        for name in group.hf:
            shape, dtype = engine.hf_meta[name]
            if group.stage == stage:
                t = tensors[name].to(dtype).contiguous()  # the HF dtype (parameters may be bf16 under bf16 compute)
            else:
                t = torch.empty(shape, dtype=dtype, device=engine.device)
            if pp > 1:
                dist.broadcast(t, src=stage_rank(group.stage), group=engine.pp_group)
            if tuple(t.shape) != shape:
                raise ValueError(f"exported {name} has shape {tuple(t.shape)}, the HF model {shape}")
            yield name, t


def stage_rank(stage: int) -> int:
    """Global rank of ``stage`` in this rank's pipeline group."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    # megatron annotates its group getters loosely (int / list for other layouts); here it is a ProcessGroup
    return dist.get_global_rank(group, stage)  # pyright: ignore[reportArgumentType]
