"""The engine loop of the HF-model training engines (layer 1): FSDP2 (backends/fsdp/engine.py) and DeepSpeed ZeRO-3
(backends/deepspeed/engine.py) subclass ``HFTrainEngine`` and supply only what their framework does its own way.

Shared here: loading the HF model (same seed on every rank, so fresh value/reward heads agree), ``forward`` (no-grad,
micro-batched, outputs put back in row order), ``train_step`` (micro-batches weighted by backends/accumulation.py,
then the step-or-skip tail of backends/accumulation.py that the Megatron engine uses too), ``export_weights`` and
``save_hf``. Micro-batches are ``micro_batch_size_per_gpu`` rows or, with ``use_dynamic_bsz``, a token budget
(backends/batching.py); the ranks agree on one count. ``meta_info["temperature"]`` (default 1) divides the logits.

LoRA (``ModelConfig.lora_rank > 0``; backends/lora.py, backends/lora_weights.py): ``export_weights`` yields the
merged weights under the base model's HF names, ``export_adapter`` / ``adapter_bytes`` the adapter tensors alone,
``save_hf`` writes a PEFT adapter directory (or, ``merged=True``, the merged model), and ``forward`` runs the base
model with the adapters disabled when ``ForwardOptions.base_model`` asks for it (a reference policy for free).
``save`` / ``load`` hold the adapters and their optimizer state like any trained parameter.

Hooks (the backend's part):
  - ``_compute_module()``: the module a micro-batch runs through (FSDP: the sharded model; DeepSpeed: its engine,
    whose forward sets up autocast and the ZeRO-3 hooks);
  - ``_on_device(optimizer)``: a context that brings offloaded state back for a call (FSDP; DeepSpeed offloads
    inside ZeRO);
  - ``_backward(loss)``; ``_clip_grads()`` -> the global gradient norm before clipping; ``_apply_update()``;
    ``_end_step(skipped)``: zero the gradients and advance the LR schedule (one per train_step, skipped or not);
  - ``_param_items()``: the model's state dict as (name, full nbytes, get) in order, ``get`` gathering the full
    tensor (collective) when called; the shared code buckets them (and merges LoRA adapters) in
    ``_gathered_buckets``, which a backend may replace (FSDP gathers a bucket at a time);
  - ``_set_portable(state)``: this rank's shard of each full parameter and Adam moment of a checkpoint written by
    another backend or layout (``load_portable``; backends/checkpoint/portable.py).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from backends.accumulation import Accumulation, finish_train_step, partition_batch, require_trainable
from backends.base import MODEL_INPUTS, Buckets, LossFn, TrainEngine, base_model_only, bucketed
from backends.batching import Partition, restore_order
from backends.checkpoint.hf_export import collective_write, save_engine_hf
from backends.checkpoint.hf_names import checkpoint_layout
from backends.checkpoint.portable import PortableState, read_portable_state
from backends.config import (
    DEFAULT_FORWARD,
    EngineConfig,
    ForwardOptions,
    MicroBatching,
    ModelConfig,
    OptimConfig,
    resolve_precision,
)
from backends.dist import local_device
from backends.hf_model import build_model, check_outputs, forward_micro_batch, tied_duplicate_names
from backends.lora import ADAPTER, lora_enabled
from backends.lora_weights import Item, LoraLayout, adapter_config_dict, write_adapter_dir
from backends.moe import RouterRecorder, add_router_terms, check_router_settings
from backends.optim import set_schedule_step
from backends.sequence.ulysses import SequenceParallel, sequence_parallel
from backends.vision import MULTI_MODAL_INPUTS, gather_vision_inputs, is_vision_language, vision_keys
from scaletrain.protocol import DataProto


class HFTrainEngine(TrainEngine):
    """One engine per process; every public method is collective over ``self.group`` (the data-parallel ranks)."""

    group = None  # the data-parallel process group (None: the default group)
    model: torch.nn.Module  # the HF model (PEFT-wrapped with LoRA), set by the backend's __init__
    optimizer = None  # set by a trainable engine
    scheduler: LRScheduler | None = None  # set by a trainable engine
    lora: LoraLayout | None = None  # set by a LoRA engine
    sp: SequenceParallel | None = None  # this rank's Ulysses group (ulysses_sequence_parallel_size > 1)

    def _resolve_configs(
        self, model_config: ModelConfig, optim_config: OptimConfig | None, engine_config: EngineConfig
    ) -> None:
        """Pick the device and store the configs with precision settings resolved for it."""
        self.device = local_device()
        model_config, engine_config = resolve_precision(
            model_config, engine_config, self.device.type, trainable=optim_config is not None
        )
        self.model_config, self.optim_config, self.engine_config = model_config, optim_config, engine_config
        self.global_step = 0

    def _load_hf_model(self) -> torch.nn.Module:
        """The HF model of ``model_config`` (frozen for a forward-only engine), remembering what ``save_hf`` needs
        before the backend wraps or renames it."""
        torch.manual_seed(self.engine_config.seed)  # same fresh heads (value/reward) and adapters on every rank
        model = build_model(self.model_config)
        hf_model = model
        if lora_enabled(self.model_config):
            from peft import PeftModel

            assert isinstance(model, PeftModel)  # build_model wraps a LoRA model with PEFT
            hf_model, self.lora = model.get_base_model(), LoraLayout.of(model)
            self.peft_config = model.peft_config[ADAPTER]
        self.architecture = type(hf_model).__name__
        self.tied_names = tied_duplicate_names(hf_model)
        self.hf_config = hf_model.config
        self.hf_model = hf_model  # the unwrapped HF model: its checkpoint layout for exports (checkpoint/hf_names.py)
        self.generation_config = getattr(hf_model, "generation_config", None)
        self.sp = self._sequence_parallel(hf_model)
        mc = self.model_config
        check_router_settings(hf_model, mc.router_aux_loss_coef, mc.router_z_loss_coef)
        if self.sp is not None and (mc.router_aux_loss_coef or mc.router_z_loss_coef):
            raise ValueError(
                "router_aux_loss_coef / router_z_loss_coef with ulysses_sequence_parallel_size > 1: the router "
                "losses need the whole packed sequence, which Ulysses splits over its ranks"
            )
        self.routers = RouterRecorder(hf_model)
        if self.optim_config is None:
            model.requires_grad_(False)
        return model

    def _sequence_parallel(self, hf_model: torch.nn.Module) -> SequenceParallel | None:
        """Collective: the Ulysses group of ``ulysses_sequence_parallel_size`` ranks (None for 1), which runs text
        models packed (backends/sequence/ulysses.py)."""
        size = self.engine_config.ulysses_sequence_parallel_size
        if size > 1 and not self.model_config.use_remove_padding:
            raise ValueError(
                f"ulysses_sequence_parallel_size={size} needs the model's use_remove_padding=true (it splits the "
                "packed sequence)"
            )
        if size > 1 and is_vision_language(hf_model.config):
            raise ValueError(
                f"ulysses_sequence_parallel_size={size}: Ulysses sequence parallelism runs text models only "
                f"({type(hf_model).__name__} is a vision-language model)"
            )
        return sequence_parallel(size, hf_model)

    # ------------------------------------------------------------------------------------------------ hooks
    def _compute_module(self) -> torch.nn.Module:
        return self.model

    def _on_device(self, optimizer: bool):
        return contextlib.nullcontext()

    @abstractmethod
    def _backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def _clip_grads(self) -> float: ...

    @abstractmethod
    def _apply_update(self) -> None: ...

    @abstractmethod
    def _end_step(self, skipped: bool) -> None: ...

    @abstractmethod
    def _param_items(self) -> list[Item]: ...

    @abstractmethod
    def _set_portable(self, state: PortableState) -> None: ...

    def load_portable(self, path: str) -> None:
        """Collective: resume checkpoint ``path`` written by another backend or layout (backends/checkpoint/
        portable.py): parameters, Adam's moments and step, the LR schedule at that step."""
        names = [name for name, _, _ in self._param_items()]
        trainable = self.optimizer is not None
        state = read_portable_state(
            path, self.architecture, names, trainable, f"{type(self).__name__} on {dist.get_world_size()} ranks"
        )
        with torch.no_grad(), self._on_device(optimizer=True):
            self._set_portable(state)
        if self.scheduler is not None:
            assert isinstance(self.scheduler, LambdaLR)  # backends/optim.py build_lr_scheduler's
            set_schedule_step(self.scheduler, state.step)
        self.global_step = state.step
        dist.barrier()

    def _schedule(self) -> LRScheduler:
        """The LR schedule; only a trainable engine has one (``train_step`` checks ``require_trainable``)."""
        assert self.scheduler is not None, "a trainable engine sets its scheduler in __init__"
        return self.scheduler

    # ------------------------------------------------------------------------------------------ properties
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel share (a Ulysses group's ranks hold the same share)."""
        return dist.get_rank(self.group) // self._sp_size

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.group) // self._sp_size

    @property
    def collects_output(self) -> bool:
        """Every rank of a Ulysses group gives the whole share's outputs: its first rank's are kept."""
        return self.sp is None or self.sp.rank == 0

    @property
    def _sp_size(self) -> int:
        return 1 if self.sp is None else self.sp.size

    @property
    def has_adapter(self) -> bool:
        return self.lora is not None

    # --------------------------------------------------------------------------------------- micro-batching
    def _partition(self, batch: DataProto, call: MicroBatching | None = None) -> Partition:
        return partition_batch(batch, self.engine_config, self.device, self.group, call)

    def _forward(self, micro: DataProto, outputs: tuple[str, ...], temperature: float) -> dict[str, torch.Tensor]:
        # response_mask: which response tokens are the model's (a vision-language model's tool turns hold images)
        keys = (*MODEL_INPUTS, "response_mask")
        inputs = {k: micro.tensors[k].to(self.device) for k in keys if k in micro.tensors.keys()}
        vision = gather_vision_inputs(micro.non_tensor_batch.get(MULTI_MODAL_INPUTS), self.device)
        return forward_micro_batch(
            self._compute_module(),
            inputs,
            outputs,
            kind=self.model_config.kind,
            remove_padding=self.model_config.use_remove_padding,
            temperature=temperature,
            chunk_size=self.engine_config.entropy_chunk_size,
            vision=vision,
            sp=self.sp,
        )

    # -------------------------------------------------------------------------------------------- compute
    def forward(
        self, batch: DataProto, outputs: tuple[str, ...] = ("log_probs",), options: ForwardOptions = DEFAULT_FORWARD
    ) -> DataProto:
        outputs = check_outputs(self.model_config.kind, outputs)
        temperature = float(batch.meta_info.get("temperature", 1.0))
        base_only = base_model_only(options, self.has_adapter)
        keys = [k for k in MODEL_INPUTS if k in batch.tensors.keys()]
        inputs = batch.select(batch_keys=keys, non_tensor_batch_keys=vision_keys(batch.non_tensor_batch))
        with self._on_device(optimizer=False), self._adapters_off(base_only):
            self._compute_module().eval()
            parts = self._partition(inputs, options.micro_batching)
            results = []
            with torch.no_grad():
                for part in parts:
                    out = self._forward(inputs.select_idxs(part), outputs, temperature)
                    results.append({k: v.float().cpu() for k, v in out.items()})
        order = restore_order(parts)
        return DataProto.from_dict({k: torch.cat([r[k] for r in results])[order] for k in outputs})

    @contextlib.contextmanager
    def _adapters_off(self, off: bool):
        """PEFT's ``disable_adapter()`` around a forward when ``off``: the frozen base model computes."""
        if not off:
            yield
            return
        from peft import PeftModel

        assert isinstance(self.model, PeftModel)  # ``off`` only with adapters: a PEFT-wrapped model
        try:
            with self.model.disable_adapter():
                yield
        finally:
            if self.optim_config is None:  # leaving the context, PEFT makes the adapters trainable again
                self.model.requires_grad_(False)

    def train_step(self, mini_batch: DataProto, loss_fn: LossFn, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        """Metrics are the whole mini-batch's (all DP ranks; backends/accumulation.py): ``loss`` and loss_fn's
        metrics, plus the global ``grad_norm`` (before clipping), the ``lr`` this step used and ``step_skipped``
        (1.0 when a non-finite gradient norm skipped the optimizer update; backends/accumulation.py)."""
        require_trainable(self.optim_config)
        outputs = check_outputs(self.model_config.kind, outputs)
        temperature = float(mini_batch.meta_info.get("temperature", 1.0))
        with self._on_device(optimizer=True):
            self._compute_module().train()
            micros = [mini_batch.select_idxs(part) for part in self._partition(mini_batch)]
            acc = Accumulation(loss_fn, micros, self.device, self.group)
            for i, micro in enumerate(micros):
                micro = micro.to(self.device)
                loss, metrics = self._micro_loss(micro, loss_fn, outputs, temperature)
                self._backward(loss * acc.grad_scale(i))
                acc.add(i, loss.detach(), metrics)
            lr = float(self._schedule().get_last_lr()[0])
            result = finish_train_step(acc.metrics(), lr, self.global_step, self._clip_grads, self._apply_update)
            self._end_step(skipped=bool(result["step_skipped"]))
            self.global_step += 1
        return result

    def _micro_loss(self, micro: DataProto, loss_fn: LossFn, outputs: tuple[str, ...], temperature: float):
        """``loss_fn``'s loss and metrics for one micro-batch, plus a MoE model's router losses and metrics
        (backends/moe.py: recorded over the real tokens, pads excluded on the padded path)."""
        valid = None if self.model_config.use_remove_padding else micro.tensors["attention_mask"]
        with self.routers.recording(valid):
            out = self._forward(micro, outputs, temperature)
        loss, metrics = loss_fn(out, micro)
        mc = self.model_config
        return add_router_terms(loss, metrics, self.routers.terms(), mc.router_aux_loss_coef, mc.router_z_loss_coef)

    # -------------------------------------------------------------------------------------------- weights
    def export_weights(self, bucket_bytes: int = 256 << 20) -> Buckets:
        """The HF-named full tensors; with LoRA, the merged weights under the base model's names
        (backends/lora_weights.py), so a rollout engine loads them as a plain checkpoint."""
        return self._full_tensor_buckets(bucket_bytes, skip=())

    def export_adapter(self, bucket_bytes: int = 256 << 20) -> Buckets:
        if self.lora is None:
            return super().export_adapter(bucket_bytes)
        return self._full_tensor_buckets(bucket_bytes, skip=(), adapter=True)

    def adapter_bytes(self) -> int:
        """The bytes ``export_adapter`` yields in all (full tensors, no gather); 0 without LoRA."""
        return 0 if self.lora is None else sum(n for _, n, _ in self.lora.adapter_items(self._param_items()))

    def adapter_config(self) -> dict:
        if self.lora is None:
            return super().adapter_config()
        return adapter_config_dict(self.peft_config)

    def _full_tensor_buckets(self, bucket_bytes: int, skip, adapter: bool = False) -> Buckets:
        """``_gathered_buckets`` with the model weights in the checkpoint's layout (a MoE model's fused experts split
        per expert: backends/checkpoint/hf_names.py); ``skip`` names the in-memory names to leave out."""
        buckets = self._gathered_buckets(bucket_bytes, skip, adapter)
        yield from buckets if adapter else checkpoint_layout(buckets, self.hf_model)

    def _gathered_buckets(self, bucket_bytes: int, skip, adapter: bool) -> Buckets:
        """Gathers one tensor at a time; a bucket is yielded before the next tensor would overflow it, so at most one
        bucket plus one tensor (with LoRA: plus its two adapter matrices) is ever full-size."""
        with self._on_device(optimizer=False):
            items = self._param_items()
            if self.lora is not None:
                items = self.lora.adapter_items(items) if adapter else self.lora.merged_items(items)
            yield from bucketed((item for item in items if item[0] not in skip), bucket_bytes)

    def save_hf(self, path: str, shard_bytes: int = 1 << 30, merged: bool = False) -> None:
        """Config + safetensors (+ tokenizer files of the source model), written by rank 0; collective. With LoRA:
        the PEFT adapter directory (``PeftModel.from_pretrained(base, path)`` loads it), or with ``merged`` the
        merged full model (``AutoModelForCausalLM.from_pretrained(path)``)."""
        if self.lora is None or merged:
            save_engine_hf(self, path, self._full_tensor_buckets(shard_bytes, skip=self.tied_names))
            return
        buckets = self._full_tensor_buckets(shard_bytes, skip=(), adapter=True)
        collective_write(
            lambda is_writer: write_adapter_dir(
                path, buckets, self.adapter_config(), is_writer, self.model_config.path
            ),
            what="the LoRA adapter export",
        )
