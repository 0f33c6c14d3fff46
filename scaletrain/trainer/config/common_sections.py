"""The keys the PPO and the SFT trainers share (layer 4): their data and trainer sections extend these classes, so
each shared key and its default exist once (ppo_config.py, sft_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataSettings:
    train_files: Any = None  # str | list[str] of parquet files; null: the embedded default task's
    val_files: Any = None  # str | list[str]; null: no validation (the embedded default task: its held-out split)
    prompt_key: str = "prompt"  # the column holding each row's prompt
    image_key: str = "images"  # a vision-language model's image column (lists of {bytes} / {path} / paths)
    truncation: str = "error"  # a row over its length limits: error; PPO (when not filtering): left | right;
    # SFT: truncate (the prompt keeps its end, the response its start)
    seed: int = 1  # seed of the training rows' order (epoch e: derive_seed(seed, e))
    max_samples: int | None = None  # the first N rows of train_files (counted before filtering); null: all
    val_max_samples: int | None = None  # the first N rows of the validation files; null: all


@dataclass
class RunSettings:
    project_name: str = "scaletrain"  # the loggers' project; names the default output directory
    total_epochs: int = 1  # passes over the training data (when the trainer's step count is null)
    n_gpus_per_node: int = 2  # training ranks per node (one worker process each; a GPU each on CUDA)
    nnodes: int = 1  # nodes of the training pool (world size: nnodes x n_gpus_per_node)
    device: str = "auto"  # auto | cpu | cuda
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # console | jsonl | tensorboard |
    # wandb | mlflow
    save_hf_at_end: bool = True  # the trained model as an HF checkpoint in <output dir>/hf (with LoRA: the adapter)
    seed: int = 1  # seeds the engines (before each model is built) and the rollout's sampling
    worker_call_timeout_s: float | None = 3600.0  # a worker-group call running longer fails the run, naming the
    # role, ranks and method, with every worker's Python stack in <output dir>/stacks; null: wait forever
    verbose: bool = False  # the console shows libraries' INFO logs too (run.log always has them: console.py)
