"""The DeepSpeed ZeRO stage-3 training engine: an HF model whose parameters, gradients and optimizer state are
partitioned over the data-parallel ranks (``p.ds_tensor`` holds this rank's slice), trained with torch AdamW as a
DeepSpeed client optimizer.

Same contract as the FSDP engine (backends/fsdp/engine.py): every public method is collective, micro-batches
come from backends/batching.py (the ranks agree on one count), each micro-batch's loss is weighted by its share of
the mini-batch's loss units over all ranks (backends/accumulation.py), and one ``train_step`` is one optimizer step.

Gradient accumulation is driven by the engine, not by DeepSpeed's micro-step counter: DeepSpeed runs with
``managed_gradient_accumulation: false``, so ``backward`` only accumulates (reduce-scattered, averaged over
ranks) and every ``step()`` is the boundary: clip (``OptimConfig.grad_clip``, 0 = off), AdamW, LR schedule
(backends/optim.py, stepped by DeepSpeed). ``backward(..., scale_wrt_gas=False)``: the scale is ours.

Mixed precision (``EngineConfig.mixed_precision="bfloat16"``) uses DeepSpeed's ``torch_autocast``: parameters
and optimizer state stay in ``ModelConfig.dtype`` (like FSDP's MixedPrecisionPolicy); compute runs in bf16.
``param_offload`` / ``optimizer_offload`` become ZeRO-3's ``offload_param`` / ``offload_optimizer`` (device
cpu; torch AdamW runs on the CPU copy). ``EngineConfig.extra["deepspeed_config"]`` is merged over the generated
config (top-level keys; "zero_optimization" merged key by key).

Checkpoints: DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint`` (partitioned model + optimizer + LR
scheduler, tag "state") plus one ``extra_rank{R}.pt`` per rank with the RNG states and the step counter. A
forward-only engine (no optimizer: DeepSpeed cannot checkpoint it) saves each rank's parameter partitions instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from backends.accumulation import Accumulation
from backends.base import MODEL_INPUTS, Buckets, LossFn, TrainEngine, bucketed, register_backend
from backends.batching import Partition, restore_order
from backends.config import EngineConfig, ModelConfig, OptimConfig, resolve_precision
from backends.dist import agreed_partition, free_port, local_device, rng_state, set_rng_state
from backends.hf_checkpoint import write_hf_checkpoint
from backends.hf_model import build_model, check_outputs, forward_micro_batch, tied_duplicate_names
from backends.optim import build_lr_scheduler, build_optimizer
from scaletrain.protocol import DataProto

logger = logging.getLogger(__name__)

CKPT_TAG = "state"


def init_deepspeed_distributed(device: torch.device, timeout_s: float) -> None:
    """``deepspeed.init_distributed`` (gloo on CPU, nccl on CUDA) unless already initialised; without RANK /
    WORLD_SIZE in the environment, a one-process group on a free local port."""
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 - load it so sys.modules holds the module (the name is shadowed)

    if device.type == "cpu":  # training never needs the shm all-reduce op; its JIT build takes minutes
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if not dist.is_initialized():
            os.environ.update(
                RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
            )
    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo",
        auto_mpi_discovery=False,
        verbose=False,
        timeout=timedelta(seconds=timeout_s),
    )


def deepspeed_config(optim_config: OptimConfig | None, engine_config: EngineConfig, world_size: int) -> dict:
    micro = engine_config.micro_batch_size_per_gpu
    zero: dict = {"stage": 3}
    if engine_config.param_offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if engine_config.optimizer_offload and optim_config is not None:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": micro * world_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max(0.0, optim_config.grad_clip) if optim_config is not None else 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 62,
        "wall_clock_breakdown": False,
    }
    if engine_config.mixed_precision:
        config["torch_autocast"] = {"enabled": True, "dtype": engine_config.mixed_precision}
    extra = dict(engine_config.extra.get("deepspeed_config", {}))
    config["zero_optimization"].update(extra.pop("zero_optimization", {}))
    config.update(extra)
    return config


@register_backend("deepspeed")
class DeepSpeedEngine(TrainEngine):
    dispatch = "DP_COMPUTE_PROTO"

    def __init__(self, model_config: ModelConfig, optim_config: OptimConfig | None, engine_config: EngineConfig):
        """``optim_config=None`` builds a forward-only engine (ZeRO-3 partitioned parameters, no optimizer)."""
        import deepspeed

        self.device = local_device()
        model_config, engine_config = resolve_precision(
            model_config, engine_config, self.device.type, trainable=optim_config is not None
        )
        self.model_config, self.optim_config, self.engine_config = model_config, optim_config, engine_config
        init_deepspeed_distributed(self.device, engine_config.collective_timeout_s)

        torch.manual_seed(engine_config.seed)  # same fresh heads (value/reward) on every rank
        model = build_model(model_config)
        self.architecture = type(model).__name__
        self.tied_names = tied_duplicate_names(model)
        self.hf_config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        kwargs = {}
        if optim_config is None:
            model.requires_grad_(False)
        else:
            optimizer = build_optimizer(model.parameters(), optim_config)
            kwargs = {"optimizer": optimizer, "lr_scheduler": lambda opt: build_lr_scheduler(opt, optim_config)}
        config = deepspeed_config(optim_config, engine_config, dist.get_world_size())
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(model=model, config=config, **kwargs)
        self.model = self.ds.module
        self.global_step = 0

    # ------------------------------------------------------------------------------------------ properties
    @property
    def dp_rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_size(self) -> int:
        return dist.get_world_size()

    # --------------------------------------------------------------------------------------- micro-batching
    def _partition(self, batch: DataProto) -> Partition:
        return agreed_partition(batch, self.engine_config, self.device)

    def _forward(self, micro: DataProto, outputs: tuple[str, ...], temperature: float) -> dict[str, torch.Tensor]:
        inputs = {k: micro.batch[k].to(self.device) for k in MODEL_INPUTS if k in micro.batch.keys()}
        # through the DeepSpeed engine: its forward sets up autocast and the ZeRO-3 backward hooks
        return forward_micro_batch(
            self.ds,
            inputs,
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
        self.ds.eval()
        parts = self._partition(inputs)
        results = []
        with torch.no_grad():
            for part in parts:
                out = self._forward(inputs.select_idxs(part), outputs, temperature)
                results.append({k: v.float().cpu() for k, v in out.items()})
        order = restore_order(parts)
        return DataProto.from_dict({k: torch.cat([r[k] for r in results])[order] for k in outputs})

    def train_step(self, mini_batch: DataProto, loss_fn: LossFn, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        """Metrics as the FSDP engine's: the whole mini-batch's ``loss`` and loss_fn metrics, the global
        ``grad_norm`` (before clipping), the ``lr`` this step used, ``step_skipped`` (non-finite gradient norm)."""
        if self.optim_config is None:
            raise RuntimeError("train_step on a forward-only engine (built with optim_config=None)")
        outputs = check_outputs(self.model_config.kind, outputs)
        temperature = float(mini_batch.meta_info.get("temperature", 1.0))
        self.ds.train()
        micros = [mini_batch.select_idxs(part) for part in self._partition(mini_batch)]
        acc = Accumulation(loss_fn, micros, self.device)
        for i, micro in enumerate(micros):
            micro = micro.to(self.device)
            out = self._forward(micro, outputs, temperature)
            loss, metrics = loss_fn(out, micro)
            self.ds.backward(loss * acc.grad_scale(i), scale_wrt_gas=False)
            acc.add(i, loss.detach(), metrics)
        sums = acc.metrics()
        lr = self.scheduler.get_last_lr()[0]
        self.ds.step()  # the boundary: clip, AdamW, LR schedule, zero the gradients
        skipped = not self.ds.was_step_applied()
        grad_norm = self.ds.get_global_grad_norm()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        if skipped:
            logger.warning("non-finite grad norm %s at step %d: optimizer step skipped", grad_norm, self.global_step)
            self.scheduler.step()  # DeepSpeed does not advance the schedule on a skipped step; FSDP does
        self.global_step += 1
        return {**sums, "grad_norm": grad_norm, "lr": lr, "step_skipped": float(skipped)}

    # -------------------------------------------------------------------------------------------- weights
    def export_weights(self, bucket_bytes: int = 256 << 20) -> Buckets:
        return self._full_tensor_buckets(bucket_bytes, skip=())

    def _full_tensor_buckets(self, bucket_bytes: int, skip) -> Buckets:
        """Gathers one parameter at a time (``GatheredParameters``), in HF state_dict order; a bucket is yielded
        before the next tensor would overflow it, so at most one bucket plus one parameter is ever full-size."""
        import deepspeed

        def full(value) -> torch.Tensor:
            if not hasattr(value, "ds_id"):
                return value.detach().clone()
            with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
                return value.detach().clone()

        items = (
            (name, math.prod(getattr(value, "ds_shape", value.shape)) * value.dtype.itemsize, partial(full, value))
            for name, value in self.model.state_dict(keep_vars=True).items()
            if name not in skip
        )
        yield from bucketed(items, bucket_bytes)

    def save_hf(self, path: str, shard_bytes: int = 1 << 30) -> None:
        """Config + safetensors (+ tokenizer files of the source model), written by rank 0; collective."""
        write_hf_checkpoint(
            path,
            self._full_tensor_buckets(shard_bytes, skip=self.tied_names),
            self.hf_config,
            self.architecture,
            is_writer=dist.get_rank() == 0,
            generation_config=self.generation_config,
            tokenizer_dir=self.model_config.path,
        )
        dist.barrier()

    # -------------------------------------------------------------------------------------------- checkpoint
    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        if self.optim_config is None:  # DeepSpeed checkpoints need an optimizer: save this rank's partitions
            torch.save({k: v.detach().clone() for k, v in self._partitions().items()}, self._partitions_file(path))
        else:
            self.ds.save_checkpoint(path, tag=CKPT_TAG, save_latest=False)
        torch.save(
            {"rng": rng_state(), "global_step": self.global_step}, os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
        )
        dist.barrier()

    def load(self, path: str) -> None:
        extra_file = os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
        if not os.path.isfile(extra_file):
            raise FileNotFoundError(f"{extra_file} not found: was the checkpoint written with a different world size?")
        if self.optim_config is None:
            saved = torch.load(self._partitions_file(path), weights_only=True)
            with torch.no_grad():
                for name, part in self._partitions().items():
                    part.copy_(saved[name])
        else:
            load_path, _ = self.ds.load_checkpoint(
                path, tag=CKPT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            if load_path is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint '{CKPT_TAG}' under {path}")
        extra = torch.load(extra_file, weights_only=False)
        set_rng_state(extra["rng"])
        self.global_step = int(extra["global_step"])
        dist.barrier()

    def _partitions(self) -> dict[str, torch.Tensor]:
        """This rank's ZeRO-3 slices of the parameters (the tensors themselves: writing them updates the model)."""
        return {name: p.ds_tensor for name, p in self.model.named_parameters()}

    @staticmethod
    def _partitions_file(path: str) -> str:
        return os.path.join(path, f"frozen_params_rank{dist.get_rank()}.pt")

    # -------------------------------------------------------------------------------------------- offload
    def offload(self) -> None:
        """Partitioned parameters and optimizer state to CPU (no-op on a CPU-only machine, or when ZeRO offload
        already keeps them there)."""
        if self.device.type == "cpu" or self.engine_config.param_offload or self.optim_config is None:
            return
        with contextlib.suppress(AttributeError):
            self.ds.offload_states()
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type == "cpu" or self.engine_config.param_offload or self.optim_config is None:
            return
        with contextlib.suppress(AttributeError):
            self.ds.reload_states()
