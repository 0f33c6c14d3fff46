"""Rollout engines (layer 1): vllm and hf, behind one RolloutEngine interface.

The registry in base.py imports each built-in engine module on first lookup (``get_rollout("vllm")``); the
modules themselves import vLLM / transformers only when an engine is constructed.
"""

from backends.rollout.base import RolloutConfig, RolloutEngine, SamplingConfig, get_rollout, register_rollout

__all__ = ["RolloutConfig", "RolloutEngine", "SamplingConfig", "get_rollout", "register_rollout"]
