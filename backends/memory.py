"""How many bytes a role's engine holds on one rank (layer 1): the arithmetic of the memory plan.

Pure functions of a model's shape and a role's layout, no torch state: the trainer's memory plan
(scaletrain/trainer/memory_plan.py) sums them per device and phase before Ray starts.

- States: parameters, gradients and optimizer state (AdamW: two float32 moments) of the trainable parameters,
  sharded as the backend shards them: fsdp and deepspeed (ZeRO-3) over the data-parallel ranks, megatron over
  TP x PP (its optimizer also over DP with ``use_distributed_optimizer``). DeepSpeed keeps a float32 master copy
  of its partition and a reduce bucket of ``reduce_bucket_size`` elements (allocated whole at start). megatron keeps
  a persistent float32 gradient buffer. Offloaded parameters / optimizer state count on the host instead.
- Activations of the largest micro-batch, per decoder layer and token (fitted to torch's allocator on CPU,
  benchmarks/memory_plan.py; the constants below): the HF engines save about ``10 H + 4.2 I`` values per packed
  token (H hidden, I the MLP width), plus a value per token pair where sdpa/eager attention get a dense
  block-diagonal mask for a packed micro-batch; megatron's layers about ``14.6 H + 5.3 I`` per padded token plus
  their per-row attention. With gradient checkpointing each layer keeps its inputs (2.5 H per token) and one
  layer's activations (with its MLP gradients) exist at a time.
- The head: only the response positions reach it, a bounded chunk of logits at a time
  (backends/sequence/response_head.py); a few chunk-sized float32 temporaries exist at once.
- Rollout engines: vLLM's weights (sharded by its TP) and KV cache (``kv_cache_bytes``, else
  ``gpu_memory_utilization`` of the device on CUDA, 64 MiB on CPU); the HF engine's own weights, KV cache and the
  per-step scores ``generate`` keeps.
"""

from __future__ import annotations

import dataclasses
import math

from backends.config import EngineConfig
from backends.sequence.response_head import CHUNK_ELEMENTS

MIB = 1 << 20
GIB = 1 << 30
ADAM_STATES = 2  # exp_avg and exp_avg_sq, float32
# Measured on CPU with torch's allocator (benchmarks/memory_plan.py fits them; docs/performance.md has the table):
HF_LAYER_VALUES = (10, 4.2)  # values a decoder layer saves per packed token: x H (hidden), x I (MLP width)
MEGATRON_LAYER_VALUES = (14.6, 5.3)  # megatron's layers, per padded token
MEGATRON_MASK_BYTES = 28  # x rows x length^2, once per step: megatron's attention masks, kept to the end
RECOMPUTE_VALUES = 2.5  # x H per token and layer kept with gradient checkpointing (the layer's inputs)
BACKWARD_VALUES = 2.5  # x I per token: the MLP's gradients while a recomputed layer runs its backward
LAYER_MASK_VALUES = 1  # x tokens^2 per layer: sdpa/eager's dense block-diagonal mask of a packed micro-batch
SHARED_MASK_BYTES = 2  # x tokens^2: the mask gradient checkpointing keeps for the recomputed layers
MEGATRON_ATTENTION_BYTES = 3.2  # x heads x rows x length^2 per layer: megatron's local (unfused) attention
HEAD_TEMPORARIES = 7  # chunk-sized float32 tensors alive at once in the fused head's backward (with entropy)
MEGATRON_HEAD_TEMPORARIES = 5  # the same in megatron's vocabulary-parallel head
DEEPSPEED_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
CPU_KV_CACHE_BYTES = 64 << 20  # vLLM's KV cache on CPU unless kv_cache_bytes says otherwise


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a model: its parameter counts and layer dimensions."""

    params: int  # every parameter
    trainable: int  # the ones the optimizer steps (with LoRA: the adapters only)
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_dim: int  # key/value heads x head dim (the KV cache's width per layer)
    heads: int = 1  # attention heads
    expert_params: int = 0  # of ``params``, the routed experts' (a mixture of experts; megatron splits them over EP)


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """One training role on one rank: how the backend splits it and where its states live."""

    backend: str  # fsdp | deepspeed | megatron (another name: sharded over DP like fsdp)
    world: int
    tp: int = 1
    pp: int = 1
    sp: int = 1  # Ulysses sequence parallelism
    ep: int = 1  # megatron: expert parallelism (a mixture of experts' experts split over EP x ETP x PP)
    etp: int | None = None  # megatron: expert tensor parallelism (None: the TP size)
    distributed_optimizer: bool = False  # megatron: the optimizer state split over DP too
    weight_bytes: int = 4  # the model's dtype
    compute_bytes: int = 4  # activations (2 with bf16 mixed precision)
    trains: bool = True  # False: a forward-only role (reference policy, reward model)
    param_offload: bool = False
    optimizer_offload: bool = False
    grad_offload: bool = False  # megatron: its gradient buffer freed between updates (back for each step)
    reduce_bucket: int = DEEPSPEED_REDUCE_BUCKET  # deepspeed: zero_optimization.reduce_bucket_size
    head_chunk_rows: int = EngineConfig.entropy_chunk_size  # the fused head's rows per chunk at most

    @property
    def dp(self) -> int:
        return max(1, self.world // (self.tp * self.pp * self.sp))


@dataclasses.dataclass(frozen=True)
class MicroBatchShape:
    """The largest micro-batch one rank computes on."""

    tokens: int  # valid tokens (packed) or rows x padded length
    head_positions: int  # positions whose log-prob or value is computed (the responses)
    packed: bool = True
    dense_mask: bool = True  # sdpa / eager on a packed micro-batch: a dense (tokens x tokens) mask
    recompute: bool = False  # gradient checkpointing
    length: int = 0  # a row's padded length (megatron's attention is per row)


def state_bytes(shape: ModelShape, layout: TrainLayout) -> tuple[dict[str, int], dict[str, int]]:
    """(on the device, on the host) bytes a role keeps on one rank between steps: parameters, optimizer state and
    the gradient buffers that persist (megatron's float32 buffer, DeepSpeed's partition and reduce bucket)."""
    if layout.backend == "megatron":
        device = _megatron_states(shape, layout)
    else:
        trainable = shape.trainable // layout.dp
        device = {
            "parameters": shape.params * layout.weight_bytes // layout.dp,
            "optimizer": trainable * 4 * ADAM_STATES,
        }
        if layout.backend == "deepspeed":
            device["optimizer"] += trainable * 4  # ZeRO-3's float32 master copy of the partition
            device["gradients"] = (trainable + layout.reduce_bucket) * 4  # the bucket is allocated whole
    if not layout.trains:
        device = {"parameters": device["parameters"]}
    host: dict[str, int] = {}
    if layout.param_offload:
        host["parameters"] = device.pop("parameters")
    if layout.optimizer_offload and "optimizer" in device:
        host["optimizer"] = device.pop("optimizer")
    if layout.grad_offload and layout.backend == "megatron":
        device.pop("gradients", None)  # freed, not kept on the host: a step zeroes it first
    return device, host


def _megatron_states(shape: ModelShape, layout: TrainLayout) -> dict[str, int]:
    """Megatron's parameters, optimizer state and float32 gradient buffer on one rank: the dense part split over
    TP x PP (the optimizer's over DP too with the distributed optimizer), the experts over ETP x EP x PP (and
    expert DP)."""
    expert_split = (layout.etp or layout.tp) * layout.ep * layout.pp
    experts = shape.expert_params
    expert_trainable = experts if shape.trainable == shape.params else 0
    params = (shape.params - experts) // (layout.tp * layout.pp) + experts // expert_split
    # LoRA adapters (trainable < params) are whole on every TP rank (backends/megatron/lora.py)
    dense = (shape.trainable - expert_trainable) // ((layout.tp if shape.trainable == shape.params else 1) * layout.pp)
    expert = expert_trainable // expert_split
    dp, expert_dp = (layout.dp, max(1, layout.world // expert_split)) if layout.distributed_optimizer else (1, 1)
    return {
        "parameters": params * layout.weight_bytes,
        "optimizer": (dense * 4 * ADAM_STATES) // dp + (expert * 4 * ADAM_STATES) // expert_dp,
        "gradients": (dense + expert) * 4,
    }


def freed_gradients(shape: ModelShape, layout: TrainLayout) -> int:
    """Bytes of the gradients that exist only from the backward pass to the optimizer step (fsdp's): they grow as
    the saved activations are freed, so a step's peak holds the larger of the two, not their sum."""
    if not layout.trains or layout.backend in ("megatron", "deepspeed"):
        return 0
    return shape.trainable // layout.dp * 4


def step_bytes(shape: ModelShape, layout: TrainLayout, micro: MicroBatchShape, backward: bool) -> dict[str, int]:
    """The transient bytes of one micro-batch on one rank at their peak, by cause; ``backward``: a training step
    (activations saved for the backward pass), else a no-grad forward (one layer's at a time)."""
    tokens = micro.tokens / layout.sp
    megatron = layout.backend == "megatron"
    coeff = MEGATRON_LAYER_VALUES if megatron else HF_LAYER_VALUES
    values = (coeff[0] * shape.hidden + coeff[1] * shape.intermediate) / layout.tp
    layer = values * tokens * layout.compute_bytes
    shared = 0.0
    if megatron:
        layer += MEGATRON_ATTENTION_BYTES * shape.heads / layout.tp * micro.tokens * micro.length
        shared = MEGATRON_MASK_BYTES * micro.tokens * micro.length
    elif micro.packed and micro.dense_mask and layout.sp == 1:
        layer += LAYER_MASK_VALUES * layout.compute_bytes * micro.tokens**2
        shared = SHARED_MASK_BYTES * micro.tokens**2
    layers = shape.layers / layout.pp
    head = head_bytes(shape, layout, micro)
    if backward and not micro.recompute:
        # the head's backward runs while every layer's activations are saved; the mask is freed after the forward
        return {"activations": int(layers * layer + (shared if megatron else 0)), "logits": head}
    kept = layers * tokens * shape.hidden * RECOMPUTE_VALUES * layout.compute_bytes if backward else 0
    if backward:
        layer += BACKWARD_VALUES * shape.intermediate / layout.tp * tokens * layout.compute_bytes
    # the head's temporaries and one layer's (recomputed) activations do not coexist: the larger counts
    return {"activations": int(kept + shared + (layer if layer > head else 0)), "logits": head if head >= layer else 0}


def step_peak(shape: ModelShape, layout: TrainLayout, micro: MicroBatchShape) -> dict[str, int]:
    """A training step's transient bytes at its peak on one rank: the micro-batch's activations and logits, or the
    freed gradients that replace them (``freed_gradients``), whichever is larger."""
    step = step_bytes(shape, layout, micro, backward=layout.trains)
    grads = freed_gradients(shape, layout)
    if grads > sum(step.values()):
        step = {"gradients": grads}
    if layout.trains and layout.grad_offload and layout.backend == "megatron":
        step["gradients"] = _megatron_states(shape, layout)["gradients"]  # back for the whole step
    return {name: n for name, n in step.items() if n}


def train_peak(shape: ModelShape, layout: TrainLayout, micro: MicroBatchShape) -> dict[str, int]:
    """One rank's bytes at the peak of a training step, by line: the states it keeps and ``step_peak``."""
    return state_bytes(shape, layout)[0] | step_peak(shape, layout, micro)


def head_bytes(shape: ModelShape, layout: TrainLayout, micro: MicroBatchShape) -> int:
    """The fused head's chunk temporaries and the hidden states it keeps (response positions only)."""
    vocab = shape.vocab / layout.tp
    rows = max(1, min(layout.head_chunk_rows, CHUNK_ELEMENTS // max(1, int(vocab)), micro.head_positions))
    kept = micro.head_positions * shape.hidden * 4 * 4  # the hidden states, outputs and their gradients
    temporaries = MEGATRON_HEAD_TEMPORARIES if layout.backend == "megatron" else HEAD_TEMPORARIES
    return int(temporaries * rows * vocab * 4 + kept)


def vllm_bytes(shape: ModelShape, tp: int, weight_bytes: int, kv_cache: int) -> dict[str, int]:
    """A vLLM engine's weights (its TP shard) and KV cache on one rank."""
    return {"rollout weights": shape.params * weight_bytes // tp, "KV cache": kv_cache}


def hf_rollout_bytes(shape: ModelShape, weight_bytes: int, rows: int, length: int, response: int) -> dict[str, int]:
    """The HF engine's own weights, the KV cache of ``rows`` sequences of ``length`` tokens, and the float32 scores
    ``generate`` keeps for each of the ``response`` steps."""
    kv = rows * length * shape.layers * 2 * shape.kv_dim * weight_bytes
    return {
        "rollout weights": shape.params * weight_bytes,
        "KV cache": kv,
        "generate scores": rows * response * shape.vocab * 4,
    }


def gib(n: float) -> str:
    """Bytes as GiB with two decimals (MiB below one GiB)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{math.ceil(n / MIB)} MiB"


def activated_intermediate(text) -> int:
    """The MLP width a token's activations span: the dense MLP's, or for a mixture of experts the top-k experts'
    together (top-k x the expert width: Qwen3-MoE's ``moe_intermediate_size``, Mixtral's ``intermediate_size``). The
    expert case follows from the dense fit, it was not measured apart."""
    from backends.moe import num_experts

    top_k = getattr(text, "num_experts_per_tok", None)
    width = getattr(text, "intermediate_size", 4 * text.hidden_size)
    if num_experts(text) and top_k:
        return top_k * (getattr(text, "moe_intermediate_size", None) or width)
    return width


def model_shape(model_config, config=None) -> ModelShape:
    """The shape of the model of ``model_config`` (a ``backends.config.ModelConfig``; ``config``: its HF config,
    else read from its path), counted on the meta device (no weights are read); with ``lora_rank > 0`` the
    trainable count is the adapters' (backends/lora.py)."""
    import torch
    from transformers import AutoConfig

    from backends.lora import lora_enabled, wrap_lora
    from backends.vision import causal_lm_class

    remote = model_config.trust_remote_code
    config = config or AutoConfig.from_pretrained(model_config.path, trust_remote_code=remote)
    text = getattr(config, "text_config", None) or config
    with torch.device("meta"):  # a vision-language model with its vision tower (backends/vision.py)
        model = causal_lm_class(config).from_config(config, trust_remote_code=remote)
        if lora_enabled(model_config):
            model = wrap_lora(model, dataclasses.replace(model_config, lora_adapter_path=None))
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return ModelShape(
        params=params,
        trainable=trainable,
        hidden=text.hidden_size,
        layers=text.num_hidden_layers,
        intermediate=activated_intermediate(text),
        vocab=text.vocab_size,
        kv_dim=kv_heads * head_dim,
        heads=text.num_attention_heads,
        expert_params=experts,
    )
