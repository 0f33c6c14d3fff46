"""Full tensors of FSDP2's sharded parameters, a whole bucket per collective (layer 0: the fsdp weight export).

``DTensor.full_tensor()`` runs one all-gather per parameter: a model's few hundred tensors pay a collective's
latency each, and the export took ~10x a memcpy of its bytes. ``gather_full`` hands the dim-0 shards of a bucket to
``backends.dist.gather_row_shards``: one all-gather per bucket, plus a copy of the shards in and of the full tensors
out. FSDP2 shards dim 0 the way ``torch.chunk`` does, so every rank knows every rank's share from the global shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from backends.dist import RowShard, gather_row_shards, row_chunks


def _row_shard(value: DTensor, world: int, rank: int) -> RowShard | None:
    """This rank's rows of a dim-0-sharded DTensor holding the ``torch.chunk`` share; None for any other layout."""
    if tuple(value.placements) != (Shard(0),) or value.dim() == 0:
        return None
    local = value.to_local()
    if local.shape[0] != row_chunks(value.shape[0], world)[1][rank]:
        return None
    return RowShard(local, value.shape)


def gather_full(values: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The full tensors of ``values``: dim-0-sharded DTensors over ``group`` with one all-gather for them all; other
    DTensors with their own ``full_tensor()``; plain tensors as they are. Collective: every rank, same ``values``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shards = {i: _row_shard(v, world, rank) for i, v in enumerate(values) if isinstance(v, DTensor)}
    grouped = {i: s for i, s in shards.items() if s is not None}
    gathered = dict(zip(grouped, gather_row_shards(list(grouped.values()), group))) if grouped else {}
    full = []
    for i, value in enumerate(values):
        if i in gathered:
            full.append(gathered[i])
        elif isinstance(value, DTensor):
            full.append(value.full_tensor().detach())
        else:
            full.append(value.detach())
    return full
