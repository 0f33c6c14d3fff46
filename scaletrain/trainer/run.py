"""One training run end to end (layer 4): datasets, workers, fit(), final export, curves and a summary."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from transformers import AutoTokenizer

from scaletrain.data import RLDataset
from scaletrain.trainer.checkpoint import CheckpointManager
from scaletrain.trainer.config import PPOConfig
from scaletrain.trainer.plan import log_plan, plan_run
from scaletrain.trainer.ppo_trainer import RayPPOTrainer
from scaletrain.trainer.tracking import Tracking
from scaletrain.utils.typed_config import to_dict
from scaletrain.workers.actor_rollout_ref import merged_dir

logger = logging.getLogger(__name__)


def _dataset(files: Any, tokenizer, cfg: PPOConfig, max_samples: int | None) -> RLDataset | None:
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
    )


def train(cfg: PPOConfig) -> dict[str, Any]:
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    train_set = _dataset(cfg.data.train_files, tokenizer, cfg, cfg.data.max_samples)
    val_set = _dataset(cfg.data.val_files, tokenizer, cfg, cfg.data.val_max_samples)
    latest = CheckpointManager(os.path.abspath(cfg.trainer.default_local_dir)).latest()
    plan = plan_run(cfg, len(train_set), latest)
    log_plan(cfg, plan)
    trainer = RayPPOTrainer(cfg, plan, tokenizer, train_set, val_set)
    run_dir = plan.run_dir
    os.makedirs(run_dir, exist_ok=True)
    trainer.init_workers()
    tracking = Tracking(
        cfg.trainer.project_name,
        cfg.trainer.experiment_name,
        cfg.trainer.logger,
        run_dir,
        config=to_dict(cfg),
        total_steps=plan.total_steps,
        resume_step=plan.resume_step,  # the jsonl log drops lines from steps the resumed run will redo
    )
    try:
        with tracking:
            val_metrics = trainer.fit(tracking)
        summary: dict[str, Any] = {"steps": trainer.global_step, "run_dir": run_dir, **val_metrics}
        summary.update({f"{k}@start": v for k, v in trainer.initial_val_metrics.items() if k.endswith("/acc")})
        if trainer.preempted:  # the run goes on later from its checkpoint: no final export yet
            summary["preempted"] = {**trainer.preempted, "checkpoint": trainer.checkpoints.latest()}
        elif cfg.trainer.save_hf_at_end:
            summary["hf_checkpoint"] = trainer.save_hf(os.path.join(run_dir, "hf"))
            if cfg.trainer.save_merged and cfg.actor_rollout_ref.model.lora_rank > 0:
                summary["hf_merged"] = merged_dir(summary["hf_checkpoint"])
        if cfg.trainer.plot_at_end and "jsonl" in cfg.trainer.logger:
            from scaletrain.plot import plot_run

            summary["plots"] = [str(p) for p in plot_run(run_dir)]
    finally:
        trainer.close()
    summary["wall_s"] = round(time.monotonic() - start, 1)
    return summary
