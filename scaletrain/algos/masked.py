"""Masked reductions over (batch, response_length) tensors: sum, mean, variance, whitening.

A mask is 1 at response tokens that count and 0 at padding / tokens that must not count (tool observations,
prompt). Empty masks give 0 for sums and means instead of NaN.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over everything, or along ``dim``); a NaN or inf where the mask is
    unset does not reach the sum (as in verl)."""
    prod = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)) * mask
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 where the mask is empty."""
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1e-8).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``values``; ``unbiased`` divides by (n - 1) and needs n >= 2."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"unbiased masked variance needs at least 2 unmasked entries, got {int(n)}")
        var = var * (n / (n - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with mean and unbiased variance taken over the masked entries.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised). Masked-out entries are
    transformed too; callers multiply by the mask when they need zeros there.
    """
    n = mask.sum()
    if n < 2:
        raise ValueError(f"unbiased masked variance needs at least 2 unmasked entries, got {int(n)}")
    mask = mask.to(values.dtype)
    mean = torch.dot(values.reshape(-1), mask.reshape(-1)) / n  # BLAS passes, no temporaries
    shifted = values - mean
    masked = (shifted * mask).reshape(-1)
    var = torch.dot(masked, masked) / (n - 1)
    whitened = shifted.mul_(torch.rsqrt(var + eps))
    return whitened if shift_mean else whitened.add_(mean)
