"""A rollout engine sharing its process and device with a training engine: who holds the memory when (layer 2).

The role workers (ActorRolloutRefWorker, SFTWorker) switch between two modes, lazily, at the first call that
needs the other one:

- rollout mode (``serve``): the engine's weights are woken, the trainer's memory is offloaded when
  ``offload_trainer`` is set, then the KV cache is woken; generation runs.
- training mode (``release``): the engine sleeps when ``free_cache_engine`` is set, and the trainer's memory is
  brought back. Every training-side worker call (log-probs, update, checkpoints) enters it first.

Weights are pushed into an awake engine (``push_weights``, the full weights or, with ``adapter_sync``, a LoRA adapter
alone; ``load_weights`` / ``load_adapter`` for another process's buckets): weights woken, the trainer's buckets
streamed in while the trainer is still on the device (the next bucket gathered while the engine loads the previous
one), then the trainer offloaded and the KV cache woken (rollout mode). The engine therefore stays awake across a
whole rollout phase (every agent-loop flush, validation) and sleeps only when training needs the memory. The
engine's own state machine (``backends/rollout/lifecycle.py``) refuses any other order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from backends.base import TrainEngine
from backends.rollout.base import RolloutEngine, SamplingConfig, TokenOutput, TokenRequest
from backends.rollout.lifecycle import EngineLifecycle
from scaletrain.protocol import DataProto
from scaletrain.utils.prefetch import prefetched


class ColocatedRollout:
    def __init__(
        self,
        engine: RolloutEngine,
        trainer: TrainEngine | None,
        *,
        free_cache_engine: bool,
        offload_trainer: bool,
        bucket_bytes: int,
        adapter_sync: bool = False,
    ) -> None:
        """``adapter_sync``: ``push_weights`` sends the trainer's LoRA adapter alone (the engine serves it on its base
        weights) instead of the merged full weights."""
        self.engine = engine
        self.adapter_sync = adapter_sync
        self.lifecycle = EngineLifecycle(engine)
        self.trainer = trainer
        self.free_cache_engine = free_cache_engine
        self.offload_trainer = offload_trainer and trainer is not None
        self.bucket_bytes = bucket_bytes
        self.trainer_offloaded = False

    # --------------------------------------------------------------------------------------------- modes
    def serve(self) -> RolloutEngine:
        """Rollout mode: engine weights woken, trainer offloaded (when configured), then the KV cache woken."""
        self.lifecycle.ensure_weights()
        if self.offload_trainer and not self.trainer_offloaded:
            assert self.trainer is not None  # offload_trainer implies a trainer (__init__)
            self.trainer.offload()
            self.trainer_offloaded = True
        self.lifecycle.ensure_serving()
        return self.engine

    def release(self) -> None:
        """Training mode: the engine asleep (``free_cache_engine``), the trainer's memory back on the device."""
        if self.free_cache_engine:
            self.lifecycle.ensure_sleeping()
        if self.trainer_offloaded:
            assert self.trainer is not None  # offloaded by serve()
            self.trainer.onload()
            self.trainer_offloaded = False

    # ------------------------------------------------------------------------------------------- weights
    def push_weights(self) -> int:
        """The trainer's weights (with ``adapter_sync``: its LoRA adapter) into the engine (a collective on the
        trainer's side: every rank calls it); returns the bytes handed to the engine."""
        if self.trainer is None:
            raise RuntimeError("push_weights: this worker has no training engine to take the weights from")
        if self.trainer_offloaded:
            self.trainer.onload()
            self.trainer_offloaded = False
        counted = [0]
        if self.adapter_sync:
            buckets = _counting(_ahead(self.trainer.export_adapter(self.bucket_bytes)), counted)
            self.load_adapter(buckets, self.trainer.adapter_config())
        else:
            self.load_weights(_counting(_ahead(self.trainer.export_weights(self.bucket_bytes)), counted))
        return counted[0]

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """HF-named buckets (this process's trainer, or another's: split placement) into the woken engine weights,
        then rollout mode."""
        self._into_engine(lambda: self.engine.update_weights(buckets))

    def load_adapter(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], adapter_config: dict) -> None:
        """A LoRA adapter's PEFT-named buckets (``adapter_config``: its PEFT config) served by the engine on its base
        weights from now on, then rollout mode."""
        self._into_engine(lambda: self.engine.update_adapter(buckets, adapter_config))

    def _into_engine(self, update) -> None:
        """``update()`` (weights or an adapter into the engine) with the engine's weights woken, then rollout mode."""
        self.lifecycle.ensure_weights()
        self.lifecycle.require("update_weights")
        update()
        self.serve()

    # ------------------------------------------------------------------------------------------ generate
    def generate(self, prompts: DataProto, sampling: SamplingConfig) -> DataProto:
        return self.serve().generate(prompts, sampling)

    def generate_tokens(self, requests: list[TokenRequest]) -> list[TokenOutput]:
        return self.serve().generate_tokens(requests)


def _ahead(buckets: Iterable[list[tuple[str, torch.Tensor]]]):
    """The export gathering the next bucket (a collective over the trainer's ranks) while the engine loads the
    previous one: at most three buckets held at once, the one loading, one ready and one being gathered (the
    memory plan's "weight sync" phase counts them)."""
    return prefetched(buckets, depth=1, name="weight-export")


def _counting(buckets: Iterable[list[tuple[str, torch.Tensor]]], counted: list[int]):
    """``buckets`` passed through, their tensors' bytes added to ``counted[0]``."""
    for bucket in buckets:
        counted[0] += sum(t.numel() * t.element_size() for _, t in bucket)
        yield bucket
