"""The rollout-engine interface and its registry (layer 1).

``generate`` takes prompts (``input_ids``/``attention_mask``/``position_ids`` of shape (B, P), left-padded) and
returns B * n rows, the n samples of prompt i adjacent (rows i*n .. i*n+n-1; non-tensor fields repeated alike):
``prompts`` (B*n, P), ``responses`` (B*n, R) right-padded with pad_token_id, ``response_mask`` (B*n, R) of 1s up to
and including the EOS token, ``input_ids`` / ``attention_mask`` / ``position_ids`` of shape (B*n, P + R)
(position ids continue after the prompt's last position) and ``rollout_log_probs`` (B*n, R) float32, the
sampling log-prob of each response token under the engine's own (temperature-scaled) distribution, 0 on padding.
R = ``max_new_tokens`` always, so shapes do not depend on what was sampled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable

import torch

from scaletrain.protocol import DataProto
from scaletrain.utils.registry import Registry


@dataclass
class SamplingConfig:
    n: int = 1
    temperature: float = 1.0                    # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                             # -1 = off
    max_new_tokens: int = 128
    seed: int | None = None                     # per-call seed: same seed + same weights -> same samples


@dataclass
class RolloutConfig:
    model_path: str
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    kv_cache_bytes: int = 64 << 20              # bound the KV cache (CPU vLLM takes ~90% of RAM otherwise)
    enforce_eager: bool = True
    seed: int = 0


class RolloutEngine(ABC):
    @abstractmethod
    def generate(self, prompts: DataProto, sampling: SamplingConfig) -> DataProto:
        """Sample ``sampling.n`` responses per prompt row (see the module docstring for the layout)."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Load HF-named full tensors, bucket by bucket, into the engine's own layout; resets caches."""

    def sleep(self) -> None:
        """Release the KV cache / weights memory while training runs (no-op where unsupported)."""

    def wake_up(self) -> None:
        """Undo sleep."""


# built-ins are imported on first use, so a run imports only the framework it needs
ROLLOUTS = Registry("rollout engine", lazy={"hf": "backends.rollout.hf", "vllm": "backends.rollout.vllm_engine"})


def register_rollout(name: str):
    """``@register_rollout("vllm")`` on a RolloutEngine subclass whose __init__ takes (RolloutConfig, tokenizer)."""
    return ROLLOUTS.register(name)


def get_rollout(name: str) -> type[RolloutEngine]:
    return ROLLOUTS.get(name)
