"""The trainer config -> the role workers' settings (layer 4 -> layer 2), shared by the PPO and SFT trainers.

``model_config`` and ``engine_config`` turn a model section and the backend section into the engines' own
settings (``backends.config``); ``ppo_worker_configs`` builds the actor/rollout/ref, critic and reward-model
workers' configs of a resolved PPO config and its plan (scaletrain/trainer/config/plan.py). A new model or engine key
is read here once, for every trainer.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING

from backends.config import BackendSettings, EngineConfig, LoraSettings, ModelConfig, ModelSettings
from scaletrain.algos.advantage import estimator_traits

if TYPE_CHECKING:
    from scaletrain.trainer.config.plan import RunPlan
    from scaletrain.trainer.config.ppo_config import PPOConfig
    from scaletrain.workers.config import ActorRolloutRefConfig, CriticConfig, EngineSetup
    from scaletrain.workers.rm_config import RewardModelConfig


def model_config(section: ModelSettings, path: str | None, kind: str = "causal_lm") -> ModelConfig:
    """The engines' ModelConfig of a model section: its keys (``ModelSettings``; the LoRA keys too where the section
    has them: the actor's and the critic's), ``path`` given apart (a role may fall back to another's)."""
    keys = [f.name for f in fields(ModelSettings)]
    if isinstance(section, LoraSettings):
        keys += [f.name for f in fields(LoraSettings)]
    return ModelConfig(**{**{name: getattr(section, name) for name in keys}, "path": path, "kind": kind})


def engine_config(backend: BackendSettings, seed: int, **settings) -> EngineConfig:
    """The engines' EngineConfig of the backend section; ``settings``: other EngineConfig fields."""
    shared = {f.name: getattr(backend, f.name) for f in fields(BackendSettings)}
    return EngineConfig(**{**shared, "extra": dict(backend.extra)}, seed=seed, **settings)


def ppo_worker_configs(
    cfg: PPOConfig, plan: RunPlan
) -> tuple[
    tuple[ActorRolloutRefConfig, EngineSetup],
    tuple[CriticConfig, EngineSetup] | None,
    tuple[RewardModelConfig, EngineSetup] | None,
]:
    """Each role worker's arguments, its section and its setup: the actor/rollout/ref's, the critic's (None without
    a critic) and the sequence-classifier reward model's (None with it off or a generative judge)."""
    from scaletrain.trainer.step.rollout_correction import bypass_policy_loss, corrects_in_the_loss
    from scaletrain.workers.config import EngineSetup

    arr = cfg.actor_rollout_ref
    engine = engine_config(cfg.backend, cfg.trainer.seed, collective_timeout_s=cfg.trainer.collective_timeout_s)
    actor = replace(arr.actor, optim=replace(arr.actor.optim, total_steps=plan.actor_optim_steps))
    if estimator_traits(cfg.algorithm.adv_estimator).needs_sum_pi_squared:
        actor = replace(actor, calculate_sum_pi_squared=True)
    rc = cfg.algorithm.rollout_correction
    if corrects_in_the_loss(rc):  # verl's bypass: the correction runs in the loss, against the current policy
        policy_loss = replace(actor.policy_loss, loss_mode="bypass_mode", rollout_correction=bypass_policy_loss(rc))
        actor = replace(actor, policy_loss=policy_loss)
    model = replace(model_config(arr.model, arr.model.path), freeze_vision_tower=actor.freeze_vision_tower)
    setup = EngineSetup(model=model, backend=cfg.backend.name, engine=engine)
    actor_cfg = (replace(arr, actor=actor), setup)
    critic_cfg = _critic_config(cfg, plan, engine) if plan.use_critic else None
    rm_cfg = None if plan.generative_judge else _reward_model_config(cfg, engine)  # a judge: judge_engines.py
    return actor_cfg, critic_cfg, rm_cfg


def _critic_config(cfg: PPOConfig, plan: RunPlan, engine: EngineConfig) -> tuple[CriticConfig, EngineSetup]:
    """The critic worker's arguments: its section (the optimizer's step count from the plan) and its setup."""
    from scaletrain.workers.config import EngineSetup
    from scaletrain.workers.model_sections import with_offload

    c, arr = cfg.critic, cfg.actor_rollout_ref
    setup = EngineSetup(
        model=model_config(c.model, c.model.path or arr.model.path, kind="value"),  # null: the actor's model
        backend=cfg.backend.name,
        engine=with_offload(engine, cfg.backend.name, c.model.fsdp_config, c.megatron),
        rollout_n=arr.rollout.n,
    )
    return replace(c, optim=replace(c.optim, total_steps=plan.critic_optim_steps)), setup


def _reward_model_config(cfg: PPOConfig, engine: EngineConfig) -> tuple[RewardModelConfig, EngineSetup] | None:
    """The reward-model worker's arguments: its section and its setup; None when the reward model is off."""
    from scaletrain.workers.config import EngineSetup
    from scaletrain.workers.model_sections import with_offload

    rm = cfg.reward_model
    if not rm.enable:
        return None
    setup = EngineSetup(
        model=model_config(rm.model, rm.model.path, kind="reward"),
        backend=cfg.backend.name,
        engine=with_offload(engine, cfg.backend.name, rm.model.fsdp_config, None),
    )
    return rm, setup
