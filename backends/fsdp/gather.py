"""Full tensors of FSDP2's sharded parameters, a whole bucket per collective (layer 0: the fsdp weight export).

``DTensor.full_tensor()`` runs one all-gather per parameter: a model's few hundred tensors pay a collective's
latency each, and the export took ~10x a memcpy of its bytes. ``gather_full`` packs this rank's shards of a bucket
of parameters into one flat byte buffer, all-gathers it once, and cuts the full tensors out of the result: one
collective per bucket, plus a copy of the shards in and of the full tensors out.

FSDP2 shards dim 0 the way ``torch.chunk`` does (rank r holds rows [r c, r c + c) of c = ceil(rows / world), the
last ranks fewer or none), so every rank knows every rank's share from the global shape. Each tensor gets a slot
of c rows in every rank's buffer (the buffers must be the same size), the unused rows left as they are.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _row_split(value: DTensor, world: int) -> tuple[int, list[int]] | None:
    """(rows per slot, rows of each rank) of a dim-0-sharded DTensor; None for any other layout."""
    if tuple(value.placements) != (Shard(0),) or value.dim() == 0:
        return None
    rows = value.shape[0]
    chunk = -(-rows // world)
    return chunk, [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def gather_full(values: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The full tensors of ``values``: dim-0-sharded DTensors over ``group`` with one all-gather for them all; other
    DTensors with their own ``full_tensor()``; plain tensors as they are. Collective: every rank, same ``values``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plans, offset = {}, 0
    for i, value in enumerate(values):
        if not isinstance(value, DTensor):
            continue
        split = _row_split(value, world)
        if split is not None and value.to_local().shape[0] == split[1][rank]:
            row_bytes = math.prod(value.shape[1:]) * value.element_size()
            plans[i] = (offset, row_bytes, *split)
            offset += split[0] * row_bytes
    out = [v.detach() if not isinstance(v, DTensor) else None for v in values]
    if plans:
        gathered = _all_gather_slots(values, plans, offset, rank, world, group)
        for i, (start, row_bytes, chunk, rows) in plans.items():
            out[i] = _cut_full(values[i], gathered, start, row_bytes, chunk, rows, offset)
    full = []
    for value, done in zip(values, out):
        if done is None:
            assert isinstance(value, DTensor)  # the plain tensors are done already
            done = value.full_tensor().detach()
        full.append(done)
    return full


def _all_gather_slots(values, plans, slot_bytes: int, rank: int, world: int, group) -> torch.Tensor:
    """Every rank's packed shards, rank after rank: (world * slot_bytes) bytes."""
    device = next(values[i] for i in plans).to_local().device
    flat = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
    for i, (start, row_bytes, _chunk, rows) in plans.items():
        local = values[i].to_local().detach().contiguous().reshape(-1).view(torch.uint8)
        flat[start : start + rows[rank] * row_bytes].copy_(local)
    gathered = torch.empty(world * slot_bytes, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, flat, group=group)
    return gathered


def _cut_full(value: DTensor, gathered, start: int, row_bytes: int, chunk: int, rows: list[int], slot_bytes: int):
    """``value``'s full tensor, its rows copied out of each rank's slot in ``gathered``."""
    full = torch.empty(value.shape, dtype=value.dtype, device=gathered.device)
    flat_full = full.view(-1).view(torch.uint8)
    for r, count in enumerate(rows):
        if count:
            src = gathered[r * slot_bytes + start : r * slot_bytes + start + count * row_bytes]
            flat_full[r * chunk * row_bytes : (r * chunk + count) * row_bytes].copy_(src)
    return full
