"""Rollout engines (layer 1): vllm and hf, behind one RolloutEngine interface.

Importing this package registers both engines (``get_rollout("vllm")`` / ``get_rollout("hf")``) without importing
vLLM or transformers: each engine imports its library when it is constructed.
"""

from backends.rollout import hf, vllm_engine  # noqa: F401  (registers "hf" and "vllm")
from backends.rollout.base import RolloutConfig, RolloutEngine, SamplingConfig, get_rollout, register_rollout

__all__ = ["RolloutConfig", "RolloutEngine", "SamplingConfig", "get_rollout", "register_rollout"]
