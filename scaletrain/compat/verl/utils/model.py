"""``verl.utils.model``: the one helper of verl's model utilities that code outside verl's workers calls, a random
padded attention mask for tests and benchmarks of code that handles padding."""

from __future__ import annotations

import numpy as np
import torch

from scaletrain.utils.errors import InvalidInput

__all__ = ["create_random_mask"]


def create_random_mask(
    input_ids: torch.Tensor,
    max_ratio_of_valid_token: float,
    max_ratio_of_left_padding: float,
    min_ratio_of_valid_token: float = 0,
) -> torch.Tensor:
    """An int64 mask shaped like ``input_ids``: per row a random number of left-padding zeros (up to the ratio of
    the length), then a random number of ones (between the two ratios, at least one), then zeros."""
    if not (0 < max_ratio_of_valid_token <= 1 and 0 <= max_ratio_of_left_padding < 1):
        raise InvalidInput("max_ratio_of_valid_token must be in (0, 1] and max_ratio_of_left_padding in [0, 1)")
    if min_ratio_of_valid_token > max_ratio_of_valid_token:
        raise InvalidInput("min_ratio_of_valid_token exceeds max_ratio_of_valid_token")
    rows, length = input_ids.shape
    most_valid = int(length * max_ratio_of_valid_token)
    least_valid = max(1, int(length * min_ratio_of_valid_token))
    most_padding = int(length * max_ratio_of_left_padding)
    if most_valid + most_padding > length or most_valid < 1:
        raise InvalidInput(f"{most_valid} valid and {most_padding} padding tokens do not fit {length} columns")
    left = np.random.randint(0, most_padding + 1, size=rows)
    valid = np.random.randint(least_valid, most_valid + 1, size=rows)
    positions = torch.arange(length)
    start, end = torch.as_tensor(left).unsqueeze(1), torch.as_tensor(left + valid).unsqueeze(1)
    return ((positions >= start) & (positions < end)).to(torch.int64)
