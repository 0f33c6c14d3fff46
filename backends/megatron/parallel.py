"""Megatron parallel layout: the typed ``engine_config.extra["megatron"]`` settings, their validation, and the
set-up of megatron-core's parallel state (TP x PP x DP over the torch.distributed world, order tp-dp-pp as
megatron's default "tp-cp-ep-dp-pp").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MegatronParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> MegatronParallelConfig:
        """From ``engine_config.extra["megatron"]`` (a dict, or None for the defaults); unknown keys fail."""
        raw = dict((extra or {}).get("megatron") or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown megatron settings {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"megatron.{name} must be an integer >= 1, got {value!r}")
        for name in ("sequence_parallel", "use_distributed_optimizer"):
            if not isinstance(getattr(config, name), bool):
                raise ValueError(f"megatron.{name} must be a bool, got {getattr(config, name)!r}")
        return config

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def validate(self, world_size: int, hf_config=None) -> None:
        """Clear errors for layouts megatron would reject (or silently mis-shard)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
                f"pipeline_model_parallel_size {pp}"
            )
        if self.sequence_parallel and tp == 1:
            raise ValueError("megatron.sequence_parallel needs tensor_model_parallel_size > 1")
        if hf_config is None:
            return
        layers = hf_config.num_hidden_layers
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if layers % pp:
            raise ValueError(f"num_hidden_layers {layers} is not divisible by pipeline_model_parallel_size {pp}")
        if heads % tp or kv_heads % tp:
            raise ValueError(
                f"attention heads {heads} / key-value heads {kv_heads} are not both divisible by "
                f"tensor_model_parallel_size {tp}"
            )
        if hf_config.intermediate_size % tp:
            raise ValueError(
                f"intermediate_size {hf_config.intermediate_size} is not divisible by tensor_model_parallel_size {tp}"
            )


def init_model_parallel(config: MegatronParallelConfig, seed: int, timeout_s: float) -> None:
    """Initialise megatron's parallel state (once per process; a second engine must use the same layout)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(
                f"megatron parallel state already initialised with TP x PP = {have}, asked for "
                f"{(tp, pp)}: engines in one process must share the layout"
            )
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
        logger.info("megatron parallel state: TP %d x PP %d x DP %d", tp, pp, ps.get_data_parallel_world_size())
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
