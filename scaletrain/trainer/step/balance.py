"""``trainer.balance_batch``: reorder a step's rows so each data-parallel rank gets a similar token count (layer 4).

The engine dispatch hands DP rank r the r-th of ``dp_size`` equal, contiguous chunks of the batch. Without
balancing, one rank can draw the long responses and the others wait for it at every collective. Rows are split
into ``dp_size`` parts of equal row count by the longest-first greedy rule (each row, longest first, goes to the
part with the fewest tokens that still has room), then laid out part after part. The loss is unchanged: advantages
group rows by ``uid``, not by position, and token-mean is taken over the whole mini-batch.

Metrics: ``training/seq_balance/imbalance_before`` and ``.../imbalance_after``, the largest part's tokens over the
mean part's (1.0 = perfectly even).
"""

from __future__ import annotations

import heapq

import torch

from scaletrain.protocol import DataProto


def actor_dp_size(cfg) -> int:
    """Data-parallel ranks of the actor: the world, divided by megatron's TP x PP where it runs."""
    if cfg.backend.name != "megatron":
        return cfg.world_size
    layout = cfg.actor_rollout_ref.actor.megatron.resolved(cfg.backend.extra)
    return cfg.world_size // (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size)


def equal_count_parts(lengths: list[int], parts: int) -> list[list[int]]:
    """Row indices in ``parts`` parts of ``len(lengths) // parts`` rows each, token sums balanced greedily."""
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows do not split into {parts} equal parts")
    room = len(lengths) // parts
    heap = [(0, p) for p in range(parts)]  # (tokens, part) of the parts that still have room
    out: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        tokens, part = heapq.heappop(heap)
        out[part].append(row)
        if len(out[part]) < room:
            heapq.heappush(heap, (tokens + lengths[row], part))
    return [sorted(p) for p in out]


def imbalance(lengths: list[int], parts: list[list[int]]) -> float:
    sums = [sum(lengths[i] for i in p) for p in parts]
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean else 1.0


def balance_batch(batch: DataProto, dp_size: int) -> dict[str, float]:
    """Reorder ``batch`` in place (see the module docstring); returns the imbalance before and after."""
    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    room = len(lengths) // dp_size
    before = imbalance(lengths, [list(range(r * room, (r + 1) * room)) for r in range(dp_size)])
    parts = equal_count_parts(lengths, dp_size)
    batch.reorder(torch.tensor([i for part in parts for i in part]))
    return {
        "training/seq_balance/imbalance_before": before,
        "training/seq_balance/imbalance_after": imbalance(lengths, parts),
    }
