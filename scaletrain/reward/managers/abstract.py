"""AbstractRewardManager: the interface every reward manager has (verl's ``AbstractRewardManager``, same name,
arguments and helper), so that a manager written for verl subclasses it unchanged.

scaletrain's own managers (``RewardManager`` in base.py) implement it; a manager that implements only this
interface (a ported verl one) runs in the trainer through ``ExternalRewardManager`` (external.py), which adds
what the trainer reads beyond it (metrics, ``close``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from scaletrain.protocol import DataProto

RawRewardFn = Callable[..., Any]


class AbstractRewardManager(ABC):
    """Called with a rollout batch; returns the (B, R) token-level scores, or with ``return_dict=True`` a dict
    with ``reward_tensor`` and ``reward_extra_info`` (per-row lists)."""

    @abstractmethod
    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: RawRewardFn | None,
        reward_fn_key: str = "data_source",
        **kwargs: Any,
    ):
        pass

    @abstractmethod
    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        pass

    def _extract_reward_from_rm_scores(
        self, data: DataProto, return_dict: bool = False
    ) -> torch.Tensor | dict[str, Any] | None:
        """The batch's ``rm_scores`` (a reward model's, computed before) as this manager's answer; None if the
        batch has none. verl's helper, kept for managers written against it."""
        if data.batch is None or "rm_scores" not in data.batch.keys():
            return None
        if not return_dict:
            return data.batch["rm_scores"]
        extra_keys = data.meta_info.get("reward_extra_keys", [])
        return {
            "reward_tensor": data.batch["rm_scores"],
            "reward_extra_info": {key: data.non_tensor_batch[key] for key in extra_keys},
        }
