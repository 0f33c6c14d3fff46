"""Discounted reverse cumulative sums (the scans behind GAE and REINFORCE++ returns) without a loop over time.

``y[t] = sum_{s >= t} f**(s - t) * x[s]`` is computed exactly with two small matrix products (no Python loop
over time steps, no negative powers, so no overflow or underflow for long sequences):

1. split the time axis into chunks of C steps and take the discounted suffix sum inside each chunk with one
   (C, C) upper-triangular matrix of powers f**(i - j);
2. the value at each chunk start ``S_c`` then satisfies ``A_c = sum_{c' >= c} f**(C (c' - c)) S_{c'}``, another
   (n_chunks, n_chunks) triangular product, and every position adds ``f**(C - j) * A_{c+1}``.

Work is O(B T C + B (T / C)**2) instead of the O(B T**2) of a full (T, T) decay matrix. On the CPU the products
run in the input's precision (at least float32: chunks of 32 terms lose nothing worth keeping, and a float32 product
costs a third of a float64 one); on a GPU in float64, so the result does not depend on TF32 settings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _decay_matrix(n: int, factor: float, stride: int, device: torch.device) -> torch.Tensor:
    """(n, n) matrix M with M[j, i] = factor**(stride * (i - j)) for i >= j, else 0 (float64)."""
    idx = torch.arange(n, device=device)
    gap = idx[None, :] - idx[:, None]
    powers = torch.tensor(float(factor), dtype=torch.float64, device=device) ** (stride * gap.clamp(min=0))
    return torch.where(gap >= 0, powers, torch.zeros((), dtype=torch.float64, device=device))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.is_cuda else torch.promote_types(x.dtype, torch.float32)


def discounted_suffix_sum(x: torch.Tensor, factor: float, chunk_size: int = 32) -> torch.Tensor:
    """``y[..., t] = sum_{s >= t} factor**(s - t) * x[..., s]`` along the last dim; returns x's dtype.

    ``factor`` must lie in [0, 1] (a discount). ``factor == 0`` returns x, ``factor == 1`` a plain reverse cumsum.
    """
    factor = float(factor)
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"discount factor must be in [0, 1], got {factor}")
    *lead, T = x.shape
    if T == 0:
        return x.clone()
    dtype = _work_dtype(x)
    flat = x.reshape(-1, T).to(dtype)
    C = max(1, min(chunk_size, T))
    n = -(-T // C)
    if n * C != T:
        flat = F.pad(flat, (0, n * C - T))  # zeros at the end do not change earlier suffix sums
    chunks = flat.view(-1, n, C)

    inner = _decay_matrix(C, factor, 1, x.device).to(dtype)  # (C, C)
    local = chunks @ inner.T  # suffix sums inside each chunk
    starts = local[..., 0] @ _decay_matrix(n, factor, C, x.device).to(dtype).T  # full value at each chunk start
    carry = F.pad(starts[:, 1:], (0, 1))  # value at the start of the next chunk
    exps = torch.arange(C, 0, -1, device=x.device)  # position j is C - j steps before the next chunk
    tail = (torch.tensor(factor, dtype=torch.float64, device=x.device) ** exps).to(dtype)
    y = local.view(-1, C).addmm_(carry.reshape(-1, 1), tail.view(1, C))  # + carry * tail: a rank-1 update
    return y.view(-1, n * C)[:, :T].reshape(*lead, T).to(x.dtype)
