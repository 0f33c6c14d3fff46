"""``verl.utils.torch_functional`` (imported as ``verl_F`` by verl's losses and the custom ones copied from them):
the masked statistics and logit helpers, over scaletrain.algos.

scaletrain's functions take ``dim=`` where verl's take ``axis=``; the adapters below only rename. The distributed
statistics and ``expand_as_nested`` have no scaletrain counterpart and are written here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scaletrain.algos import entropy_from_logits, masked_var, masked_whiten
from scaletrain.algos import logprobs_from_logits as _logprobs_from_logits
from scaletrain.algos import masked_mean as _masked_mean
from scaletrain.algos import masked_sum as _masked_sum
from scaletrain.algos.entropy import sum_pi_squared_from_logits as calculate_sum_pi_squared_from_logits


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    return _masked_sum(values, mask, dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    return _masked_mean(values, mask, dim=axis)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl's signature; the chunked computation never needs the in-place backward verl's flash-attn path offers."""
    return _logprobs_from_logits(logits, labels)


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """torch.clamp with tensor bounds."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def distributed_mean_max_min_std(
    local_tensor: torch.Tensor, compute_max: bool = True, compute_min: bool = True, compute_std: bool = True
) -> tuple:
    """(mean, max, min, unbiased std) of every rank's values together; None for a statistic not asked for."""
    total = torch.stack([local_tensor.sum(), torch.tensor(local_tensor.numel(), dtype=local_tensor.dtype)])
    dist.all_reduce(total)
    mean, count = total[0] / total[1], total[1]
    stats = []
    for wanted, op, local in ((compute_max, dist.ReduceOp.MAX, torch.max), (compute_min, dist.ReduceOp.MIN, torch.min)):
        value = local(local_tensor).clone() if wanted else None
        if value is not None:
            dist.all_reduce(value, op=op)
        stats.append(value)
    std = None
    if compute_std:
        squares = ((local_tensor - mean) ** 2).sum()
        dist.all_reduce(squares)
        std = torch.sqrt(squares / (count - 1))
    return mean, stats[0], stats[1], std


def distributed_masked_mean(local_tensor: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """The mean of every rank's masked values together."""
    total = torch.stack([(local_tensor * local_mask).sum(), local_mask.sum().to(local_tensor.dtype)])
    dist.all_reduce(total)
    return total[0] / total[1]


def expand_as_nested(tensor: torch.Tensor, nested_tensor: torch.Tensor) -> torch.Tensor:
    """A (bsz,) tensor repeated along each row of a jagged (bsz, j) nested tensor, as a nested tensor of its shape."""
    assert nested_tensor.is_nested, "nested_tensor must be nested"
    assert tensor.dim() == 1, f"tensor must be 1-d, got shape {tuple(tensor.shape)}"
    assert tensor.shape[0] == nested_tensor.shape[0], (
        f"batch sizes differ: {tensor.shape[0]} vs {nested_tensor.shape[0]}"
    )
    assert nested_tensor.dim() == 2, f"nested_tensor must be 2-d, got {nested_tensor.dim()} dims"
    offsets = nested_tensor.offsets()  # pyright: ignore[reportAttributeAccessIssue]  (jagged layout only)
    values = torch.repeat_interleave(tensor, offsets.diff(), dim=0)
    return torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)


__all__ = [
    "calculate_sum_pi_squared_from_logits",
    "clip_by_value",
    "distributed_masked_mean",
    "distributed_mean_max_min_std",
    "entropy_from_logits",
    "expand_as_nested",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
