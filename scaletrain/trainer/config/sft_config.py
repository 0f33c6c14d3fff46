"""The SFT trainer's typed config (layer 4): every key and its default, the embedded paths, the checks.

configs/sft_trainer.yaml lists the same keys with the same defaults (the embedded default's warm-up recipe; a
test compares them). ``load_sft_config`` builds the dataclasses strictly, ``resolve_embedded`` fills null paths
with the embedded default's files, ``check_sft_config`` checks across keys; all before Ray starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow.parquet as pq

from backends.config import ModelSettings, OptimConfig
from scaletrain.trainer.config.common_sections import DataSettings, RunSettings
from scaletrain.trainer.config.ppo_config import BackendConfig, RayKwargsConfig, files_of
from scaletrain.utils.hydra_compose import plain_dict
from scaletrain.utils.typed_config import ConfigError, build
from scaletrain.workers.sft import GreedyRolloutConfig

TRUNCATION = ("error", "truncate")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class SFTDataConfig(DataSettings):
    val_prompts_file: str | None = None  # RL-format parquet for greedy accuracy (embedded default: its val)
    response_key: str = "response"  # the column holding the target response text (EOS appended); a.b: field b of
    # struct column a (reward_model.ground_truth: an RL parquet's answers)
    train_batch_size: int = 128  # rows per optimizer step, over all ranks
    micro_batch_size_per_gpu: int = 64  # rows per forward/backward on each rank
    max_prompt_length: int = 8  # prompt tokens, left-padded to this (longer ones: truncation decides)
    max_response_length: int = 5  # response + EOS; also the greedy generation's max_new_tokens


@dataclass
class SFTTrainerSection(RunSettings):
    experiment_name: str = "sft"  # the loggers' run name; names the default output dir too
    total_steps: int | None = 1200  # set: overrides total_epochs
    default_local_dir: str | None = None  # null: outputs/<project_name>/<experiment_name>
    test_freq: int = 25  # steps between evaluations (and at the last step); <= 0: never
    val_before_train: bool = False  # evaluate (val loss, greedy accuracy) once before the first step
    stop_at_val_acc: float | None = 0.15  # stop once greedy val accuracy >= this; null: never


@dataclass
class SFTConfig:
    """Defaults = configs/sft_trainer.yaml's (the warm-up recipe), so ``run_sft`` on a dict of paths follows it."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: ModelSettings = field(default_factory=ModelSettings)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=0.0, warmup_steps=100)
    )
    backend: BackendConfig = field(default_factory=BackendConfig)
    rollout: GreedyRolloutConfig = field(default_factory=GreedyRolloutConfig)
    trainer: SFTTrainerSection = field(default_factory=SFTTrainerSection)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)

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

    plain = plain_dict(OmegaConf.create(dict(data or {})))
    return build(SFTConfig, plain)


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


def check_sft_config(cfg: SFTConfig) -> SFTConfig:
    """Checks across keys; raises ConfigError naming the key. Needs resolved paths (``resolve_embedded``).
    Changes nothing; returns ``cfg`` for chaining."""
    from backends.base import BACKENDS
    from backends.rollout.base import ROLLOUTS
    from scaletrain.trainer.config.checks import check_registered
    from scaletrain.trainer.run.ray_cluster import check_ray_kwargs
    from scaletrain.trainer.run.tracking import LOGGERS

    check_registered(
        [("backend.name", cfg.backend.name, BACKENDS), ("rollout.name", cfg.rollout.name, ROLLOUTS)]
        + [("trainer.logger", name, LOGGERS) for name in cfg.trainer.logger]
    )
    cfg.rollout.check("rollout")
    check_ray_kwargs(cfg.ray_kwargs)
    _check_values(cfg)
    if cfg.model.path is None or not os.path.exists(cfg.model.path):
        raise ConfigError(f"model.path: not found: {cfg.model.path}")
    _check_data_files(cfg.data)
    _check_vision_language(cfg)
    return cfg


def _check_vision_language(cfg: SFTConfig) -> None:
    """What SFT of a vision-language model cannot do yet, refused naming the key (as for PPO: vision_checks.py)."""
    from scaletrain.trainer.config.vision_checks import HF_ROLLOUT_ONLY, NO_MEGATRON, is_vision_language_dir, refuse

    if cfg.model.path is None or not is_vision_language_dir(cfg.model.path):
        return
    generates = bool(cfg.data.val_prompts_file)  # greedy accuracy: the rollout engine takes the images
    refusals = [
        ("backend.name", cfg.backend.name == "megatron", NO_MEGATRON),
        ("rollout.name", cfg.rollout.name != "hf" and generates, HF_ROLLOUT_ONLY),
    ]
    refuse(f"model.path={cfg.model.path} is a vision-language model", refusals)


def _check_values(cfg: SFTConfig) -> None:
    from backends.optim import SCHEDULES
    from scaletrain.trainer.config.checks import check_positive

    data, trainer = cfg.data, cfg.trainer
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
        "trainer.worker_call_timeout_s": 1 if trainer.worker_call_timeout_s is None else trainer.worker_call_timeout_s,
    }
    check_positive(positive)
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


def _check_data_files(data: SFTDataConfig) -> None:
    """The files exist, have the prompt / response columns, and hold at least one batch of training rows."""
    if not files_of(data.train_files):
        raise ConfigError("data.train_files: no files given")
    for key in ("train_files", "val_files"):
        for path in files_of(getattr(data, key)):
            if not os.path.exists(path):
                raise ConfigError(f"data.{key}: file not found: {path}")
            columns = pq.read_schema(path).names
            for col_key in ("prompt_key", "response_key"):
                if getattr(data, col_key).split(".")[0] not in columns:
                    raise ConfigError(
                        f"data.{col_key}: column '{getattr(data, col_key)}' not in {path} "
                        f"(columns: {', '.join(columns)})"
                    )
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in files_of(data.train_files))
    if (rows := min(rows, data.max_samples or rows)) < data.train_batch_size:
        raise ConfigError(f"data.train_batch_size ({data.train_batch_size}) exceeds the {rows} training rows")
    if data.val_prompts_file and not os.path.exists(data.val_prompts_file):
        raise ConfigError(f"data.val_prompts_file: file not found: {data.val_prompts_file}")
