"""Combining the parts of DataProtos: equal-value checks, the unions of their dicts, concat's meta_info merge.

Layer 0 (scaletrain/protocol): imports nothing of the layers above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from scaletrain.protocol.errors import DataProtoError

METRICS_KEY = "metrics"


def values_equal(a: Any, b: Any, _seen: frozenset[tuple[int, int]] = frozenset()) -> bool:
    """Equality that also holds for tensors, numpy arrays (object arrays too, NaN equal to NaN) and their nests;
    a pair already being compared (a self-referencing object array) counts as equal."""
    if (id(a), id(b)) in _seen:
        return True
    seen = _seen | {(id(a), id(b))}
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(values_equal(x, y, seen) for x, y in zip(a.ravel(), b.ravel()))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN == NaN: the same missing value in both
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return False  # an array against a scalar or None
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # ambiguous truth value of arrays nested in objects
        return a is b


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """``tensor_dict2``'s tensors added to ``tensor_dict1`` (in place, also returned); a shared key must hold the
    same values in both."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(f"union: batch sizes differ: {tensor_dict1.batch_size} vs {tensor_dict2.batch_size}")
    return _union_into(
        tensor_dict1, tensor_dict2, lambda key: f"union: batch key '{key}' differs between the two batches"
    )


def union_numpy_dict(dict1: dict[str, np.ndarray], dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``dict2``'s arrays added to ``dict1`` (in place, also returned); a shared key must hold equal arrays."""
    return _union_into(  # verl's wording after ours: code written for verl matches it
        dict1,
        dict2,
        lambda key: (
            f"union: non_tensor_batch key '{key}' differs: `{key}` in tensor_dict1 and tensor_dict2 are not "
            "the same object."
        ),
    )


def union_meta_info(meta1: dict[str, Any], meta2: dict[str, Any]) -> dict[str, Any]:
    return _union_into(meta1, meta2, lambda key: f"union: meta_info key '{key}' differs between the two DataProtos")


def _union_into(into: Any, other: Any, differs: Callable[[str], str]) -> Any:
    """``other``'s entries set in ``into`` (a dict or TensorDict, in place, also returned); a key both hold with
    unequal values raises ``DataProtoError(differs(key))``."""
    for key, val in other.items():
        if key in into.keys() and not values_equal(into[key], val):
            raise DataProtoError(differs(key))
        into[key] = val
    return into


def list_of_dict_to_dict_of_list(list_of_dict: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """[{a: 1, b: 2}, {a: 3}] -> {a: [1, 3], b: [2]}: each key's values in order, from the dicts that have it."""
    out: dict[str, list[Any]] = {}
    for d in list_of_dict:
        for key, val in d.items():
            out.setdefault(key, []).append(val)
    return out


def merged_meta_info(metas: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """concat's meta_info: every part's keys; a key several parts hold must agree (DataProtoError names it), except
    ``metrics``: each part's metrics (a dict, or a list of dicts) are gathered into one dict of lists, so the
    metrics a data-parallel method's workers report all reach the driver."""
    merged: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    for meta in metas:
        for key, val in meta.items():
            if key == METRICS_KEY:
                if val is not None:
                    metrics.extend(val if isinstance(val, list) else [val])
            elif key not in merged:
                merged[key] = val
            elif not values_equal(merged[key], val):
                raise DataProtoError(f"Conflicting values for meta_info key '{key}': {merged[key]!r} vs {val!r}")
    if metrics:
        merged[METRICS_KEY] = list_of_dict_to_dict_of_list(metrics)
    return merged
