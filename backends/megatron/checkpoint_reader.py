"""Reading a Megatron engine checkpoint back as full HF tensors in one process (layer 1, the offline converter's
megatron reader: ``python -m scaletrain.model_merger``, and a resume on another backend or layout).

The checkpoint holds one ``rank{R}.pt`` per rank (backends/megatron/checkpoint.py) and, in its meta, each rank's
(tp, pp, dp) place. The files of DP rank 0 (one per TP rank and PP stage) are memory-mapped; the HF state dict is
walked in the export's groups (the embedding, each decoder layer, the final norm, the head:
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


def _stage_files(path: str, layout: dict, state: str) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """(tp rank, pp stage) -> that rank's tensors by module name, from the DP-rank-0 file of each place
    (memory-mapped): the parameters (the optimizer's fp32 master copies where it keeps them), or an Adam moment."""
    tensors = {}
    for rank, (tp_rank, pp_rank, dp_rank) in enumerate(layout["places"]):
        if dp_rank != 0:
            continue
        file = os.path.join(path, f"rank{rank}.pt")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} not found: the checkpoint's TP {tp_rank} / PP {pp_rank} shard is missing")
        saved = load_rank_file(file, map_location="cpu", mmap=True)
        tensors[(tp_rank, pp_rank)] = _rank_tensors(saved, state, file)
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

    layout = meta["layout"]
    config = AutoConfig.from_pretrained(os.path.join(path, HF_META_DIR))
    lo = layout_from_hf(config, layout["tp"], layout["pp"], meta["kind"])
    params = _stage_files(path, layout, state)

    def shard(tp_rank: int, stage: int, name: str) -> torch.Tensor:
        found = params[(tp_rank, stage)].get(module_name(name))
        if found is None:
            raise KeyError(f"{path}: rank file of TP {tp_rank} / PP {stage} has no parameter '{module_name(name)}'")
        return found

    def tensors():
        for group in export_groups(lo, hf_names):

            def shards_of(name: str, stage: int = group.stage) -> list[torch.Tensor]:
                ranks = range(lo.tp) if is_tensor_parallel(name) and lo.tp > 1 else range(1)
                return [shard(t, stage, name) for t in ranks]

            out = group_hf_tensors(group, lo, shards_of)
            for name in group.hf:
                yield name, out[name].numel() * out[name].element_size(), lambda t=out[name]: t.contiguous()

    yield from bucketed(tensors(), bucket_bytes)
