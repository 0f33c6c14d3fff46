"""ExternalRewardManager: a reward manager that implements only ``AbstractRewardManager`` (one written for verl,
registered with verl's ``register``) as the trainer uses a manager.

The trainer reads more than the interface promises: ``metrics`` in the returned dict, the scorer's name and last
error for the reward guard, ``close()``. This wrapper adds them (the manager's own ``metrics``, if it returns
any, are kept) and checks what the manager returns, so a wrong shape fails here naming the manager, not steps
later in the loss.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from scaletrain.protocol import DataProto
from scaletrain.reward.managers.abstract import AbstractRewardManager
from scaletrain.utils.errors import InvalidInput


class ExternalRewardManager:
    """Wraps ``manager``; called like scaletrain's RewardManager."""

    last_error: str | None = None  # such a manager handles its scorer's failures itself

    def __init__(self, manager: AbstractRewardManager):
        self.manager = manager
        self.name = type(manager).__qualname__
        self.scorer_repr = repr(getattr(manager, "compute_score", None) or manager)

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        start = time.perf_counter()
        out = self.manager(data, return_dict=True)
        reward = self.checked(out, data)
        if not return_dict:
            return reward["reward_tensor"]
        scores = reward["reward_tensor"].sum(-1)
        reward["metrics"] = {
            "reward/score_mean": scores.mean().item() if len(scores) else 0.0,
            "reward/seconds": time.perf_counter() - start,
            **reward["metrics"],
        }
        return reward

    def checked(self, out: Any, data: DataProto) -> dict[str, Any]:
        """``out`` as {reward_tensor, reward_extra_info, metrics}; InvalidInput naming the manager if malformed."""
        if isinstance(out, torch.Tensor):
            out = {"reward_tensor": out}
        if not isinstance(out, dict) or not isinstance(out.get("reward_tensor"), torch.Tensor):
            raise InvalidInput(
                f"reward manager {self.name} returned {type(out).__name__}; expected the (batch, response) reward "
                "tensor or a dict with 'reward_tensor'"
            )
        expected = tuple(data.tensors["responses"].shape)
        if tuple(out["reward_tensor"].shape) != expected:
            raise InvalidInput(
                f"reward manager {self.name} returned a reward_tensor of shape {tuple(out['reward_tensor'].shape)}; "
                f"expected the responses' {expected}"
            )
        extra = {key: list(values) for key, values in (out.get("reward_extra_info") or {}).items()}
        for key, values in extra.items():
            if len(values) != len(data):
                raise InvalidInput(
                    f"reward manager {self.name} returned reward_extra_info[{key!r}] with {len(values)} values for "
                    f"{len(data)} rows (a value per row is needed: give every row's score the same keys)"
                )
        metrics = dict(out.get("metrics") or {})
        return {"reward_tensor": out["reward_tensor"].float(), "reward_extra_info": extra, "metrics": metrics}

    def close(self) -> None:
        close = getattr(self.manager, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> ExternalRewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
