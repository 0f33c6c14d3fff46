"""The FSDP2 training engine: an HF model sharded with ``torch.distributed.fsdp.fully_shard`` over a 1-D
data-parallel mesh, trained with torch AdamW.

One engine per process; every public method is collective (all ranks of the world call it together, with
their own share of the batch). Sharding: each decoder layer is its own FSDP unit, then the root (embeddings,
final norm, head). Gradients are reduce-scattered after every micro-batch's backward and averaged over ranks; each
micro-batch's loss is weighted by its share of the mini-batch's loss units over all ranks (tokens for a token-mean
loss; backends/accumulation.py), so the step equals a single-process step on the whole batch.

Batches are DataProtos in verl's layout (see backends/base.py); ``meta_info["temperature"]`` (default 1) divides
the logits before log-probs/entropy. Micro-batches: ``micro_batch_size_per_gpu`` rows, or with
``use_dynamic_bsz`` a token budget (backends/batching.py); the ranks agree on one micro-batch count.

Loading: every rank reads the whole HF checkpoint into CPU memory, then ``fully_shard`` keeps its shard (moved to
``cuda:LOCAL_RANK`` when CUDA is available). Simple and exact; for models too large for one host's RAM times
the ranks per host, load on rank 0 only and broadcast (``set_model_state_dict(broadcast_from_rank0=True)``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from backends.accumulation import Accumulation
from backends.base import MODEL_INPUTS, Buckets, LossFn, TrainEngine, bucketed, register_backend
from backends.batching import Partition, restore_order
from backends.config import EngineConfig, ModelConfig, OptimConfig, resolve_precision
from backends.dist import agreed_partition, init_distributed, local_device
from backends.fsdp.checkpoint import load_checkpoint, save_checkpoint
from backends.hf_checkpoint import write_hf_checkpoint
from backends.hf_model import (
    build_model,
    check_outputs,
    decoder_layers,
    forward_micro_batch,
    tied_duplicate_names,
    torch_dtype,
)
from backends.optim import build_lr_scheduler, build_optimizer
from scaletrain.protocol import DataProto

logger = logging.getLogger(__name__)


@register_backend("fsdp")
class FSDPEngine(TrainEngine):
    dispatch = "DP_COMPUTE_PROTO"

    def __init__(self, model_config: ModelConfig, optim_config: OptimConfig | None, engine_config: EngineConfig):
        """``optim_config=None`` builds a forward-only engine (a frozen reference policy): no optimizer state."""
        self.device = local_device()
        model_config, engine_config = resolve_precision(
            model_config, engine_config, self.device.type, trainable=optim_config is not None
        )
        self.model_config, self.optim_config, self.engine_config = model_config, optim_config, engine_config
        init_distributed(self.device, engine_config.collective_timeout_s)
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        self.group = self.mesh.get_group()

        torch.manual_seed(engine_config.seed)  # same fresh heads (value/reward) on every rank
        model = build_model(model_config)
        self.architecture = type(model).__name__  # before fully_shard renames the class
        self.tied_names = tied_duplicate_names(model)
        if optim_config is None:
            model.requires_grad_(False)
        mp_policy = MixedPrecisionPolicy()
        if engine_config.mixed_precision:
            mp_policy = MixedPrecisionPolicy(
                param_dtype=torch_dtype(engine_config.mixed_precision), reduce_dtype=torch.float32
            )
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=self.mesh, mp_policy=mp_policy)
        self.model = model
        self.optimizer = self.scheduler = None
        if optim_config is not None:
            self.optimizer = build_optimizer(model.parameters(), optim_config)
            self.scheduler = build_lr_scheduler(self.optimizer, optim_config)
        self.global_step = 0
        self._params_offloaded = self._optimizer_offloaded = False
        self._offload_per_flags()

    # ------------------------------------------------------------------------------------------ properties
    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.mesh.size()

    # --------------------------------------------------------------------------------------- micro-batching
    def _partition(self, batch: DataProto) -> Partition:
        return agreed_partition(batch, self.engine_config, self.device, self.group)

    def _micro_inputs(self, micro: DataProto) -> dict[str, torch.Tensor]:
        return {k: micro.batch[k].to(self.device) for k in MODEL_INPUTS if k in micro.batch.keys()}

    def _forward(self, micro: DataProto, outputs: tuple[str, ...], temperature: float) -> dict[str, torch.Tensor]:
        return forward_micro_batch(
            self.model,
            self._micro_inputs(micro),
            outputs,
            kind=self.model_config.kind,
            remove_padding=self.model_config.use_remove_padding,
            temperature=temperature,
            chunk_size=self.engine_config.entropy_chunk_size,
        )

    # -------------------------------------------------------------------------------------------- compute
    def forward(self, batch: DataProto, outputs: tuple[str, ...] = ("log_probs",)) -> DataProto:
        outputs = check_outputs(self.model_config.kind, outputs)
        temperature = float(batch.meta_info.get("temperature", 1.0))
        inputs = batch.select(batch_keys=[k for k in MODEL_INPUTS if k in batch.batch.keys()], non_tensor_batch_keys=[])
        with self._on_device(optimizer=False):
            self.model.eval()
            parts = self._partition(inputs)
            results = []
            with torch.no_grad():
                for part in parts:
                    out = self._forward(inputs.select_idxs(part), outputs, temperature)
                    results.append({k: v.float().cpu() for k, v in out.items()})
        order = restore_order(parts)
        return DataProto.from_dict({k: torch.cat([r[k] for r in results])[order] for k in outputs})

    def train_step(self, mini_batch: DataProto, loss_fn: LossFn, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        """Metrics are the whole mini-batch's (all DP ranks; backends/accumulation.py): ``loss`` and loss_fn's
        metrics, plus the global ``grad_norm`` (before clipping), the ``lr`` this step used and ``step_skipped``
        (1.0 when a non-finite gradient norm skipped the optimizer step)."""
        if self.optimizer is None:
            raise RuntimeError("train_step on a forward-only engine (built with optim_config=None)")
        outputs = check_outputs(self.model_config.kind, outputs)
        temperature = float(mini_batch.meta_info.get("temperature", 1.0))
        with self._on_device(optimizer=True):
            self.model.train()
            micros = [mini_batch.select_idxs(part) for part in self._partition(mini_batch)]
            acc = Accumulation(loss_fn, micros, self.device, self.group)
            for i, micro in enumerate(micros):
                micro = micro.to(self.device)
                out = self._forward(micro, outputs, temperature)
                loss, metrics = loss_fn(out, micro)
                (loss * acc.grad_scale(i)).backward()
                acc.add(i, loss.detach(), metrics)
            sums = acc.metrics()
            grad_norm = self._clip_grads()
            lr = self.scheduler.get_last_lr()[0]
            skipped = not math.isfinite(grad_norm)
            if skipped:
                logger.warning(
                    "non-finite grad norm %s at step %d: optimizer step skipped", grad_norm, self.global_step
                )
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.global_step += 1
        return {**sums, "grad_norm": grad_norm, "lr": lr, "step_skipped": float(skipped)}

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.optim_config.grad_clip if self.optim_config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    # -------------------------------------------------------------------------------------------- weights
    def export_weights(self, bucket_bytes: int = 256 << 20) -> Buckets:
        return self._full_tensor_buckets(bucket_bytes, skip=())

    def _full_tensor_buckets(self, bucket_bytes: int, skip) -> Buckets:
        """Gathers one parameter at a time; a bucket is yielded before the next tensor would overflow it."""

        def full(value) -> torch.Tensor:
            return (value.full_tensor() if isinstance(value, DTensor) else value).detach()

        with self._on_device(optimizer=False):
            yield from bucketed(
                (
                    (name, value.numel() * value.element_size(), partial(full, value))
                    for name, value in self.model.state_dict().items()
                    if name not in skip
                ),
                bucket_bytes,
            )

    def save_hf(self, path: str, shard_bytes: int = 1 << 30) -> None:
        """Config + safetensors (+ tokenizer files of the source model), written by rank 0; collective."""
        model = self.model
        write_hf_checkpoint(
            path,
            self._full_tensor_buckets(shard_bytes, skip=self.tied_names),
            model.config,
            self.architecture,
            is_writer=dist.get_rank() == 0,
            generation_config=getattr(model, "generation_config", None),
            tokenizer_dir=self.model_config.path,
        )
        dist.barrier()

    # -------------------------------------------------------------------------------------------- checkpoint
    def save(self, path: str) -> None:
        with self._on_device(optimizer=True):
            save_checkpoint(path, self.model, self.optimizer, self.scheduler, {"global_step": self.global_step})

    def load(self, path: str) -> None:
        with self._on_device(optimizer=True):
            extra = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.global_step = int(extra.get("global_step", 0))

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
