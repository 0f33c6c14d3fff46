"""The model and engine sections of the role configs (layer 2): ``actor_rollout_ref.model``, ``critic.model``,
``reward_model.model`` (verl's keys: an HF checkpoint and how to load it, LoRA, per-role offload), which the trainer
turns into the engines' ``backends.config.ModelConfig`` (scaletrain/trainer/config/worker_configs.py), and each
role's ``fsdp_config`` / ``megatron`` section (its offload keys, megatron's layout) applied to its EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

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


@dataclass
class MegatronConfig:
    """``actor_rollout_ref.actor.megatron.*`` / ``critic.megatron.*``: the Megatron layout of that role's engine
    (backend=megatron; ignored by the other backends). Unset (null) keys fall back to ``backend.extra.megatron``
    (the critic's to the actor's layout: colocated roles share megatron's per-process parallel state; the trainer
    resolves the one layout before Ray starts), then to the engine's defaults (1, 1, false, false, 1, the TP size)."""

    # the layout a checkpoint is sharded for (tensor / pipeline sizes, the distributed optimizer) changes results
    EXECUTION_ONLY = ("sequence_parallel", "param_offload", "optimizer_offload", "grad_offload")
    # a checkpoint resumes on other TP / PP sizes (through HF names: backends/checkpoint/portable.py); the expert
    # sizes (EP / ETP) are not among them: a run resumes on its own (a resume on others is not tested yet)
    LAYOUT_ONLY = ("tensor_model_parallel_size", "pipeline_model_parallel_size")

    tensor_model_parallel_size: int | None = None  # TP: ranks each layer's weights are split over; null:
    # backend.extra.megatron's, else 1
    pipeline_model_parallel_size: int | None = None  # PP: stages the layers are split into; null:
    # backend.extra.megatron's, else 1
    sequence_parallel: bool | None = None  # split activations along the sequence over the TP ranks (needs TP > 1);
    # null: backend.extra.megatron's, else false
    use_distributed_optimizer: bool | None = None  # shard the optimizer state over the DP ranks; null:
    # backend.extra.megatron's, else false
    expert_model_parallel_size: int | None = None  # EP: ranks a mixture-of-experts layer's experts are split over;
    # null: backend.extra.megatron's, else 1
    expert_tensor_parallel_size: int | None = None  # ETP: 1 or the TP size; null: backend.extra.megatron's, else TP

    # verl's megatron offload keys (backends/megatron/offload.py): the state leaves the device between the calls
    # that use it (true with another backend fails before Ray: its fsdp_config keys are the ones it reads)
    param_offload: bool | None = None  # the role's parameters in CPU memory when unused; null: backend.param_offload
    optimizer_offload: bool | None = None  # Adam's state and the float32 main weights; null:
    # backend.optimizer_offload
    grad_offload: bool | None = None  # the float32 gradient buffers, freed between updates; null: false

    def merged(self, extra: dict[str, Any]) -> dict[str, Any]:
        """``extra["megatron"]`` with this section's set layout keys on top."""
        out = dict(extra.get("megatron") or {})
        out.update(
            {
                f.name: getattr(self, f.name)
                for f in fields(self)
                if f.name in LAYOUT_KEYS and getattr(self, f.name) is not None
            }
        )
        return out

    def offload_applied(self, engine: EngineConfig) -> EngineConfig:
        """``engine`` with this section's set offload keys on top."""
        return replace(
            engine, **{name: getattr(self, name) for name in OFFLOAD_KEYS if getattr(self, name) is not None}
        )

    def resolved(self, extra: dict[str, Any]):
        """The engine's layout (a MegatronParallelConfig) from ``merged(extra)``, its defaults filling the rest;
        unknown or invalid settings raise ValueError."""
        from backends.megatron.parallel import MegatronParallelConfig

        return MegatronParallelConfig.from_extra({"megatron": self.merged(extra)})


LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "sequence_parallel",
    "use_distributed_optimizer",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


OFFLOAD_KEYS = ("param_offload", "optimizer_offload", "grad_offload")


def with_offload(
    engine: EngineConfig, backend: str, fsdp_config: FSDPConfig, megatron: MegatronConfig | None
) -> EngineConfig:
    """``engine`` with a role's offload keys on top: on backend=megatron its ``megatron`` section's (none for the
    reward model: the backend section's then), on the others its ``fsdp_config``'s; the config checks refuse the
    other backend's keys set true."""
    if backend == "megatron":
        return megatron.offload_applied(engine) if megatron is not None else engine
    return fsdp_config.applied(engine)


def with_megatron(engine: EngineConfig, backend: str, section: MegatronConfig) -> EngineConfig:
    """A copy of ``engine`` whose ``extra["megatron"]`` holds the role's layout (only for backend=megatron)."""
    if backend != "megatron":
        return engine
    return replace(engine, extra={**engine.extra, "megatron": section.merged(engine.extra)})
