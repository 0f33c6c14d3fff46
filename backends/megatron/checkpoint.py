"""The Megatron engine's checkpoints (layer 1): one ``rank{R}.pt`` per rank.

Each file holds the rank's parameters, its inner (torch) optimizer's state and main parameters with the model name
each stands for, the step and the RNG states: tensors, lists and numbers only, loaded with
``torch.load(weights_only=True)`` (backends/checkpoint/safe_load.py). The same layout (TP x PP x DP, and EP x ETP
for a MoE model) resumes from them bit for bit. The checkpoint's meta records each rank's (tp, pp, dp) place (and
its (ep, etp, expert-dp) one), so
backends/megatron/checkpoint_reader.py reads the files back offline; a checkpoint of another layout or backend
resumes through that reading by HF name (``load_portable``, backends/checkpoint/portable.py), each rank mapping the
full tensors to its shards as it does a Hugging Face model's (backends/megatron/hf_mapping.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from backends.checkpoint.meta import resumes_natively, write_checkpoint_meta
from backends.checkpoint.portable import read_portable_state
from backends.checkpoint.safe_load import load_rank_file
from backends.megatron.hf_mapping import hf_to_megatron
from scaletrain.utils.seeding import rng_state, set_rng_state


def _rank_state(engine) -> dict:
    state = {
        "params": {k: v.detach().clone() for k, v in engine.module.named_parameters()},
        "global_step": engine.global_step,
        "rng": rng_state(),
    }
    if engine.optimizer is not None:
        inner = [opt.optimizer for opt in _inner_optimizers(engine.optimizer)]
        state["optimizer"] = [opt.state_dict() for opt in inner]
        # the optimizer's own (main) parameters: views of the model's in fp32, separate fp32 copies under bf16
        state["main_params"] = [[p.detach().clone() for g in opt.param_groups for p in g["params"]] for opt in inner]
        state["main_names"] = _main_param_names(engine)  # the offline reader's key to the moments
    return state


def _main_param_names(engine) -> list[list[str]] | None:
    """Per inner optimizer, the model parameter each of its (main) parameters stands for, in its order; None
    with the distributed optimizer (its main parameters are slices of flat buffers)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for opt in _inner_optimizers(engine.optimizer):
        # under bf16 compute the optimizer keeps fp32 copies: pair each with its model parameter
        pairs = zip(getattr(opt, "float16_groups", ()), getattr(opt, "fp32_from_float16_groups", ()))
        copies = {id(main): names[id(p)] for model_g, main_g in pairs for p, main in zip(model_g, main_g)}
        mains = [p for g in opt.optimizer.param_groups for p in g["params"]]
        if any(id(p) not in names and id(p) not in copies for p in mains):
            return None
        out.append([copies.get(id(p)) or names[id(p)] for p in mains])
    return out


def checkpoint_layout(engine) -> dict[str, int]:
    """The layout a checkpoint resumes natively on: TP, PP, DP sizes (and EP, ETP for a MoE model)."""
    layout = {"tp": engine.layout.tp, "pp": engine.layout.pp, "dp": engine.dp_size}
    if engine.layout.num_experts:
        layout.update(ep=engine.layout.ep, etp=engine.layout.etp)
    return layout


def rank_place(engine) -> tuple[int, ...]:
    """(tp, pp, dp) ranks, and for a MoE model (ep, etp, expert-dp) ranks after them."""
    place = (engine.tp_rank, engine.pp_rank, engine.dp_rank)
    if not engine.layout.num_experts:
        return place
    ps = engine.ps
    return place + (engine.ep_rank, ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())


def save_checkpoint(engine, path: str) -> None:
    """Collective: each rank writes its file; rank 0 the meta with every rank's place."""
    os.makedirs(path, exist_ok=True)
    places: list = [None] * dist.get_world_size()  # each rank's place: the offline reader's map
    dist.all_gather_object(places, rank_place(engine))
    if dist.get_rank() == 0:
        layout = {**checkpoint_layout(engine), "places": places}
        write_checkpoint_meta(engine, path, "megatron", layout, engine._tied_names())
    torch.save(_rank_state(engine), os.path.join(path, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


def load_checkpoint(engine, path: str) -> None:
    """Collective: this layout's checkpoint from each rank's own file, bit for bit; another's through HF names."""
    if not resumes_natively(path, "megatron", checkpoint_layout(engine)):
        return load_portable(engine, path)
    state = load_rank_file(os.path.join(path, f"rank{dist.get_rank()}.pt"))  # weights_only: no pickled code
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            p.copy_(state["params"][name])
    if engine.optimizer is not None:
        inner = [opt.optimizer for opt in _inner_optimizers(engine.optimizer)]
        for opt, opt_state, mains in zip(inner, state["optimizer"], state["main_params"]):
            opt.load_state_dict(opt_state)
            with torch.no_grad():
                for p, value in zip([p for g in opt.param_groups for p in g["params"]], mains):
                    p.copy_(value)
    engine.global_step = int(state["global_step"])
    set_rng_state(state["rng"])
    dist.barrier()


def load_portable(engine, path: str) -> None:
    """Collective: resume checkpoint ``path`` written by another backend or layout (backends/checkpoint/
    portable.py): each rank maps the full HF tensors of the parameters and of Adam's moments to its shards."""
    if engine.lora is not None:
        raise ValueError(
            f"{path} was written by another backend or layout: a LoRA engine on megatron resumes only its own "
            "layout's checkpoints"
        )
    if engine.optimizer is not None and engine.parallel.use_distributed_optimizer:
        raise ValueError(
            f"{path} was written by another backend or layout: megatron's distributed optimizer "
            "(use_distributed_optimizer=true) resumes only its own layout's checkpoints"
        )
    where = "megatron " + " ".join(f"{k.upper()}={v}" for k, v in checkpoint_layout(engine).items())
    state = read_portable_state(path, engine.architecture, list(engine.hf_meta), engine.optimizer is not None, where)
    lo, tp_rank, pp_rank, ep_rank = engine.layout, engine.tp_rank, engine.pp_rank, engine.ep_rank

    def shard(name: str, tensors: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        if name.startswith("output_layer.") and lo.kind == "value":
            name = "value_head." + name.split(".", 1)[1]
        return hf_to_megatron(name, tensors, lo, tp_rank, pp_rank, ep_rank).to(device=like.device, dtype=like.dtype)

    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            p.copy_(shard(name, state.params, p))
        inner = [opt.optimizer for opt in _inner_optimizers(engine.optimizer)] if engine.optimizer is not None else []
        for opt, names in zip(inner, _main_param_names(engine) or [], strict=True):
            for p, name in zip([p for g in opt.param_groups for p in g["params"]], names, strict=True):
                p.copy_(shard(name, state.params, p))  # the fp32 master (the parameter itself in fp32)
                moments = {key: shard(name, state.moments[key], p) for key in ("exp_avg", "exp_avg_sq")}
                opt.state[p] = {"step": torch.tensor(float(state.step)), **moments}
    engine.global_step = state.step
    dist.barrier()


def _inner_optimizers(optimizer) -> list:
    """The megatron optimizers of a (possibly chained) megatron optimizer, each with a torch ``.optimizer``."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
