"""The PPO trainer's typed config (layer 4): every key and its default, in one place.

Key names follow verl's so a verl user's command ports. configs/ppo_trainer.yaml lists the same keys with the
same defaults (a test compares them); the embedded task's small sizes are a recipe overlay
(configs/recipe/embedded.yaml, applied by scaletrain/trainer/embedded_default.py when the model or data paths are
null). ``load_ppo_config(dict)`` builds the dataclasses strictly (unknown keys and wrong types fail naming the
dotted key); null fallbacks and derived values are computed once by scaletrain/trainer/config/plan.py, and
scaletrain/trainer/config/checks.py checks what types cannot, once, before Ray starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.config import LoraSettings, OptimConfig
from scaletrain.reward.loader import DEFAULT_LOAD_TIMEOUT_S
from scaletrain.utils.typed_config import build
from scaletrain.workers.config import ActorConfig, FSDPConfig, MegatronConfig, RefConfig, RolloutWorkerConfig


@dataclass
class DataConfig:
    EXECUTION_ONLY = ("val_files", "val_batch_size", "val_max_samples")  # validation does not change training

    train_files: Any = None  # str | list[str]; null: the embedded default task
    val_files: Any = None  # str | list[str]; null: no validation (the embedded default task: its test split)
    train_batch_size: int = 1024  # prompts per step
    val_batch_size: int | None = None  # null: the whole validation set at once
    max_prompt_length: int = 512  # prompt tokens, left-padded to this; longer prompts are filtered or truncated
    max_response_length: int = 512  # response tokens at most (the rollout's limit unless rollout.response_length
    # is set)
    filter_overlong_prompts: bool = True  # drop prompts over max_prompt_length at load; false: truncation decides
    truncation: str = "error"  # error | left | right (when not filtering)
    shuffle: bool = True  # a new order of the training prompts each epoch; false: file order
    seed: int = 1  # seed of that order (epoch e: derive_seed(seed, e))
    prompt_key: str = "prompt"  # the column holding each row's chat messages
    return_raw_chat: bool = True  # rows keep their chat messages (raw_prompt); the agent loops need them
    max_samples: int | None = None  # the first N rows of train_files (counted before filtering); null: all
    val_max_samples: int | None = None  # the first N rows of val_files (counted before filtering); null: all


@dataclass
class HFModelConfig:
    EXECUTION_ONLY = ("attn_implementation", "use_remove_padding", "enable_gradient_checkpointing", "trust_remote_code")

    path: str | None = None  # HF checkpoint directory; null: the embedded default model for the actor, the
    # actor's model for the critic (required with reward_model.enable)
    dtype: str = "auto"  # auto: float32 weights for trained models, bfloat16 for frozen ones on
    # CUDA (compute in bfloat16 via backend.mixed_precision=auto); float32 on CPU
    attn_implementation: str | None = None  # sdpa | flash_attention_2 | eager (fsdp, deepspeed); null: sdpa
    use_remove_padding: bool = False  # pack a micro-batch's valid tokens into one sequence (fsdp, deepspeed);
    # pays off with flash_attention_2, slower with sdpa / eager
    enable_gradient_checkpointing: bool = False  # recompute activations in the backward pass to save memory
    trust_remote_code: bool = False  # let transformers run code shipped with the checkpoint (custom model classes)


@dataclass
class RoleModelConfig(HFModelConfig):
    """``critic.model`` / ``reward_model.model``: a model section with its own offload keys (verl's layout)."""

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class PolicyModelConfig(HFModelConfig, LoraSettings):
    """``actor_rollout_ref.model``: the policy's model, with verl's LoRA keys (backends.config.LoraSettings: lora_rank
    > 0 trains adapters only; the reference policy is then the actor's base model with its adapters disabled)."""


@dataclass
class CriticModelConfig(RoleModelConfig, LoraSettings):
    """``critic.model``: the value model, with its own LoRA keys (the value head is trained in full)."""


@dataclass
class RewardModelModelConfig(RoleModelConfig):
    """``reward_model.model``: an HF sequence classifier (num_labels=1) and the tokenizer its inputs come from."""

    input_tokenizer: str | None = None  # null: the RM reads the policy's tokens (same vocabulary, checked);
    # set (the policy's tokenizer): decode, re-apply the RM's chat template


@dataclass
class ActorRolloutRefSection:
    hybrid_engine: bool = True  # true: rollout engines share the training ranks (colocated); false: they run on
    # their own pool (rollout.nnodes x rollout.n_gpus_per_node), fed by a weight push (split placement)
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutWorkerConfig = field(default_factory=RolloutWorkerConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticSection:
    EXECUTION_ONLY = ("ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu")

    enable: bool | None = None  # null: on for estimators that need values (gae)
    strategy: str | None = None  # as actor_rollout_ref.actor.strategy; the roles share one backend
    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # path null: the actor's model
    ppo_mini_batch_size: int | None = None  # null: the actor's
    ppo_micro_batch_size_per_gpu: int = 8  # rows per micro-batch on one rank
    ppo_epochs: int | None = None  # passes over each step's batch; null: the actor's
    use_dynamic_bsz: bool = False  # micro-batches by tokens (ppo_max_token_len_per_gpu) instead of by rows
    ppo_max_token_len_per_gpu: int = 16384  # valid tokens per micro-batch on one rank, with use_dynamic_bsz
    cliprange_value: float = 0.5  # value clip: the loss takes the worse of v and clip(v, v_old - this, v_old + this)
    loss_agg_mode: str = "token-mean"  # as actor_rollout_ref.actor.loss_agg_mode, for the value loss
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # backend=megatron: the critic's layout


@dataclass
class RewardModelSection:
    EXECUTION_ONLY = (
        "micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "forward_max_token_len_per_gpu",
        "timeout_s",
        "load_timeout_s",
        "num_processes",
        "step_timeout_s",
        "max_error_rate",
        "max_error_steps",
    )

    enable: bool = False  # the RM's score replaces the rule reward (verl), or is added to
    # custom_reward_function's score when that is set; see rm_reward.py
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 8  # rows per RM forward on one device
    max_length: int | None = None  # re-tokenized RM inputs keep their last max_length tokens; null: all
    use_dynamic_bsz: bool = False  # micro-batches by tokens (forward_max_token_len_per_gpu) instead
    forward_max_token_len_per_gpu: int = 16384  # valid tokens per RM micro-batch on one device, with use_dynamic_bsz
    reward_manager: str = "naive"  # naive | prime | batch | dapo | multi
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # more arguments of the reward manager (e.g.
    # dapo's overlong_buffer_len, multi's scorers); names it does not take fail before Ray starts
    timeout_s: float = 30.0  # seconds one scorer call may take (the sample scores 0, counted as a timeout)
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S  # seconds the reward file's top-level code may take to
    # import (in a thread of its own: the driver fails naming the file, never freezes)
    num_processes: int = 2  # worker processes that run the scorer, in parallel
    step_timeout_s: float | None = 600.0  # seconds the scoring of one step may take; unscored samples get 0
    # and count as timeouts; null: no bound
    max_error_rate: float = 0.5  # more than this share of a step's samples failing (errors + timeouts) ...
    max_error_steps: int = 3  # ... this many steps in a row stops the run, naming the scorer and its traceback


@dataclass
class CustomRewardFunction:
    path: str | None = None  # a Python file holding the scorer; null: the built-in scorers, picked by data_source
    name: str = "compute_score"  # the scorer's function name in that file
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments bound to that function


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # the in-reward KL coefficient (adaptive: its starting value)
    horizon: int = 10000  # adaptive: each step scales the coefficient by 1 + clip(kl / target_kl - 1, -0.2, 0.2)
    # x the batch's rows / horizon
    target_kl: float = 0.1  # adaptive: the KL the coefficient steers towards


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: the rollout engine / trainer mismatch (verl's key names).

    Checked by ``scaletrain.trainer.step.rollout_correction.validate_rollout_correction``; applied each step by
    ``apply_rollout_correction`` there. Mismatch metrics are logged whenever the rollout returns log-probs."""

    rollout_is: str | None = None  # null: metrics only | token | sequence: truncated IS weights in the loss
    rollout_is_threshold: float = 2.0  # IS weights are truncated to min(w, threshold); >= 1
    rollout_is_batch_normalize: bool = False  # rescale the truncated weights to mean 1 over the batch
    rollout_rs: str | None = None  # null | token_k1 | seq_sum_k1: reject tokens / sequences out of bounds
    rollout_rs_threshold: str | float | None = None  # "lower_upper" ratio bounds, or upper (lower = 1 / upper)
    bypass_mode: bool = False  # true: the rollout's log-probs are the old ones (no old-log-prob forward)
    loss_type: str = "ppo_clip"  # only ppo_clip (the PPO ratio against the old, or in bypass the rollout, policy)
    mismatch_log_prob_threshold: float = 0.1  # metrics: share of tokens with |log pi_train - log pi_rollout| above


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups``: DAPO's dynamic sampling (verl's keys; trainer/rollout/dynamic_sampling.py)."""

    enable: bool = False  # drop groups whose metric is equal for all n samples, refill the batch
    metric: str = "acc"  # seq_reward | seq_final_reward | a key of the reward's extra info
    max_num_gen_batches: int = 0  # generation batches per step before failing; <= 0: no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # grpo | gae (trains a critic) | rloo | grpo_passk | reinforce_plus_plus |
    # reinforce_plus_plus_baseline | remax | opo | gpg (the registered advantage estimators)
    gamma: float = 1.0  # reward discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE's lambda (gae)
    norm_adv_by_std_in_grpo: bool = True  # grpo, grpo_passk: divide by the group's score std; false: Dr. GRPO
    use_kl_in_reward: bool = False  # token rewards minus kl_ctrl's coefficient x KL(old || ref) (runs the reference
    # policy; not with actor.use_kl_loss)
    kl_penalty: str = "kl"  # the in-reward KL's estimator: kl (k1) | abs | mse (k2) | low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    filter_overlong_responses: bool = False  # truncated responses (no EOS) out of the loss (trainer/step/overlong.py)


@dataclass
class BackendConfig:
    EXECUTION_ONLY = ("param_offload", "optimizer_offload")

    name: str = "fsdp"  # fsdp | deepspeed | megatron
    mixed_precision: str | None = "auto"  # auto: bfloat16 compute for trained models on CUDA, off on CPU | null
    param_offload: bool = False  # fsdp, deepspeed: parameters in CPU memory when unused (PPO: a role's
    # fsdp_config.param_offload overrides it); megatron does not offload
    optimizer_offload: bool = False  # fsdp, deepspeed: optimizer state in CPU memory when unused (PPO: a role's
    # fsdp_config.optimizer_offload overrides it); megatron does not offload
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific settings: megatron (its layout keys),
    # deepspeed_config (merged over the generated DeepSpeed config)


@dataclass
class TrainerSection:
    # what a run is called, how long it runs (so it can be extended), when it saves, validates and logs, and its
    # time-outs; the seed, the layout, critic_warmup and balance_batch change results
    EXECUTION_ONLY = (
        "project_name",
        "experiment_name",
        "total_epochs",
        "total_training_steps",
        "logger",
        "default_local_dir",
        "save_freq",
        "save_freq_minutes",
        "test_freq",
        "val_before_train",
        "resume_mode",
        "resume_from_path",
        "max_ckpt_to_keep",
        "save_hf_at_end",
        "save_merged",
        "plot_at_end",
        "collective_timeout_s",
        "worker_call_timeout_s",
        "worker_call_timeout_s_by_role",
        "rollout_data_dir",
        "validation_data_dir",
        "log_val_generations",
        "verbose",
    )

    project_name: str = "scaletrain"  # the loggers' project; names the default run dir (default_local_dir)
    experiment_name: str | None = None  # null: <adv_estimator>_<backend.name>, so runs on different backends
    # keep separate checkpoint directories
    total_epochs: int = 1  # passes over the training prompts (when total_training_steps is null)
    total_training_steps: int | None = None  # set: the run's steps, overriding total_epochs; null: total_epochs x
    # steps per epoch
    n_gpus_per_node: int = 2  # training ranks per node (one worker process each; a GPU each on CUDA)
    nnodes: int = 1  # nodes of the training pool (world size: nnodes x n_gpus_per_node)
    device: str = "auto"  # auto | cpu | cuda
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # console | jsonl | tensorboard |
    # wandb | mlflow
    default_local_dir: str | None = None  # the run directory; null: checkpoints/<project_name>/<experiment_name>
    save_freq: int = -1  # steps between checkpoints; -1: only at the end (and by save_freq_minutes)
    save_freq_minutes: float | None = 30.0  # also a checkpoint after the first step ending this long after the
    # run's start or its last checkpoint, so a crash loses at most about this much training; null: by steps only
    test_freq: int = -1  # steps between validations; -1: only at the end
    val_before_train: bool = True  # validate once before the first step (not when resuming)
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None  # resume_mode=resume_path: the global_step_<N> directory to continue from
    max_ckpt_to_keep: int | None = 2  # the newest complete checkpoints kept; null or <= 0: all
    save_hf_at_end: bool = True  # <run dir>/hf: the HF model; with LoRA (model.lora_rank > 0) the PEFT adapter
    save_merged: bool = False  # with LoRA: also the merged full model in <run dir>/hf_merged (transformers and vLLM
    # load it like any checkpoint); without LoRA <run dir>/hf is the full model already
    plot_at_end: bool = True  # curves from metrics.jsonl into <run dir>/plots at the end (needs the jsonl logger)
    collective_timeout_s: float = 600.0  # a step waiting longer on a dead rank fails, naming it
    worker_call_timeout_s: float | None = 3600.0  # a worker-group call running longer fails the run, naming the
    # role, ranks and method, with every worker's Python stack in <run dir>/stacks; null: wait forever
    worker_call_timeout_s_by_role: dict[str, float] = field(default_factory=dict)  # actor_rollout | critic | rm |
    # rollout (split placement)
    seed: int = 1  # seeds the engines (before each model is built) and, per step, the rollout's sampling
    rollout_data_dir: str | None = None  # set: each step's scored rollouts dumped to <dir>/<step>.jsonl
    validation_data_dir: str | None = None  # set: each validation's scored samples dumped to <dir>/<step>.jsonl
    log_val_generations: int = 0  # validation samples (input, output, score) shown in the loggers
    critic_warmup: int = 0  # the first N steps update only the critic (actor and rollout unchanged)
    balance_batch: bool = False  # reorder rows so each DP rank gets a similar number of tokens
    verbose: bool = False  # the console shows libraries' INFO logs too (run.log always has them: console.py)


@dataclass
class AsyncTrainingConfig:
    """``async_training``: overlapping rollout with training on split placement (trainer/rollout/schedules.py).

    The weight version of a sample is the number of weight pushes the rollout engines had received when its
    generation started; its staleness, when trained, is the number of pushes since."""

    mode: str = "sync"  # sync | one_step_off (step k+1's rollout runs while step k trains) | fully_async (a
    # rollouter streams batches into a bounded queue); both need actor_rollout_ref.hybrid_engine=false
    staleness_threshold: float = 0.0  # fully_async: the rollouter runs at most this many weight versions ahead;
    # a sample lags at most ceil(staleness_threshold) versions (0: each batch from the newest weights)
    trigger_parameter_sync_step: int = 1  # fully_async: trainer steps between weight pushes
    partial_rollout: bool = False  # fully_async: a push interrupts generations between segments; they resume
    # with the new weights, keeping their tokens and log-probs (needs the agent-loop path, rollout.mode=async)
    partial_rollout_segment_tokens: int | None = None  # tokens generated between push points; null: a quarter
    # of the response length


@dataclass
class RayInitConfig:
    """verl's ``ray_kwargs.ray_init``: arguments of ``ray.init`` (scaletrain/trainer/run/ray_cluster.py)."""

    EXECUTION_ONLY = ("*",)

    address: str | None = None  # null: start a private local cluster; "auto" or HOST:PORT: join a running one
    num_cpus: int | None = None  # a private cluster's CPUs (null: 2 per worker, at least the machine's cores)
    num_gpus: int | None = None  # a private cluster's GPUs (null: Ray counts them; 0 on trainer.device=cpu)
    object_store_memory: int | None = None  # bytes, a private cluster's (null: 1 GiB)
    resources: dict[str, float] = field(default_factory=dict)  # a private cluster's custom resources
    namespace: str | None = None  # the Ray namespace of this run's actors (null: Ray's anonymous one)
    runtime_env: dict[str, Any] = field(default_factory=dict)  # merged over the run log's; null values dropped
    include_dashboard: bool = False  # true: a private cluster starts Ray's dashboard
    dashboard_host: str | None = None  # null: Ray's (127.0.0.1)
    dashboard_port: int | None = None  # a private cluster's dashboard port (null: Ray's, 8265)


@dataclass
class RayKwargsConfig:
    EXECUTION_ONLY = ("timeline_json_file",)

    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    timeline_json_file: str | None = None  # set: the run's Ray timeline (chrome://tracing JSON) written at its end


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
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)

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


def files_of(value: Any) -> list[str]:
    """A ``*_files`` key's value as a list of paths."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)
