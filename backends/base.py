"""The training-engine interface and its registry (layer 1).

A role worker (scaletrain/workers) owns one TrainEngine and talks to it only through this interface, so the
worker is the same for FSDP2, DeepSpeed ZeRO-3 and Megatron-core. A backend knows nothing about Ray or PPO:
the worker passes in the per-micro-batch loss as a function.

Batch layout every engine accepts (verl's): ``input_ids``, ``attention_mask``, ``position_ids`` of shape
(B, P + R) with prompts left-padded and responses right-padded, and ``responses`` (B, R). Outputs are aligned
with the response tokens: ``log_probs`` / ``entropy`` / ``values`` of shape (B, R).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from backends.config import DEFAULT_FORWARD, EngineConfig, ForwardOptions, ModelConfig, OptimConfig
from scaletrain.protocol import DataProto
from scaletrain.utils.registry import Registry

# loss_fn(outputs, micro_batch) -> (loss, metrics). ``outputs`` holds (b, R) tensors with grad: "log_probs"
# (and "entropy" when asked) for causal_lm models, "values" for value models. loss_fn returns the plain loss of the
# micro-batch, a mean over some units (tokens, sequences, rows), and may say how many units a micro-batch holds
# with an attribute ``loss_fn.count(micro_batch) -> float`` (default: its rows). The engine weights micro-batch i
# by count_i / (the count of the whole mini-batch on all DP ranks), so the step is the whole mini-batch's whatever
# the split (backends/accumulation.py); the metrics it returns are the whole mini-batch's too.
LossFn = Callable[[dict[str, torch.Tensor], DataProto], tuple[torch.Tensor, dict[str, float]]]

Buckets = Iterator[list[tuple[str, torch.Tensor]]]

# the batch keys an engine's forward reads (the layout above)
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def base_model_only(options: ForwardOptions, has_adapter: bool) -> bool:
    """Whether ``options`` ask for the frozen base model's outputs (``ForwardOptions.base_model``: the reference
    policy of a LoRA engine without a second model); an error for an engine without adapters."""
    if options.base_model and not has_adapter:
        raise ValueError(
            "ForwardOptions(base_model=True) asks for the base model of a LoRA engine, but this engine has no "
            "adapters (model.lora_rank is 0): use a separate reference engine"
        )
    return options.base_model


def as_is(value: torch.Tensor) -> torch.Tensor:
    """A ``bucketed`` getter that returns its tensor as it is (the caller gathers a whole bucket at once)."""
    return value


def bucketed(items: Iterable[tuple[str, int, Callable[[], torch.Tensor]]], bucket_bytes: int) -> Buckets:
    """Buckets of (name, tensor) of at most ``bucket_bytes`` (a larger tensor is a bucket of its own) from
    (name, nbytes, get) items. ``get`` (which may gather: collective) runs only after the previous bucket was
    yielded, so the extra memory held is one bucket."""
    bucket, size = [], 0
    for name, nbytes, get in items:
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, get()))
        size += nbytes
    if bucket:
        yield bucket


class TrainEngine(ABC):
    if TYPE_CHECKING:  # the constructor every registered backend has (register_backend); declared, not defined

        def __init__(
            self, model_config: ModelConfig, optim_config: OptimConfig | None, engine_config: EngineConfig
        ) -> None: ...

    @abstractmethod
    def forward(
        self, batch: DataProto, outputs: tuple[str, ...] = ("log_probs",), options: ForwardOptions = DEFAULT_FORWARD
    ) -> DataProto:
        """No-grad forward over micro-batches (``options``: this call's micro-batching, the base model of a LoRA
        engine); returns a DataProto with the requested (B, R) outputs."""

    @abstractmethod
    def train_step(self, mini_batch: DataProto, loss_fn: LossFn, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        """One optimizer step on a mini-batch: micro-batches, grad accumulation, clip, step, LR schedule.

        Returns the mini-batch's ``loss`` and loss_fn metrics (unit-weighted over micro-batches and DP ranks, the
        same on every rank) plus ``grad_norm``, ``lr`` and ``step_skipped``.
        """

    @abstractmethod
    def export_weights(self, bucket_bytes: int = 256 << 20) -> Buckets:
        """Full HF-named tensors, yielded in buckets of at most ``bucket_bytes`` (a larger single tensor is a
        bucket of its own). Every rank must iterate it (gathers are collective); every rank gets the tensors."""

    @abstractmethod
    def save(self, path: str) -> None:
        """Sharded model + optimizer + LR scheduler + RNG state under directory ``path`` (collective)."""

    @abstractmethod
    def load(self, path: str) -> None:
        """Restore what ``save`` wrote, exactly (collective)."""

    def save_hf(self, path: str) -> None:
        """An HF checkpoint (config + safetensors) that transformers and vLLM load; written by rank 0. A LoRA engine
        (``has_adapter``) writes its PEFT adapter directory, or the merged model with ``merged=True``."""
        raise NotImplementedError

    @property
    def has_adapter(self) -> bool:
        """Whether the engine trains LoRA adapters on a frozen base model (``ModelConfig.lora_rank > 0``)."""
        return False

    def export_adapter(self, bucket_bytes: int = 256 << 20) -> Buckets:
        """The adapter tensors alone under PEFT's adapter-file names, in buckets like ``export_weights``."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA adapters to export")

    def adapter_bytes(self) -> int:
        """The bytes ``export_adapter`` yields in all; 0 without adapters."""
        return 0

    def adapter_config(self) -> dict:
        """The adapters' PEFT config as the JSON dict of an ``adapter_config.json`` (for a rollout engine that serves
        the adapter next to ``export_adapter``'s tensors)."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA adapters")

    def offload(self) -> None:
        """Free accelerator memory (params/grads/optimizer to CPU) while the rollout engine runs."""

    def onload(self) -> None:
        """Undo offload."""

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def collects_output(self) -> bool:
        """Whether this rank's outputs are the ones the controller keeps (Megatron: TP rank 0, last PP stage)."""
        return True


# built-ins are imported on first use, so a run imports only the framework it needs
BACKENDS = Registry(
    "backend", lazy={"fsdp": "backends.fsdp", "deepspeed": "backends.deepspeed", "megatron": "backends.megatron"}
)


@dataclass(frozen=True)
class BackendTraits:
    """What a backend supports, known without importing it (the config checks read it before Ray starts)."""

    offload: bool = True  # param_offload / optimizer_offload keep parameters / optimizer state in CPU memory
    lora: bool = True  # model.lora_rank > 0 trains LoRA adapters on a frozen base
    lora_value: bool = True  # ... on a value model too (critic.model.lora_rank > 0)
    check: str | None = None  # "module:function" checking a role's engine settings (check_engine_settings)
    reshards_on_resume: bool = False  # its checkpoints resume on another layout or backend, and it resumes
    # theirs (the built-ins: backends/checkpoint/portable.py; fsdp's own on any DP size through DCP)
    ulysses: bool = False  # ulysses_sequence_parallel_size > 1 splits sequences (backends/sequence/ulysses.py)
    packs: bool = True  # model.use_remove_padding packs a micro-batch's valid tokens (else it runs padded)


# the built-ins' traits (their modules load lazily); register_backend records a new backend's
BACKEND_TRAITS = {
    "fsdp": BackendTraits(reshards_on_resume=True, ulysses=True),
    "deepspeed": BackendTraits(reshards_on_resume=True, ulysses=True),
    "megatron": BackendTraits(
        lora_value=False,  # its LoRA adapts the policy's decoder linears (backends/megatron/lora.py)
        check="backends.megatron.parallel:check_engine_settings",
        reshards_on_resume=True,
        packs=False,  # megatron-core's packed (THD) attention is Transformer Engine's, CUDA only
    ),
}


def register_backend(name: str, *, traits: BackendTraits | None = None):
    """``@register_backend("fsdp")`` on a TrainEngine subclass whose __init__ takes
    (model_config, optim_config, engine_config); ``traits``: what it supports (default: everything but resuming on
    another layout)."""
    if traits is not None or name not in BACKEND_TRAITS:
        BACKEND_TRAITS[name] = traits or BackendTraits()
    return BACKENDS.register(name)


def backend_traits(name: str) -> BackendTraits:
    """The traits of backend ``name`` (everything for a name nobody registered: the config check names it)."""
    return BACKEND_TRAITS.get(name, BackendTraits())


def check_engine_settings(name: str, extra: dict[str, Any], world_size: int, hf_config: Any = None) -> Any:
    """Backend ``name``'s own check of a role's engine settings (``EngineConfig.extra``) on ``world_size`` ranks and
    the model's HF config (None: not on disk yet): ValueError / TypeError naming the setting it cannot run; returns
    what the check resolved (megatron: the layout), None for a backend without a check."""
    check = backend_traits(name).check
    if check is None:
        return None
    module, function = check.split(":")
    return getattr(importlib.import_module(module), function)(extra, world_size, hf_config)


def get_backend(name: str) -> type[TrainEngine]:
    return BACKENDS.get(name)
