"""The megatron backend's check of a role's engine settings, before anything is built (layer 1): the layout in
``EngineConfig.extra["megatron"]`` fits the world and the model, and the HF <-> megatron mapping reproduces the
model. The backend registry exposes it (backends/base.py ``check_engine_settings``), so the trainer's config check
runs it without naming megatron."""

from __future__ import annotations

from typing import Any

from backends.megatron.hf_mapping import check_mappable
from backends.megatron.parallel import MegatronParallelConfig


def check_engine_settings(extra: dict[str, Any], world_size: int, hf_config: Any = None) -> MegatronParallelConfig:
    """The layout ``extra`` asks for on ``world_size`` ranks (ValueError / TypeError naming the setting when megatron
    cannot run it on this world or model; ``hf_config`` None: the model is not on disk yet, its checks skipped)."""
    layout = MegatronParallelConfig.from_extra(extra)
    layout.validate(world_size, hf_config)
    if hf_config is not None:
        check_mappable(hf_config)
    return layout
