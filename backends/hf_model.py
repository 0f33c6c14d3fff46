"""Hugging Face model pieces shared by the training engines: building a model from ModelConfig and the forward
of one micro-batch that turns verl-layout inputs into per-response-token outputs.

Outputs of ``forward_micro_batch`` (all float32, zero at padded response positions):
  - causal_lm: ``log_probs`` (b, R) of the response tokens (logits at position t predict token t+1, so the
    predictions are taken at the R positions before each response token), optional ``entropy`` and
    ``sum_pi_squared`` (b, R: the sum of squared probabilities over the vocabulary, without gradient). The logits
    are divided by ``temperature`` first, like the sampler that produced the responses.
  - value: ``values`` (b, R), the token-classification head's output at the position *before* each response token.
  - reward: ``scores`` (b,), the sequence-classification head's output at each row's last valid token.

Two paths, numerically equal (tests/backends/test_fsdp_hf_model.py):
  - padded: a plain HF forward with ``attention_mask`` and ``position_ids``;
  - remove-padding (``ModelConfig.use_remove_padding``): the valid tokens of the micro-batch are packed into one
    (1, total) sequence, position ids restarting at 0 for each row and no attention mask. transformers (5.x) detects
    the packing from the position ids: flash-attention uses them as sequence boundaries, sdpa/eager get a
    block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``). Only the positions that predict
    response tokens go through the LM head (``logits_to_keep`` with an index tensor; the padded path keeps the
    last R + 1). Where the model allows it the head is fused with the log-probs and entropy, a chunk of tokens at a
    time, so no (tokens x vocabulary) logits exist (backends/sequence/response_head.py). Packing pays off with
    flash-attention (varlen kernels); with sdpa/eager the block-diagonal mask is dense, so attention costs
    O(total tokens^2) and the padded path is faster (see benchmarks/train_throughput.py). The inputs of both paths
    are built in backends/sequence/packing.py; with a Ulysses group (``sp``) each of its ranks runs a slice of the
    packed sequence (backends/sequence/ulysses.py) and the outputs are gathered over the group.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch
from torch import nn

from backends.config import ATTN_IMPLEMENTATIONS, ModelConfig
from backends.lora import lora_enabled, wrap_lora
from backends.sequence.packing import PreparedInputs, prepare_inputs
from backends.sequence.response_head import fused_response_head, supports_fused_head
from backends.sequence.ulysses import SequenceParallel
from backends.vision import (
    MULTI_MODAL_INPUTS,
    causal_lm_class,
    check_image_tokens,
    freeze_vision_tower,
    head_model_class,
    hf_config,
    idle_vision_tower,
    is_vision_language,
    is_vision_special,
    mask_vision_tokens,
    refuse_vision_tokens_in_responses,
)
from scaletrain.algos.entropy import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits

logger = logging.getLogger(__name__)

KIND_OUTPUTS = {"causal_lm": ("log_probs", "entropy", "sum_pi_squared"), "value": ("values",), "reward": ("scores",)}


def check_outputs(kind: str, outputs) -> tuple[str, ...]:
    """``outputs`` (a name or names) as a tuple, after checking a ``kind`` model gives each of them."""
    outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    allowed = KIND_OUTPUTS[kind]
    if not outputs or any(o not in allowed for o in outputs):
        raise ValueError(f"a {kind} model gives {list(allowed)}, asked for {list(outputs)}")
    return outputs


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        if name == "auto":
            raise ValueError("dtype 'auto' is resolved per device first (backends.config.resolve_precision)") from None
        raise ValueError(f"unknown dtype '{name}'; known: {sorted(DTYPES)}") from None


def build_hf_config(model_config: ModelConfig):
    """The HF config of ``model_config.path`` with ``override_config`` applied (value/reward: one label)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_config.checkpoint, trust_remote_code=model_config.trust_remote_code)
    for key, value in model_config.override_config.items():
        if key != "attn_implementation":
            setattr(config, key, value)
    if model_config.kind in ("value", "reward"):
        config.num_labels = 1
        if "classifier_dropout" not in model_config.override_config:
            config.classifier_dropout = 0.0  # a critic must give the same values in forward and in training
    config.use_cache = False
    return config


def build_model(model_config: ModelConfig) -> nn.Module:
    """Load the HF model for ``model_config.kind`` on CPU in ``model_config.dtype``.

    causal_lm -> AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model (a config with a
    vision tower: backends/vision.py); value -> AutoModelForTokenClassification (num_labels=1, a value per token);
    reward -> AutoModelForSequenceClassification (num_labels=1); a vision-language value / reward model is its
    backbone under the same heads (``head_model_class``). A value/reward model may start from a causal-LM
    checkpoint: its head is then freshly initialised (seed the RNG identically on every rank first).
    ``attn_implementation`` (or verl's ``override_config["attn_implementation"]``) picks the attention kernel
    (default: transformers' choice, sdpa); see ``attention_kwargs``. With ``lora_rank > 0`` the model comes back
    wrapped by PEFT, only its adapters trainable (backends/lora.py); with ``freeze_vision_tower`` a VLM's vision
    tower is frozen (backends/vision.py).
    """
    config = build_hf_config(model_config)
    if model_config.kind not in KIND_OUTPUTS:
        raise ValueError(f"unknown model kind '{model_config.kind}'; known: {sorted(KIND_OUTPUTS)}")
    kind = model_config.kind
    model_class = causal_lm_class(config) if kind == "causal_lm" else head_model_class(config, kind)
    kwargs = attention_kwargs(model_config)
    model = model_class.from_pretrained(
        model_config.path,
        config=config,
        dtype=torch_dtype(model_config.dtype),
        trust_remote_code=model_config.trust_remote_code,
        **kwargs,
    )
    if model_config.freeze_vision_tower:
        freeze_vision_tower(model)
    if model_config.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_enabled(model_config):
        model = wrap_lora(model, model_config)
    return model


def attention_kwargs(model_config: ModelConfig) -> dict[str, str]:
    """``from_pretrained``'s attention argument; flash_attention_2 without the flash-attn package is an error
    naming the key and the fix (transformers' own message comes later and names neither)."""
    name = model_config.attn_implementation or model_config.override_config.get("attn_implementation")
    if name is None:
        return {}
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"the model's attn_implementation: unknown '{name}'; known: {', '.join(ATTN_IMPLEMENTATIONS)}")
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ImportError(
            "the model's attn_implementation=flash_attention_2 needs the flash-attn "
            "package (`pip install flash-attn --no-build-isolation`, CUDA only); or use sdpa"
        )
    return {"attn_implementation": name}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (the modules named in the model's ``_no_split_modules``), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (_no_split_modules={names})")
    return layers


def _scatter_rows(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(n_valid,) values into a zero (b, R) tensor at ``valid``'s True entries (differentiable)."""
    out = values.new_zeros(valid.shape)
    return out.masked_scatter(valid, values)


# ------------------------------------------------------------------------------------------------ forward
def forward_micro_batch(
    model: nn.Module,
    micro: dict[str, torch.Tensor],
    outputs: tuple[str, ...],
    kind: str = "causal_lm",
    remove_padding: bool = False,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vision: dict[str, torch.Tensor] | None = None,
    fused_head: bool = True,
    sp: SequenceParallel | None = None,
) -> dict[str, torch.Tensor]:
    """Per-response-token outputs of one micro-batch (see the module docstring); gradients flow if enabled.
    ``vision``: a vision-language model's inputs for the micro-batch's rows with images (backends/vision.py).
    ``fused_head``: log-probs and entropy from the head fused with them where the model allows it
    (backends/sequence/response_head.py); False: from the logits. ``sp``: this rank's Ulysses sequence-parallel
    group (backends/sequence/ulysses.py; packed only): the outputs are the whole micro-batch's on every rank."""
    allowed = KIND_OUTPUTS[kind]
    unknown = [o for o in outputs if o not in allowed]
    if unknown:
        raise ValueError(f"a {kind} model cannot produce {unknown}; it gives {list(allowed)}")
    input_ids, attention_mask = micro["input_ids"], micro["attention_mask"]
    b, T = input_ids.shape
    R = micro["responses"].shape[1] if "responses" in micro else 0
    resp_valid = attention_mask[:, T - R :].bool()  # (b, R): response tokens that exist

    config = hf_config(model)
    vl = is_vision_language(config)
    if vision and not vl:
        raise ValueError(
            f"the batch carries images ({MULTI_MODAL_INPUTS}) but this {kind} model is a text model "
            f"({type(model).__name__}), which would read their placeholder tokens as text: use a vision-language model"
        )
    if sp is not None and (vl or not remove_padding):
        raise ValueError(
            "Ulysses sequence parallelism runs text models on the remove-padding path (use_remove_padding)"
        )
    if vl:  # the model's own tokens (response_mask, where given) never hold a vision token; a tool turn's may
        model_tokens = resp_valid & micro["response_mask"].bool() if "response_mask" in micro else resp_valid
        refuse_vision_tokens_in_responses(config, micro["responses"] if R else None, model_tokens)
        check_image_tokens(config, input_ids, vision or {})
    prepared = prepare_inputs(model, micro, remove_padding, (vision or {}) if vl else None, sp)
    # every rank runs the vision tower once per micro-batch, images or not (backends/vision.py)
    with idle_vision_tower(model, input_ids.device) if vl and not vision else contextlib.nullcontext():
        if kind == "reward":
            return {"scores": _reward_scores(model, micro, prepared)}
        if kind == "causal_lm" and fused_head and not vl and supports_fused_head(model, config, outputs):
            return _fused_outputs(model, micro, prepared, outputs, temperature, chunk_size)
        logits = _response_logits(model, micro, kind, prepared)
    if kind == "value":
        return {"values": _scatter_rows(prepared.gather(logits[:, 0].float()), resp_valid)}
    return _logits_outputs(logits, micro, prepared, outputs, temperature, chunk_size, config if vl else None)


def _logits_outputs(
    logits: torch.Tensor,
    micro: dict[str, torch.Tensor],
    prepared: PreparedInputs,
    outputs: tuple[str, ...],
    temperature: float,
    chunk_size: int,
    vl_config,
) -> dict[str, torch.Tensor]:
    """A causal LM's outputs from its (n, V) response logits (``vl_config``: a vision-language model's config)."""
    resp_valid, vl, config = prepared.resp_valid, vl_config is not None, vl_config
    if temperature != 1.0:
        logits = logits / temperature
    if vl:
        logits = mask_vision_tokens(logits, config)
    result = {}
    if "log_probs" in outputs:
        labels = prepared.mine_only(micro["responses"][resp_valid])
        result["log_probs"] = _scatter_rows(
            prepared.gather(logprobs_from_logits(logits, labels, chunk_size)), resp_valid
        )
        if vl:  # a tool turn's image tokens are no action of the policy: log-prob 0, as padding (not -1e30)
            result["log_probs"] = result["log_probs"].masked_fill(is_vision_special(config, micro["responses"]), 0.0)
    if "entropy" in outputs:
        result["entropy"] = _scatter_rows(prepared.gather(entropy_from_logits(logits, chunk_size)), resp_valid)
    if "sum_pi_squared" in outputs:
        result["sum_pi_squared"] = _scatter_rows(
            prepared.gather(sum_pi_squared_from_logits(logits, chunk_size)), resp_valid
        )
    return result


def _fused_outputs(
    model: nn.Module,
    micro: dict[str, torch.Tensor],
    prepared: PreparedInputs,
    outputs: tuple[str, ...],
    temperature: float,
    chunk_size: int,
) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) of a text causal LM with the head fused with them: one label per position
    the head sees (packed: the valid response tokens this rank holds; padded: the R + 1 last positions, the last one
    unused)."""
    responses, resp_valid = micro["responses"], prepared.resp_valid
    if prepared.packed_index is not None:
        labels = prepared.mine_only(responses[resp_valid])
    else:
        labels = torch.cat([responses, responses[:, -1:]], dim=1)
    with fused_response_head(model, labels, temperature, "entropy" in outputs, chunk_size):
        rows = prepared.gather(_response_logits(model, micro, "causal_lm", prepared))  # (n_valid, 2)
    result = {"log_probs": _scatter_rows(rows[:, 0], resp_valid)}
    if "entropy" in outputs:
        result["entropy"] = _scatter_rows(rows[:, 1], resp_valid)
    return result


def _response_logits(
    model: nn.Module, micro: dict[str, torch.Tensor], kind: str, prepared: PreparedInputs
) -> torch.Tensor:
    """(n, V) logits (causal_lm) or (n, 1) head outputs (value) at the positions predicting the valid response
    tokens (with ``prepared.shard``: the ones this rank holds), from the padded or the packed forward."""
    inputs = prepared.inputs
    if prepared.packed_index is not None:
        if kind == "causal_lm":
            return model(**inputs, use_cache=False, logits_to_keep=prepared.predict_at).logits[0]
        return model(**inputs, use_cache=False).logits[0, prepared.predict_at]
    T, R = micro["input_ids"].shape[1], prepared.resp_valid.shape[1]
    if kind == "causal_lm":
        return model(**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1][prepared.resp_valid]
    return model(**inputs, use_cache=False).logits[:, T - R - 1 : T - 1][prepared.resp_valid]


def _reward_scores(model: nn.Module, micro: dict[str, torch.Tensor], prepared: PreparedInputs) -> torch.Tensor:
    """Score head output at each row's last valid token. The HF sequence classifier pools at the last token that
    is not ``pad_token_id`` (wrong when pad == eos, and meaningless when packed), so the per-token head output is
    captured with a forward hook and pooled here from the attention mask."""
    captured = []
    score: nn.Module = model.score  # pyright: ignore[reportAssignmentType]
    handle = score.register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        model(**prepared.inputs, use_cache=False)
    finally:
        handle.remove()
    token_scores = captured[0][..., 0].float()  # (b, T) or (1, local)
    input_ids, attention_mask = micro["input_ids"], micro["attention_mask"]
    last = input_ids.shape[1] - 1 - attention_mask.flip(-1).long().argmax(-1)  # column of each row's last token
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    if prepared.packed_index is None:
        return token_scores[rows, last]
    at, gather = prepared.held(prepared.packed_index[rows, last])
    return gather(token_scores[0, at])


def tied_duplicate_names(model: torch.nn.Module) -> set[str]:
    """Names under which an already-seen parameter is registered again (e.g. a tied ``lm_head.weight``)."""
    seen, duplicates = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            duplicates.add(name)
        seen.add(id(param))
    return duplicates
