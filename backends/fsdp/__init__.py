"""FSDP2 training backend: ``FSDPEngine`` (registered as "fsdp"), with its distributed set-up (dist.py) and
DCP checkpoints (checkpoint.py)."""

from backends.fsdp.engine import FSDPEngine

__all__ = ["FSDPEngine"]
