"""A LoRA checkpoint (the adapters and a trained head alone: backends/lora_weights.py's names) converted: checked
for every adapted layer's two matrices, then merged into the base model's weights, read one tensor at a time."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from backends.base import Buckets, bucketed
from backends.lora import ADAPTER
from backends.lora_weights import PREFIX, Item, LoraLayout, hf_name
from scaletrain.model_merger.safetensors_dir import tensor_items


def checked_adapters(buckets: Iterable[list[tuple[str, torch.Tensor]]], scales: dict, where: str) -> list[Item]:
    """The checkpoint's trained tensors as items; raises naming a layer whose A or B matrix is missing."""
    trained = {name: t for bucket in buckets for name, t in bucket}
    missing = [
        f"{layer}.{part}.{ADAPTER}.weight"
        for layer in scales
        for part in ("lora_A", "lora_B")
        if f"{layer}.{part}.{ADAPTER}.weight" not in trained
    ]
    if missing:
        raise ValueError(f"{where}: no tensor for {len(missing)} adapter matrices: {missing[:4]}")
    return [(name, t.numel() * t.element_size(), lambda t=t: t) for name, t in trained.items()]


def merged_lora(trained: list[Item], scales: dict, base_dir: str, names: Iterable[str], bucket_bytes: int) -> Buckets:
    """The merged model's tensors under HF names: each adapted Linear's W + (B @ A) x scale, a trained head in
    place of the base's, every other base tensor of the model (``names``: a value model made from a causal LM
    has no LM head) as it is."""
    wanted = set(names) - {hf_name(name) for name, _, _ in trained}
    base = [(_peft_name(name, scales), n, get) for name, n, get in tensor_items(base_dir) if name in wanted]
    return bucketed(LoraLayout(scales).merged_items([*base, *trained]), bucket_bytes)


def _peft_name(name: str, scales: dict) -> str:
    """A base tensor's name in the PEFT model: an adapted Linear keeps its weight and bias under ``base_layer``."""
    layer, _, leaf = name.rpartition(".")
    return f"{PREFIX}{layer}.base_layer.{leaf}" if PREFIX + layer in scales else PREFIX + name
