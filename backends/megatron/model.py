"""Building the Megatron-core model of an HF Qwen2/Qwen3/Llama/Qwen3-MoE/Mixtral checkpoint: TransformerConfig +
GPTModel (local layer spec: torch RMSNorm, SwiGLU, RoPE with the HF theta and scaling, QKV bias for Qwen2, Qwen3's
per-head q/k RMSNorm, tied or untied embeddings; a MoE model's routed experts as megatron's SequentialMLP behind its
top-k router, with megatron's own load-balancing and z losses) for this rank's TP rank, PP stage and EP rank, and
the 1-output value head that replaces the LM head for value models.
Which HF configs map is decided in backends/megatron/hf_mapping.py (``check_mappable``).

Call ``apply_cpu_shim`` (backends/megatron/cpu_shim.py) and initialise megatron's parallel state first.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from backends.megatron.hf_mapping import QK_NORM_MODEL_TYPES, Layout, check_mappable, rope_settings

logger = logging.getLogger(__name__)


def transformer_config(
    hf_config,
    lo: Layout,
    sequence_parallel: bool,
    params_dtype: torch.dtype,
    compute_dtype: torch.dtype | None,
    recompute: bool,
    router_coefs: tuple[float, float] = (0.0, 0.0),
):
    """megatron's TransformerConfig of the model on the layout ``lo``; ``router_coefs``: the (load-balancing, z)
    loss coefficients of a MoE model's routers."""
    from megatron.core.transformer import TransformerConfig

    check_mappable(hf_config)
    tp, pp = lo.tp, lo.pp
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    qkv_bias = hf_config.model_type == "qwen2"  # Qwen2 always has q/k/v biases; Llama / Qwen3 with biases are refused
    bf16 = compute_dtype == torch.bfloat16 or params_dtype == torch.bfloat16
    kwargs = {}
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        qk_layernorm=hf_config.model_type in QK_NORM_MODEL_TYPES,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the HF checkpoint
        batch_p2p_comm=False,
        variable_seq_lengths=False,
        **kwargs,
        **_moe_settings(hf_config, lo, router_coefs),
    )


def _moe_settings(hf_config, lo: Layout, router_coefs: tuple[float, float]) -> dict:
    """TransformerConfig's MoE fields: HF's top-k routing (softmax over the k chosen logits = normalised top-k
    weights; softmax over all experts without renormalising when Qwen3-MoE's norm_topk_prob is off), dropless."""
    if not lo.num_experts:
        return {}
    aux, z = router_coefs
    return dict(
        num_moe_experts=lo.num_experts,
        moe_ffn_hidden_size=getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True),
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z if z > 0 else None,
        # the all-gather dispatcher runs on gloo; the all-to-all one needs CUDA streams
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=lo.ep,
        expert_tensor_parallel_size=lo.etp,
    )


class ValueHead(nn.Module):
    """HF's token-classification ``score`` (hidden -> 1), replicated on every TP rank, in the LM head's place.

    Called like ColumnParallelLinear by GPTModel. Under sequence parallelism its input is gathered from the
    sequence-parallel region with a split (not a reduce-scatter) backward: every TP rank computes the same loss."""

    def __init__(self, hidden: int, bias: bool, dtype: torch.dtype, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight, self.bias), None


def build_gpt_model(hf_config, tf_config, lo: Layout, value_bias: bool):
    """This rank's GPTModel chunk (weights zero until loaded)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if lo.num_experts:
        _define_router_gemm()
    tied = lo.tie_embeddings and lo.kind == "causal_lm"
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=lo.num_experts or None, normalization="RMSNorm", qk_layernorm=lo.qk_norm
        ),
        vocab_size=lo.padded_vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_percent=1.0,
        **rope_settings(hf_config),
    )
    if lo.kind == "value" and post:
        # megatron types output_layer as its ColumnParallelLinear; the value head stands in for it
        model.output_layer = ValueHead(  # pyright: ignore[reportAttributeAccessIssue]
            hf_config.hidden_size, value_bias, tf_config.params_dtype, tf_config.sequence_parallel
        )
    pad = getattr(hf_config, "pad_token_id", None)
    if pre and pad is not None:
        stop_padding_token_input_grad(model.embedding.word_embeddings, pad)
    return model


def _define_router_gemm() -> None:
    """megatron-core (0.16.1) without TransformerEngine: its router GEMM tests ``te_general_gemm is not None``, a
    name it imports from TransformerEngine only, so the router raises NameError; None selects its torch GEMM."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # pyright: ignore[reportAttributeAccessIssue]


def stop_padding_token_input_grad(word_embeddings, pad_token_id: int) -> None:
    """HF's Qwen2/Llama embed tokens with ``nn.Embedding(padding_idx=pad_token_id)``, whose backward gives the pad
    token's row no gradient from the input side (a tied LM head still updates it). Megatron's embedding has no
    padding index; this forward hook detaches the embedding output at pad-token positions, the same gradient.
    It matters when the pad token is also a real token (SmolLM2: pad = eos = <|im_end|>, in every chat turn)."""

    def hook(module, args, output):
        is_pad = args[0] == pad_token_id  # (b, s)
        if module.reduce_scatter_embeddings:  # sequence parallel: output is this TP rank's (s / tp, b, h) chunk
            chunk, rank = output.shape[0], module.tp_group.rank()
            is_pad = is_pad.t()[rank * chunk : (rank + 1) * chunk]
        return torch.where(is_pad.unsqueeze(-1), output.detach(), output)

    word_embeddings.register_forward_hook(hook)


def load_hf_weights(
    model, hf: dict[str, torch.Tensor], lo: Layout, tp_rank: int, pp_rank: int, ep_rank: int = 0
) -> None:
    """Copy this rank's shards of the full HF tensors ``hf`` into ``model`` (a GPTModel, unwrapped)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    from backends.megatron.hf_mapping import hf_to_megatron, is_tensor_parallel
    from backends.megatron.moe_mapping import is_expert_parameter

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.startswith("output_layer.") and lo.kind == "value":
                name = "value_head." + name.split(".", 1)[1]
            value = hf_to_megatron(name, hf, lo, tp_rank, pp_rank, ep_rank)
            if value.shape != p.shape:
                raise ValueError(f"{name}: megatron shape {tuple(p.shape)}, mapped HF shape {tuple(value.shape)}")
            p.copy_(value)
            # megatron sets these only when it initialises the weights itself (perform_initialization=False
            # here); the grad norm and the distributed optimizer need them
            split = is_tensor_parallel(name) or (is_expert_parameter(name) and lo.etp > 1)
            if split and not getattr(p, "tensor_model_parallel", False):
                row_parallel = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
                set_tensor_model_parallel_attributes(p, True, 1 if row_parallel else 0, 1)
