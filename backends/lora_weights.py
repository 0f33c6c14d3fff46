"""The tensors a LoRA engine exports (backends/lora.py): merged HF weights for the rollout engines, adapter tensors
for an adapter-only sync, and the PEFT adapter directory ``save_hf`` writes.

A PEFT model's state dict names are ``base_model.model.<HF name>``; each adapted Linear ``X`` holds
``X.base_layer.weight`` / ``.bias`` (the frozen base), ``X.lora_A.default.weight`` (r, in) and
``X.lora_B.default.weight`` (out, r); a value/reward head ``H`` holds ``H.original_module.*`` (frozen) and
``H.modules_to_save.default.*`` (trained).

``LoraLayout`` (read from the PEFT model once, before it is sharded) turns an engine's items (name, nbytes, get):
its state dict in order, ``get`` gathering the full tensor when called, into
  - ``merged_items``: the plain HF names and tensors: W + (B @ A) * lora_alpha / r for each adapted Linear, computed
    from the gathered tensors when the item is drawn (the training model is never merged in place), and the trained
    head copy under the head's own name; no adapter tensors;
  - ``adapter_items``: the adapter tensors under the names of PEFT's ``adapter_model.safetensors`` (adapter name
    dropped: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, ``base_model.model.score.weight``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from backends.checkpoint.hf_export import copy_tokenizer_files, publish_dir
from backends.lora import ADAPTER

PREFIX = "base_model.model."
SAVED = f".modules_to_save.{ADAPTER}."  # the trained copy of a value/reward head
ORIGINAL = ".original_module."  # its frozen original
ADAPTER_FILE = "adapter_model.safetensors"

Item = tuple[str, int, Callable[[], torch.Tensor]]


@dataclass(frozen=True)
class LoraLayout:
    scales: dict[str, float]  # the PEFT module name of each adapted Linear -> its scaling (lora_alpha / r)

    @classmethod
    def of(cls, peft_model: nn.Module) -> LoraLayout:
        from peft.tuners.lora import LoraLayer

        return cls(
            {name: float(m.scaling[ADAPTER]) for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
        )

    def merged_items(self, items: Iterable[Item]) -> list[Item]:
        items = list(items)
        getters = {name: get for name, _, get in items}
        merged = []
        for name, nbytes, get in items:
            hf = hf_name(name)
            if hf is None:
                continue
            layer = name.removesuffix(".base_layer.weight")
            if layer != name and layer in self.scales:
                a, b = getters[f"{layer}.lora_A.{ADAPTER}.weight"], getters[f"{layer}.lora_B.{ADAPTER}.weight"]
                get = partial(merge_lora, get, a, b, self.scales[layer])
            merged.append((hf, nbytes, get))
        return merged

    @staticmethod
    def adapter_items(items: Iterable[Item]) -> list[Item]:
        return [(saved, nbytes, get) for name, nbytes, get in items if (saved := adapter_name(name)) is not None]


def merge_lora(get_weight, get_a, get_b, scale: float) -> torch.Tensor:
    """W + (B @ A) * scale from the three gathered tensors (in float32, returned in W's dtype)."""
    weight, a, b = get_weight(), get_a(), get_b()
    return (weight.float() + (b.float() @ a.float()) * scale).to(weight.dtype)


def _lora_part(parts: list[str]) -> int | None:
    """The index of the ``lora_*`` component of a split name (``lora_A``, ``lora_B``, ...), if any."""
    return next((i for i, p in enumerate(parts) if p.startswith("lora_")), None)


def hf_name(name: str) -> str | None:
    """The HF name a PEFT state-dict entry is exported under; None for adapter tensors and frozen head originals."""
    if not name.startswith(PREFIX):
        raise ValueError(f"{name}: not a PEFT model's state dict name (no '{PREFIX}' prefix)")
    if ORIGINAL in name or _lora_part(name.split(".")) is not None:
        return None
    return name[len(PREFIX) :].replace(SAVED, ".").replace(".base_layer.", ".")


def adapter_name(name: str) -> str | None:
    """The name of an adapter tensor in PEFT's adapter file (the adapter name dropped); None for other entries."""
    if SAVED in name:
        return name.replace(SAVED, ".")
    parts = name.split(".")
    i = _lora_part(parts)
    if i is None:
        return None
    if parts[i + 1 : i + 2] == [ADAPTER]:
        del parts[i + 1]
    return ".".join(parts)


# ------------------------------------------------------------------------------------------------ adapter directory
def adapter_config_dict(peft_config) -> dict:
    """``peft_config`` as the JSON dict PEFT writes to ``adapter_config.json`` (inference mode, sets as lists)."""
    config = copy.deepcopy(peft_config)
    config.inference_mode = True
    out = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


def write_adapter_dir(path: str, buckets, config: dict, is_writer: bool, tokenizer_dir: str | None = None) -> None:
    """A PEFT adapter directory (``adapter_config.json`` from ``config``, ``adapter_config_dict``'s form, +
    ``adapter_model.safetensors`` + the source tokenizer) that ``peft.PeftModel.from_pretrained(base, path)`` loads;
    written atomically by the writing rank. Every rank draws every bucket first (the gathers behind them are
    collective; the adapter is small)."""
    import json

    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for bucket in buckets for k, v in bucket}
    if not is_writer:
        return

    def fill(tmp: str) -> None:
        save_file(tensors, os.path.join(tmp, ADAPTER_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)

    publish_dir(path, fill, what="LoRA adapter export")
