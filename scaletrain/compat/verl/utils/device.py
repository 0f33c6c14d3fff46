"""``verl.utils.device``: which accelerator this process uses (the names verl's tests and workers ask for)."""

from __future__ import annotations

from typing import Any

import torch


def get_device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_nccl_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def get_torch_device() -> Any:
    """The torch module of this process's device (``torch.cuda``, else ``torch.cpu``)."""
    return getattr(torch, get_device_name())


__all__ = ["get_device_name", "get_nccl_backend", "get_torch_device"]
