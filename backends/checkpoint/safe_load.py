"""Loading checkpoint files without running code from them (layer 2: every backend's resume path goes through it).

A pickle names functions and classes that unpickling calls, so a tampered checkpoint file can run anything as the
trainer. Every file a resume reads is therefore decoded by an allow-list, and a file naming anything else is refused
with ``UnsafeCheckpointError`` naming the file and the object, before that object is called:

- ``load_rank_file``: ``torch.load(weights_only=True)`` (tensors, containers, numbers, strings), plus plain NumPy
  arrays (checkpoints written before the RNG-state formats were unified hold them) and the classes the caller
  allows (DeepSpeed's ZeRO stage enum and loss scaler: backends/deepspeed/engine.py); a cut file fails with
  ``CorruptCheckpointError`` naming it;
- ``check_torch_bytes``: the same check for a ``torch.save`` payload in memory (DCP's byte items);
- ``load_pickle_allowing``: a plain pickle (DCP's ``.metadata``) with a restricted unpickler that resolves only the
  globals its caller allows (backends/fsdp/safe_dcp.py).
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import numpy as np
import torch

# These rebuild an array from its dtype and raw bytes; an object array's items still go through the restricted
# unpickler, so nothing here lets a file name arbitrary code.
_NUMPY_ARRAY_GLOBALS = [
    # numpy 2's np._core, numpy 1's np.core (a version switch pyright cannot follow)
    (getattr(np, "_core", None) or np.core).multiarray._reconstruct,  # pyright: ignore[reportAttributeAccessIssue]
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
]


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file names an object outside the allow-list: it was not loaded, and nothing of it ran."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file that is cut short or is not a torch file at all (a disk filled, a copy interrupted)."""


def _refusal(where: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{where}: refusing to load {what}: checkpoints are loaded with torch.load(weights_only=True), which "
        "accepts only tensors, containers, numbers, strings and NumPy arrays (and the checkpoint classes the "
        "engine names). The file was tampered with, or written by an older version or another program; if you "
        "trust it, load it with torch.load(weights_only=False) and save its content again as tensors and lists"
    )


def _refused_object(error: Exception) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", str(error))  # torch names the refused object in a few phrasings
    return f"the object {found.group(1)}" if found else "Python objects"


def load_rank_file(path: str, map_location=None, allowed: Iterable[Any] = (), mmap: bool = False):
    """``torch.load(path, weights_only=True)``, also accepting plain NumPy arrays and the ``allowed`` classes; a
    file holding other Python objects is refused with an error naming the file and the object, a cut or corrupt
    one with a ``CorruptCheckpointError`` naming the file. ``mmap``: tensors are mapped from the file, read when
    used (an offline converter touching one layer at a time)."""
    try:
        with torch.serialization.safe_globals([*_NUMPY_ARRAY_GLOBALS, *allowed]):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise _refusal(str(path), _refused_object(e)) from e
    except (RuntimeError, EOFError) as e:  # torch's zip reader on a cut file: "failed finding central directory"
        raise CorruptCheckpointError(f"{path}: not a complete checkpoint file ({e})") from e


def check_torch_bytes(stream: BinaryIO, where: str) -> None:
    """Refuses a ``torch.save`` payload (at the stream's start, rewound after) that ``load_rank_file`` would."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(where, _refused_object(e)) from e
    finally:
        stream.seek(0)


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, allowed: Callable[[str, str], bool], where: str):
        super().__init__(file)
        self.allowed, self.where = allowed, where

    def find_class(self, module: str, name: str):
        if not self.allowed(module, name):
            raise _refusal(self.where, f"the object {module}.{name}")
        return super().find_class(module, name)


def load_pickle_allowing(stream: BinaryIO, allowed: Callable[[str, str], bool], where: str):
    """Unpickles ``stream`` resolving only the globals ``allowed(module, name)`` accepts (others are refused,
    naming ``where`` and the object, before anything is called)."""
    data = stream.read()
    return _AllowListUnpickler(io.BytesIO(data), allowed, where).load()
