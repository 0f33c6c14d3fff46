"""One training run end to end (layer 4): datasets, workers, fit(), final export, curves and a summary."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoTokenizer

from scaletrain.data import RLDataset
from scaletrain.models.processor import load_processor
from scaletrain.trainer.config.plan import RunPlan, log_plan, plan_run
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.ppo_trainer import RayPPOTrainer
from scaletrain.trainer.run.checkpoint import CheckpointManager
from scaletrain.trainer.run.preemption import PreemptionWatch
from scaletrain.trainer.run.tracking import Tracking
from scaletrain.utils.typed_config import resolved, to_dict
from scaletrain.workers.actor_rollout_ref import merged_dir

logger = logging.getLogger(__name__)


def _dataset(files: Any, tokenizer, cfg: PPOConfig, max_samples: int | None, processor=None) -> RLDataset | None:
    if not files:
        return None
    return RLDataset(
        files,
        tokenizer,
        cfg.data.max_prompt_length,
        prompt_key=cfg.data.prompt_key,
        filter_overlong_prompts=cfg.data.filter_overlong_prompts,
        truncation=cfg.data.truncation,
        max_samples=max_samples,
        return_raw_chat=cfg.data.return_raw_chat,
        reward_fn_key=cfg.data.reward_fn_key,
        processor=processor,
        image_key=cfg.data.image_key,
        video_key=cfg.data.video_key,
    )


@dataclass
class RunResult:
    """What a PPO run returns (``main_ppo.run``): where its outputs are and its last figures."""

    steps: int  # the global step reached
    run_dir: str
    metrics: dict[str, float] = field(default_factory=dict)  # the last trained step's (this run's, if any)
    val_metrics: dict[str, float] = field(default_factory=dict)  # the last validation's
    initial_val_metrics: dict[str, float] = field(default_factory=dict)  # before the first step (val_before_train)
    checkpoint: str | None = None  # the latest complete checkpoint directory
    hf_checkpoint: str | None = None  # the HF export at the end (trainer.save_hf_at_end)
    hf_merged: str | None = None  # LoRA: the merged model beside it (trainer.save_merged)
    plots: list[str] = field(default_factory=list)
    preempted: dict[str, Any] | None = None  # {signal, step, checkpoint}: stopped early by a signal
    wall_s: float = 0.0


def train(cfg: PPOConfig, watch: PreemptionWatch | None = None) -> RunResult:
    """Datasets, workers, fit() and the final export; everything the run placed on the cluster is freed before it
    returns or raises (the cluster may be shared: ray_cluster.py). ``watch``: the caller's, entered before Ray
    started (a signal during start-up ends the run before its first step); None: fit()'s own."""
    start = time.monotonic()
    model_path = resolved(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    processor = load_processor(model_path)  # None for a text model
    train_files, val_files = cfg.data.train_files, cfg.data.val_files
    train_set = resolved(_dataset(train_files, tokenizer, cfg, cfg.data.max_samples, processor), "data.train_files")
    val_set = _dataset(val_files, tokenizer, cfg, cfg.data.val_max_samples, processor)
    run_dir = os.path.abspath(resolved(cfg.trainer.default_local_dir, "trainer.default_local_dir"))
    latest = CheckpointManager(run_dir).latest()
    plan = plan_run(cfg, len(train_set), latest)
    log_plan(cfg, plan)
    trainer = RayPPOTrainer(cfg, plan, tokenizer, train_set, val_set, processor)
    os.makedirs(plan.run_dir, exist_ok=True)
    try:
        trainer.init_workers()
        return _fit(cfg, plan, trainer, start, watch)
    finally:
        trainer.close()


def _fit(
    cfg: PPOConfig, plan: RunPlan, trainer: RayPPOTrainer, start: float, watch: PreemptionWatch | None
) -> RunResult:
    tracking = Tracking(
        cfg.trainer.project_name,
        resolved(cfg.trainer.experiment_name, "trainer.experiment_name"),
        cfg.trainer.logger,
        plan.run_dir,
        config=to_dict(cfg),
        total_steps=plan.total_steps,
        resume_step=plan.resume_step,  # the jsonl log drops lines from steps the resumed run will redo
    )
    with tracking:
        val_metrics = trainer.fit(tracking, watch)
    result = RunResult(
        steps=trainer.global_step,
        run_dir=plan.run_dir,
        metrics=dict(trainer.last_metrics),
        val_metrics=dict(val_metrics),
        initial_val_metrics=dict(trainer.initial_val_metrics),
        checkpoint=trainer.checkpoints.latest(),
    )
    if trainer.preempted:  # the run goes on later from its checkpoint: no final export yet
        result.preempted = {**trainer.preempted, "checkpoint": result.checkpoint}
    elif cfg.trainer.save_hf_at_end:
        result.hf_checkpoint = trainer.save_hf(os.path.join(plan.run_dir, "hf"))
        if cfg.trainer.save_merged and cfg.actor_rollout_ref.model.lora_rank > 0:
            result.hf_merged = merged_dir(result.hf_checkpoint)
    trained = not (trainer.preempted and not trainer.last_metrics)  # a signal during start-up: nothing to plot
    if cfg.trainer.plot_at_end and "jsonl" in cfg.trainer.logger and trained:
        from scaletrain.plot import plot_run

        result.plots = [str(p) for p in plot_run(plan.run_dir)]
    result.wall_s = round(time.monotonic() - start, 1)
    return result
