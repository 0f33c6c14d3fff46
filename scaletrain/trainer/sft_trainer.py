"""The SFT trainer (layer 4): supervised fine-tuning through the same worker groups and engines as PPO.

    from scaletrain.trainer.sft_trainer import run_sft
    summary = run_sft({"trainer": {"stop_at_val_acc": 0.15}})   # the embedded default's warm-up
    summary["hf_path"]                                           # the PPO trainer's starting model

Config (configs/sft_trainer.yaml): ``data`` (parquet with ``prompt`` / ``response`` string columns), ``model``,
``optim``, ``backend``, ``rollout`` (the engine that measures greedy accuracy), ``trainer``, ``ray_init``. Null
``model.path`` / ``data.train_files``: the embedded default (its ``sft_train`` / ``sft_val`` / RL ``val`` files).
``load_sft_config`` (strict dataclasses), ``validate`` (checks across keys) and tokenization run before Ray starts.

Rows: the prompt is rendered with the tokenizer's chat template as one user message with
``add_generation_prompt=True`` and tokenized without special tokens (as RLDataset does); the response gets
``tokenizer.eos_token`` appended. Batches are in verl's layout: prompt left-padded to ``max_prompt_length``,
response right-padded to ``max_response_length``; ``input_ids`` / ``attention_mask`` / ``position_ids`` (B, P + R),
``responses`` / ``response_mask`` (B, R). Each epoch is a permutation seeded by ``data.seed + epoch``; the last
partial batch is dropped.

Loop: one optimizer step per batch (the LR schedule's warm-up counts these steps); every ``trainer.test_freq``
steps and at the last step, the validation NLL and, with ``data.val_prompts_file`` (RL row format), the greedy
accuracy scored by ``default_compute_score`` (the response must end with EOS). Training stops early once
that accuracy reaches ``trainer.stop_at_val_acc`` (the embedded default's warm-up criterion: accuracy jumps at a
seed-dependent step, so a fixed step count is the wrong stop). At the end an HF checkpoint goes to
``<trainer.default_local_dir>/hf``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from backends.config import EngineConfig, ModelConfig, OptimConfig
from scaletrain.data.sft_dataset import SFTDataset
from scaletrain.protocol import DataProto
from scaletrain.trainer.config import BackendConfig, HFModelConfig, RayInitConfig
from scaletrain.utils.typed_config import ConfigError, build, to_dict
from scaletrain.workers.dispatch import reduce_metrics
from scaletrain.workers.sft import GreedyRolloutConfig, SFTWorkerConfig

logger = logging.getLogger(__name__)

TRUNCATION = ("error", "truncate")
DEVICES = ("auto", "cpu", "cuda")


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class SFTDataConfig:
    train_files: Any = None  # str | list[str]; null: the embedded default's sft_train
    val_files: Any = None  # null: no validation loss (embedded default: its sft_val)
    val_prompts_file: str | None = None  # RL-format parquet for greedy accuracy (embedded default: its val)
    prompt_key: str = "prompt"
    response_key: str = "response"
    train_batch_size: int = 128  # rows per optimizer step, over all ranks
    micro_batch_size_per_gpu: int = 64
    max_prompt_length: int = 8
    max_response_length: int = 5  # response + EOS; also the greedy generation's max_new_tokens
    truncation: str = "error"  # error | truncate (prompt keeps its end, response its start)
    seed: int = 1
    max_samples: int | None = None
    val_max_samples: int | None = None


@dataclass
class SFTTrainerSection:
    project_name: str = "scaletrain"
    experiment_name: str = "sft"
    total_epochs: int = 1
    total_steps: int | None = 1200  # set: overrides total_epochs
    n_gpus_per_node: int = 2
    nnodes: int = 1
    device: str = "auto"  # auto | cpu | cuda
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    default_local_dir: str | None = None  # null: outputs/<project_name>/<experiment_name>
    test_freq: int = 25  # steps between evaluations (and at the last step); <= 0: never
    val_before_train: bool = False
    stop_at_val_acc: float | None = 0.15  # stop once greedy val accuracy >= this; null: never
    save_hf_at_end: bool = True
    seed: int = 1


@dataclass
class SFTConfig:
    """Defaults = configs/sft_trainer.yaml's (the warm-up recipe), so ``run_sft`` on a dict of paths follows it."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: HFModelConfig = field(default_factory=HFModelConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=0.0, warmup_steps=100)
    )
    backend: BackendConfig = field(default_factory=BackendConfig)
    rollout: GreedyRolloutConfig = field(default_factory=GreedyRolloutConfig)
    trainer: SFTTrainerSection = field(default_factory=SFTTrainerSection)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)

    @property
    def world_size(self) -> int:
        return self.trainer.n_gpus_per_node * self.trainer.nnodes

    @property
    def output_dir(self) -> str:
        t = self.trainer
        return t.default_local_dir or os.path.join("outputs", t.project_name, t.experiment_name)


def load_sft_config(data: Mapping[str, Any] | None) -> SFTConfig:
    """Typed config from a plain or OmegaConf mapping (``${...}`` interpolations resolved)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(OmegaConf.create(dict(data or {})), resolve=True)
    return build(SFTConfig, plain)


def _files(value: Any) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def resolve_embedded(cfg: SFTConfig) -> SFTConfig:
    """Null model path / train files -> the embedded default's (built once, cached)."""
    if cfg.model.path is not None and cfg.data.train_files is not None:
        return cfg
    from scaletrain.data import build_embedded_default

    paths = build_embedded_default()
    data = cfg.data
    if data.train_files is None:
        data = replace(
            data,
            train_files=paths["sft_train"],
            val_files=data.val_files or paths["sft_val"],
            val_prompts_file=data.val_prompts_file or paths["val"],
        )
    model = cfg.model if cfg.model.path is not None else replace(cfg.model, path=paths["model"])
    return replace(cfg, data=data, model=model)


def validate(cfg: SFTConfig) -> SFTConfig:
    """Checks across keys; raises ConfigError naming the key. Needs resolved paths (``resolve_embedded``)."""
    from backends.base import BACKENDS
    from backends.optim import SCHEDULES
    from backends.rollout.base import ROLLOUTS
    from scaletrain.trainer.tracking import LOGGERS

    data, trainer = cfg.data, cfg.trainer
    for key, name, registry in (
        ("backend.name", cfg.backend.name, BACKENDS),
        ("rollout.name", cfg.rollout.name, ROLLOUTS),
    ):
        if name not in registry:
            raise ConfigError(f"{key}: unknown {registry.kind} '{name}'; registered: {', '.join(registry.names())}")
    for name in trainer.logger:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.logger: unknown logger '{name}'; registered: {', '.join(LOGGERS.names())}")
    cfg.rollout.check("rollout")
    positive = {
        "data.train_batch_size": data.train_batch_size,
        "trainer.nnodes": trainer.nnodes,
        "data.micro_batch_size_per_gpu": data.micro_batch_size_per_gpu,
        "data.max_prompt_length": data.max_prompt_length,
        "data.max_response_length": data.max_response_length,
        "trainer.n_gpus_per_node": trainer.n_gpus_per_node,
        "trainer.total_epochs": trainer.total_epochs,
        "trainer.total_steps": trainer.total_steps or 1,
        "optim.lr": cfg.optim.lr,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if data.train_batch_size % cfg.world_size:
        raise ConfigError(
            f"data.train_batch_size ({data.train_batch_size}) must be divisible by the world size "
            f"trainer.n_gpus_per_node x trainer.nnodes = {cfg.world_size}"
        )
    choices = {
        "data.truncation": (data.truncation, TRUNCATION),
        "trainer.device": (trainer.device, DEVICES),
        "optim.lr_scheduler": (cfg.optim.lr_scheduler, SCHEDULES),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {' | '.join(allowed)}, got '{value}'")
    if trainer.stop_at_val_acc is not None:
        if not 0.0 <= trainer.stop_at_val_acc <= 1.0:
            raise ConfigError(f"trainer.stop_at_val_acc must be in [0, 1], got {trainer.stop_at_val_acc}")
        if not data.val_prompts_file or trainer.test_freq <= 0:
            raise ConfigError("trainer.stop_at_val_acc needs data.val_prompts_file and trainer.test_freq > 0")
    if cfg.model.path is None or not os.path.exists(cfg.model.path):
        raise ConfigError(f"model.path: not found: {cfg.model.path}")
    if not _files(data.train_files):
        raise ConfigError("data.train_files: no files given")
    for key in ("train_files", "val_files"):
        for path in _files(getattr(data, key)):
            if not os.path.exists(path):
                raise ConfigError(f"data.{key}: file not found: {path}")
            columns = pq.read_schema(path).names
            for col_key in ("prompt_key", "response_key"):
                if getattr(data, col_key) not in columns:
                    raise ConfigError(
                        f"data.{col_key}: column '{getattr(data, col_key)}' not in {path} "
                        f"(columns: {', '.join(columns)})"
                    )
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in _files(data.train_files))
    if (rows := min(rows, data.max_samples or rows)) < data.train_batch_size:
        raise ConfigError(f"data.train_batch_size ({data.train_batch_size}) exceeds the {rows} training rows")
    if data.val_prompts_file and not os.path.exists(data.val_prompts_file):
        raise ConfigError(f"data.val_prompts_file: file not found: {data.val_prompts_file}")
    return cfg


# ------------------------------------------------------------------------------------------------ evaluation
def greedy_scores(out: DataProto, prompts: DataProto, tokenizer: Any, eos_ids: list[int]) -> list[float]:
    """``default_compute_score`` of each generated response, told whether it ended with EOS (as reward managers do)."""
    from scaletrain.reward import default_compute_score
    from scaletrain.reward.scorers.arithmetic import ENDED_WITH_EOS_KEY

    responses, mask = out.batch["responses"], out.batch["response_mask"].bool()
    rows = prompts.non_tensor_batch
    scores = []
    for i in range(len(out)):
        ids = responses[i][mask[i]].tolist()
        extra = dict(rows["extra_info"][i] or {})
        extra[ENDED_WITH_EOS_KEY] = bool(ids) and ids[-1] in eos_ids
        text = tokenizer.decode(ids, skip_special_tokens=True)
        score = default_compute_score(rows["data_source"][i], text, rows["reward_model"][i]["ground_truth"], extra)
        scores.append(float(score["score"] if isinstance(score, dict) else score))
    return scores


# ------------------------------------------------------------------------------------------------------ loop
class SFTTrainer:
    """Drives an SFTWorker group over the training set; ``fit`` reads top to bottom."""

    def __init__(
        self,
        cfg: SFTConfig,
        wg: Any,
        tokenizer: Any,
        train: SFTDataset,
        val: SFTDataset | None,
        val_prompts: DataProto | None,
    ):
        from backends.rollout.layout import eos_token_ids

        self.cfg, self.wg, self.tokenizer, self.train = cfg, wg, tokenizer, train
        self.val_batch = val.get_batch(range(len(val))) if val is not None else None
        self.val_prompts = val_prompts
        self.eos_ids = eos_token_ids(tokenizer, cfg.model.path)
        self.total_steps = total_steps(cfg, len(train))

    def evaluate(self) -> dict[str, float]:
        start, metrics = time.perf_counter(), {}
        if self.val_batch is not None:
            out = self.wg.eval_loss(self.val_batch)
            metrics["val/loss"] = out.batch["nll_sum"].sum().item() / max(out.batch["num_tokens"].sum().item(), 1.0)
        if self.val_prompts is not None:
            prompts = self.val_prompts.select(
                batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_batch_keys=[]
            )
            out = self.wg.generate(prompts)
            metrics["val/acc"] = float(np.mean(greedy_scores(out, self.val_prompts, self.tokenizer, self.eos_ids)))
        metrics["timing_s/val"] = time.perf_counter() - start
        return metrics

    def _reached(self, val_metrics: dict[str, float]) -> bool:
        target = self.cfg.trainer.stop_at_val_acc
        return target is not None and val_metrics.get("val/acc", -1.0) >= target

    def fit(self, tracking: Any) -> dict[str, Any]:
        cfg, bs = self.cfg, self.cfg.data.train_batch_size
        steps_per_epoch, freq = len(self.train) // bs, cfg.trainer.test_freq
        step, epoch, last_val, stopped, start = 0, 0, {}, False, time.perf_counter()
        if cfg.trainer.val_before_train:
            last_val = self.evaluate()
            tracking.log(last_val, step=0)
            stopped = self._reached(last_val)
        while step < self.total_steps and not stopped:
            order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(cfg.data.seed + epoch))
            for b in range(steps_per_epoch):
                if step >= self.total_steps or stopped:
                    break
                tick = time.perf_counter()
                batch = self.train.get_batch(order[b * bs : (b + 1) * bs])
                metrics = reduce_metrics(self.wg.train_batch(batch))
                step += 1
                metrics.update({"train/epoch": epoch, "timing_s/step": time.perf_counter() - tick})
                if freq > 0 and (step % freq == 0 or step == self.total_steps):
                    last_val = self.evaluate()
                    metrics.update(last_val)
                    stopped = self._reached(last_val)
                tracking.log(metrics, step=step)
            epoch += 1
        return {
            "step": step,
            "stopped_early": stopped,
            "val_acc": last_val.get("val/acc"),
            "val_loss": last_val.get("val/loss"),
            "wall_s": time.perf_counter() - start,
            "hf_path": None,
        }


def total_steps(cfg: SFTConfig, train_rows: int) -> int:
    return cfg.trainer.total_steps or cfg.trainer.total_epochs * (train_rows // cfg.data.train_batch_size)


def worker_config(cfg: SFTConfig, train_rows: int) -> SFTWorkerConfig:
    m, b = cfg.model, cfg.backend
    model = ModelConfig(
        path=m.path,
        dtype=m.dtype,
        gradient_checkpointing=m.enable_gradient_checkpointing,
        use_remove_padding=m.use_remove_padding,
        trust_remote_code=m.trust_remote_code,
        attn_implementation=m.attn_implementation,
    )
    engine = EngineConfig(
        micro_batch_size_per_gpu=cfg.data.micro_batch_size_per_gpu,
        seed=cfg.trainer.seed,
        mixed_precision=b.mixed_precision,
        param_offload=b.param_offload,
        optimizer_offload=b.optimizer_offload,
        extra=dict(b.extra),
    )
    optim = cfg.optim if cfg.optim.total_steps else replace(cfg.optim, total_steps=total_steps(cfg, train_rows))
    rollout = cfg.rollout if cfg.data.val_prompts_file else None  # no accuracy to measure: no rollout engine
    return SFTWorkerConfig(
        model=model,
        backend=b.name,
        optim=optim,
        engine=engine,
        rollout=rollout,
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
    )


def run_sft(config: SFTConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Validate, tokenize, train on a new SFTWorker group, save the HF checkpoint; returns a summary dict:
    ``step`` (last step), ``stopped_early``, ``val_acc``, ``val_loss``, ``wall_s`` and ``hf_path`` (None when
    ``trainer.save_hf_at_end`` is off). Starts Ray only when it is not initialized (and then shuts it down);
    the workers and their placement group are freed before returning."""
    import ray
    from transformers import AutoTokenizer

    from scaletrain.controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from scaletrain.data import RLDataset
    from scaletrain.trainer.tracking import Tracking
    from scaletrain.workers.sft import SFTWorker

    cfg = config if isinstance(config, SFTConfig) else load_sft_config(config)
    cfg = validate(resolve_embedded(cfg))
    data = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    train = SFTDataset(
        data.train_files,
        tokenizer,
        data.prompt_key,
        data.response_key,
        data.max_prompt_length,
        data.max_response_length,
        data.truncation,
        data.max_samples,
    )
    val = (
        SFTDataset(
            data.val_files,
            tokenizer,
            data.prompt_key,
            data.response_key,
            data.max_prompt_length,
            data.max_response_length,
            data.truncation,
            data.val_max_samples,
        )
        if _files(data.val_files)
        else None
    )
    prompts = None
    if data.val_prompts_file:
        rl = RLDataset(data.val_prompts_file, tokenizer, data.max_prompt_length, max_samples=data.val_max_samples)
        prompts = rl.get_batch(range(len(rl)))

    started_ray, ri = not ray.is_initialized(), cfg.ray_init
    if started_ray:
        ray.init(
            address=ri.address or "local",
            num_cpus=ri.num_cpus,
            object_store_memory=ri.object_store_memory,
            include_dashboard=False,
        )
    use_gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    pool = RayResourcePool([cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes, use_gpu=use_gpu, name_prefix="sft")
    wg = None
    try:
        wg = RayWorkerGroup(pool, RayClassWithInitArgs(SFTWorker, worker_config(cfg, len(train))), name_prefix="sft")
        wg.init_model()
        trainer, t = SFTTrainer(cfg, wg, tokenizer, train, val, prompts), cfg.trainer
        with Tracking(
            t.project_name,
            t.experiment_name,
            t.logger,
            cfg.output_dir,
            config=to_dict(cfg),
            total_steps=trainer.total_steps,
        ) as tracking:
            summary = trainer.fit(tracking)
        if t.save_hf_at_end:
            summary["hf_path"] = os.path.abspath(os.path.join(cfg.output_dir, "hf"))
            wg.save_hf(summary["hf_path"])
    finally:
        for actor in wg.workers if wg is not None else []:
            ray.kill(actor)
        pool.release()
        if started_ray:
            ray.shutdown()
    logger.info("SFT done: %s", summary)
    return summary
