"""The Megatron-core training engine: an HF Qwen2/Qwen3/Llama (or Qwen3-MoE/Mixtral, experts split by expert
parallelism) checkpoint mapped onto megatron's GPTModel, split by tensor parallelism (TP), pipeline parallelism
(PP, 1F1B) and data parallelism (megatron DDP), trained with
megatron's optimizer (torch AdamW underneath on CPU) under the LR schedule of backends/optim.py.

Same contract as the FSDP/DeepSpeed engines (every public method is collective; see backends/base.py). Layout from
``engine_config.extra["megatron"]`` (backends/megatron/parallel.py). Every rank of one DP group gets the same rows
(dispatch "MEGATRON_COMPUTE_PROTO"; the workers' mesh is (dp_rank, dp_size, collects_output)). Micro-batches are
the other engines' (backends/batching.py, agreed over the DP group); with PP > 1 they are padded to equal rows.
Micro-batch i backpropagates its loss times its share of the mini-batch's loss units over the DP group, times the DP
size (backends/accumulation.py; megatron divides by the micro-batch count, undone here) and DDP averages over DP,
so the gradient equals the other engines'. forward() and train_step() results are computed
on the last PP stage and broadcast to the other stages (small: (B, R) tensors and a metrics dict), so every rank
returns the same; the controller keeps TP rank 0 of the last stage (``collects_output``).

Weights are read from the HF checkpoint on every rank (each keeps its shards; backends/megatron/hf_mapping.py).
Checkpoints: backends/megatron/checkpoint.py (one file per rank; another layout's or backend's through HF names).
Offload between calls: backends/megatron/offload.py; LoRA adapters on a causal LM: backends/megatron/lora.py.
CPU: backends/megatron/cpu_shim.py is applied before megatron-core is first used.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.utils import parametrize

from backends.accumulation import Accumulation, finish_train_step, partition_batch, require_trainable
from backends.base import Buckets, LossFn, TrainEngine, base_model_only, bucketed, register_backend
from backends.batching import restore_order
from backends.checkpoint.hf_export import collective_write, save_engine_hf
from backends.checkpoint.hf_names import checkpoint_layout
from backends.config import (
    DEFAULT_FORWARD,
    EngineConfig,
    ForwardOptions,
    MicroBatching,
    ModelConfig,
    OptimConfig,
    resolve_precision,
)
from backends.dist import init_distributed, local_device
from backends.hf_model import build_model, check_outputs, torch_dtype
from backends.lora_weights import adapter_config_dict, write_adapter_dir
from backends.megatron.checkpoint import load_checkpoint, save_checkpoint
from backends.megatron.export import ExportPlan, export_groups, gather_hf_buckets, stage_rank
from backends.megatron.hf_mapping import layout_from_hf
from backends.megatron.lora import MegatronLora, attach_lora, split_peft_model
from backends.megatron.model import build_gpt_model, load_hf_weights, transformer_config
from backends.megatron.moe_metrics import RouterMetrics, router_padding
from backends.megatron.offload import MegatronOffload
from backends.megatron.ops import from_last_stage, head_mode, prepared_micros, response_head, response_outputs
from backends.megatron.optimizer import wrap_for_training
from backends.megatron.parallel import MegatronParallelConfig, init_model_parallel
from backends.optim import SCHEDULES, lr_multiplier, warmup_steps
from scaletrain.protocol import DataProto


def _check_supported(model_config: ModelConfig, optim_config: OptimConfig | None) -> None:
    if model_config.kind not in ("causal_lm", "value", "reward"):
        raise ValueError(f"the megatron backend runs causal_lm, value and reward models, not '{model_config.kind}'")
    if model_config.lora_rank > 0 and model_config.kind != "causal_lm":
        raise ValueError(
            f"model.lora_rank={model_config.lora_rank}: the megatron backend trains LoRA adapters on a causal LM "
            f"(the policy); a {model_config.kind} model with LoRA runs on backend=fsdp|deepspeed"
        )
    if model_config.attn_implementation:
        raise ValueError(
            "model.attn_implementation applies to the HF backends (fsdp, deepspeed); megatron runs "
            "megatron-core's own attention: leave it unset"
        )
    if optim_config is not None and optim_config.lr_scheduler not in SCHEDULES:
        raise ValueError(f"unknown lr_scheduler '{optim_config.lr_scheduler}'; known: {list(SCHEDULES)}")


@register_backend("megatron")
class MegatronEngine(TrainEngine):
    # a causal LM's head computes the response-predicting positions only (ops.response_positions_only);
    # benchmarks/response_head.py turns it off on an engine to measure the all-positions head it replaced
    response_head_only = True

    def __init__(self, model_config: ModelConfig, optim_config: OptimConfig | None, engine_config: EngineConfig):
        """``optim_config=None`` builds a forward-only engine (a frozen reference policy)."""
        if engine_config.ulysses_sequence_parallel_size != 1:
            raise ValueError(
                "ulysses_sequence_parallel_size: the megatron backend does not run Ulysses; use its sequence_parallel "
                "with tensor parallelism"
            )
        _check_supported(model_config, optim_config)
        self.parallel = MegatronParallelConfig.from_extra(engine_config.extra)
        self.device = local_device()
        model_config, engine_config = resolve_precision(
            model_config, engine_config, self.device.type, trainable=optim_config is not None
        )
        self.model_config, self.optim_config, self.engine_config = model_config, optim_config, engine_config
        init_distributed(self.device, engine_config.collective_timeout_s)
        if self.device.type == "cpu":
            from backends.megatron.cpu_shim import apply_cpu_shim

            apply_cpu_shim()
        from megatron.core import parallel_state as ps

        hf_state = self._read_hf_model()
        self.parallel.validate(dist.get_world_size(), self.hf_config)
        init_model_parallel(self.parallel, engine_config.seed, engine_config.collective_timeout_s)
        self.ps = ps
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.tp_group, self.pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.model = self._build_gpt_model(hf_state)
        del hf_state  # the full HF weights: free them before the optimizer state is allocated
        self.optimizer = None
        if optim_config is None:
            self.model.requires_grad_(False)
        else:
            self.model, self.optimizer = wrap_for_training(self.model, self.tf_config, self.parallel, optim_config)
        self.global_step = 0
        flags = (engine_config.param_offload, engine_config.grad_offload, engine_config.optimizer_offload)
        self.offloading = MegatronOffload(self.module, self.model, self.optimizer, flags)
        self.offloading.offload_per_flags()

    def _read_hf_model(self) -> dict[str, torch.Tensor]:
        """The HF model's state dict (config and names kept for save_hf); the model itself stays on the meta
        device only, for the checkpoint layout of exports (backends/checkpoint/hf_names.py)."""
        torch.manual_seed(self.engine_config.seed)  # same fresh value head / adapters on every rank (as the others)
        hf_model = build_model(self.model_config)
        self.peft = split_peft_model(hf_model) if self.model_config.lora_rank > 0 else None  # the adapters apart
        hf_model = self.peft.model if self.peft is not None else hf_model
        self.hf_config, self.architecture = hf_model.config, type(hf_model).__name__
        self.generation_config = getattr(hf_model, "generation_config", None)
        state = {k: v.detach() for k, v in hf_model.state_dict().items()}  # the storage outlives the move to meta
        self.layout_model = hf_model.to("meta")
        return state

    def _build_gpt_model(self, hf_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """This rank's shard of megatron's GPTModel with the HF weights (``self.module``); returns it wrapped for
        bf16 compute when the config asks for it."""
        model_config, engine_config = self.model_config, self.engine_config
        # a reward model (HF sequence classifier, head ``score``) runs as a value model: the same per-token head,
        # read at each row's last valid token (ops.response_outputs) instead of before each response token
        parallel, coefs = self.parallel, (model_config.router_aux_loss_coef, model_config.router_z_loss_coef)
        self.layout = layout_from_hf(
            self.hf_config,
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            "value" if model_config.kind == "reward" else model_config.kind,
            parallel.expert_model_parallel_size,
            parallel.etp,
        )
        self.tf_config = transformer_config(
            self.hf_config,
            self.layout,
            parallel.sequence_parallel,
            torch_dtype(model_config.dtype),
            torch_dtype(engine_config.mixed_precision) if engine_config.mixed_precision else None,
            model_config.enable_gradient_checkpointing,
            coefs,
        )
        model = build_gpt_model(self.hf_config, self.tf_config, self.layout, "score.bias" in hf_state)
        load_hf_weights(model, hf_state, self.layout, self.tp_rank, self.pp_rank, self.ep_rank)
        self.hf_meta = {k: (tuple(v.shape), v.dtype) for k, v in hf_state.items()}
        shapes = {k: shape for k, (shape, _) in self.hf_meta.items()}
        place = (self.layout, self.tp_rank, self.pp_rank)
        self.lora = None if self.peft is None else attach_lora(model, self.peft, shapes, place)
        if self.device.type == "cuda":
            model.cuda(self.device)
        groups = export_groups(self.layout, list(hf_state))
        self.export_plan = ExportPlan(groups, self.layout, self.pp_rank, self.tp_rank, self.device)
        self.module = model  # the unwrapped GPTModel
        self.router_metrics = RouterMetrics(model, self.device, coefs)
        if self.tf_config.bf16 and torch_dtype(model_config.dtype) != torch.bfloat16:
            from megatron.core.transformer.module import Float16Module

            # bf16 compute: megatron casts the model to bf16 and keeps fp32 main weights in its optimizer
            model = Float16Module(self.tf_config, model)
        return model

    # ------------------------------------------------------------------------------------------ properties
    @property
    def dp_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    @property
    def collects_output(self) -> bool:
        return self.tp_rank == 0 and self.ps.is_pipeline_last_stage()

    # -------------------------------------------------------------------------------------------- compute
    def _run(
        self, batch: DataProto, outputs: tuple[str, ...], loss_fn: LossFn | None, call: MicroBatching | None = None
    ):
        """Forward (and backward when ``loss_fn``) over the micro-batches of ``batch`` (``call``: this call's
        micro-batching over the engine's); returns (partition, the
        Accumulation (None without ``loss_fn``), the per-micro-batch results of the last stage: (outputs, metrics)
        dicts; [] on other stages)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        temperature = float(batch.meta_info.get("temperature", 1.0))
        dp_group = self.ps.get_data_parallel_group()
        parts = partition_batch(batch, self.engine_config, self.device, dp_group, call)
        micros = self._prepared_micros(batch, parts)
        n = len(micros)
        # every stage and TP rank of a DP rank holds the same rows, so all agree on the weights
        acc = Accumulation(loss_fn, [m[1] for m in micros], self.device, dp_group) if loss_fn is not None else None
        at_predictions, fused = head_mode(self, outputs)

        def loss_func(i, micro, prepared, output):
            kind, vocab = self.model_config.kind, self.layout.vocab_size
            out = response_outputs(
                output, prepared, outputs, kind, temperature, vocab, self.tp_rank, self.tp_group, at_predictions, fused
            )
            if loss_fn is None:
                return output.sum() * 0.0, ({k: v.detach() for k, v in out.items()}, {})
            assert acc is not None  # built whenever loss_fn is given
            loss, metrics = loss_fn(out, micro)
            # megatron divides by the micro-batch count, undone by the factor n
            return loss * acc.grad_scale(i) * n, (
                None,
                {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}},
            )

        shard_padding = self.parallel.sequence_parallel and not self.ps.is_pipeline_first_stage()

        def forward_step(data_iterator, model):
            i, micro, prepared = next(data_iterator)
            with response_head(self, prepared, at_predictions, (outputs, temperature) if fused else None):
                output = model(
                    input_ids=prepared["input_ids"].to(self.device),
                    position_ids=prepared["position_ids"].to(self.device),
                    attention_mask=None,
                    **router_padding(prepared["padding_mask"], self.layout, self.tp_rank, shard_padding),
                )
            return output, partial(loss_func, i, micro, prepared)

        seq = micros[0][2]["input_ids"].shape[1]
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micros),
            model=[self.model],
            num_microbatches=n,
            seq_length=seq,
            micro_batch_size=micros[0][2]["input_ids"].shape[0],
            forward_only=loss_fn is None,
        )
        return parts, acc, results

    def _prepared_micros(self, batch: DataProto, parts) -> list[tuple[int, DataProto, dict[str, torch.Tensor]]]:
        """ops.prepared_micros with this engine's padding: equal rows with PP > 1 (the pipeline needs one shape),
        lengths a multiple of TP with sequence parallelism."""
        rows = max(len(p) for p in parts) if self.layout.pp > 1 else 0
        seq_multiple = self.layout.tp if self.parallel.sequence_parallel else 1
        pad_id = getattr(self.hf_config, "pad_token_id", None) or 0
        return prepared_micros(batch, parts, self.device, rows, seq_multiple, pad_id)

    def forward(
        self, batch: DataProto, outputs: tuple[str, ...] = ("log_probs",), options: ForwardOptions = DEFAULT_FORWARD
    ) -> DataProto:
        outputs = check_outputs(self.model_config.kind, outputs)
        base_only = base_model_only(options, self.has_adapter)  # an engine without adapters refuses base_model
        self.model.eval()
        adapters_off = self.lora.disabled(base_only) if self.lora is not None else contextlib.nullcontext()
        with torch.no_grad(), self._on_device(optimizer=False), adapters_off, parametrize.cached():
            parts, _, results = self._run(batch, outputs, None, options.micro_batching)
        tensors = None
        if self.ps.is_pipeline_last_stage():
            order = restore_order(parts)
            tensors = {k: torch.cat([r[0][k].float().cpu() for r in results])[order] for k in outputs}
        return DataProto.from_dict(from_last_stage(self, tensors))

    def train_step(self, mini_batch: DataProto, loss_fn: LossFn, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        """Metrics like the FSDP engine's: the whole mini-batch's ``loss`` and loss_fn metrics (all DP ranks), the
        global ``grad_norm`` (before clipping), the ``lr`` of this step and ``step_skipped``; the step-or-skip tail is
        the one every engine shares (backends/accumulation.py)."""
        with self._on_device(optimizer=True):
            return self._train_step(mini_batch, loss_fn, check_outputs(self.model_config.kind, outputs))

    def _train_step(self, mini_batch: DataProto, loss_fn: LossFn, outputs: tuple[str, ...]) -> dict:
        optim, optimizer, model = self._trainable()
        lr = optim.lr * lr_multiplier(
            self.global_step, warmup_steps(optim), optim.total_steps, optim.lr_scheduler, optim.min_lr_ratio
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        parts, acc, results = self._run(mini_batch, outputs, loss_fn)
        if self.lora is not None and self.layout.tp > 1:
            self.lora.reduce_grads(self.tp_group)  # each TP rank's backward saw its shard of the adapters' deltas
        sums = None
        if self.ps.is_pipeline_last_stage():  # the loss exists there only; the DP group is last-stage ranks
            assert acc is not None  # _run builds it for a loss_fn
            for i, (_, metrics) in enumerate(results):
                acc.add(i, metrics.pop("loss"), metrics)
            sums = acc.metrics()
        result = finish_train_step(from_last_stage(self, sums), lr, self.global_step, self._grad_norm, optimizer.step)
        result.update(self.router_metrics.step_metrics(len(parts)))
        optimizer.zero_grad()
        model.zero_grad_buffer()
        self.global_step += 1
        return result

    def _trainable(self):
        """(optim config, megatron optimizer, DDP-wrapped model); train_step on a forward-only engine raises."""
        from megatron.core.distributed import DistributedDataParallel

        optim = require_trainable(self.optim_config)
        # _build_optimizer set both whenever optim_config is given
        assert self.optimizer is not None and isinstance(self.model, DistributedDataParallel)
        return optim, self.optimizer, self.model

    def _grad_norm(self) -> float:
        """The global gradient norm (over TP, PP and DP) before clipping; megatron's ``step()`` clips."""
        optimizer = self._trainable()[1]
        optimizer.prepare_grads()
        return float(optimizer.get_grad_norm())

    # -------------------------------------------------------------------------------------------- weights
    def export_weights(self, bucket_bytes: int = 256 << 20) -> Buckets:
        with self._on_device(optimizer=False):
            for bucket in checkpoint_layout(gather_hf_buckets(self, bucket_bytes, skip=()), self.layout_model):
                # a tensor may view a parameter (one not split over TP): a copy outlives the parameters' offload
                yield [(name, t.clone()) for name, t in bucket] if self.engine_config.param_offload else bucket

    def save_hf(self, path: str, shard_bytes: int = 1 << 30, merged: bool = False) -> None:
        """The HF model (config + safetensors + tokenizer files), written by rank 0; collective. With LoRA: the PEFT
        adapter directory, or with ``merged`` the merged model."""
        if self.lora is not None and not merged:
            adapter = self.export_adapter(shard_bytes)
            write = partial(
                write_adapter_dir, path, adapter, self.adapter_config(), tokenizer_dir=self.model_config.path
            )
            collective_write(write, what="the LoRA adapter export")
            return
        with self._on_device(optimizer=False):
            buckets = gather_hf_buckets(self, shard_bytes, skip=self._tied_names())
            save_engine_hf(self, path, checkpoint_layout(buckets, self.layout_model))

    # ------------------------------------------------------------------------------------------------ LoRA
    @property
    def has_adapter(self) -> bool:
        return self.lora is not None

    def export_adapter(self, bucket_bytes: int = 256 << 20) -> Buckets:
        if self.lora is None:
            return super().export_adapter(bucket_bytes)
        return self._adapter_buckets(self.lora, bucket_bytes)

    def _adapter_buckets(self, lora: MegatronLora, bucket_bytes: int) -> Buckets:
        with self._on_device(optimizer=False):
            pp_group = self.pp_group if self.layout.pp > 1 else None
            yield from bucketed(lora.items(self.device, pp_group, stage_rank), bucket_bytes)

    def adapter_bytes(self) -> int:
        return 0 if self.lora is None else self.lora.nbytes()

    def adapter_config(self) -> dict:
        return super().adapter_config() if self.lora is None else adapter_config_dict(self.lora.config)

    def _tied_names(self) -> tuple[str, ...]:
        """What an HF export leaves out: a tied causal LM's ``lm_head.weight`` (the embedding's)."""
        return ("lm_head.weight",) if self.layout.tie_embeddings and self.layout.kind == "causal_lm" else ()

    # -------------------------------------------------------------------------------------------- checkpoint
    def save(self, path: str) -> None:
        with self._on_device(optimizer=True):
            save_checkpoint(self, path)

    def load(self, path: str) -> None:
        with self._on_device(optimizer=True):
            load_checkpoint(self, path)

    # -------------------------------------------------------------------------------------------- offload
    def offload(self) -> None:
        """Parameters, gradient buffers and optimizer state off the device (backends/megatron/offload.py)."""
        self.offloading.offload_all()

    def onload(self) -> None:
        self.offloading.onload(optimizer=True)

    @contextlib.contextmanager
    def _on_device(self, optimizer: bool):
        """The state a call needs on the device for its duration (the gradients and optimizer state when
        ``optimizer``), then what the offload flags keep off the device offloaded again."""
        self.offloading.onload(optimizer)
        try:
            yield
        finally:
            self.offloading.offload_per_flags()
