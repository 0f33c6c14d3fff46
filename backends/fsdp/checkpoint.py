"""Resumable checkpoints of the FSDP engine with torch.distributed.checkpoint (DCP).

Layout under the checkpoint directory:
  dcp/                    model + optimizer state, sharded: each rank writes its own shards (DCP format), so a
                          checkpoint never passes through one rank's memory
  extra_rank{R}.pt        per rank: LR scheduler state, the engine's step counter, and the RNG states (torch CPU,
                          CUDA, Python, NumPy), so a resumed run draws the same random numbers; plain tensors,
                          lists and numbers only, loaded with ``torch.load(weights_only=True)``
Loading runs nothing from the files: DCP's metadata and byte items are checked by allow-lists (safe_dcp.py).
Resuming reproduces the run bit for bit on the same world size. A forward-only engine (no optimizer, no
scheduler) saves and loads the model alone. A LoRA engine saves its trainable parameters alone (the adapters, a
value head) and their optimizer state: the frozen base is the model path's, rebuilt by every run.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from backends.fsdp.safe_dcp import safe_dcp_load
from backends.safe_load import load_rank_file
from scaletrain.utils.seeding import rng_state, set_rng_state


def _extra_path(path: str) -> str:
    return os.path.join(path, f"extra_rank{dist.get_rank()}.pt")


def _options(trainable_only: bool) -> StateDictOptions:
    # trainable_only (a LoRA engine): loading sets a subset of the model's keys, the ones dcp.load just filled
    return StateDictOptions(strict=not trainable_only)


def _without_frozen(model, model_sd: dict) -> dict:
    """``model_sd`` less the frozen parameters, under every name they have: torch's ``ignore_frozen_params`` keeps
    the second name of a tied parameter (a tied ``lm_head.weight``, the size of the embedding)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}


def _sharded_state(model, optimizer, trainable_only: bool) -> dict:
    """The DCP state; ``trainable_only``: the frozen base left out, it is the model path's on every run."""
    options = _options(trainable_only)
    if optimizer is None:
        model_sd, state = get_model_state_dict(model, options=options), {}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"optimizer": optim_sd}
    return {"model": _without_frozen(model, model_sd) if trainable_only else model_sd, **state}


def save_checkpoint(path: str, model, optimizer, scheduler, extra: dict, trainable_only: bool = False) -> None:
    """Collective: every rank writes its shards and its extra state, then all wait for each other.
    ``trainable_only``: the parameters that train (and their optimizer state) alone, not the frozen ones."""
    os.makedirs(path, exist_ok=True)
    state = _sharded_state(model, optimizer, trainable_only)
    # torch re-exports save without listing it in __all__
    dcp.save(state, checkpoint_id=os.path.join(path, "dcp"))  # pyright: ignore[reportPrivateImportUsage]
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    torch.save({"scheduler": scheduler_state, "rng": rng_state(), **extra}, _extra_path(path))
    dist.barrier()


def load_checkpoint(path: str, model, optimizer, scheduler, trainable_only: bool = False) -> dict:
    """Collective: restores model, optimizer, scheduler and RNG in place; returns the rest of the extra state.
    ``trainable_only``: as saved with it (the frozen parameters keep the values they were built with)."""
    extra_file = _extra_path(path)
    if not os.path.isfile(extra_file):
        raise FileNotFoundError(f"{extra_file} not found: was the checkpoint written with a different world size?")
    state = _sharded_state(model, optimizer, trainable_only)
    safe_dcp_load(state, os.path.join(path, "dcp"))  # no code runs from a tampered file: safe_dcp.py
    options = _options(trainable_only)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
        )
    extra = load_rank_file(extra_file)
    scheduler_state = extra.pop("scheduler")
    if scheduler is not None and scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    set_rng_state(extra.pop("rng"))
    dist.barrier()
    return extra
