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

from backends.config import BackendSettings
from scaletrain.algos.advantage import estimator_traits
from scaletrain.reward.judge import JudgeSettings
from scaletrain.reward.remote_rm import RemoteRMSettings
from scaletrain.reward.sandbox_fusion import SandboxFusionSettings
from scaletrain.trainer.config.common_sections import DataSettings, RunSettings
from scaletrain.utils.typed_config import build
from scaletrain.workers.config import ActorRolloutRefConfig, CriticConfig
from scaletrain.workers.rm_config import RewardModelConfig


@dataclass
class DataConfig(DataSettings):
    EXECUTION_ONLY = ("val_files", "val_batch_size", "val_max_samples")  # validation does not change training

    train_batch_size: int = 1024  # prompts per step
    val_batch_size: int | None = None  # null: the whole validation set at once
    max_prompt_length: int = 512  # prompt tokens, left-padded to this; longer prompts are filtered or truncated
    max_response_length: int = 512  # response tokens at most (the rollout's limit unless rollout.response_length
    # is set)
    filter_overlong_prompts: bool = True  # drop prompts over max_prompt_length at load; false: truncation decides
    shuffle: bool = True  # a new order of the training prompts each epoch; false: file order
    return_raw_chat: bool = True  # rows keep their chat messages (raw_prompt); the agent loops need them
    reward_fn_key: str = "data_source"  # the column that picks each row's scorer (a non-empty string in every row),
    # handed to the reward manager as its reward_fn_key
    video_key: str = "videos"  # the video column (refused: videos are not supported yet)


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
    loss_type: str = "ppo_clip"  # bypass_mode: ppo_clip (PPO against the rollout) | reinforce (IS-weighted PG)
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
    # reinforce_plus_plus_baseline | remax | opo | gpg | gdpo (the registered advantage estimators)
    gamma: float = 1.0  # reward discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE's lambda (gae)
    norm_adv_by_std_in_grpo: bool = True  # grpo, grpo_passk, gdpo: divide by the group's score std; false: Dr. GRPO
    gdpo_reward_keys: list[str] = field(default_factory=list)  # gdpo: the reward components (keys of the dict
    # compute_score returns), each normalised within its group on its own
    gdpo_reward_weights: list[float] | None = None  # gdpo: one weight per component in the sum; null: 1 each
    use_kl_in_reward: bool = False  # token rewards minus kl_ctrl's coefficient x KL(old || ref) (runs the reference
    # policy; not with actor.use_kl_loss)
    kl_penalty: str = "kl"  # the in-reward KL's estimator: kl (k1) | abs | mse (k2) | low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    filter_overlong_responses: bool = False  # truncated responses (no EOS) out of the loss (trainer/step/overlong.py)


@dataclass
class BackendConfig(BackendSettings):
    """``backend.*``: which training engine every role uses, and its engine settings (backends.config)."""

    LAYOUT_ONLY = ("name",)  # a checkpoint resumes on another backend (backends/checkpoint/portable.py)

    name: str = "fsdp"  # fsdp | deepspeed | megatron


@dataclass
class TrainerSection(RunSettings):
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
        "memory_check",
        "device_memory_gib",
    )
    LAYOUT_ONLY = ("n_gpus_per_node", "nnodes")  # the number of training ranks: resumable across it where the
    # backends reshard (backends/base.py BackendTraits.reshards_on_resume)

    experiment_name: str | None = None  # null: <adv_estimator>_<backend.name>, so runs on different backends
    # keep separate checkpoint directories
    total_training_steps: int | None = None  # set: the run's steps, overriding total_epochs; null: total_epochs x
    # steps per epoch
    default_local_dir: str | None = None  # the run directory; null: checkpoints/<project_name>/<experiment_name>
    save_freq: int = -1  # steps between checkpoints; -1: only at the end (and by save_freq_minutes)
    save_freq_minutes: float | None = 30.0  # also a checkpoint after the first step ending this long after the
    # run's start or its last checkpoint, so a crash loses at most about this much training; null: by steps only
    test_freq: int = -1  # steps between validations; -1: only at the end
    val_before_train: bool = True  # validate once before the first step (not when resuming)
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None  # resume_mode=resume_path: the global_step_<N> directory to continue from
    max_ckpt_to_keep: int | None = 2  # the newest complete checkpoints kept; null or <= 0: all
    save_merged: bool = False  # with LoRA: also the merged full model in <run dir>/hf_merged (transformers and vLLM
    # load it like any checkpoint); without LoRA <run dir>/hf is the full model already
    plot_at_end: bool = True  # curves from metrics.jsonl into <run dir>/plots at the end (needs the jsonl logger)
    collective_timeout_s: float = 600.0  # a step waiting longer on a dead rank fails, naming it
    worker_call_timeout_s_by_role: dict[str, float] = field(default_factory=dict)  # actor_rollout | critic | rm |
    # rollout (split placement)
    rollout_data_dir: str | None = None  # set: each step's scored rollouts dumped to <dir>/<step>.jsonl
    validation_data_dir: str | None = None  # set: each validation's scored samples dumped to <dir>/<step>.jsonl
    log_val_generations: int = 0  # validation samples (input, output, score) shown in the loggers
    critic_warmup: int = 0  # the first N steps update only the critic (actor and rollout unchanged)
    balance_batch: bool = False  # reorder rows so each DP rank gets a similar number of tokens
    memory_check: str = "warn"  # warn | error | off: a memory plan over the device's budget warns or fails before
    # Ray starts (scaletrain/trainer/memory_plan.py); the plan is logged either way
    device_memory_gib: float | None = None  # one training device's memory budget; null: the GPU's (nvidia-smi), on
    # CPU the host's available memory over the node's ranks


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
class RewardHealthConfig:
    """``reward.health``: alarms on the reward signal (scaletrain/trainer/step/reward_health.py). Every step logs
    the ``reward_health/*`` signals; one beyond its threshold (null: logged, never an alarm) in ``patience``
    consecutive steps is an alarm, and ``action`` is taken before that step trains."""

    max_zero_variance_groups: float | None = 0.95  # share of groups (>= 2 samples of a prompt) whose samples all
    # got the same reward: their group-relative advantages are 0, the step learns nothing from them
    max_format_only: float | None = 0.5  # share of samples rewarded (score > 0) for their format with a wrong
    # answer (read where the scorer reports both components, e.g. the multi manager's format + correctness)
    max_length_corr: float | None = None  # |Pearson correlation| of the reward and the response length
    max_judge_rule_disagreement: float | None = None  # share of samples on which the reward model's verdict and
    # the rule's differ (each: above its own batch mean), with reward_model.enable and custom_reward_function.path
    patience: int = 10  # consecutive steps beyond a threshold that make an alarm
    action: str = "warn"  # warn (a warning naming the signal and the steps, repeated every patience steps it
    # lasts) | stop (the run stops before training on that step's rewards; checkpoints kept)
    format_component: str = "format"  # the reward's per-sample extra info holding the format score
    answer_components: list[str] = field(default_factory=lambda: ["acc", "correctness"])  # the first of these
    # the extra info holds is the answer's correctness (> 0: right)


@dataclass
class RewardSection:
    """``reward``: verl's newer reward section. Its verl keys reward_manager.name, reward_model.enable / model_path
    and custom_reward_function are renamed to reward_model.* / custom_reward_function
    (scaletrain/trainer/config/verl_keys.py); ``num_workers`` and ``sandbox_fusion`` are verl's (the client's limits
    added); ``stream``, ``health``, ``judge`` and ``remote_rm`` are this project's."""

    health: RewardHealthConfig = field(default_factory=RewardHealthConfig)
    num_workers: int = 0  # Ray actors (1 CPU each) scoring the rule reward off the driver, a batch split among them
    # (scaletrain/trainer/rollout/reward_loop.py); 0: the driver scores (in reward_model.num_processes processes)
    stream: bool = True  # with num_workers and the agent loops: each trajectory is scored as soon as it finishes,
    # overlapping the generation still going on
    rule_weight: float = 1.0  # with reward_model.enable and custom_reward_function.path: the rule (or judge)
    # reward's weight in the sum with the reward model's score (each component logged unweighted: rule_score, rm_score)
    reward_model_weight: float = 1.0  # the reward model's score's weight (alone or in that sum)
    judge: JudgeSettings = field(default_factory=JudgeSettings)  # a generative judge behind an OpenAI-compatible
    # endpoint, awaited by an async custom_reward_function (scaletrain/reward/judge.py)
    sandbox_fusion: SandboxFusionSettings = field(default_factory=SandboxFusionSettings)  # a code sandbox service
    # (scaletrain/reward/sandbox_fusion.py)
    remote_rm: RemoteRMSettings = field(default_factory=RemoteRMSettings)  # a discriminative reward model served
    # over HTTP (OpenRLHF's remote RM protocol, scaletrain/reward/remote_rm.py), in reward_model.enable's place


@dataclass
class RayInitConfig:
    """verl's ``ray_kwargs.ray_init``: arguments of ``ray.init`` (scaletrain/trainer/run/ray_cluster.py)."""

    EXECUTION_ONLY = ("*",)

    address: str | None = None  # null: start a private local cluster; "auto" or HOST:PORT: join a running one
    num_cpus: int | None = None  # a private cluster's CPUs (null: 2 per worker, at least the machine's cores)
    num_gpus: int | None = None  # a private cluster's GPUs (null: Ray counts them; 0 on trainer.device=cpu)
    object_store_memory: int | None = None  # bytes, a private cluster's (null: 1 GiB + 2x the weights it pushes)
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
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunction = field(default_factory=CustomRewardFunction)
    reward: RewardSection = field(default_factory=RewardSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        return estimator_traits(self.algorithm.adv_estimator).needs_values

    @property
    def world_size(self) -> int:
        return self.trainer.n_gpus_per_node * self.trainer.nnodes


def load_ppo_config(data: dict[str, Any]) -> PPOConfig:
    return build(PPOConfig, data)


def files_of(value: Any) -> list[str]:
    """A ``*_files`` key's value as a list of paths."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)
