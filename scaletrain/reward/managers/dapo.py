"""``dapo``: per-sample scoring plus DAPO's overlong penalty on responses that run into the length limit.

With ``L = max_resp_len`` and ``B = overlong_buffer_len``, a response of ``n`` valid tokens gets
``-overlong_penalty_factor * clamp((n - (L - B)) / B, 0, 1)`` added to its score: nothing up to ``L - B``
tokens, then linearly down to ``-overlong_penalty_factor`` at ``L``. ``overlong_buffer_len=0`` turns it off.
The penalty applies whatever the scorer returned (a failed sample gets 0 + penalty). Per-row extra info:
``overlong_reward`` (the penalty) and ``overlong`` (whether it was non-zero).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scaletrain.reward.managers.base import DEFAULT_TIMEOUT_S, RewardManager, Rows, register_reward_manager


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    if buffer_len <= 0:
        return 0.0
    excess = length - (max_resp_len - buffer_len)
    return -factor * min(max(excess / buffer_len, 0.0), 1.0)


@register_reward_manager("dapo")
class DAPORewardManager(RewardManager):
    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        num_examine: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_resp_len: int | None = None,
        overlong_buffer_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        **kwargs: Any,
    ):
        if overlong_buffer_len < 0 or overlong_penalty_factor < 0:
            raise ValueError("dapo: overlong_buffer_len and overlong_penalty_factor must be >= 0")
        if overlong_buffer_len > 0:
            if max_resp_len is None:
                raise ValueError("dapo: overlong_buffer_len > 0 needs max_resp_len (data.max_response_length)")
            if overlong_buffer_len > max_resp_len:
                raise ValueError(
                    f"dapo: overlong_buffer_len ({overlong_buffer_len}) exceeds max_resp_len ({max_resp_len})"
                )
        super().__init__(tokenizer, compute_score, num_examine, timeout_s, **kwargs)
        self.max_resp_len = max_resp_len
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor

    def adjust_scores(self, rows: Rows, scores: list[float], extra_info: dict[str, list]) -> list[float]:
        if self.overlong_buffer_len <= 0:
            return scores
        max_resp_len = self.max_resp_len
        assert max_resp_len is not None  # __init__ requires it with an overlong buffer
        penalties = [
            overlong_penalty(n, max_resp_len, self.overlong_buffer_len, self.overlong_penalty_factor)
            for n in rows.response_lengths.tolist()
        ]
        extra_info["overlong_reward"] = penalties
        extra_info["overlong"] = [p < 0 for p in penalties]
        return [s + p for s, p in zip(scores, penalties)]

    def extra_metrics(self, rows: Rows, extra_info: dict[str, list]) -> dict[str, float]:
        flags = extra_info.get("overlong")
        return {"reward/overlong_frac": sum(flags) / len(flags)} if flags else {}
