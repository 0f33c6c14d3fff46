"""CPU compatibility patches for megatron-core (pinned: megatron-core==0.16.1, setup.py extra ``megatron``).

megatron-core assumes CUDA in a handful of places that matter for training on CPU with gloo. ``apply_cpu_shim()``
patches them, once per process, and only when ``torch.cuda.is_available()`` is False; the Megatron engine calls it
right before it first touches megatron-core (never at import of scaletrain). Re-check every item when bumping the
pinned version. The items (the code below refers to their numbers):

1. ``torch.cuda.current_device()`` is used as a device argument -> returns "cpu".
2. ``torch.cuda.synchronize()`` in p2p communication -> no-op.
3. ``Tensor.cuda()`` (tied embeddings with PP move the shared weight) -> identity.
4. hard-coded ``device="cuda"`` (schedules, default causal mask, optimizer, clip_grads) -> a process-wide
   ``TorchFunctionMode`` rewrites a "cuda" device argument to "cpu". Torch function modes are off inside
   ``autograd.Function.forward`` (megatron's activation recompute), so the causal masks built there are patched
   directly.
5. the CUDA RNG tracker -> its get/set state helpers map onto the CPU generator.
6. clip_grads asserts CUDA grad types -> covered by item 8 (the norm/clip itself is device-agnostic torch code
   once item 4 rewrites its "cuda" buffers).
7. torch norms refuse sequence parallel -> built with sequence_parallel off, then their parameters are tagged
   ``sequence_parallel=True`` (so their gradients are all-reduced over the TP group like Megatron's own norms).
8. optimizers check ``param.type() == 'torch.cuda.FloatTensor'`` -> ``Tensor.type()`` without arguments reports
   the CUDA type string for CPU tensors.
9. gloo sends contiguous tensors only: under PP x TP (sequence parallel) a mixture-of-experts stage's training
   output reaches the pipeline's ``isend`` non-contiguous (RuntimeError on that stage, the next one left waiting in
   its ``irecv``) -> the same mode sends a contiguous copy (a send's buffer is read, never written).
10. megatron-core >= 0.17 (not the pinned 0.16.1) asks ``torch.cuda.current_stream()`` in DDP's ``start_grad_sync``
   on every gradient sync, to wait for CUDA-graph events (none on CPU) -> a stream whose waits do nothing. With it,
   0.19.2 (Python >= 3.12) passed the megatron engine and MoE parity tests on CPU (docs/backends.md).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

PINNED_VERSION = "0.16.1"
_applied = False
_mode = None


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


_SENDS = (torch.distributed.isend, torch.distributed.send)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites a "cuda" ``device`` argument (keyword, or the first positional of ``Tensor.to``) to "cpu"; sends a
    non-contiguous tensor's contiguous copy (item 9)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func in _SENDS and args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
            args = (args[0].contiguous(), *args[1:])  # 9
        return func(*args, **kwargs)


class _NullStream:
    """Item 10: the stream megatron-core >= 0.17 waits on for CUDA-graph events; on CPU there are none."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def apply_cpu_shim() -> bool:
    """Apply the patches (idempotent); returns True when they are (or were already) in effect."""
    global _applied, _mode
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    import megatron.core
    from megatron.core.tensor_parallel import random as mg_random  # imported before any patch (the order checked)
    from megatron.core.transformer import torch_norm

    version = getattr(megatron.core, "__version__", "?")
    if version != PINNED_VERSION:
        logger.warning("megatron-core %s: the CPU shim was checked against %s only", version, PINNED_VERSION)

    torch.cuda.current_device = lambda: "cpu"  # 1
    torch.cuda.synchronize = lambda *a, **k: None  # 2
    torch.Tensor.cuda = lambda self, *a, **k: self  # 3
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # 10
    _mode = _CudaToCpuMode()  # 4
    _mode.__enter__()  # stays pushed for the life of the process
    _patch_causal_masks()  # built inside autograd.Function.forward under recompute, where modes are off
    _patch_rng_tracker(mg_random)  # 5
    _patch_torch_norm(torch_norm)  # 7
    _patch_tensor_type()  # 8 (and 6)
    _applied = True
    logger.info("megatron-core CPU shim applied")
    return True


def _patch_rng_tracker(mg_random) -> None:
    """Item 5: megatron's CUDA RNG tracker (module ``mg_random``) saves and restores states through the CPU
    generator."""

    def get_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mg_random._get_cuda_rng_state = get_state
    mg_random._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: None  # the tracker seeds a side state; CPU keeps one generator


def _patch_torch_norm(torch_norm) -> None:
    """Item 7: torch norms (module ``torch_norm``) under sequence parallelism, built without it and tagged for the
    TP all-reduce."""

    original_new = torch_norm.WrappedTorchNorm.__new__

    def norm_new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        norm = original_new(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = norm_new


def _patch_tensor_type() -> None:
    """Item 8: ``Tensor.type()`` without arguments reports the CUDA type string for CPU float tensors."""
    original_type = torch.Tensor.type
    cuda_names = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    def tensor_type(self, *args, **kwargs):
        result = original_type(self, *args, **kwargs)
        if not args and not kwargs:
            return cuda_names.get(result, result)
        return result

    # a monkeypatch of torch's method (typed by overloads this wrapper does not restate)
    torch.Tensor.type = tensor_type  # pyright: ignore[reportAttributeAccessIssue]


def _patch_causal_masks() -> None:
    """CPU versions of megatron's default and sliding-window causal masks (hard-coded device="cuda"). Activation
    recompute builds them inside ``torch.autograd.Function.forward``, where torch function modes are disabled."""
    from functools import lru_cache

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    @lru_cache(maxsize=16)
    def default_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    def sliding_window_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    for module in (utils, fused_softmax):  # monkeypatches of megatron's module functions
        module.get_default_causal_mask = default_mask  # pyright: ignore[reportAttributeAccessIssue]
        module.get_sliding_window_causal_mask = sliding_window_mask  # pyright: ignore[reportAttributeAccessIssue]
