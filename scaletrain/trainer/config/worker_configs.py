"""The trainer config -> the role workers' settings (layer 4 -> layer 2), shared by the PPO and SFT trainers.

``model_config`` and ``engine_config`` turn a model section and the backend section into the engines' own
settings (``backends.config``); ``ppo_worker_configs`` builds the actor/rollout/ref, critic and reward-model
workers' configs of a resolved PPO config and its plan (scaletrain/trainer/config/plan.py). A new model or engine key
is read here once, for every trainer.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, cast

from backends.config import EngineConfig, LoraSettings, ModelConfig
from scaletrain.utils.typed_config import resolved

if TYPE_CHECKING:
    from scaletrain.trainer.config.plan import RunPlan
    from scaletrain.trainer.config.ppo_config import BackendConfig, HFModelConfig, PPOConfig
    from scaletrain.workers.config import ActorRolloutRefConfig, CriticConfig, RewardModelConfig


def model_config(section: HFModelConfig, path: str | None, kind: str = "causal_lm") -> ModelConfig:
    """The engines' ModelConfig of a model section (``path`` given apart: a role may fall back to another's); a
    section with LoRA keys (``LoraSettings``: the actor's and the critic's) passes them on."""
    lora = {f.name: getattr(section, f.name) for f in fields(LoraSettings)} if isinstance(section, LoraSettings) else {}
    return ModelConfig(
        **lora,
        path=cast(str, path),  # None only before the embedded default model's path is filled in
        kind=kind,
        dtype=section.dtype,
        gradient_checkpointing=section.enable_gradient_checkpointing,
        use_remove_padding=section.use_remove_padding,
        trust_remote_code=section.trust_remote_code,
        attn_implementation=section.attn_implementation,
    )


def engine_config(backend: BackendConfig, seed: int, **settings) -> EngineConfig:
    """The engines' EngineConfig of the backend section; ``settings``: other EngineConfig fields."""
    return EngineConfig(
        mixed_precision=backend.mixed_precision,
        param_offload=backend.param_offload,
        optimizer_offload=backend.optimizer_offload,
        seed=seed,
        extra=dict(backend.extra),
        **settings,
    )


def ppo_worker_configs(
    cfg: PPOConfig, plan: RunPlan
) -> tuple[ActorRolloutRefConfig, CriticConfig | None, RewardModelConfig | None]:
    """The actor/rollout/ref, critic (None without one) and reward-model (None when disabled) worker configs."""
    from scaletrain.workers.config import ActorRolloutRefConfig

    arr = cfg.actor_rollout_ref
    engine = engine_config(cfg.backend, cfg.trainer.seed, collective_timeout_s=cfg.trainer.collective_timeout_s)
    actor = replace(arr.actor, optim=replace(arr.actor.optim, total_steps=plan.actor_optim_steps))
    actor_cfg = ActorRolloutRefConfig(
        model=model_config(arr.model, arr.model.path),
        backend=cfg.backend.name,
        actor=actor,
        rollout=arr.rollout,
        ref=arr.ref,
        engine=engine,
    )
    critic_cfg = _critic_config(cfg, plan, engine) if plan.use_critic else None
    return actor_cfg, critic_cfg, _reward_model_config(cfg, engine)


def _critic_config(cfg: PPOConfig, plan: RunPlan, engine: EngineConfig) -> CriticConfig:
    from scaletrain.workers.config import CriticConfig

    c, arr = cfg.critic, cfg.actor_rollout_ref
    return CriticConfig(
        model=model_config(c.model, c.model.path or arr.model.path, kind="value"),  # null: the actor's model
        backend=cfg.backend.name,
        ppo_mini_batch_size=resolved(c.ppo_mini_batch_size, "critic.ppo_mini_batch_size"),
        ppo_micro_batch_size_per_gpu=c.ppo_micro_batch_size_per_gpu,
        ppo_epochs=resolved(c.ppo_epochs, "critic.ppo_epochs"),
        use_dynamic_bsz=c.use_dynamic_bsz,
        ppo_max_token_len_per_gpu=c.ppo_max_token_len_per_gpu,
        cliprange_value=c.cliprange_value,
        loss_agg_mode=c.loss_agg_mode,
        rollout_n=arr.rollout.n,
        optim=replace(c.optim, total_steps=plan.critic_optim_steps),
        engine=c.model.fsdp_config.applied(engine),
        megatron=c.megatron,
    )


def _reward_model_config(cfg: PPOConfig, engine: EngineConfig) -> RewardModelConfig | None:
    """``reward_model.*`` as the RM worker's config; None when the reward model is off."""
    from scaletrain.workers.config import RewardModelConfig

    rm = cfg.reward_model
    if not rm.enable:
        return None
    return RewardModelConfig(
        model=model_config(rm.model, rm.model.path, kind="reward"),
        backend=cfg.backend.name,
        micro_batch_size_per_gpu=rm.micro_batch_size_per_gpu,
        use_dynamic_bsz=rm.use_dynamic_bsz,
        forward_max_token_len_per_gpu=rm.forward_max_token_len_per_gpu,
        input_tokenizer=rm.model.input_tokenizer,
        max_length=rm.max_length,
        engine=rm.model.fsdp_config.applied(engine),
    )
