"""Optimizer and learning-rate schedule shared by the training engines (torch AdamW + a LambdaLR).

Schedule, as a multiplier of ``OptimConfig.lr`` for optimizer step s (0-based: the s-th ``train_step``):
  - warm-up: (s + 1) / warmup_steps for s < warmup_steps, so the first step already moves the weights;
  - then ``constant``: 1, or ``cosine``: from 1 down to ``min_lr_ratio`` at ``total_steps``, flat afterwards
    (with ``total_steps`` <= 0, i.e. unknown, cosine stays at 1 after the warm-up, with a warning).
``warmup_steps`` and ``total_steps`` count optimizer steps (``train_step`` calls), not PPO iterations;
``lr_warmup_steps_ratio`` (verl's key) makes the warm-up that share of ``total_steps`` when ``warmup_steps`` is 0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from backends.config import OptimConfig

logger = logging.getLogger(__name__)

SCHEDULES = ("constant", "cosine")


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """The factor applied to the base learning rate at optimizer step ``step`` (see the module docstring)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        if total_steps <= 0:
            return 1.0
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler '{schedule}'; known: {list(SCHEDULES)}")


def warmup_steps(config: OptimConfig) -> int:
    """The warm-up in optimizer steps: ``warmup_steps``, or ``lr_warmup_steps_ratio`` x ``total_steps`` when it is 0
    (every engine's schedule reads it here)."""
    if config.warmup_steps == 0 and config.lr_warmup_steps_ratio > 0:
        if config.total_steps <= 0:
            raise ValueError("optim.lr_warmup_steps_ratio needs optim.total_steps (the trainer sets it)")
        return int(config.lr_warmup_steps_ratio * config.total_steps)
    return config.warmup_steps


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    beta1, beta2 = config.betas  # a list too (a config read from YAML)
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=config.lr,
        betas=(beta1, beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> LambdaLR:
    if config.lr_scheduler not in SCHEDULES:
        raise ValueError(f"unknown lr_scheduler '{config.lr_scheduler}'; known: {list(SCHEDULES)}")
    if config.lr_scheduler == "cosine" and config.total_steps <= 0:
        logger.warning("lr_scheduler=cosine without optim.total_steps: constant learning rate after the warm-up")
    warmup, total = warmup_steps(config), config.total_steps
    schedule, min_ratio = config.lr_scheduler, config.min_lr_ratio

    # a plain function (not a callable object), so the scheduler's state_dict holds only the step count and
    # a resumed run follows the config it was resumed with
    def multiplier(step: int) -> float:
        return lr_multiplier(step, warmup, total, schedule, min_ratio)

    return LambdaLR(optimizer, multiplier)


def set_schedule_step(scheduler: LambdaLR, step: int) -> None:
    """The schedule as after ``step`` updates (a resume that did not bring the scheduler's own state): its count and
    the optimizer's learning rates at that step."""
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler.last_epoch, scheduler._step_count, scheduler._last_lr = step, step + 1, lrs
