"""Images of multimodal RL rows (verl's format, as its geo3k preprocessing writes them) for the RL dataset.

A row's image column (``data.image_key``, ``images`` by default) holds a list of images, each ``{"bytes": <encoded
image>}``, ``{"path": <file>}`` (either key may sit beside the other as None), a path string (``file://`` allowed)
or a PIL image. Its prompt's text marks where each goes with ``<image>``: ``vision_messages`` turns every
placeholder into an ``{"type": "image"}`` content item (the chat template renders the model's vision tokens
there), as verl does. ``encode_prompt`` applies the processor: the prompt's token ids with each image's tokens
expanded (what ``max_prompt_length`` counts) and the vision inputs (``pixel_values``, ``image_grid_thw``) the
model's forward takes. Every refusal names the file, row, column and image.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
TOKEN_ALIGNED = ("mm_token_type_ids", "token_type_ids")


def decode_image(value: Any, where: str, base_dir: str | None = None) -> Any:
    """One image value as an RGB PIL image (decoded in full now, so a corrupt file fails here); a relative path is
    looked up as given, then beside the data file (``base_dir``)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and value.get("bytes") is not None:
        source, opener = "its bytes", lambda: io.BytesIO(value["bytes"])
    else:
        path = value.get("path") if isinstance(value, dict) else value
        if not isinstance(path, str) or not path:
            raise ValueError(
                f"{where}: expected {{'bytes': ...}}, {{'path': ...}}, a path or a PIL image, got {value!r:.100}"
            )
        path = path.removeprefix("file://")
        if not os.path.isabs(path) and not os.path.exists(path) and base_dir is not None:
            path = os.path.join(base_dir, path)
        if not os.path.isfile(path):
            raise ValueError(f"{where}: image file not found: {path}")
        source, opener = path, lambda: path
    try:
        with Image.open(opener()) as image:
            return image.convert("RGB")  # convert loads every pixel
    except Exception as exc:  # PIL raises several kinds for data it cannot decode
        raise ValueError(f"{where}: cannot decode the image from {source}: {exc}") from exc


def decode_images(values: Sequence[Any] | None, where: str, base_dir: str | None = None) -> list[Any]:
    """A row's image list (None: no images) decoded; ``where`` names the row and column."""
    if values is None:
        return []
    return [decode_image(value, f"{where}[{i}]", base_dir) for i, value in enumerate(values)]


def vision_messages(messages: Sequence[dict[str, Any]], num_images: int, where: str) -> list[dict[str, Any]]:
    """The chat messages with each ``<image>`` in their text an image item (content becomes a list of items);
    the placeholders must number the images."""
    out, found = [], 0
    for message in messages:
        content = message["content"]
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(dict(message))
            continue
        items: list[dict[str, Any]] = []
        for i, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                items.append({"type": "image"})
                found += 1
            if text:
                items.append({"type": "text", "text": text})
        out.append({**message, "content": items})
    if found != num_images:
        raise ValueError(f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholders for {num_images} images")
    return out


def encode_prompt(
    processor: Any, messages: Sequence[dict[str, Any]], images: list[Any], template_kwargs: dict[str, Any]
) -> tuple[list[int], dict[str, Any]]:
    """(token ids of the rendered prompt, vision tokens expanded; the model's vision inputs, tensors per name)."""
    text = processor.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **template_kwargs)
    return encode_text(processor, text, images)


def encode_text(processor: Any, text: str, images: list[Any]) -> tuple[list[int], dict[str, Any]]:
    """(token ids of rendered chat text, each image's vision tokens expanded; the model's vision inputs)."""
    encoded = processor(text=[text], images=images or None, return_tensors="pt")
    # per-token fields (the mask, the processor's token types) follow from the ids: only the vision inputs stay
    inputs = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask", *TOKEN_ALIGNED)}
    return encoded["input_ids"][0].tolist(), inputs
