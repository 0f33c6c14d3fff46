"""Checks of the PPO config across keys (layer 4), run once before Ray starts.

``check_config`` takes the resolved config (``scaletrain.trainer.config.plan.resolve_config``: null fallbacks filled)
and checks what types cannot: batch sizes that must divide, registered names (estimator, policy loss, backend,
rollout engine, reward manager, loggers), files and models that must exist, layouts that must fit. It raises
ConfigError naming the key and changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from backends.base import backend_traits, check_engine_settings
from backends.config import EngineConfig, ModelSettings
from backends.moe import check_router_coefficients, num_experts
from scaletrain.algos.advantage import estimator_traits
from scaletrain.models.prepare import check_causal_lm
from scaletrain.trainer.config.async_checks import rollout_world_size, validate_async_training
from scaletrain.trainer.config.lora_checks import validate_lora
from scaletrain.trainer.config.ppo_config import PPOConfig, TrainerSection, files_of
from scaletrain.trainer.config.rollout_checks import validate_rollout, validate_rollout_model
from scaletrain.trainer.config.vision_checks import validate_vision_language
from scaletrain.utils.typed_config import ConfigError
from scaletrain.workers.config import CHECKPOINT_CONTENTS, CheckpointContents
from scaletrain.workers.model_sections import with_megatron

WORKER_ROLES = ("actor_rollout", "critic", "rm", "rollout")  # the PPO trainer's worker groups (init_workers;
# rollout: the split placement's pool)


def check_config(cfg: PPOConfig) -> PPOConfig:
    """Checks across keys of a resolved config (``plan.resolve_config``); raises ConfigError naming the key.
    Changes nothing; returns ``cfg`` for chaining."""
    from scaletrain.trainer.config.role_checks import validate_roles
    from scaletrain.trainer.rollout.dynamic_sampling import validate_filter_groups
    from scaletrain.trainer.rollout.reward_checks import validate_reward_services
    from scaletrain.trainer.rollout.rm_reward import validate_reward_model
    from scaletrain.trainer.run.ray_cluster import check_ray_kwargs
    from scaletrain.trainer.step.reward_health import validate_reward_health
    from scaletrain.trainer.step.rollout_correction import validate_rollout_correction

    validate_vision_language(cfg)  # first: before the backends' checks read the model's config as a text model's
    validate_lora(cfg)  # megatron's refusal of LoRA before its packages are imported
    _validate_names(cfg)
    _validate_batch_sizes(cfg)
    _validate_algorithm(cfg)
    validate_async_training(cfg)
    split = not cfg.actor_rollout_ref.hybrid_engine
    validate_rollout(cfg.actor_rollout_ref.rollout, rollout_world_size(cfg), cfg.trainer.device, split)
    validate_roles(cfg)
    validate_rollout_correction(cfg)
    validate_filter_groups(cfg)
    _validate_engine_settings(cfg, cfg.world_size)
    _validate_router_losses(cfg)
    _validate_trainer(cfg)
    cfg.actor_rollout_ref.rollout.val_sampling()  # raises ConfigError naming a bad val_kwargs key
    _validate_paths(cfg)
    validate_reward_model(cfg)  # after _validate_engine_settings: the RM shares the resolved layout
    validate_reward_health(cfg.reward.health)
    validate_reward_services(cfg)
    _validate_reward_workers(cfg)
    check_ray_kwargs(cfg.ray_kwargs)
    return cfg


def _validate_batch_sizes(cfg: PPOConfig) -> None:
    """Prompts per step split into mini-batches, mini-batch rows over the ranks, micro-batches into those rows."""
    actor, data, trainer, n = cfg.actor_rollout_ref.actor, cfg.data, cfg.trainer, cfg.actor_rollout_ref.rollout.n
    positive = {
        "data.train_batch_size": data.train_batch_size,
        "actor_rollout_ref.rollout.n": n,
        "actor_rollout_ref.actor.ppo_mini_batch_size": actor.ppo_mini_batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": actor.ppo_micro_batch_size_per_gpu,
        "trainer.n_gpus_per_node": trainer.n_gpus_per_node,
        "trainer.nnodes": trainer.nnodes,
    }
    check_positive(positive)
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}) must "
            f"divide data.train_batch_size ({data.train_batch_size})"
        )
    world, sp = cfg.world_size, actor.ulysses_sequence_parallel_size
    dp = world // sp if isinstance(sp, int) and sp >= 1 and world % sp == 0 else world  # a Ulysses group: one share
    if (actor.ppo_mini_batch_size * n) % dp:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = "
            f"{actor.ppo_mini_batch_size * n} rows do not split over {dp} data-parallel ranks"
        )
    rows_per_rank, micro = actor.ppo_mini_batch_size * n // dp, actor.ppo_micro_batch_size_per_gpu
    if not actor.use_dynamic_bsz and micro < rows_per_rank and rows_per_rank % micro:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu ({micro}) must divide the {rows_per_rank} "
            "mini-batch rows per rank"
        )


def _validate_algorithm(cfg: PPOConfig) -> None:
    estimator, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if estimator_traits(estimator).group_based and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} compares samples of one prompt: "
            f"set actor_rollout_ref.rollout.n >= 2 (got {n})"
        )
    algo = cfg.algorithm
    if estimator == "gdpo" and not algo.gdpo_reward_keys:
        raise ConfigError(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components (keys of the dict "
            "compute_score returns) it normalises one by one"
        )
    if algo.gdpo_reward_weights is not None and len(algo.gdpo_reward_weights) != len(algo.gdpo_reward_keys):
        raise ConfigError(
            f"algorithm.gdpo_reward_weights has {len(algo.gdpo_reward_weights)} weights for "
            f"{len(algo.gdpo_reward_keys)} gdpo_reward_keys"
        )
    if estimator_traits(estimator).needs_sum_pi_squared and algo.rollout_correction.bypass_mode:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} reads the actor's sum of squared probabilities from the old-log-prob "
            "pass, which algorithm.rollout_correction.bypass_mode=true skips: turn bypass_mode off"
        )
    if cfg.actor_rollout_ref.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        raise ConfigError(
            "actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward both add a KL penalty; enable one"
        )


def _validate_trainer(cfg: PPOConfig) -> None:
    trainer = cfg.trainer
    if trainer.resume_mode not in ("auto", "disable", "resume_path"):
        raise ConfigError(f"trainer.resume_mode must be auto | disable | resume_path, got '{trainer.resume_mode}'")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    if trainer.memory_check not in ("warn", "error", "off"):
        raise ConfigError(f"trainer.memory_check must be warn | error | off, got '{trainer.memory_check}'")
    if trainer.device_memory_gib is not None and not trainer.device_memory_gib > 0:
        raise ConfigError(f"trainer.device_memory_gib must be > 0 (or null: measured), got {trainer.device_memory_gib}")
    _validate_generation_outputs(trainer)
    _validate_deadlines(cfg)
    if trainer.save_freq_minutes is not None and not trainer.save_freq_minutes > 0:
        raise ConfigError(
            f"trainer.save_freq_minutes must be > 0 (or null: checkpoints by trainer.save_freq alone), "
            f"got {trainer.save_freq_minutes}"
        )
    for key, section in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor), ("critic", cfg.critic)):
        check_checkpoint_contents(f"{key}.checkpoint", section.checkpoint)
    if trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {trainer.critic_warmup}")
    if trainer.critic_warmup and not cfg.use_critic:
        raise ConfigError(
            f"trainer.critic_warmup={trainer.critic_warmup} warms up a critic, but this run has none "
            f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator}, critic.enable={cfg.critic.enable})"
        )


def _validate_deadlines(cfg: PPOConfig) -> None:
    """Worker-call deadlines (per role) and the reward's step budget and error limits."""
    trainer, rm = cfg.trainer, cfg.reward_model
    timeouts = {
        "trainer.worker_call_timeout_s": trainer.worker_call_timeout_s,
        "reward_model.step_timeout_s": rm.step_timeout_s,
    }
    for role, value in trainer.worker_call_timeout_s_by_role.items():
        if role not in WORKER_ROLES:
            raise ConfigError(
                f"trainer.worker_call_timeout_s_by_role: unknown role '{role}'; the roles are {', '.join(WORKER_ROLES)}"
            )
        timeouts[f"trainer.worker_call_timeout_s_by_role.{role}"] = value
    for key, value in timeouts.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{key} must be > 0 seconds (or null: no deadline), got {value}")
    if not 0.0 <= rm.max_error_rate <= 1.0:
        raise ConfigError(f"reward_model.max_error_rate must be in [0, 1], got {rm.max_error_rate}")
    if rm.max_error_steps < 1:
        raise ConfigError(f"reward_model.max_error_steps must be >= 1, got {rm.max_error_steps}")


def _validate_names(cfg: PPOConfig) -> None:
    """Every configured name (estimator, loss, backend, rollout, reward manager, aggregation, loggers) is registered;
    the backend's packages import."""
    from backends.base import BACKENDS
    from backends.rollout.base import ROLLOUTS
    from scaletrain.algos import ADV_ESTIMATORS, ENGINE_AGG_MODES, POLICY_LOSSES
    from scaletrain.reward.managers.reward_loop import reward_manager_class
    from scaletrain.trainer.run.tracking import LOGGERS

    arr = cfg.actor_rollout_ref
    names = [
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADV_ESTIMATORS),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", arr.actor.policy_loss.loss_mode, POLICY_LOSSES),
        ("backend.name", cfg.backend.name, BACKENDS),
        ("actor_rollout_ref.rollout.name", arr.rollout.name, ROLLOUTS),
    ]
    check_registered(names + [("trainer.logger", name, LOGGERS) for name in cfg.trainer.logger])
    try:
        reward_manager_class(cfg.reward_model.reward_manager)  # a batch manager's name, or a reward-loop manager's
    except ValueError as exc:
        raise ConfigError(f"reward_model.reward_manager: {exc}") from None
    try:
        BACKENDS.get(cfg.backend.name)  # imports a lazily registered backend: a missing package fails here
    except ImportError as exc:
        raise ConfigError(f"backend.name: {exc}") from exc
    for key, mode in (
        ("actor_rollout_ref.actor.loss_agg_mode", arr.actor.loss_agg_mode),
        ("critic.loss_agg_mode", cfg.critic.loss_agg_mode),
    ):
        if mode not in ENGINE_AGG_MODES:  # token-sum: a sum the engines' micro-batch weighting would average
            raise ConfigError(f"{key}: unsupported mode '{mode}'; one of {', '.join(ENGINE_AGG_MODES)}")


def check_checkpoint_contents(key: str, contents: CheckpointContents) -> None:
    """verl's save_contents / load_contents: known entries; the model, optimizer and extra state always in (a
    checkpoint without them would not resume: not supported)."""
    loads = contents.save_contents if contents.load_contents is None else contents.load_contents
    for name, entries in (("save_contents", contents.save_contents), ("load_contents", loads)):
        unknown = [e for e in entries if e not in (*CHECKPOINT_CONTENTS, "hf_model")]
        if unknown:
            raise ConfigError(f"{key}.{name}: unknown {unknown}; known: {[*CHECKPOINT_CONTENTS, 'hf_model']}")
        missing = [e for e in CHECKPOINT_CONTENTS if e not in entries]
        if missing:
            raise ConfigError(
                f"{key}.{name} leaves out {missing}: every checkpoint saves and loads the model, the optimizer and "
                "the extra state (a partial checkpoint is not supported); hf_model may be added"
            )


def check_positive(values: Mapping[str, float]) -> None:
    """Each dotted key's value is > 0."""
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")


def check_registered(entries) -> None:
    """Each (key, name, registry) names a registered entry; ConfigError naming the key and the choices if not."""
    for key, name, registry in entries:
        if name not in registry:
            raise ConfigError(f"{key}: unknown {registry.kind} '{name}'; registered: {', '.join(registry.names())}")


def _validate_paths(cfg: PPOConfig) -> None:
    """Data files, model directories and the reward function exist; the actor's model is a causal LM."""
    for key in ("data.train_files", "data.val_files"):
        for path in files_of(getattr(cfg.data, key.split(".")[1])):
            if not os.path.exists(path):
                raise ConfigError(f"{key}: file not found: {path}")
    model_path = cfg.actor_rollout_ref.model.path
    for key, path in (
        ("actor_rollout_ref.model.path", model_path),
        ("critic.model.path", cfg.critic.model.path),
        ("custom_reward_function.path", cfg.custom_reward_function.path),
    ):
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"{key}: not found: {path}")
    if model_path is not None:
        try:
            check_causal_lm(model_path, "actor_rollout_ref.model.path")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        validate_rollout_model(cfg.actor_rollout_ref.rollout, model_path, device=cfg.trainer.device)


def _validate_generation_outputs(trainer: TrainerSection) -> None:
    """``trainer.log_val_generations`` >= 0; the dump directories can be created (nothing is created here)."""
    if trainer.log_val_generations < 0:
        raise ConfigError(f"trainer.log_val_generations must be >= 0, got {trainer.log_val_generations}")
    for key in ("rollout_data_dir", "validation_data_dir"):
        path = getattr(trainer, key)
        if path is None:
            continue
        existing = os.path.abspath(path)
        while not os.path.exists(existing):  # the nearest existing ancestor decides
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ConfigError(f"trainer.{key}: {existing} is not a directory, so {path} cannot be one")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"trainer.{key}: {path} cannot be written ({existing} is not writable)")


def _validate_engine_settings(cfg: PPOConfig, world: int) -> None:
    """The backend's own check (``check_engine_settings``, exposed by its registry entry) of the actor's (and ref's)
    and the critic's engine settings on the world and the model, when on disk (megatron: the layout).

    The roles are colocated in one process per device, so a backend's per-process state (megatron's parallel
    state) is shared: ``resolve_config`` put the actor's layout in ``backend.extra``; the critic's set keys must agree
    with what the check resolved for the actor."""
    if backend_traits(cfg.backend.name).check is None:
        return
    arr = cfg.actor_rollout_ref
    sections = [("actor_rollout_ref.actor.megatron", arr.actor.megatron, arr.model.path)]
    if cfg.use_critic:
        sections.append(("critic.megatron", cfg.critic.megatron, cfg.critic.model.path or arr.model.path))
    resolved = []
    for key, section, path in sections:
        hf_config = None
        if path and os.path.isfile(os.path.join(path, "config.json")):
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=arr.model.trust_remote_code)
        extra = with_megatron(EngineConfig(extra=cfg.backend.extra), cfg.backend.name, section).extra
        try:
            resolved.append((key, check_engine_settings(cfg.backend.name, extra, world, hf_config)))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{key}: {exc} (trainer.n_gpus_per_node x trainer.nnodes = {world} ranks)") from exc
    for key, settings in resolved[1:]:
        if settings != resolved[0][1]:
            raise ConfigError(
                f"{key} ({settings}) differs from {resolved[0][0]} ({resolved[0][1]}): the roles share "
                f"one process per device and the {cfg.backend.name} backend's parallel state, so they need the same "
                "layout"
            )


def _validate_router_losses(cfg: PPOConfig) -> None:
    """The trained models' router-loss coefficients (backends/moe.py; megatron's own: backends/megatron/model.py):
    >= 0, and non-zero only on a mixture-of-experts model (read from its config.json when on disk)."""
    arr = cfg.actor_rollout_ref
    sections: list[tuple[str, ModelSettings, str | None]] = [("actor_rollout_ref.model", arr.model, arr.model.path)]
    if cfg.use_critic:
        sections.append(("critic.model", cfg.critic.model, cfg.critic.model.path or arr.model.path))
    for key, section, path in sections:
        try:
            check_router_coefficients(section.router_aux_loss_coef, section.router_z_loss_coef, key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(section, name)
            if not value:
                continue
            if path and os.path.isfile(os.path.join(path, "config.json")) and not num_experts(_hf_config(path, arr)):
                raise ConfigError(f"{key}.{name}={value} but {path} is not a mixture-of-experts model: set it to 0")


def _hf_config(path: str, arr):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=arr.model.trust_remote_code)


def _validate_reward_workers(cfg: PPOConfig) -> None:
    """``reward.num_workers``: not negative; above 0, a reward manager that scores each sample on its own (a batch
    is split among the workers, a streamed trajectory scored alone: rollout/reward_loop.py)."""
    from scaletrain.reward import BatchRewardManager, RewardManager
    from scaletrain.reward.managers.reward_loop import RewardManagerBase, reward_manager_class

    workers = cfg.reward.num_workers
    if workers < 0:
        raise ConfigError(f"reward.num_workers must be >= 0 (0: the driver scores), got {workers}")
    manager = reward_manager_class(cfg.reward_model.reward_manager)
    per_sample = issubclass(manager, (RewardManager, RewardManagerBase)) and not issubclass(manager, BatchRewardManager)
    if workers and not per_sample:
        raise ConfigError(
            f"reward.num_workers={workers} splits each batch among reward workers, and reward_model.reward_manager="
            f"{cfg.reward_model.reward_manager} scores a whole batch at once: set reward.num_workers=0"
        )
