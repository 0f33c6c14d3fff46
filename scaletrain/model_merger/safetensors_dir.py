"""Reading an HF directory's safetensors one tensor at a time (the converter's base weights and its comparison)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from safetensors import safe_open


def safetensors_index(hf_dir: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, in an HF directory (one file or an index)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(hf_dir, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(hf_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def tensor_items(hf_dir: str) -> list[tuple[str, int, Callable[[], torch.Tensor]]]:
    """(name, bytes, read) of every tensor of ``hf_dir``; ``read()`` loads that one tensor from its file."""
    items = []
    for name, file in safetensors_index(hf_dir).items():
        with safe_open(file, "pt") as f:
            part = f.get_slice(name)
            shape, dtype = part.get_shape(), part.get_dtype()
        nbytes = _numel(shape) * _DTYPE_BYTES.get(dtype, 4)
        items.append((name, nbytes, lambda file=file, name=name: _read(file, name)))
    return items


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read(file: str, name: str) -> torch.Tensor:
    with safe_open(file, "pt") as f:
        return f.get_tensor(name)
