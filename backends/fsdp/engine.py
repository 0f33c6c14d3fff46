"""The FSDP2 training engine: an HF model sharded with ``torch.distributed.fsdp.fully_shard`` over a 1-D
data-parallel mesh, trained with torch AdamW.

One engine per process; every public method is collective (all ranks of the world call it together, with
their own share of the batch). Sharding: each decoder layer is its own FSDP unit, then the root (embeddings,
final norm, head). Gradients are reduce-scattered after every micro-batch's backward and averaged over ranks; each
micro-batch's loss is weighted by its share of the mini-batch's loss units over all ranks (tokens for a token-mean
loss; backends/accumulation.py), so the step equals a single-process step on the whole batch.

The forward / train_step loop, micro-batching and HF export are the HF engines' shared loop (backends/hf_engine.py);
this module supplies the sharding, the plain ``loss.backward()``, torch's gradient clipping and AdamW step, the
checkpoints and the offload of parameters / optimizer state between calls.

Loading: every rank reads the whole HF checkpoint into CPU memory, then ``fully_shard`` keeps its shard (moved to
``cuda:LOCAL_RANK`` when CUDA is available). Simple and exact; for models too large for one host's RAM times
the ranks per host, load on rank 0 only and broadcast (``set_model_state_dict(broadcast_from_rank0=True)``).

Resuming: its own checkpoints on any number of ranks (DCP reshards: backends/fsdp/checkpoint.py); another
backend's, or another layout's, through HF names (``load_portable``: backends/checkpoint/portable.py).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from backends.accumulation import require_trainable
from backends.base import Buckets, as_is, bucketed, register_backend
from backends.checkpoint.meta import resumes_natively, write_checkpoint_meta
from backends.checkpoint.portable import PortableState
from backends.config import EngineConfig, ModelConfig, OptimConfig
from backends.dist import init_distributed
from backends.fsdp.checkpoint import load_checkpoint, save_checkpoint
from backends.fsdp.gather import gather_full
from backends.hf_engine import HFTrainEngine
from backends.hf_model import decoder_layers, torch_dtype
from backends.lora_weights import Item
from backends.optim import build_lr_scheduler, build_optimizer


@register_backend("fsdp")
class FSDPEngine(HFTrainEngine):
    def __init__(self, model_config: ModelConfig, optim_config: OptimConfig | None, engine_config: EngineConfig):
        """``optim_config=None`` builds a forward-only engine (a frozen reference policy): no optimizer state."""
        self._resolve_configs(model_config, optim_config, engine_config)
        init_distributed(self.device, self.engine_config.collective_timeout_s)
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        self.group = self.mesh.get_group()
        model = self._load_hf_model()
        mp_policy = MixedPrecisionPolicy()
        if self.engine_config.mixed_precision:
            mp_policy = MixedPrecisionPolicy(
                param_dtype=torch_dtype(self.engine_config.mixed_precision), reduce_dtype=torch.float32
            )
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=self.mesh, mp_policy=mp_policy)
        self.model = model
        if optim_config is not None:
            self.optimizer = build_optimizer(model.parameters(), optim_config)
            self.scheduler = build_lr_scheduler(self.optimizer, optim_config)
        self._params_offloaded = self._optimizer_offloaded = False
        self._offload_per_flags()

    # ------------------------------------------------------------------------------------------------ hooks
    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # FSDP reduce-scatters (and averages over the ranks) each micro-batch's gradients

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        grad_clip = require_trainable(self.optim_config).grad_clip
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _apply_update(self) -> None:
        self.optimizer.step()

    def _end_step(self, skipped: bool) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._schedule().step()

    def _gathered_buckets(self, bucket_bytes: int, skip, adapter: bool) -> Buckets:
        """Without LoRA: each bucket's tensors gathered together, one all-gather per bucket (backends/fsdp/gather.py),
        instead of one per tensor. With LoRA, the shared path (its items merge or pick tensors as they are drawn)."""
        if self.lora is not None:
            yield from super()._gathered_buckets(bucket_bytes, skip, adapter)
            return
        with self._on_device(optimizer=False):
            state = [(n, v) for n, v in self.model.state_dict().items() if n not in skip]
            sharded = ((n, v.numel() * v.element_size(), partial(as_is, v)) for n, v in state)
            for bucket in bucketed(sharded, bucket_bytes):
                yield list(zip([n for n, _ in bucket], gather_full([v for _, v in bucket], self.group)))

    def _param_items(self) -> list[Item]:
        """The state dict's DTensors; ``get`` gathers one (``full_tensor``, collective)."""

        def full(value) -> torch.Tensor:
            return (value.full_tensor() if isinstance(value, DTensor) else value).detach()

        return [
            (name, value.numel() * value.element_size(), partial(full, value))
            for name, value in self.model.state_dict().items()
        ]

    # -------------------------------------------------------------------------------------------- checkpoint
    def save(self, path: str) -> None:
        if dist.get_rank() == 0:
            write_checkpoint_meta(self, path, "fsdp", {"dp": dist.get_world_size()}, self.tied_names)
        with self._on_device(optimizer=True):
            extra = {"global_step": self.global_step}
            save_checkpoint(path, self.model, self.optimizer, self.scheduler, extra, trainable_only=self.has_adapter)

    def load(self, path: str) -> None:
        if not resumes_natively(path, "fsdp"):  # DCP reshards fsdp's own on any number of ranks
            return self.load_portable(path)
        with self._on_device(optimizer=True):
            extra = load_checkpoint(path, self.model, self.optimizer, self.scheduler, trainable_only=self.has_adapter)
        self.global_step = int(extra.get("global_step", 0))

    def _set_portable(self, state: PortableState) -> None:
        """Each parameter's and moment's shard (DTensor, sharded as the parameter) cut from the full tensor that
        every rank holds, so no rank sends anything."""

        def shard(full: torch.Tensor, like: DTensor) -> DTensor:
            full = full.to(device=like.device, dtype=like.dtype)
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)

        for name, p in self.model.named_parameters():
            assert isinstance(p, DTensor)  # fully_shard made every parameter one
            p.to_local().copy_(shard(state.params[name], p).to_local())
            if self.optimizer is not None and p.requires_grad:
                moments = {key: shard(state.moment(key, name), p) for key in ("exp_avg", "exp_avg_sq")}
                self.optimizer.state[p] = {"step": torch.tensor(float(state.step)), **moments}

    # -------------------------------------------------------------------------------------------- offload
    def offload(self) -> None:
        """Parameters and optimizer state to CPU (on a CPU-only machine they already are: moves are no-ops)."""
        self._move_params(torch.device("cpu"))
        self._move_optimizer(torch.device("cpu"))

    def onload(self) -> None:
        self._move_params(self.device)
        self._move_optimizer(self.device)

    def _move_params(self, device: torch.device) -> None:
        self.model.to(device)  # FSDP2 re-registers its sharded parameters after a module move
        self._params_offloaded = device.type == "cpu" and self.device.type != "cpu"
        if self.device.type == "cuda" and device.type == "cpu":
            torch.cuda.empty_cache()

    def _move_optimizer(self, device: torch.device) -> None:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            if device.type == "cpu":
                torch.cuda.empty_cache()
        self._optimizer_offloaded = device.type == "cpu" and self.device.type != "cpu"

    @contextlib.contextmanager
    def _on_device(self, optimizer: bool):
        """Bring offloaded state back for the duration of a call, then offload again per the config flags."""
        if self._params_offloaded:
            self._move_params(self.device)
        if optimizer and self._optimizer_offloaded:
            self._move_optimizer(self.device)
        try:
            yield
        finally:
            self._offload_per_flags()

    def _offload_per_flags(self) -> None:
        if self.engine_config.param_offload:
            self._move_params(torch.device("cpu"))
        if self.engine_config.optimizer_offload:
            self._move_optimizer(torch.device("cpu"))
