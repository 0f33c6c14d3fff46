"""``dapo``: per-sample scoring plus DAPO's overlong penalty on responses that run into the length limit.

Configured as verl's DAPO manager is: ``max_resp_len`` (default in the trainer: ``data.max_response_length``) and
``overlong_buffer_cfg={enable, len, penalty_factor, log}``. With ``L = max_resp_len`` and ``B = len``, a response
of ``n`` valid tokens gets ``-penalty_factor * clamp((n - (L - B)) / B, 0, 1)`` added to its score: nothing up to
``L - B`` tokens, then linearly down to ``-penalty_factor`` at ``L``. No config or ``enable=false`` turns it off.
The penalty applies whatever the scorer returned (a failed sample gets 0 + penalty). Per-row extra info
(always; verl only with ``log``): ``overlong_reward`` (the penalty) and ``overlong`` (whether it was non-zero).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from scaletrain.reward.managers.base import RewardManager, Rows, register_reward_manager
from scaletrain.utils.errors import InvalidInput


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    if buffer_len <= 0:
        return 0.0
    excess = length - (max_resp_len - buffer_len)
    return -factor * min(max(excess / buffer_len, 0.0), 1.0)


@dataclass(frozen=True)
class OverlongBuffer:
    """verl's ``overlong_buffer_cfg``, checked: ``len`` tokens before ``max_resp_len`` the penalty starts."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False

    @classmethod
    def of(cls, cfg: Mapping[str, Any] | None) -> OverlongBuffer:
        if cfg is None:
            return cls()
        if not isinstance(cfg, Mapping):
            raise InvalidInput(
                f"dapo: overlong_buffer_cfg must be a mapping {{enable, len, penalty_factor, log}}, got {cfg!r}"
            )
        unknown = sorted(set(cfg) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidInput(
                f"dapo: overlong_buffer_cfg has unknown keys {unknown}; known: enable, len, penalty_factor, log"
            )
        return cls(**dict(cfg))


@register_reward_manager("dapo")
class DAPORewardManager(RewardManager):
    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        buffer = OverlongBuffer.of(overlong_buffer_cfg)
        if buffer.enable:
            if max_resp_len is None:
                raise InvalidInput(
                    f"dapo: max_resp_len must be provided if overlong_buffer_cfg={dict(overlong_buffer_cfg or {})} "
                    "is enabled, but got None"
                )
            if max_resp_len < buffer.len:
                raise InvalidInput(
                    f"dapo: max_resp_len must be larger than overlong_buffer_cfg.len ({max_resp_len} < {buffer.len})"
                )
            if buffer.len <= 0 or buffer.penalty_factor < 0:
                raise InvalidInput(
                    f"dapo: an enabled overlong buffer needs len > 0 and penalty_factor >= 0, got len={buffer.len}, "
                    f"penalty_factor={buffer.penalty_factor}; to turn the penalty off set enable=false"
                )
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, **kwargs)
        self.max_resp_len = max_resp_len
        self.overlong_buffer = buffer

    def adjust_scores(self, rows: Rows, scores: list[float], extra_info: dict[str, list]) -> list[float]:
        buffer = self.overlong_buffer
        if not buffer.enable:
            return scores
        max_resp_len = self.max_resp_len
        assert max_resp_len is not None  # __init__ requires it with an overlong buffer
        penalties = [
            overlong_penalty(n, max_resp_len, buffer.len, buffer.penalty_factor) for n in rows.response_lengths.tolist()
        ]
        extra_info["overlong_reward"] = penalties
        extra_info["overlong"] = [p < 0 for p in penalties]
        return [s + p for s, p in zip(scores, penalties)]

    def extra_metrics(self, rows: Rows, extra_info: dict[str, list]) -> dict[str, float]:
        flags = extra_info.get("overlong")
        return {"reward/overlong_frac": sum(flags) / len(flags)} if flags else {}
