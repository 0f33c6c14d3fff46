"""torch.distributed helpers every training engine shares (layer 1): device choice, process-group init, cross-rank
agreement on the micro-batch partition (every rank must run the same number of forwards: FSDP and ZeRO-3 all-gather
parameters in each, Megatron's pipeline schedule needs equal counts)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from backends.config import MicroBatching
from scaletrain.utils.net import free_port

logger = logging.getLogger(__name__)


def local_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (modulo the visible devices) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Initialise the default process group unless the caller already did.

    ``timeout_s`` bounds every collective: a rank whose peer died fails instead of waiting forever.

    From the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when RANK and WORLD_SIZE are set; otherwise a
    one-process group on a free local port (notebooks, benchmarks). gloo on CPU; on CUDA nccl for CUDA tensors
    plus gloo for CPU tensors.
    """
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
        )
    logger.info("initialised torch.distributed: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)


def peak_memory_metrics() -> dict[str, float]:
    """This process's peak CUDA memory so far, in GiB, under verl's metric names; empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    return {
        "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
    }


def max_over_ranks(values: list[int], device: torch.device, group=None) -> list[int]:
    """Element-wise maximum of small integer lists across the ranks of ``group`` (no-op for one rank)."""
    if dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(x) for x in t.tolist()]


def sum_over_ranks(values: list[float], device: torch.device, group=None) -> list[float]:
    """Element-wise sum of small float lists across the ranks of ``group`` (float64; no-op for one rank or
    without an initialised process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [float(x) for x in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [float(x) for x in t.tolist()]


def agreed_partition(batch, cfg, device: torch.device, group=None, call: MicroBatching | None = None):
    """Micro-batches of ``batch`` (fixed size or token budget, per ``cfg``, or ``call``: one call's settings over
    the engine's), with the same count on every rank of ``group``: a rank with fewer micro-batches would leave the
    others waiting in a parameter gather forever."""
    from backends.batching import fixed_partition, token_budget_partition

    if call is not None:
        cfg = dataclasses.replace(cfg, **dataclasses.asdict(call))
    n = len(batch)
    if not cfg.use_dynamic_bsz:
        parts = fixed_partition(n, cfg.micro_batch_size_per_gpu)
        most, neg_least = max_over_ranks([len(parts), -len(parts)], device, group)
        if most != -neg_least:
            raise ValueError(
                f"ranks got different numbers of micro-batches ({-neg_least}..{most}): every DP "
                "rank needs the same number of rows (pad the batch to a multiple of dp_size)"
            )
        return parts
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    parts = token_budget_partition(lengths, cfg.max_token_len_per_gpu)
    target, neg_rows = max_over_ranks([len(parts), -n], device, group)
    while True:
        if target > -neg_rows:
            raise ValueError(f"a rank needs {target} micro-batches but another has only {-neg_rows} rows")
        if len(parts) < target:
            parts = token_budget_partition(lengths, cfg.max_token_len_per_gpu, min_parts=target)
        (agreed,) = max_over_ranks([len(parts)], device, group)
        if agreed == target:  # every rank sees the same values, so all leave together
            return parts
        target = agreed


@dataclasses.dataclass(frozen=True)
class RowShard:
    """This rank's rows of a tensor split along dim 0 the way ``torch.chunk`` splits it: rank r holds rows
    [r c, r c + c) of c = ceil(rows / world), the last ranks fewer or none (FSDP2's Shard(0); ZeRO-3's flat
    partitions are the same split of the flattened tensor). ``local``: exactly this rank's rows."""

    local: torch.Tensor
    shape: torch.Size  # the full tensor's


def row_chunks(rows: int, world: int) -> tuple[int, list[int]]:
    """(rows per slot, the rows each rank holds) of a ``torch.chunk``-style split of ``rows`` over ``world``."""
    chunk = -(-rows // world)
    return chunk, [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def gather_row_shards(shards: list[RowShard], group) -> list[torch.Tensor]:
    """The full tensors of ``shards`` with one all-gather for them all: each rank's rows packed into a slot per
    tensor of one flat byte buffer (the buffers must be the same size on every rank), gathered, and cut out into
    fresh tensors. Collective: every rank of ``group``, the same tensors in the same order."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plans, slot_bytes = [], 0
    for shard in shards:
        row_bytes = math.prod(shard.shape[1:]) * shard.local.element_size()
        chunk, counts = row_chunks(shard.shape[0], world)
        plans.append((slot_bytes, row_bytes, chunk, counts))
        slot_bytes += chunk * row_bytes
    device = shards[0].local.device
    flat = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
    for shard, (start, row_bytes, _, counts) in zip(shards, plans):
        local = shard.local.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[start : start + counts[rank] * row_bytes].copy_(local)
    gathered = torch.empty(world * slot_bytes, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, flat, group=group)
    out = []
    for shard, (start, row_bytes, chunk, counts) in zip(shards, plans):
        full = torch.empty(shard.shape, dtype=shard.local.dtype, device=device)
        flat_full = full.view(-1).view(torch.uint8)
        for r, count in enumerate(counts):
            if count:
                src = gathered[r * slot_bytes + start : r * slot_bytes + start + count * row_bytes]
                flat_full[r * chunk * row_bytes : (r * chunk + count) * row_bytes].copy_(src)
        out.append(full)
    return out
