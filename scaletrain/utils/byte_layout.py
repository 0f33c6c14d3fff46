"""Where tensors lie when packed into one byte buffer (layer 0): the weight transports' shared-memory slots
(backends/rollout/ipc_transport.py) and the push's receive buffers (scaletrain/controller/weight_transport.py)."""

from __future__ import annotations

from collections.abc import Iterable

ALIGN = 64  # every tensor starts at a multiple of this: a view of any dtype over the buffer is aligned


def aligned_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """(where each of ``sizes`` bytes starts, packed in order at ``ALIGN``-byte boundaries; where the last ends,
    rounded up to the boundary)."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end
