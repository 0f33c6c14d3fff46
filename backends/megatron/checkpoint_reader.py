"""Reading a Megatron engine checkpoint back as full HF tensors in one process (layer 1, the offline converter's
megatron reader: ``python -m scaletrain.model_merger``, and a resume on another backend or layout).

The checkpoint holds one ``rank{R}.pt`` per rank (backends/megatron/checkpoint.py) and, in its meta, each rank's
(tp, pp, dp) place (a MoE model's also its (ep, etp, expert-dp) one). The files of DP rank 0 (one per TP rank and
PP stage) and, for the experts, of expert-DP rank 0 (one per ETP rank, PP stage and EP rank) are memory-mapped;
the HF state dict is walked in the export's groups (the embedding, each decoder layer, the final norm, the head:
backends/megatron/export.py) and each group's TP shards are mapped to HF tensors (backends/megatron/hf_mapping.py),
so memory holds one layer plus one bucket. Adam's moments are mapped the same way (they are element-wise).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from backends.base import bucketed
from backends.checkpoint.meta import CHECKPOINT_READERS, HF_META_DIR
from backends.checkpoint.safe_load import load_rank_file
from backends.megatron.export import export_groups, group_hf_tensors, module_name
from backends.megatron.hf_mapping import is_tensor_parallel, layout_from_hf
from backends.megatron.moe_mapping import is_expert_parameter


def _stage_files(path: str, layout: dict, state: str) -> dict[tuple, dict[str, torch.Tensor]]:
    """("dense", tp rank, pp stage) -> that rank's tensors by module name, from the DP-rank-0 file of each place,
    and ("expert", etp rank, pp stage, ep rank) from the expert-DP-rank-0 file of each (memory-mapped): the
    parameters (the optimizer's fp32 master copies where it keeps them), or an Adam moment."""
    tensors, loaded = {}, {}
    for rank, place in enumerate(layout["places"]):
        tp_rank, pp_rank, dp_rank = place[:3]
        keys: list[tuple] = [("dense", tp_rank, pp_rank)] if dp_rank == 0 else []
        if len(place) > 3 and place[5] == 0:  # a MoE model's place: (ep, etp, expert-dp) ranks
            keys.append(("expert", place[4], pp_rank, place[3]))
        if not keys:
            continue
        file = os.path.join(path, f"rank{rank}.pt")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} not found: the checkpoint's shard {keys[0][1:]} is missing")
        if file not in loaded:
            loaded[file] = _rank_tensors(load_rank_file(file, map_location="cpu", mmap=True), state, file)
        tensors.update({key: loaded[file] for key in keys})
    return tensors


def _rank_tensors(saved: dict, state: str, file: str) -> dict[str, torch.Tensor]:
    """One rank file's tensors of ``state`` by module name (see ``_stage_files``)."""
    names = saved.get("main_names")  # per inner optimizer, the module name of each of its parameters
    if names is None:
        if state != "param":
            raise ValueError(
                f"{file} has no optimizer state by parameter (written before checkpoints recorded it, by a "
                "forward-only engine, or with the distributed optimizer): it resumes on its own layout alone"
            )
        return saved["params"]
    out = dict(saved["params"]) if state == "param" else {}
    for opt_names, opt_state, mains in zip(names, saved["optimizer"], saved["main_params"], strict=True):
        order = [index for group in opt_state["param_groups"] for index in group["params"]]
        for name, index, main in zip(opt_names, order, mains, strict=True):
            out[name] = main if state == "param" else opt_state["state"][index][state]
    return out


@CHECKPOINT_READERS.register("megatron")
def read_megatron_checkpoint(
    path: str, meta: dict, hf_names: list[str], bucket_bytes: int, state: str = "param"
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The HF tensors (every name of the HF model, a tied head's included), or with ``state`` an Adam moment of
    each, one export group at a time."""
    from transformers import AutoConfig

    if meta["lora"] is not None:
        raise ValueError(
            f"{path} holds LoRA adapters trained on megatron: reading them offline is not implemented; the run's "
            "save_hf (checkpoint.save_contents with hf_model) writes the adapter directory"
        )
    layout = meta["layout"]
    config = AutoConfig.from_pretrained(os.path.join(path, HF_META_DIR))
    tp = layout["tp"]
    lo = layout_from_hf(config, tp, layout["pp"], meta["kind"], layout.get("ep", 1), layout.get("etp", tp))
    params = _stage_files(path, layout, state)

    def shard(key: tuple, name: str) -> torch.Tensor:
        found = params[key].get(module_name(name))
        if found is None:
            raise KeyError(f"{path}: rank file of {key} has no parameter '{module_name(name)}'")
        return found

    def tensors():
        for group in export_groups(lo, hf_names):

            def shards_of(name: str, ep_rank: int, stage: int = group.stage) -> list[torch.Tensor]:
                if is_expert_parameter(name):
                    return [shard(("expert", t, stage, ep_rank), name) for t in range(lo.etp)]
                ranks = range(lo.tp) if is_tensor_parallel(name) and lo.tp > 1 else range(1)
                return [shard(("dense", t, stage), name) for t in ranks]

            out = group_hf_tensors(group, lo, shards_of)
            for name in group.hf:
                yield name, out[name].numel() * out[name].element_size(), lambda t=out[name]: t.contiguous()

    yield from bucketed(tensors(), bucket_bytes)
