"""Typed settings the engines take (layer 1). The trainer's Hydra config maps onto these.

Kept free of Hydra/OmegaConf so an engine can be built from plain Python (tests, notebooks, benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class LoraSettings:
    """LoRA adapters (fsdp, deepspeed; backends/lora.py), verl's keys: only the adapters train, the base stays frozen.
    The keys and their defaults live here once: ModelConfig and the trainer's model sections
    (``actor_rollout_ref.model``, ``critic.model``) extend this class."""

    lora_rank: int = 0  # 0: off (full fine-tuning)
    lora_alpha: int = 16  # the update is scaled by lora_alpha / lora_rank
    target_modules: str | list[str] = "all-linear"  # PEFT's: module names, a regex, or every Linear but the head
    exclude_modules: str | list[str] | None = None  # PEFT's: names (or a regex) left without an adapter
    lora_adapter_path: str | None = None  # a trained PEFT adapter directory to start from (its rank = lora_rank)


@dataclass
class ModelSettings:
    """An HF model and how to load it, verl's keys: the keys of every model section (``actor_rollout_ref.model``,
    ``critic.model``, ``reward_model.model``, the SFT trainer's ``model``) and their defaults live here once;
    ModelConfig and the trainer's model sections extend this class."""

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
    router_aux_loss_coef: float = 0.0  # mixture-of-experts: the routers' load-balancing loss (Switch, as HF's
    # output_router_logits) x this is added to a trained model's loss (fsdp, deepspeed); 0: off, metrics only
    router_z_loss_coef: float = 0.0  # mixture-of-experts: the routers' z-loss (ST-MoE) x this; 0: off


@dataclass(kw_only=True)
class ModelConfig(ModelSettings, LoraSettings):
    """What an engine builds: a role's model section (its path resolved) and the head the role needs."""

    kind: str = "causal_lm"  # causal_lm (actor/ref) | value (critic) | reward (seq. classifier)
    override_config: dict[str, Any] = field(default_factory=dict)  # HF config attributes set before loading
    freeze_vision_tower: bool = False  # a vision-language model's vision tower gets no gradient (the actor's key)

    @property
    def checkpoint(self) -> str:
        """``path``, which an engine needs set (the trainer resolves a section's null path before it builds one)."""
        if self.path is None:
            raise ValueError("ModelConfig.path is unset: the model section's path must be resolved first")
        return self.path

    def __post_init__(self) -> None:
        check_lora_keys(self)


@dataclass
class OptimConfig:
    lr: float = 1e-6  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW's weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's (beta1, beta2)
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # <= 0 disables clipping
    warmup_steps: int = 0  # optimizer steps of linear warm-up to lr (step s: lr x (s + 1) / warmup_steps);
    # 0: none (or lr_warmup_steps_ratio's)
    lr_warmup_steps_ratio: float = 0.0  # verl's: warm-up = ratio x total_steps when warmup_steps is 0
    total_steps: int = 0  # needed by cosine; 0 = unknown (constant after warm-up)
    lr_scheduler: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine: the lr decays to lr x this at total_steps


@dataclass(frozen=True)
class MicroBatching:
    """One call's micro-batch settings over the engine's own (``EngineConfig``'s keys of the same names): e.g. the
    log-prob passes' ``log_prob_micro_batch_size_per_gpu`` / ``log_prob_use_dynamic_bsz`` /
    ``log_prob_max_token_len_per_gpu``."""

    micro_batch_size_per_gpu: int
    use_dynamic_bsz: bool
    max_token_len_per_gpu: int


@dataclass(frozen=True)
class ForwardOptions:
    """How one ``TrainEngine.forward`` call computes, passed beside the batch (its ``meta_info`` holds facts about the
    data, such as the temperature the rows were sampled at)."""

    micro_batching: MicroBatching | None = None  # None: the engine's own settings
    base_model: bool = False  # a LoRA engine's frozen base model (adapters disabled): a reference policy for free


DEFAULT_FORWARD = ForwardOptions()  # the engine's own micro-batching, the trained model


@dataclass
class BackendSettings:
    """The backend section's engine keys (the trainer's ``backend.*``), their defaults here once: EngineConfig and
    the trainer's backend section extend this class."""

    EXECUTION_ONLY = ("param_offload", "optimizer_offload")

    mixed_precision: str | None = "auto"  # auto: bfloat16 compute for trained models on CUDA, off on CPU | null
    # (weights stay in the model's dtype, gradients are reduced in float32)
    param_offload: bool = False  # parameters in CPU memory when unused (PPO: a role's fsdp_config.param_offload
    # overrides it, on megatron its megatron.param_offload)
    optimizer_offload: bool = False  # optimizer state in CPU memory when unused (PPO: a role's
    # fsdp_config.optimizer_offload overrides it, on megatron its megatron.optimizer_offload)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific settings: megatron (its layout keys),
    # deepspeed_config (merged over the generated DeepSpeed config)


@dataclass
class EngineConfig(BackendSettings):
    """How a training engine batches and shards: the backend section's settings and a role's micro-batching."""

    micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 16384  # token budget of one micro-batch when use_dynamic_bsz
    entropy_chunk_size: int = 1024
    ulysses_sequence_parallel_size: int = 1  # fsdp, deepspeed: ranks splitting each packed sequence (Ulysses,
    # backends/sequence/ulysses.py); the data-parallel size is then the world over it
    grad_offload: bool = False  # megatron: its gradient buffers freed between updates (a role's megatron.grad_offload)
    seed: int = 1
    collective_timeout_s: float = 600.0  # a collective waiting longer (a peer died) fails


def check_lora_keys(cfg: LoraSettings, key: str = "model") -> None:
    """ValueErrors naming ``<key>.<field>`` for LoRA settings that cannot work (the adapter path is read at build
    time)."""
    if isinstance(cfg.lora_rank, bool) or not isinstance(cfg.lora_rank, int) or cfg.lora_rank < 0:
        raise ValueError(f"{key}.lora_rank must be an integer >= 0 (0: LoRA off), got {cfg.lora_rank!r}")
    if cfg.lora_rank == 0:
        if cfg.lora_adapter_path is not None:
            raise ValueError(f"{key}.lora_adapter_path needs {key}.lora_rank > 0 (the rank of that adapter)")
        return
    if not isinstance(cfg.lora_alpha, (int, float)) or cfg.lora_alpha <= 0:
        raise ValueError(f"{key}.lora_alpha must be > 0, got {cfg.lora_alpha!r}")
    if not _names(cfg.target_modules):
        raise ValueError(f"{key}.target_modules must be a name, a regex or a list, got {cfg.target_modules!r}")
    if cfg.exclude_modules is not None and not _names(cfg.exclude_modules):
        raise ValueError(f"{key}.exclude_modules must be null, a name, a regex or a list, got {cfg.exclude_modules!r}")


def _names(value) -> bool:
    """A non-empty string or a non-empty list of non-empty strings (OmegaConf's ListConfig included)."""
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, Sequence) and bool(value) and all(isinstance(v, str) and v for v in value)


AUTO = "auto"
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")


def resolve_precision(
    model: ModelConfig, engine: EngineConfig, device: str, trainable: bool
) -> tuple[ModelConfig, EngineConfig]:
    """Copies with ``auto`` dtype / mixed precision filled in for ``device`` ("cuda" | "cpu").

    On CUDA a trained model keeps float32 weights (the optimizer's master copy) and computes in bfloat16 (mixed
    precision, float32 gradient reduction); a frozen one (reference policy, reward model) holds bfloat16 weights.
    On CPU everything is float32 without mixed precision. Explicit values are kept.
    """
    cuda = device == "cuda"
    dtype = model.dtype
    if dtype == AUTO:
        dtype = "bfloat16" if cuda and not trainable else "float32"
    mixed = engine.mixed_precision
    if mixed == AUTO:
        mixed = "bfloat16" if cuda and trainable else None
    return replace(model, dtype=dtype), replace(engine, mixed_precision=mixed)
