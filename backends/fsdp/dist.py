"""torch.distributed set-up for the FSDP engine: device choice, process-group init, and cross-rank agreement on the
number of micro-batches (every rank must run the same number of forwards: each one all-gathers parameters)."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
import socket

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def local_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (modulo the visible devices) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                timeout=timeout)
    logger.info("initialised torch.distributed: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)


def max_over_ranks(values: list[int], device: torch.device, group=None) -> list[int]:
    """Element-wise maximum of small integer lists across the ranks of ``group`` (no-op for one rank)."""
    if dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(x) for x in t.tolist()]


def agreed_partition(batch, cfg, device: torch.device, group=None):
    """Micro-batches of ``batch`` (fixed size or token budget, per ``cfg``), with the same count on every rank of
    ``group``: a rank with fewer micro-batches would leave the others waiting in a parameter gather forever."""
    from backends.batching import fixed_partition, token_budget_partition

    n = len(batch)
    if not cfg.use_dynamic_bsz:
        parts = fixed_partition(n, cfg.micro_batch_size_per_gpu)
        most, neg_least = max_over_ranks([len(parts), -len(parts)], device, group)
        if most != -neg_least:
            raise ValueError(f"ranks got different numbers of micro-batches ({-neg_least}..{most}): every DP "
                             "rank needs the same number of rows (pad the batch to a multiple of dp_size)")
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
