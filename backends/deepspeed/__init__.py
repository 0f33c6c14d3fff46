"""DeepSpeed ZeRO-3 training backend: ``DeepSpeedEngine`` (registered as "deepspeed")."""

from backends.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
