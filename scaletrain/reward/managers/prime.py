"""``prime``: per-sample scoring in ``num_processes`` worker processes at once (default: up to 8, one per CPU),
for scorers that are slow per sample (symbolic math, running code). Each call keeps its own ``timeout_s``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from scaletrain.reward.managers.base import DEFAULT_TIMEOUT_S, RewardManager, register_reward_manager


def default_num_processes() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@register_reward_manager("prime")
class PrimeRewardManager(RewardManager):
    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        num_examine: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_processes: int | None = None,
        **kwargs: Any,
    ):
        num_processes = default_num_processes() if num_processes is None else num_processes
        super().__init__(tokenizer, compute_score, num_examine, timeout_s, num_processes=num_processes, **kwargs)
