"""A tiny random-init Qwen2.5-VL (outside the layers, beside the offline pretrained models): the vision-language
model the multimodal tests and the visual recipe train, built here because no package on the index ships a small
pretrained VLM's weights.

    python -m scaletrain.models.prepare tiny-qwen2.5-vl [--output DIR]

writes a Hugging Face directory that loads like any Qwen2.5-VL checkpoint: ``Qwen2_5_VLForConditionalGeneration``
weights (a 2-layer text model of ``scaletrain.models.tiny.SHAPES["embedded"]`` and a 2-block vision tower, ~0.5M
parameters), a character-level tokenizer with Qwen's special tokens (``<|im_start|>``, ``<|vision_start|>``,
``<|image_pad|>``, ...), Qwen's chat template (an ``{"type": "image"}`` content item renders as
``<|vision_start|><|image_pad|><|vision_end|>``, which the processor expands to one pad per merged patch) and the
Qwen2-VL image processor's settings (patch 14, merge 2: a 56 x 56 image is 4 vision tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.models.prepare import PRETRAINED_MODELS, BuiltSpec

SPECIAL_TOKENS = (
    "<pad>",
    "<bos>",
    "<|im_end|>",  # the end of a turn: the model's EOS, as Qwen's
    "<unk>",
    "<|im_start|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz ?.,:=+-\n"
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224  # 4 to 64 vision tokens an image

# Qwen's chat template, content as a string or a list of {"type": "image" | "video" | "text"} items
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def build_vlm_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` with Qwen-VL's special tokens and the chat template above."""
    from scaletrain.models.tiny import char_level_tokenizer

    tokenizer = char_level_tokenizer(
        {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARACTERS])},
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[4:]),
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen2_5_vl_config(tokenizer: Any, shape: str = "embedded") -> Any:
    """A ``Qwen2_5_VLConfig``: the text model of ``SHAPES[shape]`` (2 layers, M-RoPE), a 2-block vision tower."""
    from transformers import Qwen2_5_VLConfig

    from scaletrain.models.tiny import SHAPES

    text = SHAPES[shape]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in _TOKEN_FIELDS.items()}
    return Qwen2_5_VLConfig(
        text_config=dict(
            **text,
            vocab_size=len(tokenizer),
            num_hidden_layers=2,
            max_position_embeddings=1024,
            # M-RoPE's temporal / height / width sections of half the head dimension
            rope_scaling={"type": "mrope", "mrope_section": _mrope_sections(head_dim // 2)},
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=text["hidden_size"],
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=TEMPORAL,
            window_size=PATCH * MERGE * 2,
            fullatt_block_indexes=[1],
        ),
        tie_word_embeddings=True,
        **ids,
    )


_TOKEN_FIELDS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def _mrope_sections(half: int) -> list[int]:
    """Qwen's split of the rotary half-dimension into temporal / height / width sections (1 : 1.5 : 1.5)."""
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def image_processor_settings() -> dict[str, Any]:
    """The Qwen2-VL image processor's ``preprocessor_config.json`` for this model."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": PATCH,
        "merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
    }


def save_tiny_qwen2_5_vl(path: str | Path, seed: int = 0, shape: str = "embedded", dtype: str = "float32") -> str:
    """Write the model, tokenizer, chat template and image processor settings to ``path``; returns it."""
    import json

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config(tokenizer, shape))
    model.to(getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(image_processor_settings(), indent=2))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(path)


TINY_QWEN2_5_VL = PRETRAINED_MODELS.register("tiny-qwen2.5-vl")(
    BuiltSpec(
        name="tiny-qwen2.5-vl",
        cache_name="tiny-qwen2.5-vl",
        builder=lambda out, dtype: save_tiny_qwen2_5_vl(out, dtype=dtype),
        version=1,
    )
)
