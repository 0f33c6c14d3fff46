"""Megatron offload between phases (layer 1, the megatron engine's): verl's ``megatron.param_offload`` /
``grad_offload`` / ``optimizer_offload``. The weights, megatron's float32 gradient buffers and the optimizer's state
(Adam's moments, the float32 main weights of bf16 training) leave the device when a call is done and come back for
the next call that needs them.

Megatron keeps most of this state in large contiguous buffers that many tensors view (each parameter and its
``main_grad`` are slices of its DDP buffers; the distributed optimizer's shards view them too), so a tensor cannot be
replaced by its host copy without breaking those views. What moves is each distinct *storage*: its bytes are copied
to host memory and the storage is resized to nothing, which frees the device memory while every view keeps pointing
at the same storage; onload resizes it back and copies the bytes in, so the views see the same values again.
Gradients are not copied: a train step zeroes them before it accumulates, so their storage is freed and zeroed on
return. The mechanism is the same on CPU (the "device" is then host memory too), which lets the tests check on CPU
that the storages are emptied and refilled bit-exactly; the device memory it frees is measured in tests/gpu.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch


def distinct_storages(
    tensors: Iterable[torch.Tensor], skip: frozenset[int] = frozenset()
) -> list[torch.UntypedStorage]:
    """The storages of ``tensors``, each once (tied weights and views share one), leaving out empty ones and those
    whose data pointer is in ``skip``."""
    out: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in skip:
            out.setdefault(storage.data_ptr(), storage)
    return list(out.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageStash:
    """One kind of state (``collect()`` yields its tensors when the offload happens, so state created later, such as
    Adam's moments after the first step, is included), moved off the device and back. ``keep=False`` drops the
    content (gradients) and refills with zeros."""

    def __init__(self, collect: Callable[[], Iterable[torch.UntypedStorage]], keep: bool = True):
        self.collect, self.keep = collect, keep
        self.moved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []

    def offload(self) -> None:
        if self.moved:
            return
        for storage in self.collect():
            host = None
            if self.keep:
                view = _bytes_of(storage)
                pinned = view.device.type == "cuda"  # a pinned copy is what makes the copy back asynchronous
                host = torch.empty(view.numel(), dtype=torch.uint8, pin_memory=pinned)
                host.copy_(view)
            self.moved.append((storage, storage.nbytes(), host))
            storage.resize_(0)

    def onload(self) -> None:
        for storage, nbytes, host in self.moved:
            storage.resize_(nbytes)
            view = _bytes_of(storage)
            if host is None:
                view.zero_()
            else:
                view.copy_(host, non_blocking=True)
        if self.moved and self.moved[0][0].device.type == "cuda":
            torch.cuda.synchronize()  # the host copies are dropped next
        self.moved = []


def _model_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()


def _grad_buffers(model) -> Iterator[torch.Tensor]:
    """Megatron DDP's gradient buffers (each parameter's ``main_grad`` views one); nothing on a forward-only
    engine."""
    # megatron DDP's own lists (on a plain module ``buffers`` is nn.Module's method: read the instance's attributes)
    attributes = vars(model)
    for buffer in attributes.get("buffers", []) + attributes.get("expert_parallel_buffers", []):
        yield buffer.grad_data


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """The inner torch optimizers' parameters (the float32 main weights with bf16; the model's own otherwise) and
    their state tensors (the step counters stay: they are host scalars); a state tensor whose storage cannot be
    resized is replaced by a copy first (nothing else views it)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            for key, value in list(state.items()):
                if key == "step" or not isinstance(value, torch.Tensor):
                    continue
                if not value.untyped_storage().resizable():
                    # loaded from a checkpoint file on CPU (its storage is the file's, fixed): a copy can be freed
                    state[key] = value = value.clone()
                yield value


class MegatronOffload:
    """The three stashes of one megatron engine and which of them its flags keep offloaded between calls."""

    def __init__(self, module: torch.nn.Module, model, optimizer, flags: tuple[bool, bool, bool]):
        """``module``: the GPTModel (its parameters); ``model``: the DDP-wrapped model (its gradient buffers);
        ``optimizer``: megatron's (None on a forward-only engine); ``flags``: (params, grads, optimizer)."""
        self.flags = flags
        self.params = StorageStash(lambda: distinct_storages(_model_tensors(module)))

        def optimizer_storages():
            # the model's own parameters (an fp32 run's optimizer steps them in place) move with the parameters
            own = {s.data_ptr() for s in distinct_storages(_model_tensors(module))}
            return (
                distinct_storages(_optimizer_tensors(optimizer), skip=frozenset(own)) if optimizer is not None else []
            )

        self.grads = StorageStash(lambda: distinct_storages(_grad_buffers(model)), keep=False)
        self.optimizer = StorageStash(optimizer_storages)

    def offload_all(self) -> None:
        # the optimizer's storages are told apart from the parameters' while both are still allocated
        self.optimizer.offload()
        self.grads.offload()
        self.params.offload()

    def onload(self, optimizer: bool) -> None:
        """Parameters back; gradients and optimizer state too when ``optimizer`` (a train step, a checkpoint)."""
        self.params.onload()
        if optimizer:
            self.grads.onload()
            self.optimizer.onload()

    def offload_per_flags(self) -> None:
        params, grads, optimizer = self.flags
        if optimizer:
            self.optimizer.offload()
        if grads:
            self.grads.offload()
        if params:
            self.params.offload()
