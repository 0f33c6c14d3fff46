"""``prime``: per-sample scoring in ``num_processes`` worker processes at once (default: up to 8, one per CPU),
for scorers that are slow per sample (symbolic math, running code). Each call keeps its own
``compute_score_timeout``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from scaletrain.reward.managers.base import RewardManager, register_reward_manager


def default_num_processes() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@register_reward_manager("prime")
class PrimeRewardManager(RewardManager):
    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        *,
        num_processes: int | None = None,
        **kwargs: Any,
    ):
        num_processes = default_num_processes() if num_processes is None else num_processes
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, num_processes=num_processes, **kwargs)
