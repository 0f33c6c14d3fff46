"""Micro-batch partitioning for the training engines: fixed size or by token budget, and the way back.

A partition is a list of micro-batches, each a sorted list of row indices into the mini-batch.

- ``fixed_partition(n, size)``: consecutive rows, ``size`` at a time.
- ``token_budget_partition(lengths, max_tokens, min_parts)``: dynamic batch size. Rows are grouped so that each
  micro-batch's sum of valid tokens (``attention_mask.sum(-1)``) stays within ``max_tokens``, using the fewest
  parts (>= ``min_parts``) for which a balanced split fits: rows are placed longest first into the currently
  lightest part (LPT). A row longer than the budget gets a part of its own (with a warning).
- ``karmarkar_karp(lengths, parts, equal_size)``: balanced sums by the largest differencing method (the method
  of verl's sequence balancing helpers, which scaletrain's verl compatibility layer offers).
- ``restore_order(partition)``: the index that puts outputs concatenated in partition order back into the
  original row order: ``torch.cat(outputs)[restore_order(partition)]``.

How micro-batches are weighted in gradient accumulation (exactly, for token-mean and seq-mean losses, over
micro-batches and DP ranks) is backends/accumulation.py.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

Partition = list[list[int]]


def fixed_partition(n_rows: int, micro_batch_size: int) -> Partition:
    """Consecutive rows ``micro_batch_size`` at a time (the last part may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, n_rows))) for s in range(0, n_rows, micro_batch_size)]


def balanced_partition(lengths: Sequence[int], parts: int) -> Partition:
    """Exactly ``parts`` non-empty parts with balanced length sums: longest row first into the lightest part."""
    n = len(lengths)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} rows into {parts} non-empty parts")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(parts)]
    # the first `parts` rows seed one part each, so no part stays empty
    heap = []
    for k, i in enumerate(order[:parts]):
        bins[k].append(i)
        heap.append((lengths[i], k))
    heapq.heapify(heap)
    for i in order[parts:]:
        load, k = heapq.heappop(heap)
        bins[k].append(i)
        heapq.heappush(heap, (load + lengths[i], k))
    return [sorted(b) for b in bins]


def _fits(partition: Partition, lengths: Sequence[int], max_tokens: int) -> bool:
    return all(len(p) == 1 or sum(lengths[i] for i in p) <= max_tokens for p in partition)


def token_budget_partition(lengths: Sequence[int], max_tokens: int, min_parts: int = 1) -> Partition:
    """The fewest balanced parts (at least ``min_parts``) whose token sums are each <= ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n = len(lengths)
    if n == 0:
        return []
    if min_parts > n:
        raise ValueError(f"cannot split {n} rows into at least {min_parts} micro-batches")
    too_long = [i for i in range(n) if lengths[i] > max_tokens]
    if too_long:
        logger.warning(
            "%d row(s) longer than max_token_len_per_gpu=%d (longest %d tokens) each form a micro-batch of their own",
            len(too_long),
            max_tokens,
            max(lengths[i] for i in too_long),
        )
    parts = max(min_parts, len(too_long), math.ceil(sum(min(x, max_tokens) for x in lengths) / max_tokens), 1)
    while True:
        partition = balanced_partition(lengths, parts)
        if _fits(partition, lengths, max_tokens):
            return partition
        parts += 1  # ends at parts == n, where every row is alone


def restore_order(partition: Partition) -> torch.Tensor:
    """Index ``r`` with ``torch.cat(per_part_outputs)[r]`` in the original row order."""
    flat = torch.tensor([i for part in partition for i in part], dtype=torch.long)
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(len(flat))
    return inverse


def karmarkar_karp(lengths: Sequence[int], parts: int, equal_size: bool = False) -> Partition:
    """``parts`` parts with balanced length sums by the largest differencing method (Karmarkar and Karp, 1982):
    every row starts as a partial split of its own, and the two partial splits whose sums spread the most are
    merged, the heaviest part of one with the lightest of the other, until one split is left. ``equal_size``
    starts from splits of ``parts`` rows (the next ``parts`` longest, one per part), so every part gets the same
    count (``len(lengths) % parts == 0``). Parts hold sorted row indices."""
    n = len(lengths)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} rows into {parts} non-empty parts")
    if equal_size and n % parts:
        raise ValueError(f"{n} rows do not split into {parts} parts of equal size")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    starts = [order[s : s + parts] for s in range(0, n, parts)] if equal_size else [[i] for i in order]
    heap = []
    for serial, rows in enumerate(starts):
        split = [(lengths[i], [i]) for i in rows] + [(0, []) for _ in range(parts - len(rows))]
        split.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(split[0][0] - split[-1][0]), serial, split))
    serial = len(starts)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ra + rb) for (sa, ra), (sb, rb) in zip(a, reversed(b))]  # heaviest with lightest
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), serial, merged))
        serial += 1
    split = heap[0][2]
    if any(not rows for _, rows in split):
        raise ValueError(f"{n} rows left a part empty out of {parts}")
    return [sorted(rows) for _, rows in split]
