"""Measuring a training step's peak memory with torch's allocator, for the memory plan's tests and benchmark.

``allocator_peak(fn)``: the peak of the bytes torch's CPU allocator held while ``fn`` ran, from the profiler's
allocation events (each ``[memory]`` event is one allocation, +bytes, or free, -bytes, in order). Unlike the
resident set it counts neither the libraries nor untouched pages of an allocation, and it is what CUDA's
``max_memory_allocated`` reports on a GPU.

``engine_step_peak(backend, model_dir, batch, recompute)``: build the backend's engine on this process's rank and
run two ``train_step`` calls (the second has its optimizer state from the first: the steady state a run lives in);
returns (the measured peak, the micro-batch shape the plan needs).
"""

from __future__ import annotations

import torch


def allocator_peak(fn) -> int:
    """Bytes at the peak of torch's CPU allocations while ``fn()`` runs (those made before it count as zero)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = (torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.MKLDNN)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() in cpu]
    events.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def engine_step_peak(backend: str, model_dir: str, batch, recompute: bool = False, extra: dict | None = None):
    """(measured peak bytes of building the engine and two training steps on ``batch`` as one micro-batch, the
    batch's MicroBatchShape); ``extra``: the engine's ``extra`` settings (megatron's layout, DeepSpeed's config)."""
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from backends.memory import MicroBatchShape
    from tests.backends.reference import actor_loss

    mask = batch.batch["attention_mask"]

    def build_and_train():
        engine = get_backend(backend)(
            ModelConfig(path=model_dir, use_remove_padding=True, enable_gradient_checkpointing=recompute),
            OptimConfig(lr=1e-5),
            EngineConfig(micro_batch_size_per_gpu=len(batch), extra=extra or {}),  # one micro-batch
        )
        for _ in range(2):
            engine.train_step(batch, actor_loss, ("log_probs", "entropy"))

    peak = allocator_peak(build_and_train)
    megatron = backend == "megatron"
    micro = MicroBatchShape(
        tokens=mask.numel() if megatron else int(mask.sum()),
        head_positions=int(batch.batch["response_mask"].sum()),
        packed=not megatron,
        recompute=recompute,
        length=mask.shape[1],
    )
    return peak, micro
