"""The DeepSpeed ZeRO stage-3 training engine: an HF model whose parameters, gradients and optimizer state are
partitioned over the data-parallel ranks (``p.ds_tensor`` holds this rank's slice), trained with torch AdamW as a
DeepSpeed client optimizer.

Same contract and the same loop as the FSDP engine (backends/hf_engine.py, shared): every public method is
collective, micro-batches come from backends/batching.py (the ranks agree on one count), each micro-batch's loss is
weighted by its share of the mini-batch's loss units over all ranks (backends/accumulation.py), and one
``train_step`` is one optimizer step. This module supplies DeepSpeed's backward, step, gather and checkpoints.

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
Another backend's checkpoint, or one of another data-parallel size, resumes through HF names (``load_portable``:
backends/checkpoint/portable.py). Every file loads with ``torch.load(weights_only=True)``
(backends/checkpoint/safe_load.py): the extra and partition files directly, DeepSpeed's own through its checkpoint
engine's ``load``, replaced on this engine's instance (DeepSpeed's loads with ``weights_only=False``), with the two
DeepSpeed classes its optimizer states hold allowed.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from backends.base import Buckets, as_is, bucketed, register_backend
from backends.checkpoint.meta import resumes_natively, write_checkpoint_meta
from backends.checkpoint.portable import PortableState
from backends.checkpoint.safe_load import load_rank_file
from backends.config import EngineConfig, ModelConfig, OptimConfig
from backends.dist import RowShard, gather_row_shards, row_chunks
from backends.hf_engine import HFTrainEngine
from backends.lora_weights import Item
from backends.optim import build_lr_scheduler, build_optimizer
from scaletrain.utils.net import free_port
from scaletrain.utils.seeding import rng_state, set_rng_state

CKPT_TAG = "state"


def init_deepspeed_distributed(device: torch.device, timeout_s: float) -> None:
    """``deepspeed.init_distributed`` (gloo on CPU, nccl on CUDA) unless already initialised; without RANK /
    WORLD_SIZE in the environment, a one-process group on a free local port."""
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 - load it so sys.modules holds the module (the name is shadowed)

    if device.type == "cpu":  # training never needs the shm all-reduce op; its JIT build takes minutes
        # a monkeypatch of DeepSpeed's module
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # pyright: ignore[reportAttributeAccessIssue]
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


def deepspeed_checkpoint_classes() -> tuple:
    """The DeepSpeed classes its optimizer states hold (a ZeRO stage enum and a loss scaler: attributes set on an
    instance, no constructor or method of theirs runs), allowed in a weights-only load."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum, LossScaler, DynamicLossScaler


def _load_deepspeed_file(path: str, map_location=None):
    """DeepSpeed's checkpoint-engine ``load`` with ``weights_only=True``."""
    return load_rank_file(path, map_location, allowed=deepspeed_checkpoint_classes())


def _row_shards(params: list[Any]) -> list[RowShard] | None:
    """This rank's ZeRO-3 partitions of ``params`` as row shards of their flattened tensors (rank r holds elements
    [r c, r c + c) of c = ceil(numel / world), padded at the end), for one grouped all-gather; None where DeepSpeed's
    own gather must run: no partitioned parameter, ZeRO++ secondary partitions or quantized weights, a parameter
    still gathered (its release is DeepSpeed's), several process groups, a partition of another size, host
    partitions (parameter offload) under NCCL."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if not params:
        return None
    group = params[0].ds_process_group
    world, rank, nccl = dist.get_world_size(group), dist.get_rank(group), dist.get_backend(group) == "nccl"
    shards = []
    for param in params:
        part = param.ds_tensor
        chunk, counts = row_chunks(param.ds_numel, world)
        special = getattr(param, "ds_secondary_tensor", None) is not None or hasattr(part, "ds_quant_scale")
        special = special or param.ds_status != ZeroParamStatus.NOT_AVAILABLE  # left gathered: DeepSpeed releases it
        if special or param.ds_process_group is not group or part.numel() != chunk or (nccl and not part.is_cuda):
            return None
        shards.append(RowShard(part.reshape(-1)[: counts[rank]], torch.Size([param.ds_numel])))
    return shards


def _full(gathered: dict[int, torch.Tensor], value: Any) -> torch.Tensor:
    """A bucket's tensor whole: its gathered flat tensor in its shape, or a copy of one ZeRO-3 does not partition."""
    full = gathered.get(id(value))
    return full.view(value.ds_shape) if full is not None else value.detach().clone()


@register_backend("deepspeed")
class DeepSpeedEngine(HFTrainEngine):
    def __init__(self, model_config: ModelConfig, optim_config: OptimConfig | None, engine_config: EngineConfig):
        """``optim_config=None`` builds a forward-only engine (ZeRO-3 partitioned parameters, no optimizer)."""
        import deepspeed

        self._resolve_configs(model_config, optim_config, engine_config)
        init_deepspeed_distributed(self.device, self.engine_config.collective_timeout_s)
        model = self._load_hf_model()
        kwargs = {}
        if optim_config is not None:
            optimizer = build_optimizer(model.parameters(), optim_config)
            kwargs = {"optimizer": optimizer, "lr_scheduler": lambda opt: build_lr_scheduler(opt, optim_config)}
        config = deepspeed_config(optim_config, self.engine_config, dist.get_world_size())
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(model=model, config=config, **kwargs)
        module = self.ds.module
        assert isinstance(module, torch.nn.Module)  # the model passed in (pyright sees nn.Module.__getattr__)
        self.model = module

    # ------------------------------------------------------------------------------------------------ hooks
    def _compute_module(self) -> torch.nn.Module:
        return self.ds  # its forward sets up autocast and the ZeRO-3 backward hooks

    def _backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss, scale_wrt_gas=False)  # accumulates only: the micro-batch weights are ours

    def _clip_grads(self) -> float:
        """DeepSpeed clips and updates in one call, ``step()`` (the boundary: clip, AdamW, LR schedule, zero the
        gradients), so it runs here and ``_apply_update`` has nothing left to do. It skips the update itself on a
        non-finite gradient norm (the rule of backends/accumulation.py), reporting the norm as inf."""
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        if not self.ds.was_step_applied() and math.isfinite(norm):
            return float("inf")  # whatever made DeepSpeed skip, the shared tail must see a skipped step
        return norm

    def _apply_update(self) -> None:
        pass  # applied by ``ds.step()`` in _clip_grads

    def _end_step(self, skipped: bool) -> None:
        if skipped:  # DeepSpeed advances the schedule only with an applied update; one advance per train_step
            self._schedule().step()

    def _gathered_buckets(self, bucket_bytes: int, skip, adapter: bool) -> Buckets:
        """Without LoRA: each bucket's partitions gathered together by one all-gather straight into fresh full
        tensors (``backends.dist.gather_row_shards``, as fsdp's export), or, for partitions that layout does not
        cover (``_row_shards``), one ``GatheredParameters`` per bucket, cloned out of it. With LoRA, the shared
        path (its items merge or pick tensors as they are drawn)."""
        if self.lora is not None:
            yield from super()._gathered_buckets(bucket_bytes, skip, adapter)
            return
        import deepspeed

        with self._on_device(optimizer=False):
            state = [(n, v) for n, v in self.model.state_dict(keep_vars=True).items() if n not in skip]
            sized = (
                (n, math.prod(getattr(v, "ds_shape", v.shape)) * v.dtype.itemsize, partial(as_is, v)) for n, v in state
            )
            for bucket in bucketed(sized, bucket_bytes):
                partitioned: list[Any] = [v for _, v in bucket if hasattr(v, "ds_id")]
                shards = _row_shards(partitioned)
                if shards is not None:  # one all-gather into fresh tensors, no DeepSpeed gather + clone
                    gathered = dict(
                        zip(map(id, partitioned), gather_row_shards(shards, partitioned[0].ds_process_group))
                    )
                    yield [(n, _full(gathered, v)) for n, v in bucket]
                    continue
                with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
                    full = [(name, value.detach().clone()) for name, value in bucket]
                yield full  # re-partitioned already: only the clones are held while the consumer loads them

    def _param_items(self) -> list[Item]:
        """The partitioned parameters in HF state_dict order; ``get`` gathers one (``GatheredParameters``)."""
        import deepspeed

        def full(value) -> torch.Tensor:
            if not hasattr(value, "ds_id"):
                return value.detach().clone()
            with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
                return value.detach().clone()

        return [
            (name, math.prod(getattr(value, "ds_shape", value.shape)) * value.dtype.itemsize, partial(full, value))
            for name, value in self.model.state_dict(keep_vars=True).items()
        ]

    # -------------------------------------------------------------------------------------------- checkpoint
    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        if dist.get_rank() == 0:
            write_checkpoint_meta(self, path, "deepspeed", {"dp": dist.get_world_size()}, self.tied_names)
        if self.optim_config is None:  # DeepSpeed checkpoints need an optimizer: save this rank's partitions
            torch.save({k: v.detach().clone() for k, v in self._partitions().items()}, self._partitions_file(path))
        else:
            # a LoRA engine: the frozen base is left out (every run rebuilds it from the model path)
            self.ds.save_checkpoint(path, tag=CKPT_TAG, save_latest=False, exclude_frozen_parameters=self.has_adapter)
        torch.save(
            {"rng": rng_state(), "global_step": self.global_step}, os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
        )
        dist.barrier()

    def load(self, path: str) -> None:
        if not resumes_natively(path, "deepspeed", {"dp": dist.get_world_size()}):  # ZeRO partitions are per rank
            return self.load_portable(path)
        extra_file = os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
        if not os.path.isfile(extra_file):
            raise FileNotFoundError(f"{extra_file} not found: was the checkpoint written with a different world size?")
        if self.optim_config is None:
            saved = load_rank_file(self._partitions_file(path))
            with torch.no_grad():
                for name, part in self._partitions().items():
                    part.copy_(saved[name])
        else:
            # weights_only, not DeepSpeed's plain torch.load (DeepSpeed inits checkpoint_engine to None, then sets it)
            self.ds.checkpoint_engine.load = _load_deepspeed_file  # pyright: ignore[reportOptionalMemberAccess]
            load_path, _ = self.ds.load_checkpoint(
                path,
                tag=CKPT_TAG,
                load_module_strict=not self.has_adapter,  # the adapters' keys alone were saved
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
            if load_path is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint '{CKPT_TAG}' under {path}")
        extra = load_rank_file(extra_file)  # weights_only: no pickled code
        set_rng_state(extra["rng"])
        self.global_step = int(extra["global_step"])
        dist.barrier()

    def _set_portable(self, state: PortableState) -> None:
        """Each parameter's ZeRO-3 partition (this rank's slice of the flattened tensor, zero-padded at the end),
        its fp32 master partition and Adam moments in the optimizer's flat groups."""
        rank, trained = dist.get_rank(), self.optim_config is not None
        if trained:
            self._init_optimizer_state(state.step)
            self.ds.global_steps = state.step
        for name, p in self.model.named_parameters():
            part = p.ds_tensor  # pyright: ignore[reportAttributeAccessIssue]

            def piece(full: torch.Tensor, n: int = part.numel()) -> torch.Tensor:
                flat = full.reshape(-1)[rank * n : (rank + 1) * n]
                return torch.cat([flat, flat.new_zeros(n - flat.numel())])

            part.copy_(piece(state.params[name]))
            if trained and p.requires_grad:
                for key in (None, "exp_avg", "exp_avg_sq"):
                    full = state.params[name] if key is None else state.moment(key, name)
                    self._hp_partition(p, key).copy_(piece(full))

    def _hp_partition(self, p: torch.nn.Parameter, key: str | None) -> torch.Tensor:
        """This rank's slice of parameter ``p``'s fp32 master (``key`` None) or Adam moment ``key`` in ZeRO-3's
        flat groups: where DeepSpeed's own ``safe_set_full_*`` writes, which fails on a partition holding padding
        alone (a 1-element value-head bias on rank 1)."""
        zero: Any = self.ds.optimizer
        group, offset, n = zero.grad_position[zero.get_param_id(p)]
        flat = zero.fp32_partitioned_groups_flat[group]
        target = flat if key is None else zero.optimizer.state[flat][key]
        return target.narrow(0, offset, n)

    def _init_optimizer_state(self, step: int) -> None:
        """AdamW's state of each flat fp32 partition (ZeRO-3's optimizer parameters), as after ``step`` updates:
        before the first update it does not exist yet, and DeepSpeed's setters write into it."""
        zero: Any = self.ds.optimizer  # ZeRO-3's optimizer, set whenever optim_config is given
        for flat in zero.fp32_partitioned_groups_flat:
            partition_state = zero.optimizer.state[flat]
            for key in ("exp_avg", "exp_avg_sq"):
                partition_state.setdefault(key, torch.zeros_like(flat))
            partition_state["step"] = torch.tensor(float(step))

    def _partitions(self) -> dict[str, torch.Tensor]:
        """This rank's ZeRO-3 slices of the parameters (the tensors themselves: writing them updates the model)."""
        params = self.model.named_parameters()
        # ZeRO-3 sets ds_tensor on each parameter it partitions
        return {name: p.ds_tensor for name, p in params}  # pyright: ignore[reportAttributeAccessIssue]

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
