"""How a DataProto's contents cross a process boundary: the state ``DataProto.__getstate__`` / ``__setstate__``
(scaletrain/protocol/core.py) pickle.

Tensors travel as contiguous numpy arrays, so pickle protocol 5 (Ray's object store) ships them out-of-band,
without a pickle copy; bfloat16, which numpy lacks, travels as int16 bits. The receiver copies each array once
into a fresh, writable tensor when it must: the object store's buffers are read-only and shared between readers,
and an in-process out-of-band buffer is the sender's own memory. An in-band pickle's array lives in a bytearray
the unpickler made for it alone, so that one becomes the tensor as it is (no second copy).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


def to_wire(batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray], meta_info: dict[str, Any]) -> dict:
    """The picklable state of a DataProto's three parts (tensors moved to the CPU)."""
    tensors, dtypes = {}, {}
    if batch is not None:
        for key, t in batch.items():
            t = t.detach().to("cpu").contiguous()
            dtypes[key] = t.dtype
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            tensors[key] = t.numpy()
    size = None if batch is None else int(batch.batch_size[0])
    return {"tensors": tensors, "dtypes": dtypes, "size": size, "non": non_tensor_batch, "meta": meta_info}


def from_wire(state: dict) -> tuple[TensorDict | None, dict[str, np.ndarray], dict[str, Any]]:
    """(batch, non_tensor_batch, meta_info) back from ``to_wire``'s state."""
    batch = None
    if state["size"] is not None:
        tensors = {}
        for key, arr in state["tensors"].items():
            t = torch.from_numpy(arr if _private(arr) else np.array(arr, copy=True))
            if state["dtypes"][key] == torch.bfloat16:
                t = t.view(torch.bfloat16)
            tensors[key] = t
        batch = TensorDict(tensors, batch_size=[state["size"]])
    return batch, state["non"], state["meta"]


def _private(arr: np.ndarray) -> bool:
    """Whether ``arr``'s memory is a writable bytearray no one else holds: what unpickling an in-band buffer makes."""
    owner = arr
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    return arr.flags.writeable and isinstance(owner, bytearray)
