"""Derived values of a PPO run, computed once (layer 4).

Two pure steps, both before any worker starts:

- ``resolve_config(cfg)`` fills the config's null fallbacks (the device, the experiment name and run directory,
  the rollout's lengths from ``data.*``, the LoRA weight-sync mode, the log-prob passes' dynamic batching from the
  actor's, the critic's mini-batch and epochs from the actor's, the megatron layout shared by the colocated roles)
  into a new config;
  ``config_checks.check_config`` then checks that config, once.
- ``plan_run(cfg, train_rows, checkpoints)`` computes what the config does not hold (training steps, optimizer
  steps per role, the roles in play, the checkpoint a run resumes from) into a frozen ``RunPlan``, which
  ``log_plan`` writes to the log at start.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from scaletrain.trainer.config.lora_checks import lora_sync_fallback, reference_source
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.utils.typed_config import resolved
from scaletrain.workers.rm_config import serves_judge

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` where torch sees a GPU, else ``cpu``; other values unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_config(cfg: PPOConfig) -> PPOConfig:
    """A copy of ``cfg`` with every null fallback filled; ``cfg`` is left as it was."""
    arr, actor, data, tr = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.data, cfg.trainer
    experiment = tr.experiment_name or f"{cfg.algorithm.adv_estimator}_{cfg.backend.name}"
    trainer = replace(
        tr,
        device=resolve_device(tr.device),
        experiment_name=experiment,
        default_local_dir=tr.default_local_dir or os.path.join("checkpoints", tr.project_name, experiment),
    )

    def log_prob_pass(section):  # verl's defaults: the log-prob passes batch as the actor does
        return replace(
            section,
            log_prob_use_dynamic_bsz=_first(section.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz),
            log_prob_max_token_len_per_gpu=_first(
                section.log_prob_max_token_len_per_gpu, actor.ppo_max_token_len_per_gpu
            ),
        )

    rollout = log_prob_pass(
        replace(
            arr.rollout,
            prompt_length=_first(arr.rollout.prompt_length, data.max_prompt_length),
            response_length=_first(arr.rollout.response_length, data.max_response_length),
            lora_sync=lora_sync_fallback(cfg),
        )
    )
    critic = replace(
        cfg.critic,
        ppo_mini_batch_size=_first(cfg.critic.ppo_mini_batch_size, actor.ppo_mini_batch_size),
        ppo_epochs=_first(cfg.critic.ppo_epochs, actor.ppo_epochs),
    )
    backend = cfg.backend
    if backend.name == "megatron":  # the colocated roles share one layout: the actor's over backend.extra
        backend = replace(backend, extra={**backend.extra, "megatron": actor.megatron.merged(backend.extra)})
    if cfg.async_training.mode == "fully_async" and data.train_batch_size == 0:  # verl's fully-async scripts
        data = replace(data, train_batch_size=actor.ppo_mini_batch_size)  # a step: one mini-batch of groups
    return replace(
        cfg,
        data=data,
        actor_rollout_ref=replace(arr, rollout=rollout, ref=log_prob_pass(arr.ref)),
        critic=critic,
        backend=backend,
        trainer=trainer,
    )


def _first(value, fallback):
    return fallback if value is None else value


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, derived once from the resolved config, the training set and the run directory."""

    world_size: int
    steps_per_epoch: int
    total_steps: int  # trainer steps (one batch of prompts each)
    actor_optim_steps: int  # optimizer steps of the actor over the run (the LR schedule's length)
    critic_optim_steps: int  # 0 without a critic
    use_critic: bool
    use_ref: bool  # a reference policy (KL loss or KL in reward)
    run_dir: str
    resume_path: str | None  # the checkpoint this run continues from (trainer.resume_mode)
    resume_step: int | None  # the first step the resumed run trains; None when starting fresh
    rollout_world_size: int = 0  # split placement: the rollout pool's ranks (0: colocated)
    rollout_batches: int = 0  # batches the rollout engines generate for training in all (the fully_async bound)
    generative_judge: bool = False  # the reward model is a generative judge on engines of the run's own


def plan_run(cfg: PPOConfig, train_rows: int, latest_checkpoint: str | None) -> RunPlan:
    """``cfg`` must be resolved; ``latest_checkpoint`` is the newest checkpoint in the run directory, if any."""
    data, actor, critic, tr = cfg.data, cfg.actor_rollout_ref.actor, cfg.critic, cfg.trainer
    steps_per_epoch = train_rows // data.train_batch_size
    total = tr.total_training_steps or steps_per_epoch * tr.total_epochs
    rollout_batches = total
    if cfg.async_training.mode == "fully_async" and cfg.actor_rollout_ref.rollout.total_rollout_steps:
        rollout_batches = cfg.actor_rollout_ref.rollout.total_rollout_steps // data.train_batch_size
        total = min(total, rollout_batches) if tr.total_training_steps else rollout_batches
    rc = cfg.actor_rollout_ref.rollout
    resume = (
        None
        if tr.resume_mode == "disable"
        else tr.resume_from_path
        if tr.resume_mode == "resume_path"
        else latest_checkpoint
    )
    resume_step = None
    if resume is not None:  # global_step_<N>: step N is done, the run continues at N + 1
        resume_step = int(os.path.basename(os.path.normpath(resume)).rsplit("_", 1)[1]) + 1
    critic_optim_steps = 0
    if cfg.use_critic:
        mini_batch = resolved(critic.ppo_mini_batch_size, "critic.ppo_mini_batch_size")
        epochs = resolved(critic.ppo_epochs, "critic.ppo_epochs")
        critic_optim_steps = total * (data.train_batch_size // mini_batch) * epochs
    return RunPlan(
        world_size=cfg.world_size,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        actor_optim_steps=total * (data.train_batch_size // actor.ppo_mini_batch_size) * actor.ppo_epochs,
        critic_optim_steps=critic_optim_steps,
        use_critic=cfg.use_critic,
        use_ref=actor.use_kl_loss or cfg.algorithm.use_kl_in_reward,
        run_dir=os.path.abspath(resolved(tr.default_local_dir, "trainer.default_local_dir")),
        resume_path=resume,
        resume_step=resume_step,
        rollout_world_size=0 if cfg.actor_rollout_ref.hybrid_engine else rc.nnodes * rc.n_gpus_per_node,
        rollout_batches=rollout_batches,
        generative_judge=serves_judge(cfg.reward_model),
    )


def log_plan(cfg: PPOConfig, plan: RunPlan) -> None:
    arr = cfg.actor_rollout_ref
    logger.info(
        "plan: %d steps (%d per epoch) of %d prompts x %d samples on %d %s ranks, backend %s, rollout %s; "
        "optimizer steps actor %d critic %d; ref %s; run dir %s; %s",
        plan.total_steps,
        plan.steps_per_epoch,
        cfg.data.train_batch_size,
        arr.rollout.n,
        plan.world_size,
        cfg.trainer.device,
        cfg.backend.name,
        arr.rollout.name
        + (f" on its own {plan.rollout_world_size} ranks" if plan.rollout_world_size else " colocated")
        + f", {cfg.async_training.mode}",
        plan.actor_optim_steps,
        plan.critic_optim_steps,
        f"on: {reference_source(cfg)}" if plan.use_ref else "off",
        plan.run_dir,
        f"resuming from {plan.resume_path} at step {plan.resume_step}" if plan.resume_path else "starting fresh",
    )
