"""Megatron parallel layout: the typed ``engine_config.extra["megatron"]`` settings, their validation (and the
backend's check of a role's settings before anything is built, ``check_engine_settings``), and the set-up of
megatron-core's parallel state (TP x PP x DP over the torch.distributed world, order tp-dp-pp as megatron's default
"tp-cp-ep-dp-pp"). A mixture-of-experts model's experts are split over EP ranks (and ETP = 1 or
TP), which megatron lays out as "etp-ep-edp-pp" over the same world: the dense layers' DP is unchanged, the experts'
data parallelism is world / (ETP x EP x PP).
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
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the TP size (megatron's default)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> MegatronParallelConfig:
        """From ``engine_config.extra["megatron"]`` (a dict, or None for the defaults); unknown keys fail."""
        raw = dict((extra or {}).get("megatron") or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown megatron settings {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"megatron.{name} must be an integer >= 1, got {value!r}")
        for name in ("sequence_parallel", "use_distributed_optimizer"):
            if not isinstance(getattr(config, name), bool):
                raise ValueError(f"megatron.{name} must be a bool, got {getattr(config, name)!r}")
        etp = config.expert_tensor_parallel_size
        if etp is not None and etp not in (1, config.tensor_model_parallel_size):
            raise ValueError(
                f"megatron.expert_tensor_parallel_size must be 1 or the tensor_model_parallel_size "
                f"({config.tensor_model_parallel_size}), got {etp!r}"
            )
        return config

    @property
    def etp(self) -> int:
        """The experts' tensor-parallel size (megatron's default: the TP size)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

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
        ep = self.expert_model_parallel_size
        if world_size % (self.etp * ep * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by expert_tensor_parallel_size {self.etp} x "
                f"expert_model_parallel_size {ep} x pipeline_model_parallel_size {pp}"
            )
        if hf_config is None:
            return
        self._validate_experts(hf_config)
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

    def _validate_experts(self, hf_config) -> None:
        from backends.moe import num_experts

        ep, experts = self.expert_model_parallel_size, num_experts(hf_config)
        if ep > 1 and not experts:
            raise ValueError(
                f"megatron.expert_model_parallel_size {ep} needs a mixture-of-experts model; "
                f"{hf_config.model_type} has no experts"
            )
        if experts and self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            # megatron-core refuses to train it (its MoE layers gather and scatter tokens over TP as SP does)
            raise ValueError(
                "a mixture-of-experts model with tensor_model_parallel_size > 1 needs megatron.sequence_parallel=true"
            )
        if experts and experts % ep:
            raise ValueError(f"{experts} experts are not divisible by expert_model_parallel_size {ep}")
        width = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        if experts and width % self.etp:
            raise ValueError(
                f"the experts' intermediate size {width} is not divisible by expert_tensor_parallel_size {self.etp}"
            )


def init_model_parallel(config: MegatronParallelConfig, seed: int, timeout_s: float) -> None:
    """Initialise megatron's parallel state (once per process; a second engine must use the same layout)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    ep, etp = config.expert_model_parallel_size, config.etp
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if have != (tp, pp, ep, etp):
            raise ValueError(
                f"megatron parallel state already initialised with TP x PP x EP x ETP = {have}, asked for "
                f"{(tp, pp, ep, etp)}: engines in one process must share the layout"
            )
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
        logger.info(
            "megatron parallel state: TP %d x PP %d x DP %d, experts EP %d x ETP %d",
            tp,
            pp,
            ps.get_data_parallel_world_size(),
            ep,
            etp,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def check_engine_settings(extra: dict[str, Any], world_size: int, hf_config: Any = None) -> MegatronParallelConfig:
    """The backend's check of a role's engine settings before anything is built (the backend registry exposes it:
    backends/base.py ``check_engine_settings``): the layout ``extra`` asks for on ``world_size`` ranks (ValueError /
    TypeError naming the setting when megatron cannot run it on this world or model; ``hf_config`` None: the model is
    not on disk yet, its checks skipped), and the HF <-> megatron mapping reproduces the model."""
    from backends.megatron.hf_mapping import check_mappable

    layout = MegatronParallelConfig.from_extra(extra)
    layout.validate(world_size, hf_config)
    if hf_config is not None:
        check_mappable(hf_config)
    return layout
