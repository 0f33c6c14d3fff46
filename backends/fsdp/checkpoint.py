"""Resumable checkpoints of the FSDP engine with torch.distributed.checkpoint (DCP).

Layout under the checkpoint directory:
  dcp/                    model + optimizer state, sharded: each rank writes its own shards (DCP format), so a
                          checkpoint never passes through one rank's memory
  extra_rank{R}.pt        per rank: LR scheduler state, the engine's step counter, and the RNG states (torch CPU,
                          CUDA, Python, NumPy), so a resumed run draws the same random numbers; plain tensors,
                          lists and numbers only, loaded with ``torch.load(weights_only=True)``
Loading runs nothing from the files: DCP's metadata and byte items are checked by allow-lists (safe_dcp.py).
Resuming reproduces the run bit for bit on the same world size; on another one DCP reshards the state (the
checkpoint's meta says how many ranks wrote it). A forward-only engine (no optimizer, no scheduler)
saves and loads the model alone. A LoRA engine saves its trainable parameters alone (the adapters, a value head)
and their optimizer state: the frozen base is the model path's, rebuilt by every run. ``read_fsdp_checkpoint``
reads the model's full tensors back in one process with no process group (DCP reshards the saved shards), a bucket
at a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from backends.base import bucketed
from backends.checkpoint.meta import CHECKPOINT_META, CHECKPOINT_READERS, read_checkpoint_meta
from backends.checkpoint.safe_load import CorruptCheckpointError, load_rank_file
from backends.fsdp.safe_dcp import safe_dcp_load, safe_dcp_metadata
from scaletrain.utils.seeding import rng_state, set_rng_state

logger = logging.getLogger(__name__)


def _extra_path(path: str, rank: int | None = None) -> str:
    return os.path.join(path, f"extra_rank{dist.get_rank() if rank is None else rank}.pt")


def _saved_world(path: str) -> int:
    """The number of ranks that wrote the checkpoint (its meta's; this run's for a checkpoint without one)."""
    if not os.path.isfile(os.path.join(path, CHECKPOINT_META)):
        return dist.get_world_size()
    return int(read_checkpoint_meta(path)["layout"]["dp"])


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
    ``trainable_only``: as saved with it (the frozen parameters keep the values they were built with). On another
    number of ranks than the checkpoint's, DCP reshards the model and optimizer state; the scheduler and step come
    from rank 0's extra state (the same on every rank), and a rank the checkpoint did not have keeps its own RNG."""
    rank, saved_world = dist.get_rank(), _saved_world(path)
    extra_file = _extra_path(path, rank if rank < saved_world else 0)
    if not os.path.isfile(extra_file):
        raise FileNotFoundError(f"{extra_file} not found: the checkpoint of {saved_world} ranks is incomplete")
    if saved_world != dist.get_world_size() and rank == 0:
        logger.info("resuming %s, written by %d ranks, on %d", path, saved_world, dist.get_world_size())
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
    rng = extra.pop("rng")
    if rank < saved_world:
        set_rng_state(rng)
    dist.barrier()
    return extra


@CHECKPOINT_READERS.register("fsdp")
def read_fsdp_checkpoint(
    path: str, meta: dict, hf_names: list[str], bucket_bytes: int, state: str = "param"
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's tensors (or with ``state``, an Adam moment of each) under the engine's names, full, in buckets
    of about ``bucket_bytes``: each bucket is one ``dcp.load`` of just its tensors (in this process), so memory
    holds one bucket, never the whole model."""
    dcp_dir = os.path.join(path, "dcp")
    metadata = safe_dcp_metadata(dcp_dir)
    # DCP flattens the nested state: model.<name>, optimizer.state.<name>.<exp_avg | exp_avg_sq | step>
    prefix, suffix = ("model.", "") if state == "param" else ("optimizer.state.", f".{state}")
    _check_files(dcp_dir, metadata, prefix)
    tensors = {
        key[len(prefix) : len(key) - len(suffix)]: (m.size, m.properties.dtype)
        for key, m in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and key.endswith(suffix) and isinstance(m, TensorStorageMetadata)
    }

    def empty(name: str) -> torch.Tensor:  # filled by the bucket's dcp.load
        size, dtype = tensors[name]
        return torch.empty(size, dtype=dtype)

    items = ((name, size.numel() * dtype.itemsize, partial(empty, name)) for name, (size, dtype) in tensors.items())
    for bucket in bucketed(items, bucket_bytes):
        if state == "param":
            loaded = {"model": dict(bucket)}
        else:
            loaded = {"optimizer": {"state": {name: {state: tensor} for name, tensor in bucket}}}
        safe_dcp_load(loaded, dcp_dir, no_dist=True)  # this process alone, in a process group or not
        yield bucket


def _check_files(dcp_dir: str, metadata, prefix: str = "model.") -> None:
    """Every file the tensors read (under ``prefix``) are stored in is there and long enough: a missing or cut
    shard fails here, naming the file, before anything is read."""
    needed: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(prefix):
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = os.path.join(dcp_dir, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} not found: a shard of the checkpoint's model is missing")
        if os.path.getsize(file) < end:
            raise CorruptCheckpointError(
                f"{file}: cut at {os.path.getsize(file)} bytes, its model tensors end at {end}"
            )
