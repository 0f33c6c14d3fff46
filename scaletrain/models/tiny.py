"""Tiny random models (outside the layers, beside the offline pretrained ones): the one place their shapes are
written down, for the embedded default (scaletrain/data/embedded.py), the tests and the benchmarks.

``tiny_qwen2_config(vocab_size, pad, bos, eos, shape=..., **overrides)``: a ``Qwen2Config`` of one of ``SHAPES``
(2 layers, tied embeddings, GQA) for a tokenizer's vocabulary and special ids, with any field overridden.
``tiny_config(architecture, ...)``: the same shape in another of ``ARCHITECTURES``: ``qwen3`` (q/k RMS norms, no
QKV bias, an explicit head_dim), ``qwen3_moe`` (every layer a mixture of ``MOE["num_experts"]`` experts, top-2,
normalised top-k weights) or ``mixtral`` (the same experts in Mixtral's layout).
``char_level_tokenizer(vocab, **special_tokens)``: the one-token-per-character tokenizer of the embedded task and
the tiny VLM.
"""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    # the tests' and the small benchmarks' model: hidden 64, 4 query / 2 KV heads
    "test": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    # the embedded default's (and the end-to-end benchmark's) model: hidden 128
    "embedded": dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
}


# the experts of the MoE architectures: 4 experts of a quarter of the dense MLP's width, 2 per token
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe", "mixtral")


def tiny_qwen2_config(
    vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int, shape: str = "test", **overrides: Any
):
    """A 2-layer ``Qwen2Config`` with tied embeddings of ``SHAPES[shape]``, for a tokenizer of ``vocab_size`` ids
    and these special ids; ``overrides`` replace any field (``max_position_embeddings`` defaults to 512)."""
    return tiny_config("qwen2", vocab_size, pad_token_id, bos_token_id, eos_token_id, shape, **overrides)


def tiny_config(
    architecture: str,
    vocab_size: int,
    pad_token_id: int,
    bos_token_id: int,
    eos_token_id: int,
    shape: str = "test",
    **overrides: Any,
):
    """``tiny_qwen2_config``'s model in ``architecture`` (one of ``ARCHITECTURES``): the same hidden size, heads and
    layers; the MoE ones hold ``MOE["num_experts"]`` experts of intermediate size / 4 in every layer."""
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown tiny model shape {shape!r}; known: {', '.join(SHAPES)}")
    settings: dict[str, Any] = dict(
        SHAPES[shape],
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    dims = SHAPES[shape]
    if architecture != "qwen2":  # Qwen3's configs default head_dim to 128 rather than hidden / heads
        settings["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    if architecture == "qwen3_moe":
        settings.update(MOE, moe_intermediate_size=dims["intermediate_size"] // 4)
    if architecture == "mixtral":
        settings.update(
            num_local_experts=MOE["num_experts"],
            num_experts_per_tok=MOE["num_experts_per_tok"],
            intermediate_size=dims["intermediate_size"] // 4,
        )
    settings.update(overrides)
    config_class = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}
    return getattr(transformers, config_class.get(architecture, "MixtralConfig"))(**settings)


def char_level_tokenizer(vocab: dict[str, int], **tokenizer_kwargs: Any) -> Any:
    """A ``PreTrainedTokenizerFast`` whose every character is one token of ``vocab`` (a WordLevel model behind a
    split-every-character pre-tokenizer, the ``Fuse`` decoder joining tokens back without spaces); unknown
    characters become ``<unk>``. ``tokenizer_kwargs``: the special tokens and other tokenizer settings."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", **tokenizer_kwargs)
