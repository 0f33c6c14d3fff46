"""Building a role worker's rollout engine, colocated with its training engine, and declaring its place in
the "rollout" mesh (layer 2)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from transformers import AutoTokenizer

from backends.base import TrainEngine
from backends.rollout.base import (
    CheckpointEngineSettings,
    RolloutConfig,
    RolloutEngine,
    RolloutEngineSettings,
    get_rollout,
)
from scaletrain.controller import ROLLOUT_MESH, Worker
from scaletrain.utils.seeding import derive_seed
from scaletrain.workers.colocated_rollout import ColocatedRollout


def build_rollout(
    worker: Worker,
    name: str,
    model_path: str,
    settings: RolloutEngineSettings,
    *,
    tensor_parallel_size: int,
    max_model_len: int,
    trust_remote_code: bool = False,
    lora_rank: int = 0,
    checkpoint_engine: CheckpointEngineSettings | None = None,
) -> tuple[RolloutEngine, Any]:
    """(engine, tokenizer). Ranks form rollout groups of ``tensor_parallel_size``; rank 0 of each is collected.
    ``settings`` is the worker's rollout section (it extends RolloutEngineSettings); each engine's seed is derived
    from the configured seed and its rollout DP rank (32 bits: vLLM passes it to ``numpy.random.seed``), the same
    on the ranks of one engine. With TP > 1 every rank hosts one shard of its group's engine
    (backends/rollout/vllm_tp.py). ``lora_rank`` > 0: the engine serves a LoRA adapter of that rank.
    ``checkpoint_engine``: how synced weights reach it (default: auto)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    shared = {f.name: getattr(settings, f.name) for f in fields(RolloutEngineSettings)}
    shared["seed"] = derive_seed(settings.seed, worker.rank // tensor_parallel_size, bits=32)
    config = RolloutConfig(
        **shared,
        model_path=model_path,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len,
        lora_rank=lora_rank,
        checkpoint_engine=checkpoint_engine or CheckpointEngineSettings(),
    )
    engine = get_rollout(name)(config, tokenizer)
    tp = tensor_parallel_size
    worker.register_mesh(ROLLOUT_MESH, worker.rank // tp, worker.world_size // tp, worker.rank % tp == 0)
    return engine, tokenizer


def build_colocated_rollout(
    worker: Worker,
    settings: Any,
    engine_name: str,
    model_path: str,
    trainer: TrainEngine | None,
    *,
    max_model_len: int,
    trust_remote_code: bool,
    offload_trainer: bool,
    adapter_rank: int = 0,
    checkpoint_engine: CheckpointEngineSettings | None = None,
) -> tuple[ColocatedRollout, Any]:
    """(the rollout engine in its colocation with ``trainer``, tokenizer). ``settings``: the worker's rollout
    section (``tensor_model_parallel_size``, ``free_cache_engine``, ``weight_bucket_bytes`` and the
    RolloutEngineSettings); ``engine_name``: the registered rollout engine (``settings.name``, or vllm_async);
    ``trainer`` (None: no trained weights to sync) feeds it weights; ``adapter_rank`` > 0: its LoRA adapter alone
    (``rollout.lora_sync=adapter``), which the engine serves on its base weights; ``checkpoint_engine``: the
    rollout section's weight transport (build_rollout)."""
    engine, tokenizer = build_rollout(
        worker,
        engine_name,
        model_path,
        settings,
        tensor_parallel_size=settings.tensor_model_parallel_size,
        max_model_len=max_model_len,
        trust_remote_code=trust_remote_code,
        lora_rank=adapter_rank,
        checkpoint_engine=checkpoint_engine,
    )
    rollout = ColocatedRollout(
        engine,
        trainer,
        free_cache_engine=settings.free_cache_engine,
        offload_trainer=offload_trainer,
        bucket_bytes=settings.weight_bucket_bytes,
        adapter_sync=adapter_rank > 0,
    )
    return rollout, tokenizer
