"""SFTWorker: supervised fine-tuning on the same training engines, plus greedy generation for accuracy (layer 2).

One instance per rank. It owns a TrainEngine (any registered backend) trained with the token-mean negative
log-likelihood of the response tokens, and a RolloutEngine (``hf`` by default) on the same model path used only
to measure greedy accuracy. The rollout engine is refreshed from the training engine (HF-named tensors streamed
in buckets, a collective every rank takes part in) at the start of the first ``generate`` after a training step,
so generation always sees the current weights. The rollout engine sleeps while training runs and wakes for
generation (``ColocatedRollout``, colocated_rollout.py).

Call path from the SFT trainer: ``self.model.train_batch(batch)`` (``SFTRole``, scaletrain/workers/roles.py) ->
this worker's ``train_batch`` on every rank -> ``train_step`` of the backend's engine with ``sft_loss_fn``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from backends.base import TrainEngine, get_backend
from backends.config import OptimConfig
from backends.rollout.base import RolloutEngineSettings, SamplingConfig
from backends.vision import vision_keys
from scaletrain.algos import agg_loss
from scaletrain.controller import Dispatch, Worker, register
from scaletrain.protocol import DataProto
from scaletrain.workers.colocated_rollout import ColocatedRollout
from scaletrain.workers.config import EngineSetup
from scaletrain.workers.dispatch import ENGINE_METRIC, ENGINE_PROTO, ROLLOUT_PROTO, declare_engine_mesh
from scaletrain.workers.losses import aggregated
from scaletrain.workers.rollout_setup import build_colocated_rollout

logger = logging.getLogger(__name__)

# batch fields the SFT update reads (and, for a vision-language model, each row's vision inputs)
SFT_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def sft_inputs(data: DataProto) -> DataProto:
    """The fields of ``data`` the SFT update and loss read."""
    return data.select(batch_keys=list(SFT_INPUTS), non_tensor_batch_keys=vision_keys(data.non_tensor_batch))


@dataclass
class GreedyRolloutConfig(RolloutEngineSettings):
    """The rollout engine that measures greedy accuracy (named as in ``actor_rollout_ref.rollout``)."""

    name: str = "hf"  # hf | vllm
    tensor_model_parallel_size: int = 1  # ranks one rollout engine is sharded over (tensor parallel; vllm)
    weight_bucket_bytes: int = 256 << 20  # bytes per bucket when the trained weights go to the rollout engine


@dataclass
class SFTWorkerConfig:
    """What the SFT worker trains with beside its ``EngineSetup`` (the engine's model, backend and settings)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: GreedyRolloutConfig | None = field(default_factory=GreedyRolloutConfig)  # None: no generation
    max_prompt_length: int = 16
    max_response_length: int = 8  # also the greedy generation's max_new_tokens


@aggregated("token-mean")
def sft_loss_fn(outputs: dict[str, torch.Tensor], mb: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean NLL over the response tokens of one micro-batch; the engine weights micro-batches by their tokens,
    so its step and reported ``loss`` are the token-mean over the whole batch (all ranks)."""
    return agg_loss(-outputs["log_probs"], mb.tensors["response_mask"], "token-mean"), {}


class SFTWorker(Worker):
    def __init__(self, config: SFTWorkerConfig, setup: EngineSetup) -> None:
        super().__init__()
        self.config = config
        self.setup = setup
        self.engine: TrainEngine | None = None
        self.rollout: ColocatedRollout | None = None
        self._rollout_stale = True

    # ------------------------------------------------------------------------------------------------- build
    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg, setup = self.config, self.setup
        self.engine = get_backend(setup.backend)(setup.model, cfg.optim, setup.engine)
        declare_engine_mesh(self, self.engine)
        if cfg.rollout is not None:
            rc = cfg.rollout
            self.rollout, _ = build_colocated_rollout(
                self,
                rc,
                rc.name,
                setup.model.checkpoint,
                self.engine,
                max_model_len=cfg.max_prompt_length + cfg.max_response_length,
                trust_remote_code=setup.model.trust_remote_code,
                offload_trainer=False,
            )
            self._rollout_stale = True  # the engine may have loaded other weights than the path (e.g. a resume)
            self.rollout.release()

    def _training(self) -> TrainEngine:
        """The training engine, in training mode (the rollout engine asleep when free_cache_engine)."""
        if self.rollout is not None:
            self.rollout.release()
        return self._need_engine()

    def _need_engine(self) -> TrainEngine:
        if self.engine is None:
            raise RuntimeError("SFTWorker: call init_model first")
        return self.engine

    # -------------------------------------------------------------------------------------------- training
    @register(dispatch_mode=ENGINE_METRIC)
    def train_batch(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch; metrics ``sft/loss``, ``sft/grad_norm``, ``sft/lr``."""
        engine = self._training()
        metrics = engine.train_step(sft_inputs(data), sft_loss_fn, outputs=("log_probs",))
        self._rollout_stale = True
        return {(k if "/" in k else f"sft/{k}"): float(v) for k, v in metrics.items()}

    @register(dispatch_mode=ENGINE_PROTO)
    def eval_loss(self, data: DataProto) -> DataProto:
        """No-grad NLL per row: ``nll_sum`` (summed over response tokens) and ``num_tokens``, both (B,) float."""
        batch = sft_inputs(data)
        log_probs = self._training().forward(batch, outputs=("log_probs",)).tensors["log_probs"]
        mask = batch.tensors["response_mask"].float()
        return DataProto.from_dict({"nll_sum": -(log_probs * mask).sum(-1), "num_tokens": mask.sum(-1)})

    # ---------------------------------------------------------------------------------------------- rollout
    @register(dispatch_mode=ROLLOUT_PROTO)
    def generate(self, prompts: DataProto) -> DataProto:
        """Greedy responses (one per prompt, at most ``max_response_length`` tokens) from the current weights."""
        if self.rollout is None:
            raise RuntimeError("SFTWorker: no rollout engine (config.rollout is None); call init_model first")
        if self._rollout_stale:  # every rank trained, so every rank takes part in this collective export
            self.rollout.push_weights()
            self._rollout_stale = False
        sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=self.config.max_response_length, seed=None)
        return self.rollout.generate(prompts, sampling)

    # ---------------------------------------------------------------------------------------- checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, path: str) -> None:
        """An HF checkpoint (config, safetensors, the source model's tokenizer files), written by rank 0."""
        self._training().save_hf(path)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer + LR schedule + RNG under ``path/model`` (collective)."""
        self._training().save(os.path.join(path, "model"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self._training().load(os.path.join(path, "model"))
        self._rollout_stale = True
