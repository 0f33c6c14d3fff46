"""Building a role worker's rollout engine and declaring its place in the "rollout" mesh (layer 2)."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from backends.rollout.base import RolloutConfig, RolloutEngine, get_rollout
from scaletrain.controller import Worker


def build_rollout(worker: Worker, name: str, model_path: str, *, dtype: str, tensor_parallel_size: int,
                  max_model_len: int, kv_cache_bytes: int, seed: int,
                  trust_remote_code: bool = False) -> tuple[RolloutEngine, Any]:
    """(engine, tokenizer). Ranks form rollout groups of ``tensor_parallel_size``; rank 0 of each is collected."""
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = RolloutConfig(model_path=model_path, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                           max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, seed=seed + worker.rank)
    engine = get_rollout(name)(config, tokenizer)
    tp = tensor_parallel_size
    worker.register_mesh("rollout", worker.rank // tp, worker.world_size // tp, worker.rank % tp == 0)
    return engine, tokenizer
