"""Checks of the roles' keys before Ray starts (layer 4): verl's ``strategy`` against the backend, the offload keys
each backend honours, the reference policy's layout, the raw chat the agent loops need, and what the trainer would
otherwise only build after Ray starts (critic optimizer, reward-manager arguments). Each raises ConfigError naming
the key and what to use instead."""

from __future__ import annotations

import logging
from dataclasses import fields

from backends.base import BACKEND_TRAITS, backend_traits
from backends.config import ModelSettings
from scaletrain.utils.typed_config import ConfigError
from scaletrain.workers.model_sections import LAYOUT_KEYS, OFFLOAD_KEYS

logger = logging.getLogger(__name__)

# verl's actor_rollout_ref.actor.strategy / critic.strategy -> this project's backend
STRATEGIES = {"fsdp": "fsdp", "fsdp2": "fsdp", "deepspeed": "deepspeed", "megatron": "megatron"}


def backend_of_strategy(strategy: str, key: str) -> str:
    if strategy not in STRATEGIES:
        raise ConfigError(f"{key}: unknown strategy '{strategy}'; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy]


def validate_roles(cfg) -> None:
    _validate_strategies(cfg)
    _validate_prebuilt(cfg)
    _validate_offload(cfg)
    _validate_ref_layout(cfg)
    _validate_sequence_parallel(cfg)
    _note_unpacked(cfg)
    if not cfg.data.return_raw_chat and cfg.actor_rollout_ref.rollout.use_agent_loop:
        raise ConfigError(
            "data.return_raw_chat=false: the agent loops (rollout.mode=async / multi_turn.enable) "
            "start from the rows' chat messages; set it true"
        )


def _note_unpacked(cfg) -> None:
    """``use_remove_padding=true`` on a backend that does not pack (megatron): the run goes on padded, said once at
    start rather than refused, since verl's megatron scripts set the key."""
    if backend_traits(cfg.backend.name).packs:
        return
    sections = {
        "actor_rollout_ref.model": cfg.actor_rollout_ref.model,
        "critic.model": cfg.critic.model,
        "reward_model.model": cfg.reward_model.model,
    }
    for key in [k for k, model in sections.items() if model.use_remove_padding]:
        logger.warning(
            "%s.use_remove_padding=true: the %s backend runs padded micro-batches, it does not pack (megatron-core's "
            "packed attention needs Transformer Engine on CUDA)",
            key,
            cfg.backend.name,
        )


def _validate_prebuilt(cfg) -> None:
    """What the trainer builds after Ray starts, checked now: the optimizers' schedules, the reward manager's
    keyword arguments."""
    from backends.optim import SCHEDULES
    from scaletrain.reward.build import unknown_manager_kwargs

    for key, optim in (
        ("critic.optim", cfg.critic.optim),
        ("actor_rollout_ref.actor.optim", cfg.actor_rollout_ref.actor.optim),
    ):
        if optim.lr_scheduler not in SCHEDULES:
            raise ConfigError(f"{key}.lr_scheduler: unknown '{optim.lr_scheduler}'; known: {', '.join(SCHEDULES)}")
        if not 0.0 <= optim.lr_warmup_steps_ratio <= 1.0:
            raise ConfigError(f"{key}.lr_warmup_steps_ratio must be in [0, 1], got {optim.lr_warmup_steps_ratio}")
    rm = cfg.reward_model
    unknown = unknown_manager_kwargs(rm.reward_manager, rm.reward_kwargs)
    if unknown:
        raise ConfigError(
            f"reward_model.reward_kwargs: {unknown} are not arguments of reward manager '{rm.reward_manager}'"
        )


def _validate_strategies(cfg) -> None:
    backend = cfg.backend.name
    for key, strategy in (
        ("actor_rollout_ref.actor.strategy", cfg.actor_rollout_ref.actor.strategy),
        ("critic.strategy", cfg.critic.strategy),
    ):
        if strategy is not None and backend_of_strategy(strategy, key) != backend:
            raise ConfigError(
                f"{key}={strategy} selects backend {STRATEGIES[strategy]}, but backend.name is "
                f"{backend} (backend={backend}): the roles share one backend, set one of the two"
            )


def _fsdp_offload_keys(cfg) -> list[tuple[str, str, bool]]:
    """(role prefix, key, value) of each fsdp_config offload key (backends fsdp and deepspeed)."""
    arr = cfg.actor_rollout_ref
    sections = {
        "actor_rollout_ref.actor": arr.actor.fsdp_config,
        "actor_rollout_ref.ref": arr.ref.fsdp_config,
        "critic.model": cfg.critic.model.fsdp_config,
        "reward_model.model": cfg.reward_model.model.fsdp_config,
    }
    return [
        (prefix, f"{prefix}.fsdp_config.{f.name}", getattr(section, f.name))
        for prefix, section in sections.items()
        for f in fields(section)
    ]


def _megatron_offload_keys(cfg) -> list[tuple[str, str, bool]]:
    """(role prefix, key, value) of each megatron offload key (backend megatron)."""
    arr = cfg.actor_rollout_ref
    sections = {"actor_rollout_ref.actor": arr.actor, "actor_rollout_ref.ref": arr.ref, "critic": cfg.critic}
    return [
        (prefix, f"{prefix}.megatron.{name}", getattr(section.megatron, name))
        for prefix, section in sections.items()
        for name in OFFLOAD_KEYS
    ]


def _validate_offload(cfg) -> None:
    """Each backend reads its own offload keys: a set-true key of another backend would be silently dropped."""
    backend = cfg.backend.name
    if not backend_traits(backend).offload:
        shared = [
            (None, f"backend.{name}", getattr(cfg.backend, name)) for name in ("param_offload", "optimizer_offload")
        ]
        for _, key, value in _fsdp_offload_keys(cfg) + _megatron_offload_keys(cfg) + shared:
            if value:
                offloading = ", ".join(name for name, traits in BACKEND_TRAITS.items() if traits.offload)
                raise ConfigError(f"{key}=true: the {backend} backend does not offload ({offloading} do); set it false")
    elif backend == "megatron":
        for prefix, key, value in _fsdp_offload_keys(cfg):
            if value:
                name = key.rsplit(".", 1)[1]
                where = "backend" if prefix == "reward_model.model" else f"{prefix.removesuffix('.model')}.megatron"
                raise ConfigError(
                    f"{key}=true: fsdp_config applies to backend=fsdp|deepspeed; on megatron set {where}.{name}"
                )
    else:
        for prefix, key, value in _megatron_offload_keys(cfg):
            if value:
                name = key.rsplit(".", 1)[1]
                if name == "grad_offload":
                    raise ConfigError(f"{key}=true applies to backend=megatron; {backend} has no gradient offload")
                fsdp_prefix = "critic.model" if prefix == "critic" else prefix
                raise ConfigError(
                    f"{key}=true applies to backend=megatron; on {backend} set {fsdp_prefix}.fsdp_config.{name}"
                )


def _validate_ref_layout(cfg) -> None:
    """The reference policy shares the actor's process and megatron's per-process parallel state."""
    try:
        actor = cfg.actor_rollout_ref.actor.megatron.resolved(cfg.backend.extra)
    except ValueError as exc:  # the layout's own checks name the key
        raise ConfigError(f"actor_rollout_ref.actor.megatron: {exc}") from exc
    ref = cfg.actor_rollout_ref.ref.megatron
    for name in LAYOUT_KEYS:
        mine, theirs = getattr(ref, name), getattr(actor, name)
        if mine is not None and mine != theirs:
            raise ConfigError(
                f"actor_rollout_ref.ref.megatron.{name}={mine} differs from the actor's ({theirs}): "
                f"the reference policy runs in the actor's processes, with its layout"
            )


def ulysses_sizes(cfg) -> dict[str, tuple[int, ModelSettings]]:
    """{the key of each training role's Ulysses size: (its size, the role's model section)} for the roles the run
    builds (the reference policy's is the actor's)."""
    arr = cfg.actor_rollout_ref
    sizes = {"actor_rollout_ref.actor": (arr.actor.ulysses_sequence_parallel_size, arr.model)}
    if cfg.use_critic:
        sizes["critic"] = (cfg.critic.ulysses_sequence_parallel_size, cfg.critic.model)
    if cfg.reward_model.enable and not cfg.reward_model.rollout.name:
        sizes["reward_model"] = (cfg.reward_model.ulysses_sequence_parallel_size, cfg.reward_model.model)
    return sizes


def _validate_sequence_parallel(cfg) -> None:
    """Each role's ``ulysses_sequence_parallel_size``: a backend that splits sequences, the packed path, a divisor of
    the ranks; the reference policy's equals the actor's (it runs in the actor's processes)."""
    arr, world = cfg.actor_rollout_ref, cfg.world_size
    ref = arr.ref.ulysses_sequence_parallel_size
    if ref is not None and ref != arr.actor.ulysses_sequence_parallel_size:
        raise ConfigError(
            f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={ref} differs from the actor's "
            f"({arr.actor.ulysses_sequence_parallel_size}): the reference policy runs in the actor's processes"
        )
    for section, (size, model) in ulysses_sizes(cfg).items():
        key = f"{section}.ulysses_sequence_parallel_size"
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {size!r}")
        if size == 1:
            continue
        if not backend_traits(cfg.backend.name).ulysses:
            raise ConfigError(
                f"{key}={size}: the {cfg.backend.name} backend does not split sequences (Ulysses runs on "
                f"{', '.join(n for n, t in BACKEND_TRAITS.items() if t.ulysses)}); megatron's is "
                f"{section}.megatron.sequence_parallel=true with tensor parallelism"
            )
        model_key = "actor_rollout_ref.model" if section == "actor_rollout_ref.actor" else f"{section}.model"
        if not model.use_remove_padding:
            raise ConfigError(f"{key}={size} splits the packed sequence: set {model_key}.use_remove_padding=true")
        if world % size:
            raise ConfigError(f"{key}={size} must divide the {world} ranks (trainer.n_gpus_per_node x nnodes)")
