"""The PPO trainer's typed config (layer 4): configs/ppo_trainer.yaml mapped onto dataclasses, then validated.

Key names follow verl's so a verl user's command ports. ``load_ppo_config(dict)`` builds the dataclasses
strictly (unknown keys and wrong types fail naming the dotted key) and ``validate`` checks what types cannot:
batch sizes that must divide, registered names (estimator, policy loss, backend, rollout engine, reward
manager, loggers), files that must exist. Both run before Ray starts.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from scaletrain.models.prepare import check_causal_lm
from scaletrain.trainer.rollout_checks import validate_rollout, validate_rollout_model
from scaletrain.utils.typed_config import ConfigError, build
from scaletrain.workers.config import ActorConfig, FSDPConfig, MegatronConfig, RefConfig, RolloutWorkerConfig


@dataclass
class DataConfig:
    train_files: Any = None  # str | list[str]; null: the embedded default task
    val_files: Any = None
    train_batch_size: int = 32  # prompts per step
    val_batch_size: int | None = None  # null: the whole validation set at once
    max_prompt_length: int = 16
    max_response_length: int = 8
    filter_overlong_prompts: bool = True
    truncation: str = "error"  # error | left | right (when not filtering)
    shuffle: bool = True
    seed: int = 1
    prompt_key: str = "prompt"
    return_raw_chat: bool = True  # rows keep their chat messages (raw_prompt); the agent loops need them
    max_samples: int | None = None
    val_max_samples: int | None = None


@dataclass
class HFModelConfig:
    path: str | None = None  # null: the embedded default model
    dtype: str = "auto"  # auto: float32 weights for trained models, bfloat16 for frozen ones on
    # CUDA (compute in bfloat16 via backend.mixed_precision=auto); float32 on CPU
    attn_implementation: str | None = None  # sdpa | flash_attention_2 | eager (fsdp, deepspeed); null: sdpa
    use_remove_padding: bool = False
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class RoleModelConfig(HFModelConfig):
    """``critic.model`` / ``reward_model.model``: a model section with its own offload keys (verl's layout)."""

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RewardModelModelConfig(RoleModelConfig):
    """``reward_model.model``: an HF sequence classifier (num_labels=1) and the tokenizer its inputs come from."""

    input_tokenizer: str | None = None  # null: the RM reads the policy's tokens (same vocabulary, checked);
    # set (the policy's tokenizer): decode, re-apply the RM's chat template


@dataclass
class ActorRolloutRefSection:
    model: HFModelConfig = field(default_factory=HFModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutWorkerConfig = field(default_factory=RolloutWorkerConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticSection:
    enable: bool | None = None  # null: on for estimators that need values (gae)
    strategy: str | None = None  # as actor_rollout_ref.actor.strategy; the roles share one backend
    model: RoleModelConfig = field(default_factory=RoleModelConfig)  # path null: the actor's model
    ppo_mini_batch_size: int | None = None  # null: the actor's
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_epochs: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    optim: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-5})
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # backend=megatron: the critic's layout


@dataclass
class RewardModelSection:
    enable: bool = False  # the RM's score replaces the rule reward (verl), or is added to
    # custom_reward_function's score when that is set; see rm_reward.py
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 8  # rows per RM forward on one device
    max_length: int | None = None  # re-tokenized RM inputs keep their last max_length tokens; null: all
    use_dynamic_bsz: bool = False  # micro-batches by tokens (forward_max_token_len_per_gpu) instead
    forward_max_token_len_per_gpu: int = 16384
    reward_manager: str = "naive"  # naive | prime | batch | dapo | multi
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0
    num_processes: int = 2


@dataclass
class CustomRewardFunction:
    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: the rollout engine / trainer mismatch (verl's key names).

    Checked by ``scaletrain.trainer.rollout_correction.validate_rollout_correction``; applied each step by
    ``apply_rollout_correction`` there. Mismatch metrics are logged whenever the rollout returns log-probs."""

    rollout_is: str | None = None  # null: metrics only | token | sequence: truncated IS weights in the loss
    rollout_is_threshold: float = 2.0  # IS weights are truncated to min(w, threshold); >= 1
    rollout_is_batch_normalize: bool = False  # rescale the truncated weights to mean 1 over the batch
    rollout_rs: str | None = None  # null | token_k1 | seq_sum_k1: reject tokens / sequences out of bounds
    rollout_rs_threshold: str | float | None = None  # "lower_upper" ratio bounds, or upper (lower = 1 / upper)
    bypass_mode: bool = False  # only false: old log-probs are recomputed by the trainer
    loss_type: str = "ppo_clip"  # bypass mode's loss; only ppo_clip
    mismatch_log_prob_threshold: float = 0.1  # metrics: share of tokens with |log pi_train - log pi_rollout| above


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups``: DAPO's dynamic sampling (verl's keys; scaletrain/trainer/dynamic_sampling.py)."""

    enable: bool = False  # drop groups whose metric is equal for all n samples, refill the batch
    metric: str = "acc"  # seq_reward | seq_final_reward | a key of the reward's extra info
    max_num_gen_batches: int = 0  # generation batches per step before failing; <= 0: no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    filter_overlong_responses: bool = False  # truncated responses (no EOS) out of the loss (trainer/overlong.py)


@dataclass
class BackendConfig:
    name: str = "fsdp"  # fsdp | deepspeed | megatron
    mixed_precision: str | None = "auto"  # auto: bfloat16 compute for trained models on CUDA, off on CPU | null
    param_offload: bool = False
    optimizer_offload: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerSection:
    project_name: str = "scaletrain"
    experiment_name: str = "run"
    total_epochs: int = 1
    total_training_steps: int | None = None
    n_gpus_per_node: int = 2
    nnodes: int = 1
    device: str = "auto"  # auto | cpu | cuda
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # verl's
    save_freq: int = -1  # steps between checkpoints; -1: only at the end
    test_freq: int = -1  # steps between validations; -1: only at the end
    val_before_train: bool = True
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None
    max_ckpt_to_keep: int | None = 2
    save_hf_at_end: bool = True
    plot_at_end: bool = True
    collective_timeout_s: float = 600.0  # a step waiting longer on a dead rank fails, naming it
    seed: int = 1
    rollout_data_dir: str | None = None  # set: each step's scored rollouts dumped to <dir>/<step>.jsonl
    validation_data_dir: str | None = None  # set: each validation's scored samples dumped to <dir>/<step>.jsonl
    log_val_generations: int = 0  # validation samples (input, output, score) shown in the loggers
    critic_warmup: int = 0  # the first N steps update only the critic (actor and rollout unchanged)
    balance_batch: bool = False  # reorder rows so each DP rank gets a similar number of tokens


@dataclass
class RayInitConfig:
    address: str | None = None  # null: start a private local cluster; "auto": join a running one
    num_cpus: int | None = None
    object_store_memory: int | None = None


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefSection = field(default_factory=ActorRolloutRefSection)
    critic: CriticSection = field(default_factory=CriticSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    custom_reward_function: CustomRewardFunction = field(default_factory=CustomRewardFunction)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    @property
    def world_size(self) -> int:
        return self.trainer.n_gpus_per_node * self.trainer.nnodes


def load_ppo_config(data: dict[str, Any]) -> PPOConfig:
    return build(PPOConfig, data)


def _files(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def validate(cfg: PPOConfig) -> PPOConfig:
    """Checks across keys; raises ConfigError naming the key. Returns cfg for chaining."""
    from scaletrain.trainer.dynamic_sampling import validate_filter_groups
    from scaletrain.trainer.rm_reward import validate_reward_model
    from scaletrain.trainer.role_checks import validate_roles
    from scaletrain.trainer.rollout_correction import validate_rollout_correction

    arr, data, trainer = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    _validate_names(cfg)
    world, n = cfg.world_size, arr.rollout.n
    positive = {
        "data.train_batch_size": data.train_batch_size,
        "actor_rollout_ref.rollout.n": n,
        "actor_rollout_ref.actor.ppo_mini_batch_size": arr.actor.ppo_mini_batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": arr.actor.ppo_micro_batch_size_per_gpu,
        "trainer.n_gpus_per_node": trainer.n_gpus_per_node,
        "trainer.nnodes": trainer.nnodes,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if data.train_batch_size % arr.actor.ppo_mini_batch_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({arr.actor.ppo_mini_batch_size}) must "
            f"divide data.train_batch_size ({data.train_batch_size})"
        )
    if (arr.actor.ppo_mini_batch_size * n) % world:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = "
            f"{arr.actor.ppo_mini_batch_size * n} rows do not split over {world} ranks"
        )
    rows_per_rank = arr.actor.ppo_mini_batch_size * n // world
    micro = arr.actor.ppo_micro_batch_size_per_gpu
    if not arr.actor.use_dynamic_bsz and micro < rows_per_rank and rows_per_rank % micro:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu "
            f"({arr.actor.ppo_micro_batch_size_per_gpu}) must divide the {rows_per_rank} mini-batch "
            f"rows per rank"
        )
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "grpo_passk", "opo", "reinforce_plus_plus_baseline") and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of one prompt: "
            f"set actor_rollout_ref.rollout.n >= 2 (got {n})"
        )
    if arr.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        raise ConfigError(
            "actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward both add a KL penalty; enable one"
        )
    validate_rollout(arr.rollout, world, trainer.device)
    validate_roles(cfg)
    validate_rollout_correction(cfg)
    validate_filter_groups(cfg)
    if cfg.backend.name == "megatron":
        _validate_megatron(cfg, world)
    if trainer.resume_mode not in ("auto", "disable", "resume_path"):
        raise ConfigError(f"trainer.resume_mode must be auto | disable | resume_path, got '{trainer.resume_mode}'")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    _validate_generation_outputs(trainer)
    if trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {trainer.critic_warmup}")
    if trainer.critic_warmup and not cfg.use_critic:
        raise ConfigError(
            f"trainer.critic_warmup={trainer.critic_warmup} warms up a critic, but this run has none "
            f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator}, critic.enable={cfg.critic.enable})"
        )
    arr.rollout.val_sampling()  # raises ConfigError naming a bad val_kwargs key
    _validate_paths(cfg)
    validate_reward_model(cfg)  # after _validate_megatron: the RM shares the resolved layout
    return cfg


def _validate_names(cfg: PPOConfig) -> None:
    """Every configured name (estimator, loss, backend, rollout, reward manager, aggregation, loggers) is registered;
    the backend's packages import."""
    from backends.base import BACKENDS
    from backends.rollout.base import ROLLOUTS
    from scaletrain.algos import ADV_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
    from scaletrain.reward import REWARD_MANAGERS
    from scaletrain.trainer.tracking import LOGGERS

    arr = cfg.actor_rollout_ref
    names = [
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADV_ESTIMATORS),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", arr.actor.policy_loss.loss_mode, POLICY_LOSSES),
        ("backend.name", cfg.backend.name, BACKENDS),
        ("actor_rollout_ref.rollout.name", arr.rollout.name, ROLLOUTS),
        ("reward_model.reward_manager", cfg.reward_model.reward_manager, REWARD_MANAGERS),
    ]
    for key, name, registry in names:
        if name not in registry:
            raise ConfigError(f"{key}: unknown {registry.kind} '{name}'; registered: {', '.join(registry.names())}")
    try:
        BACKENDS.get(cfg.backend.name)  # imports a lazily registered backend: a missing package fails here
    except ImportError as exc:
        raise ConfigError(f"backend.name: {exc}") from exc
    for key, mode in (
        ("actor_rollout_ref.actor.loss_agg_mode", arr.actor.loss_agg_mode),
        ("critic.loss_agg_mode", cfg.critic.loss_agg_mode),
    ):
        if mode not in LOSS_AGG_MODES:
            raise ConfigError(f"{key}: unknown mode '{mode}'; one of {', '.join(LOSS_AGG_MODES)}")
    for name in cfg.trainer.logger:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.logger: unknown logger '{name}'; registered: {', '.join(LOGGERS.names())}")


def _validate_paths(cfg: PPOConfig) -> None:
    """Data files, model directories and the reward function exist; the actor's model is a causal LM."""
    for key in ("data.train_files", "data.val_files"):
        for path in _files(getattr(cfg.data, key.split(".")[1])):
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
        validate_rollout_model(cfg.actor_rollout_ref.rollout, model_path)


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


def _validate_megatron(cfg: PPOConfig, world: int) -> None:
    """The actor's (and ref's) and the critic's Megatron layouts fit the world (and the model, when on disk).

    The roles are colocated in one process per device and megatron's parallel state is per process, so they share
    one layout: it is resolved here (actor section over ``backend.extra.megatron``, critic section over that) and
    written back into ``backend.extra["megatron"]``, which every role's engine config starts from."""
    from backends.megatron.hf_mapping import check_mappable

    arr = cfg.actor_rollout_ref
    sections = [("actor_rollout_ref.actor.megatron", arr.actor.megatron, arr.model.path)]
    if cfg.use_critic:
        sections.append(("critic.megatron", cfg.critic.megatron, cfg.critic.model.path or arr.model.path))
    layouts = []
    for key, section, path in sections:
        hf_config = None
        if path and os.path.isfile(os.path.join(path, "config.json")):
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=arr.model.trust_remote_code)
        # the critic's unset keys follow the actor's layout (they must match anyway)
        base = {"megatron": asdict(layouts[0][1])} if layouts else cfg.backend.extra
        try:
            layout = section.resolved(base)
            layout.validate(world, hf_config)
            if hf_config is not None:
                check_mappable(hf_config)  # a model the HF <-> megatron mapping cannot reproduce fails before Ray
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{key}: {exc} (trainer.n_gpus_per_node x trainer.nnodes = {world} ranks)") from exc
        layouts.append((key, layout))
    for key, layout in layouts[1:]:
        if layout != layouts[0][1]:
            raise ConfigError(
                f"{key} ({layout}) differs from {layouts[0][0]} ({layouts[0][1]}): the roles share "
                "one process per device and megatron's parallel state, so they need the same layout"
            )
    cfg.backend.extra = {**cfg.backend.extra, "megatron": asdict(layouts[0][1])}
