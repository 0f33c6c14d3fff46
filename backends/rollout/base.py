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
``finish_reason`` "stop" when the last token is an EOS, else "length") per request out. The default
implementation groups requests with equal temperature / top-p / top-k (a group uses its first request's seed
and the largest ``max_new_tokens``; each output is then cut to its own limit, which samples from the same
distribution as stopping there) and runs ``generate`` on each group; engines override it where they can do
better (vLLM takes per-request sampling in one call).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
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
class TokenRequest:
    prompt_ids: list[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)   # n is ignored (always 1)


@dataclass
class TokenOutput:
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str = "stop"                 # stop: ended with an EOS token | length: hit max_new_tokens


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
                ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p):] = 1
            data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
            longest = max(requests[i].sampling.max_new_tokens for i in idx)
            out = self.generate(data, replace(requests[idx[0]].sampling, n=1, max_new_tokens=longest))
            valid = out.batch["response_mask"].bool()
            for row, i in enumerate(idx):
                limit = requests[i].sampling.max_new_tokens
                tokens = out.batch["responses"][row][valid[row]].tolist()[:limit]
                lps = out.batch["rollout_log_probs"][row][valid[row]].tolist()[:limit]
                reason = "stop" if tokens and tokens[-1] in eos else "length"
                outputs[i] = TokenOutput(tokens, lps, reason)
        return outputs  # type: ignore[return-value]

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
