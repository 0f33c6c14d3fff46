"""Reward-loop managers: verl 0.9's per-sample reward manager interface (``RewardManagerBase``: built from
``(config, tokenizer, compute_score)``, scoring one sample per ``async run_single(data)``), so that a manager written
for it runs in scaletrain's trainer.

- ``REWARD_LOOP_MANAGERS`` is that interface's registry (verl keeps it apart from the batch managers' too). The
  trainer's ``reward_model.reward_manager`` finds a name in the batch managers' registry first, then here
  (``reward_manager_class``).
- ``RewardLoopAdapter`` runs such a manager on a batch: every row's ``run_single`` at once on the manager's event
  loop, the scores placed on each row's last valid response token (``assemble_rm_scores``), the rows' extra info
  gathered into per-row lists (None where a row lacks a key).
- ``LoopNaiveRewardManager`` / ``LoopDAPORewardManager``: verl's two built-in ones, each a one-row call of
  scaletrain's batch manager of the same name (one implementation of reading, scoring and DAPO's penalty).

``config`` is what the trainer has for them: ``{"reward": {"reward_kwargs": reward_model.reward_kwargs}}`` (an
OmegaConf mapping; verl hands them its whole trainer config, of which they read that section).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

import torch

from scaletrain.protocol import DataProto
from scaletrain.reward.managers.abstract import AbstractRewardManager, RawRewardFn
from scaletrain.reward.managers.base import REWARD_MANAGERS, RewardManager
from scaletrain.reward.managers.dapo import DAPORewardManager
from scaletrain.reward.managers.naive import NaiveRewardManager
from scaletrain.utils.errors import InvalidInput
from scaletrain.utils.registry import Registry

REWARD_LOOP_MANAGERS = Registry("reward-loop manager")


def reward_manager_class(name: str) -> type:
    """The manager the trainer's ``reward_model.reward_manager`` names: a batch manager's name first, then a
    reward-loop manager's; ValueError listing both kinds of names if neither has it."""
    for registry in (REWARD_MANAGERS, REWARD_LOOP_MANAGERS):
        if name in registry:
            return registry.get(name)
    raise ValueError(
        f"unknown reward manager '{name}'; registered: {', '.join(REWARD_MANAGERS.names())} (batch managers), "
        f"{', '.join(REWARD_LOOP_MANAGERS.names())} (reward-loop managers){VERL_MANAGERS.get(name, '')}"
    )


# verl's managers whose job another setting does here
VERL_MANAGERS = {
    "limited": "; verl's rate-limited manager is the naive one here with its service's limits: "
    "reward.judge.max_concurrent / max_rpm (or reward.sandbox_fusion.max_concurrent)",
    "remote": "; verl's remote manager (scoring in Ray workers) is the naive one here with reward.num_workers=N",
}


def get_event_loop() -> asyncio.AbstractEventLoop:
    """This thread's event loop, made and set if it has none (verl's ``ray_utils.get_event_loop``)."""
    try:
        return asyncio.get_event_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


def reward_kwargs(config: Any) -> dict[str, Any]:
    """``config.reward.reward_kwargs`` as a dict ({} where either is missing)."""
    reward = config.get("reward") if config is not None else None
    return dict((reward or {}).get("reward_kwargs") or {})


class RewardManagerBase(ABC):
    """verl's interface: ``run_single`` scores one sample (a one-row DataProto) and returns
    ``{"reward_score": float, "reward_extra_info": dict}``."""

    _class_initialized = False

    def __init__(self, config: Any, tokenizer: Any, compute_score: RawRewardFn | None):
        self.config = config
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.loop = get_event_loop()
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config: Any, tokenizer: Any) -> None:
        """State shared by all instances, set up once (the first instance's call)."""
        if cls._class_initialized:
            return
        cls._class_initialized = True

    @abstractmethod
    async def run_single(self, data: DataProto) -> dict:
        raise NotImplementedError

    @classmethod
    def assemble_rm_scores(cls, data: DataProto, scores: list[float]) -> torch.Tensor:
        """A (B, R) float32 tensor: zero but ``scores[i]`` on row i's last valid response token."""
        tensors = data.tensors
        prompt_length = tensors["prompts"].size(1)
        valid = tensors["attention_mask"][:, prompt_length:].sum(dim=1)
        rm_scores = torch.zeros_like(tensors["responses"], dtype=torch.float32)
        rows = torch.arange(rm_scores.size(0), device=rm_scores.device)
        rm_scores[rows, valid - 1] = rm_scores.new_tensor(scores)
        return rm_scores


class RewardLoopAdapter(AbstractRewardManager):
    """A RewardManagerBase run as a batch manager (the trainer wraps it further in ExternalRewardManager)."""

    def __init__(self, manager: RewardManagerBase):
        self.manager = manager
        self.compute_score = manager.compute_score

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        async def every_row() -> list[dict]:
            return await asyncio.gather(*(self.manager.run_single(data[i : i + 1]) for i in range(len(data))))

        results = self.manager.loop.run_until_complete(every_row())
        for i, result in enumerate(results):
            if not isinstance(result, dict) or "reward_score" not in result:
                raise InvalidInput(
                    f"{type(self.manager).__qualname__}.run_single returned {result!r:.200} for row {i}; expected a "
                    "dict with 'reward_score' (and 'reward_extra_info')"
                )
        reward_tensor = self.manager.assemble_rm_scores(data, [float(r["reward_score"]) for r in results])
        extras = [r.get("reward_extra_info") or {} for r in results]
        keys = sorted({key for extra in extras for key in extra})
        extra_info = {key: [extra.get(key) for extra in extras] for key in keys}
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": extra_info}
        return reward_tensor

    def close(self) -> None:
        close = getattr(self.manager, "close", None)
        if callable(close):
            close()


class _OneRowOfBatchManager(RewardManagerBase):
    """A reward-loop manager that scores its one row with scaletrain's batch manager ``batch_manager``."""

    batch_manager: type[RewardManager]

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        compute_score: RawRewardFn | None,
        reward_router_address: str | None = None,
        reward_model_tokenizer: Any = None,
    ):
        if reward_router_address is not None:
            raise InvalidInput("reward_router_address: a generative reward model behind a router is not supported")
        super().__init__(config, tokenizer, compute_score)
        self.scorer = self.batch_manager(tokenizer, compute_score=compute_score, **reward_kwargs(config))

    async def run_single(self, data: DataProto) -> dict:
        out = await self.loop.run_in_executor(None, lambda: self.scorer(data[-1:], return_dict=True))
        assert isinstance(out, dict)  # return_dict=True
        extra = {key: values[0] for key, values in out["reward_extra_info"].items()}
        return {"reward_score": float(out["reward_tensor"].sum()), "reward_extra_info": extra}

    def close(self) -> None:
        self.scorer.close()


@REWARD_LOOP_MANAGERS.register("naive")
class LoopNaiveRewardManager(_OneRowOfBatchManager):
    batch_manager = NaiveRewardManager


@REWARD_LOOP_MANAGERS.register("dapo")
class LoopDAPORewardManager(_OneRowOfBatchManager):
    batch_manager = DAPORewardManager

    @property
    def max_resp_len(self) -> int | None:
        return self.scorer.max_resp_len  # type: ignore[attr-defined]
