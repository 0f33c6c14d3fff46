"""The model sections of the role configs (layer 2): ``actor_rollout_ref.model``, ``critic.model``,
``reward_model.model`` (verl's keys: an HF checkpoint and how to load it, LoRA, per-role offload), which the trainer
turns into the engines' ``backends.config.ModelConfig`` (scaletrain/trainer/config/worker_configs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from backends.config import EngineConfig, LoraSettings, ModelSettings


@dataclass
class FSDPConfig:
    """``*.fsdp_config.*`` (verl's name; backends fsdp and deepspeed): keep the role's parameters / optimizer
    state in CPU memory between uses. Null: the backend section's ``param_offload`` / ``optimizer_offload``."""

    EXECUTION_ONLY = ("*",)

    param_offload: bool | None = None  # the role's parameters in CPU memory when unused; null: backend.param_offload
    optimizer_offload: bool | None = None  # optimizer state in CPU memory when unused; null: backend.optimizer_offload

    def applied(self, engine: EngineConfig) -> EngineConfig:
        """``engine`` with this section's set keys on top."""
        return replace(
            engine, **{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        )


@dataclass
class RoleModelConfig(ModelSettings):
    """``critic.model`` / ``reward_model.model``: a model section with its own offload keys (verl's layout)."""

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class PolicyModelConfig(ModelSettings, LoraSettings):
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
