"""Megatron-core training backend: ``MegatronEngine`` (registered as "megatron"): TP x PP x DP on megatron's
GPTModel, with the HF <-> Megatron weight mapping (hf_mapping.py), model building (model.py), vocab-parallel
outputs (ops.py), weight export (export.py), the parallel layout (parallel.py) and the CPU shim (cpu_shim.py).
megatron-core is imported only when an engine is built."""

from backends.megatron.engine import MegatronEngine

__all__ = ["MegatronEngine"]
