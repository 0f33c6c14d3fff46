"""Typed settings of the role workers (layer 2), named as in verl so a verl user's keys port.

The trainer's Hydra config (``actor_rollout_ref.*``, ``critic.*``; ``reward_model.*`` in rm_config.py) maps onto
these dataclasses; the workers turn them into the engines' own settings (``backends.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, cast

from backends.config import EngineConfig, MicroBatching, ModelConfig, OptimConfig
from backends.rollout.base import CheckpointEngineSettings, RolloutEngineSettings, SamplingConfig
from scaletrain.utils.typed_config import ConfigError
from scaletrain.workers.model_sections import (
    CriticModelConfig,
    FSDPConfig,
    MegatronConfig,
    PolicyModelConfig,
    with_megatron,
    with_offload,
)

VAL_KWARGS = ("n", "temperature", "top_p", "top_k", "do_sample")  # actor_rollout_ref.rollout.val_kwargs


@dataclass
class PolicyLossConfig:
    """``loss_mode`` names a registered policy loss; the other fields are read by the losses that use them."""

    loss_mode: str = "vanilla"  # vanilla (PPO) | gspo | gpg | cispo | sapo | clip_cov | kl_cov | dro | dppo_tv |
    # dppo_kl | geo_mean | bypass_mode (set by algorithm.rollout_correction.bypass_mode) (the registered losses)
    clip_cov_ratio: float | None = None  # clip_cov: share of the tokens whose gradient is detached; null: 2e-4
    clip_cov_lb: float | None = None  # clip_cov: covariance lower bound of the tokens it may pick; null: 1.0
    clip_cov_ub: float | None = None  # clip_cov: covariance upper bound of the tokens it may pick; null: 5.0
    kl_cov_ratio: float | None = None  # kl_cov: share of the tokens (highest covariance) penalised; null: 2e-4
    ppo_kl_coef: float | None = None  # kl_cov: coefficient of |log pi - log pi_old| on those tokens; null: 1.0
    tau_pos: float | None = None  # sapo: gate temperature for positive advantages; null: 1.0
    tau_neg: float | None = None  # sapo: gate temperature for the other advantages; null: 1.05
    dro_beta: float | None = None  # dro: weight of the squared log-ratio penalty; must be set (> 0)
    rollout_correction: dict[str, Any] = field(default_factory=dict)  # bypass_mode: the trainer copies
    # algorithm.rollout_correction here when its bypass corrects in the loss (loss_type reinforce, rollout_is / rs)


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")  # what every checkpoint holds: a resume needs all three


@dataclass
class CheckpointContents:
    """``<role>.checkpoint``: verl's ``save_contents`` / ``load_contents``. Every checkpoint holds the model, the
    optimizer and the extra state (step, LR schedule, RNG); ``hf_model`` adds the role's HF export to each one
    (``global_step_N/<role>/huggingface``: weights beside the config; a LoRA role's merged model)."""

    EXECUTION_ONLY = ("*",)  # what a checkpoint holds besides its state changes no result: a resume may add hf_model

    save_contents: list[str] = field(default_factory=lambda: list(CHECKPOINT_CONTENTS))  # model, optimizer, extra
    # (always), hf_model (the role's HF export in each checkpoint)
    load_contents: list[str] | None = None  # null: save_contents (an hf_model entry loads nothing)

    @property
    def saves_hf_model(self) -> bool:
        return "hf_model" in self.save_contents


@dataclass
class PPOUpdateSettings:
    """The keys the actor's and the critic's PPO updates share (verl names them alike in both sections), with their
    defaults here once; each role's section adds its own."""

    EXECUTION_ONLY = (
        "ppo_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu",
        "ulysses_sequence_parallel_size",
    )

    strategy: str | None = None  # verl's backend selector: fsdp | fsdp2 | deepspeed | megatron (the roles share one
    # backend); null: the backend group's (configs/backend, the `backend=` short form)
    ppo_micro_batch_size_per_gpu: int = 8  # rows per micro-batch on one rank
    shuffle: bool = False  # each pass reshuffles the rank's rows into new mini-batches (seed: data_loader_seed);
    # false: in order
    data_loader_seed: int = 1  # seed of the mini-batch shuffle (shuffle)
    use_dynamic_bsz: bool = False  # micro-batches by tokens (ppo_max_token_len_per_gpu) instead of by rows
    ppo_max_token_len_per_gpu: int = 16384  # valid tokens per micro-batch on one rank, with use_dynamic_bsz
    ulysses_sequence_parallel_size: int = 1  # fsdp, deepspeed: ranks that split each packed sequence (Ulysses;
    # needs model.use_remove_padding): the data-parallel size is the world over it (the actor's: the ref's too)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean |
    # seq-mean-token-sum-norm: how the per-token losses become one (scaletrain/algos/agg.py)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # backend=megatron: this role's layout (the
    # actor's is the ref policy's too)
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)  # what each checkpoint holds

    @property
    def global_batch_info(self) -> dict[str, Any]:
        """verl's ``agg_loss`` keyword arguments for one micro-batch's loss (a verl-written policy loss spreads them
        into its ``agg_loss`` call). scaletrain's engines weight each micro-batch by its units over the whole
        mini-batch (backends/accumulation.py), so a loss is its micro-batch's local mean: dp_size 1, local counts."""
        return {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": None}


@dataclass
class ActorConfig(PPOUpdateSettings):
    ppo_mini_batch_size: int = 256  # prompts per mini-batch (x rollout.n rows), over all DP ranks
    ppo_epochs: int = 1  # passes over each step's batch, in mini-batches of ppo_mini_batch_size
    clip_ratio: float = 0.2  # PPO clip width: the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]
    clip_ratio_low: float | None = None  # null: clip_ratio
    clip_ratio_high: float | None = None  # null: clip_ratio (DAPO's clip-higher sets it above clip_ratio_low)
    clip_ratio_c: float = 3.0  # dual clip (vanilla loss): a token with advantage A < 0 loses at most -A x this; > 1
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0  # entropy bonus: the loss minus this x the entropy (aggregated as the loss); 0: off
    use_kl_loss: bool = False  # add kl_loss_coef x KL(actor || ref) to the loss (runs the reference policy; not
    # with algorithm.use_kl_in_reward)
    kl_loss_coef: float = 0.001  # weight of the KL loss (use_kl_loss)
    kl_loss_type: str = "low_var_kl"  # the KL loss's estimator: kl (k1) | abs | mse (k2) | low_var_kl (k3); a
    # trailing + keeps the value and takes k2's gradient
    calculate_sum_pi_squared: bool = False  # the old-log-prob pass also gives each response token's sum of squared
    # probabilities over the vocabulary (column sum_pi_squared); always on for an estimator that reads it
    # (optimal_token_baseline, tir_optimal_token_baseline)
    freeze_vision_tower: bool = False  # a vision-language model's vision tower gets no gradient (verl's key)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class MultiTurnConfig:
    """``actor_rollout_ref.rollout.multi_turn``: the agent-loop rollout path (scaletrain/agent)."""

    EXECUTION_ONLY = ("tool_timeout_s", "max_batch_wait_ms")

    enable: bool = False  # true: rollouts go through the agent loops (as does rollout.mode=async)
    format: str = "hermes"  # registered ToolParser
    default_agent_loop: str | None = None  # rows without agent_name; null: tool_agent if enable, else single_turn
    max_user_turns: int | None = None  # tool results and interaction replies count as user turns
    max_assistant_turns: int | None = None  # assistant turns per trajectory at most; null: no limit
    max_parallel_calls: int = 1  # tool calls run per assistant turn (the rest are dropped and counted)
    max_tool_response_length: int = 256  # characters of a tool's answer shown to the model
    tool_response_truncate_side: str = "middle"  # left (keep the start) | right (keep the end) | middle
    tool_timeout_s: float = 30.0  # seconds a tool call may run; then the model gets an error text instead
    tools_config_file: str | None = None  # YAML of the tools the model may call (scaletrain/agent/tools/base.py)
    interaction_config_file: str | None = None  # YAML of the simulated users that answer the model
    # (scaletrain/agent/interactions/base.py)
    max_batch_wait_ms: float = 5.0  # a generate batch waits at most this long for more requests


@dataclass
class LogProbSettings:
    """A log-prob pass's micro-batching (verl's ``log_prob_*`` keys: the rollout section's size the old log-probs,
    the ref section's the reference's), with the defaults here once."""

    EXECUTION_ONLY = ("log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")

    log_prob_micro_batch_size_per_gpu: int = 8  # rows per micro-batch of this log-prob pass on one rank
    log_prob_use_dynamic_bsz: bool | None = None  # by tokens instead (max_token_len); null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null: actor.ppo_max_token_len_per_gpu


@dataclass
class RolloutWorkerConfig(RolloutEngineSettings, LogProbSettings):
    """``actor_rollout_ref.rollout``: sampling, lengths, layout and the rollout path; the engine's memory and
    kernel settings (dtype, gpu_memory_utilization, free_cache_engine, ...) come from RolloutEngineSettings."""

    EXECUTION_ONLY = (
        "tensor_model_parallel_size",
        "total_rollout_steps",
        "weight_bucket_bytes",
        "checkpoint_engine",
        "lora_sync",
        "offload_train_during_rollout",
        "val_kwargs",
        "async_engine",
    )

    name: str = "vllm"  # vllm | hf
    mode: str = "sync"  # sync: one batched generate | async: agent loops (see multi_turn)
    n: int = 8  # samples per prompt (the default estimator, GRPO, compares them)
    temperature: float = 1.0  # training rollouts' sampling temperature (0: greedy); the log-prob passes divide
    # the logits by it too
    top_p: float = 1.0  # nucleus sampling: only the most likely tokens up to this probability mass; 1: off
    top_k: int = -1  # sample among the k most likely tokens only; <= 0: off
    prompt_length: int | None = None  # null: data.max_prompt_length (the trainer's resolve fills it)
    response_length: int | None = None  # null: data.max_response_length
    tensor_model_parallel_size: int = 1  # ranks one engine spans (TP; > 1: vllm only); must divide the ranks
    nnodes: int = 1  # split placement (actor_rollout_ref.hybrid_engine=false): nodes of the rollout pool
    n_gpus_per_node: int = 1  # ... and its ranks per node (the trainer pool is trainer.nnodes x n_gpus_per_node)
    total_rollout_steps: int | None = None  # async_training.mode=fully_async: prompts the rollouter generates in
    # all; null: as many as total_training_steps trains on
    weight_bucket_bytes: int = 256 << 20  # bytes per bucket of the weights streamed from the actor to the engines
    checkpoint_engine: CheckpointEngineSettings = field(default_factory=CheckpointEngineSettings)  # how they go
    lora_sync: str | None = None  # LoRA (model.lora_rank > 0): adapter (only the adapter tensors go to the engine,
    # which serves them on its unchanged base weights; vllm, colocated) | merged (the merged full weights, any
    # engine); null: adapter where it works, else merged (scaletrain/trainer/config/lora_checks.py)
    offload_train_during_rollout: bool = False  # the actor's memory goes to CPU while the engine generates
    val_kwargs: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0, "n": 1})  # validation's
    # sampling over the training one: n, temperature, top_p, top_k, do_sample (false: greedy)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    async_engine: bool | None = None  # agent loops: vLLM's AsyncLLM in each rollout worker; null: where it runs

    @property
    def use_agent_loop(self) -> bool:
        return self.multi_turn.enable or self.mode == "async"

    @property
    def use_async_engine(self) -> bool:
        """vLLM's AsyncLLM in each rollout worker, each agent-loop request sent to it at once (continuous
        batching) instead of the driver-side batcher: on by default for the agent loops on vllm at TP=1 (the TP
        ranks of a larger engine are the trainer's SPMD ranks, which take requests only as one batch);
        ``async_engine=false`` keeps the batcher. ``async_engine=true`` where it cannot run is a config error."""
        runs = self.use_agent_loop and self.name == "vllm" and self.tensor_model_parallel_size == 1
        return runs and self.async_engine is not False

    def resolved_lengths(self) -> tuple[int, int]:
        """(prompt_length, response_length), which the trainer's config resolve fills from data.max_prompt_length /
        max_response_length; a ConfigError while either is unset."""
        if self.prompt_length is None or self.response_length is None:
            raise ConfigError(
                "actor_rollout_ref.rollout.prompt_length / response_length are unset: the trainer's config resolve "
                "fills them from data.max_prompt_length / max_response_length"
            )
        return self.prompt_length, self.response_length

    def val_sampling(self) -> dict[str, Any]:
        """Validation's sampling overrides from ``val_kwargs`` (verl's keys: n, temperature, top_p, top_k,
        do_sample): ``do_sample: false`` forces greedy decoding (temperature 0); without it the temperature decides.
        Raises ConfigError naming a bad key."""
        key = "actor_rollout_ref.rollout.val_kwargs"
        unknown = sorted(set(self.val_kwargs) - set(VAL_KWARGS))
        if unknown:
            raise ConfigError(f"{key}: unknown key(s) {', '.join(unknown)}; known: {', '.join(VAL_KWARGS)}")
        n, do_sample = self.val_kwargs.get("n", 1), self.val_kwargs.get("do_sample", True)
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ConfigError(f"{key}.n must be a positive int, got {n!r}")
        if not isinstance(do_sample, bool):
            raise ConfigError(f"{key}.do_sample must be true or false, got {do_sample!r}")
        sampling = {k: v for k, v in self.val_kwargs.items() if k != "do_sample"}
        return sampling if do_sample else {**sampling, "temperature": 0.0}

    def train_sampling(self, seed: int | None = None) -> SamplingConfig:
        """A training rollout's sampling: ``n`` samples per prompt at this section's temperature, top-p and top-k,
        ``response_length`` new tokens at most; ``seed``: the call's (None: the engine's own stream)."""
        return SamplingConfig(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            # None only in a config the trainer has not resolved yet (response_length: null)
            max_new_tokens=cast(int, self.response_length),
            seed=seed,
        )

    def validation_sampling(self, seed: int | None = 0) -> SamplingConfig:
        """Validation's sampling: training's, with ``val_kwargs`` over it (one sample per prompt unless
        ``val_kwargs.n`` says otherwise, as in verl)."""
        return replace(self.train_sampling(seed), **{"n": 1, **self.val_sampling()})


def log_prob_micro_batching(section) -> MicroBatching:
    """A log-prob pass's micro-batch settings (over the engine's own for that call) from its section's
    ``log_prob_*`` keys (``actor_rollout_ref.rollout`` for old log-probs, ``actor_rollout_ref.ref``)."""
    return MicroBatching(
        micro_batch_size_per_gpu=section.log_prob_micro_batch_size_per_gpu,
        use_dynamic_bsz=section.log_prob_use_dynamic_bsz,
        max_token_len_per_gpu=section.log_prob_max_token_len_per_gpu,
    )


@dataclass
class RefConfig(LogProbSettings):
    """``actor_rollout_ref.ref.*``: the reference policy (its log-prob pass: ``LogProbSettings``)."""

    EXECUTION_ONLY = ("ulysses_sequence_parallel_size",)  # as the actor's, which it equals

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # must match the actor's layout (colocated)
    ulysses_sequence_parallel_size: int | None = None  # null: the actor's, which it must equal (colocated)


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref.*``: the policy's section, which is also the actor/rollout/ref worker's config; the worker
    gets the derived rest (the engine's model settings, the backend, the engine settings) as an ``EngineSetup``."""

    hybrid_engine: bool = True  # true: rollout engines share the training ranks (colocated); false: they run on
    # their own pool (rollout.nnodes x rollout.n_gpus_per_node), fed by a weight push (split placement)
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutWorkerConfig = field(default_factory=RolloutWorkerConfig)
    ref: RefConfig = field(default_factory=RefConfig)

    def engine_config(self, setup: EngineSetup) -> EngineConfig:
        """The actor's and the ref's engine settings before their own offload keys: the setup's, with the actor's
        megatron layout and Ulysses size (the ref's are the actor's)."""
        engine = with_megatron(setup.engine, setup.backend, self.actor.megatron)
        return replace(engine, ulysses_sequence_parallel_size=self.actor.ulysses_sequence_parallel_size)

    def actor_engine_config(self, setup: EngineSetup) -> EngineConfig:
        """The actor engine's settings: ``engine_config``'s with the actor's offload keys and micro-batching."""
        actor = self.actor
        return replace(
            with_offload(self.engine_config(setup), setup.backend, actor.fsdp_config, actor.megatron),
            micro_batch_size_per_gpu=actor.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=actor.use_dynamic_bsz,
            max_token_len_per_gpu=actor.ppo_max_token_len_per_gpu,
        )

    def ref_engine_config(self, setup: EngineSetup) -> EngineConfig:
        """The reference engine's settings: ``engine_config``'s with the ref's offload keys."""
        return with_offload(self.engine_config(setup), setup.backend, self.ref.fsdp_config, self.ref.megatron)


@dataclass
class EngineSetup:
    """What the trainer derives for a training role's worker beside the role's own config section: the engine's
    model settings (path fallbacks resolved), the backend, the shared engine settings and the rows per prompt."""

    model: ModelConfig
    backend: str = "fsdp"
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout_n: int = 1  # rows per prompt, to turn a mini-batch of prompts into rows


@dataclass
class CriticConfig(PPOUpdateSettings):
    """``critic.*``: the value model's section, which is also the critic worker's config (one dataclass, so a Python
    user and a command-line user start from the same defaults); the worker gets the derived rest as an
    ``EngineSetup``."""

    enable: bool | None = None  # null: on for estimators that need values (gae)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # path null: the actor's model
    ppo_mini_batch_size: int | None = None  # prompts per critic mini-batch (x rollout.n rows); null: the actor's
    ppo_epochs: int | None = None  # passes over each step's batch; null: the actor's
    cliprange_value: float = 0.5  # value clip: the loss takes the worse of v and clip(v, v_old - this, v_old + this)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))

    def engine_config(self, setup: EngineSetup) -> EngineConfig:
        """The critic engine's settings: the setup's, with this section's micro-batching and megatron layout."""
        return replace(
            with_megatron(setup.engine, setup.backend, self.megatron),
            micro_batch_size_per_gpu=self.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=self.use_dynamic_bsz,
            max_token_len_per_gpu=self.ppo_max_token_len_per_gpu,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
        )
