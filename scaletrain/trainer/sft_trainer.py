"""The SFT trainer (layer 4): supervised fine-tuning through the same worker groups and engines as PPO.

    from scaletrain.trainer.sft_trainer import run_sft
    summary = run_sft({"trainer": {"stop_at_val_acc": 0.15}})   # the embedded default's warm-up
    summary["hf_path"]                                           # the PPO trainer's starting model

Config (configs/sft_trainer.yaml): ``data`` (parquet with ``prompt`` / ``response`` string columns), ``model``,
``optim``, ``backend``, ``rollout`` (the engine that measures greedy accuracy), ``trainer``, ``ray_kwargs``. Null
``model.path`` / ``data.train_files``: the embedded default (its ``sft_train`` / ``sft_val`` / RL ``val`` files).
``load_sft_config`` (strict dataclasses), ``check_sft_config`` (checks across keys; config/sft_config.py)
and tokenization run before Ray starts.

Rows: the prompt is rendered with the tokenizer's chat template as one user message with
``add_generation_prompt=True`` and tokenized without special tokens (as RLDataset does); the response gets
``tokenizer.eos_token`` appended. Batches are in verl's layout: prompt left-padded to ``max_prompt_length``,
response right-padded to ``max_response_length``; ``input_ids`` / ``attention_mask`` / ``position_ids`` (B, P + R),
``responses`` / ``response_mask`` (B, R). Each epoch is a permutation seeded by ``derive_seed(data.seed, epoch)``;
the last partial batch is dropped.

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
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from scaletrain.controller import WorkerGroup
from scaletrain.data.sft_dataset import SFTDataset
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.plan import resolve_device
from scaletrain.trainer.config.ppo_config import files_of
from scaletrain.trainer.config.sft_config import (
    SFTConfig,
    SFTDataConfig,
    check_sft_config,
    load_sft_config,
    resolve_embedded,
)
from scaletrain.trainer.config.worker_configs import engine_config, model_config
from scaletrain.utils.seeding import derive_seed
from scaletrain.utils.typed_config import to_dict
from scaletrain.workers.config import EngineSetup
from scaletrain.workers.roles import SFTRole
from scaletrain.workers.sft import SFTWorkerConfig

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ evaluation
def greedy_scores(out: DataProto, prompts: DataProto, tokenizer: Any, eos_ids: list[int]) -> list[float]:
    """``default_compute_score`` of each generated response, told whether it ended with EOS (as reward managers do)."""
    from scaletrain.reward import default_compute_score
    from scaletrain.reward.scorers.arithmetic import ENDED_WITH_EOS_KEY

    responses, mask = out.tensors["responses"], out.tensors["response_mask"].bool()
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
        wg: WorkerGroup,
        tokenizer: Any,
        train: SFTDataset,
        val: SFTDataset | None,
        val_prompts: DataProto | None,
    ):
        from backends.rollout.layout import eos_token_ids

        self.cfg, self.tokenizer, self.train = cfg, tokenizer, train
        self.model = SFTRole(wg)
        self.val_batch = val.get_batch(range(len(val))) if val is not None else None
        self.val_prompts = val_prompts
        self.eos_ids = eos_token_ids(tokenizer, cfg.model.path)
        self.total_steps = total_steps(cfg, len(train))

    def evaluate(self) -> dict[str, float]:
        start, metrics = time.perf_counter(), {}
        if self.val_batch is not None:
            out = self.model.eval_loss(self.val_batch)
            metrics["val/loss"] = out.tensors["nll_sum"].sum().item() / max(out.tensors["num_tokens"].sum().item(), 1.0)
        if self.val_prompts is not None:
            from backends.vision import vision_keys

            prompts = self.val_prompts.select(
                batch_keys=["input_ids", "attention_mask", "position_ids"],
                non_tensor_batch_keys=vision_keys(self.val_prompts.non_tensor_batch),
            )
            out = self.model.generate(prompts)
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
            epoch_rng = torch.Generator().manual_seed(derive_seed(cfg.data.seed, epoch))
            order = torch.randperm(len(self.train), generator=epoch_rng)
            for b in range(steps_per_epoch):
                if step >= self.total_steps or stopped:
                    break
                tick = time.perf_counter()
                batch = self.train.get_batch(order[b * bs : (b + 1) * bs])
                metrics = self.model.train_batch(batch)
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


def worker_config(cfg: SFTConfig, train_rows: int) -> tuple[SFTWorkerConfig, EngineSetup]:
    """The SFT worker's arguments: what it trains with, and its engine's setup."""
    engine = engine_config(cfg.backend, cfg.trainer.seed, micro_batch_size_per_gpu=cfg.data.micro_batch_size_per_gpu)
    optim = cfg.optim if cfg.optim.total_steps else replace(cfg.optim, total_steps=total_steps(cfg, train_rows))
    rollout = cfg.rollout if cfg.data.val_prompts_file else None  # no accuracy to measure: no rollout engine
    config = SFTWorkerConfig(
        optim=optim,
        rollout=rollout,
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
    )
    setup = EngineSetup(model=model_config(cfg.model, cfg.model.path), backend=cfg.backend.name, engine=engine)
    return config, setup


def _datasets(
    data: SFTDataConfig, tokenizer: Any, processor: Any
) -> tuple[SFTDataset, SFTDataset | None, DataProto | None]:
    """The training rows, the validation-loss rows and the greedy-accuracy prompts (None where not configured);
    ``processor``: a vision-language model's (rows with images), else None."""
    from scaletrain.data import RLDataset

    def sft_rows(files: Any, max_samples: int | None) -> SFTDataset:
        return SFTDataset(
            files,
            tokenizer,
            data.prompt_key,
            data.response_key,
            data.max_prompt_length,
            data.max_response_length,
            data.truncation,
            max_samples,
            processor=processor,
            image_key=data.image_key,
        )

    val = sft_rows(data.val_files, data.val_max_samples) if files_of(data.val_files) else None
    prompts = None
    if data.val_prompts_file:
        rl = RLDataset(
            data.val_prompts_file,
            tokenizer,
            data.max_prompt_length,
            max_samples=data.val_max_samples,
            processor=processor,
            image_key=data.image_key,
        )
        prompts = rl.get_batch(range(len(rl)))
    return sft_rows(data.train_files, data.max_samples), val, prompts


def run_sft(config: SFTConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Validate, tokenize, train on a new SFTWorker group, save the HF checkpoint; returns a summary dict:
    ``step`` (last step), ``stopped_early``, ``val_acc``, ``val_loss``, ``wall_s`` and ``hf_path`` (None when
    ``trainer.save_hf_at_end`` is off), ``run_dir``. Ray as ``ray_kwargs`` says (scaletrain/trainer/run/ray_cluster.py:
    this process's connection if it has one); the workers and their placement group are freed before returning."""
    from transformers import AutoTokenizer

    from scaletrain.models.processor import load_processor
    from scaletrain.trainer.run.ray_cluster import ray_cluster

    cfg = config if isinstance(config, SFTConfig) else load_sft_config(config)
    cfg = check_sft_config(resolve_embedded(cfg))
    path = cfg.model.path
    assert path is not None  # check_sft_config refuses a missing model path
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    processor = load_processor(path, trust_remote_code=cfg.model.trust_remote_code)
    train, val, prompts = _datasets(cfg.data, tokenizer, processor)

    with ray_cluster(cfg.ray_kwargs, cfg.world_size, cfg.trainer.device):
        summary = _train_on_workers(cfg, tokenizer, train, val, prompts)
    summary["run_dir"] = os.path.abspath(cfg.output_dir)
    logger.info("SFT done: %s", summary)
    return summary


def _train_on_workers(cfg: SFTConfig, tokenizer, train, val, prompts) -> dict[str, Any]:
    """The SFTWorker group's run, on the Ray cluster of the caller; the group and its pool freed at the end."""
    from scaletrain.controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from scaletrain.trainer.run.tracking import Tracking
    from scaletrain.workers.sft import SFTWorker

    use_gpu = resolve_device(cfg.trainer.device) == "cuda"
    pool = RayResourcePool([cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes, use_gpu=use_gpu, name_prefix="sft")
    wg = None
    try:
        wg = RayWorkerGroup(
            pool,
            RayClassWithInitArgs(SFTWorker, *worker_config(cfg, len(train))),
            name_prefix="sft",
            call_timeout_s=cfg.trainer.worker_call_timeout_s,
            stack_dump_dir=os.path.join(cfg.output_dir, "stacks"),
        )
        SFTRole(wg).init_model()  # the typed role's call of the group method (as SFTTrainer's)
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
            SFTRole(wg).save_hf(summary["hf_path"])
        return summary
    finally:
        if wg is not None:
            wg.shutdown()
        pool.release()
