"""Tensors and TensorDicts as plain (dtype name, shape, bytes) records, and DataProtos on disk.

Layer 0 (scaletrain/protocol). The records (verl's ``serialize_single_tensor`` / ``serialize_tensordict`` shapes)
hold no pickled objects: any dtype (bfloat16 and float8 too) travels as its raw bytes, a nested (jagged) tensor
as the records of its components. ``save_to_disk`` / ``load_from_disk`` pickle a DataProto's transport state
(transport.py) and load it with an unpickler that builds only numpy arrays, torch dtypes and plain containers:
a file that names any other class is refused, naming it, before anything in it runs.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from tensordict import TensorDict

from scaletrain.protocol.errors import DataProtoError

_NESTED = "nested"
_TENSOR = "tensor"


def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of a dense tensor (moved to the CPU)."""
    t = obj.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), raw


def deserialize_single_tensor(record: Any) -> torch.Tensor:
    dtype_name, shape, raw = record
    dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DataProtoError(f"unknown tensor dtype {dtype_name!r} in a serialized tensor")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple[str, Any]]]:
    """(batch size, device name or None, {key: ("tensor", record) or ("nested", (layout, component records))})."""
    items: dict[str, tuple[str, Any]] = {}
    for key, val in batch.items():
        if not isinstance(val, torch.Tensor):
            raise DataProtoError(f"serialize_tensordict: '{key}' is a {type(val).__name__}, not a tensor")
        if val.is_nested:
            parts = [serialize_single_tensor(p) for p in val.unbind()]
            items[key] = (_NESTED, (str(val.layout).removeprefix("torch."), parts))
        else:
            items[key] = (_TENSOR, serialize_single_tensor(val))
    device = None if batch.device is None else str(batch.device)
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(record: Any) -> TensorDict:
    batch_size, device, items = record
    tensors = {}
    for key, (kind, data) in items.items():
        if kind == _NESTED:
            layout_name, parts = data
            layout = getattr(torch, layout_name)
            tensors[key] = torch.nested.as_nested_tensor([deserialize_single_tensor(p) for p in parts], layout=layout)
        elif kind == _TENSOR:
            tensors[key] = deserialize_single_tensor(data)
        else:
            raise DataProtoError(f"deserialize_tensordict: unknown item kind {kind!r} for '{key}'")
    return TensorDict(tensors, batch_size=list(batch_size), device=device)


_SAFE_CLASSES = {
    ("builtins", name)
    for name in (
        "dict",
        "list",
        "tuple",
        "set",
        "frozenset",
        "str",
        "bytes",
        "bytearray",
        "int",
        "float",
        "bool",
        "complex",
        "slice",
        "range",
    )
} | {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "bool_"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("collections", "OrderedDict"),
    ("torch", "dtype"),
}


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_CLASSES or (module.startswith("numpy") and name.endswith("DType")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise DataProtoError(f"refusing to load {module}.{name}: a DataProto file holds only arrays and plain values")


def dump_state(state: dict[str, Any], filepath: str) -> None:
    with open(filepath, "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)


def load_state(filepath: str) -> dict[str, Any]:
    with open(filepath, "rb") as f:
        data = f.read()
    try:
        return _DataUnpickler(io.BytesIO(data)).load()
    except DataProtoError as exc:
        raise DataProtoError(f"{filepath}: {exc}") from None
