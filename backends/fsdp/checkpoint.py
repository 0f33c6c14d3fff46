"""Resumable checkpoints of the FSDP engine with torch.distributed.checkpoint (DCP).

Layout under the checkpoint directory:
  dcp/                    model + optimizer state, sharded: each rank writes its own shards (DCP format), so a
                          checkpoint never passes through one rank's memory
  extra_rank{R}.pt        per rank: LR scheduler state, the engine's step counter, and the RNG states (torch CPU,
                          CUDA, Python, NumPy), so a resumed run draws the same random numbers; plain tensors,
                          lists and numbers only, loaded with ``torch.load(weights_only=True)``
Resuming reproduces the run bit for bit on the same world size. A forward-only engine (no optimizer, no
scheduler) saves and loads the model alone.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from backends.hf_checkpoint import load_rank_file
from scaletrain.utils.seeding import rng_state, set_rng_state


def _extra_path(path: str) -> str:
    return os.path.join(path, f"extra_rank{dist.get_rank()}.pt")


def _sharded_state(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save_checkpoint(path: str, model, optimizer, scheduler, extra: dict) -> None:
    """Collective: every rank writes its shards and its extra state, then all wait for each other."""
    os.makedirs(path, exist_ok=True)
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=os.path.join(path, "dcp"))
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    torch.save({"scheduler": scheduler_state, "rng": rng_state(), **extra}, _extra_path(path))
    dist.barrier()


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Collective: restores model, optimizer, scheduler and RNG in place; returns the rest of the extra state."""
    extra_file = _extra_path(path)
    if not os.path.isfile(extra_file):
        raise FileNotFoundError(f"{extra_file} not found: was the checkpoint written with a different world size?")
    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    extra = load_rank_file(extra_file)
    scheduler_state = extra.pop("scheduler")
    if scheduler is not None and scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    set_rng_state(extra.pop("rng"))
    dist.barrier()
    return extra
