"""Weights between worker groups through Ray's object store (layer 3): split placement's weight push.

The training ranks stream their HF-named full tensors bucket by bucket (``TrainEngine.export_weights``); rank 0
puts each bucket in the object store (``put_buckets``) as raw bytes, so the trainer holds one bucket at a time and
the model sits once in the store (shared memory on the node, copied once to each other node that reads it). The
rollout ranks read the buckets back one at a time (``read_buckets``) and hand them to their engine, which loads
each into its own tensor-parallel layout. A LoRA actor with ``rollout.lora_sync=adapter`` pushes its adapter
alone the same way, its PEFT config riding along (``WeightBuckets.adapter_config``). ``WeightBuckets`` carries
the references: Ray resolves object references passed as top-level arguments, not those inside an object, so the
receiver fetches each bucket only when its engine asks for it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import ray
import torch


@dataclass
class WeightBuckets:
    """References to one weight version's buckets in the object store, and their size."""

    refs: list = field(default_factory=list)
    nbytes: int = 0
    version: int = 0
    adapter_config: dict | None = None  # a LoRA adapter's PEFT config: the buckets hold that adapter alone


def _to_bytes(tensor: torch.Tensor):
    """(numpy uint8 view, dtype, shape): any dtype (bfloat16 too) travels as raw bytes, without pickling."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), flat.dtype, tuple(tensor.shape)


def put_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, adapter_config: dict | None = None
) -> WeightBuckets:
    """Every bucket into the object store, one at a time (``adapter_config``: they are that LoRA adapter's)."""
    out = WeightBuckets(version=version, adapter_config=adapter_config)
    for bucket in buckets:
        entries = []
        for name, tensor in bucket:
            raw, dtype, shape = _to_bytes(tensor)
            entries.append((name, raw, dtype, shape))
            out.nbytes += raw.nbytes
        out.refs.append(ray.put(entries))
    return out


def read_buckets(weights: WeightBuckets) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets back as (name, tensor) lists, each fetched when the consumer asks for it. The tensors view the
    store's read-only shared memory (the engine copies them into its own parameters)."""
    for ref in weights.refs:
        entries = ray.get(ref)
        bucket = []
        with warnings.catch_warnings():  # torch warns that the store's buffers are read-only; nothing writes them
            warnings.simplefilter("ignore", UserWarning)
            for name, raw, dtype, shape in entries:
                bucket.append((name, torch.from_numpy(raw).view(dtype).reshape(shape)))
        yield bucket
