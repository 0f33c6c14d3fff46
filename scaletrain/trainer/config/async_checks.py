"""Checks of split placement and ``async_training`` before Ray starts (layer 4); ConfigError names the key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain.utils.typed_config import ConfigError

if TYPE_CHECKING:
    from scaletrain.trainer.config.ppo_config import PPOConfig

MODES = ("sync", "one_step_off", "fully_async")
KEY = "async_training"


def rollout_world_size(cfg: PPOConfig) -> int:
    """The ranks the rollout engines shard over: the training ranks (colocated) or the rollout pool's."""
    rc = cfg.actor_rollout_ref.rollout
    return cfg.world_size if cfg.actor_rollout_ref.hybrid_engine else rc.nnodes * rc.n_gpus_per_node


def validate_async_training(cfg: PPOConfig) -> None:
    at, arr = cfg.async_training, cfg.actor_rollout_ref
    rc = arr.rollout
    if at.mode not in MODES:
        raise ConfigError(f"{KEY}.mode must be one of {', '.join(MODES)}, got '{at.mode}'")
    if not arr.hybrid_engine:
        for name in ("nnodes", "n_gpus_per_node"):
            if getattr(rc, name) <= 0:
                raise ConfigError(f"actor_rollout_ref.rollout.{name} must be positive with hybrid_engine=false")
    if at.mode != "sync" and arr.hybrid_engine:
        raise ConfigError(
            f"{KEY}.mode={at.mode} overlaps rollout with training on separate ranks: set "
            "actor_rollout_ref.hybrid_engine=false and size the rollout pool with actor_rollout_ref.rollout.nnodes "
            "/ n_gpus_per_node"
        )
    fully = at.mode == "fully_async"
    only_fully = {
        "staleness_threshold": at.staleness_threshold != 0.0,
        "trigger_parameter_sync_step": at.trigger_parameter_sync_step != 1,
        "partial_rollout": at.partial_rollout,
    }
    for name, changed in only_fully.items():
        if changed and not fully:
            raise ConfigError(f"{KEY}.{name} applies to {KEY}.mode=fully_async only (mode is {at.mode})")
    if rc.total_rollout_steps is not None and not fully:
        raise ConfigError(f"actor_rollout_ref.rollout.total_rollout_steps applies to {KEY}.mode=fully_async only")
    if at.staleness_threshold < 0:
        raise ConfigError(f"{KEY}.staleness_threshold must be >= 0, got {at.staleness_threshold}")
    if at.trigger_parameter_sync_step < 1:
        raise ConfigError(f"{KEY}.trigger_parameter_sync_step must be >= 1, got {at.trigger_parameter_sync_step}")
    if at.partial_rollout_segment_tokens is not None and at.partial_rollout_segment_tokens <= 0:
        raise ConfigError(f"{KEY}.partial_rollout_segment_tokens must be positive or null")
    if at.mode != "sync":
        _validate_async_mode(cfg)


def _validate_async_mode(cfg: PPOConfig) -> None:
    at, rc = cfg.async_training, cfg.actor_rollout_ref.rollout
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(
            f"algorithm.filter_groups.enable (dynamic sampling) is supported with {KEY}.mode=sync only: its extra "
            "generation batches would race the background rollout"
        )
    if at.mode == "fully_async":
        mini, batch = cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.data.train_batch_size
        if batch != mini:
            raise ConfigError(
                f"{KEY}.mode=fully_async trains one mini-batch of groups a step: set data.train_batch_size to "
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini}) or 0, got {batch}"
            )
        if rc.total_rollout_steps is not None and rc.total_rollout_steps < batch:
            raise ConfigError(
                f"actor_rollout_ref.rollout.total_rollout_steps ({rc.total_rollout_steps}) is fewer prompts than "
                f"one step's batch ({batch})"
            )
    if at.partial_rollout and not rc.use_agent_loop:
        raise ConfigError(
            f"{KEY}.partial_rollout resumes generations token by token through the agent loops: set "
            "actor_rollout_ref.rollout.mode=async"
        )
