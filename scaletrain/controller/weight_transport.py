"""Weights between worker groups (layer 3): split placement's weight push, over a collective or the object store.

Collective (``checkpoint_engine.backend`` nccl, auto's choice on CPU): the trainer's export rank and every rollout
rank form a ``torch.distributed`` group of their own (gloo on CPU, NCCL on CUDA; group rank 0 the sender, rollout
rank r is 1 + r), met through a TCPStore the export rank hosts (``open_store``) and kept for every later push. Each
bucket goes as a small JSON header (names, dtypes and shapes), then its bytes: each tensor of 1 MiB or more broadcast as
it is (no packing copy), each run of smaller ones packed into one broadcast. The sender
gathers the next bucket while it broadcasts one, each receiver takes the next while its engine loads one
(``prefetched``: at most one bucket ahead on either side). A sender whose export fails broadcasts an abort, so the
receivers raise instead of waiting; a receiver whose engine fails reads the push to its end before it raises, so
the sender and the other ranks are not left waiting; a dead rank ends the others' wait with gloo's error (and the
driver names the rank: its worker died).

Object store (``naive``): the training ranks stream their HF-named full tensors bucket by bucket
(``TrainEngine.export_weights``); rank 0 puts each bucket in the object store (``put_buckets``) as raw bytes, so
the trainer holds one bucket at a time and the model sits once in the store (shared memory on the node, copied
once to each other node that reads it). The rollout ranks read the buckets back one at a time (``read_buckets``)
and hand them to their engine, which loads each into its own tensor-parallel layout. A LoRA actor with
``rollout.lora_sync=adapter`` pushes its adapter alone the same way, its PEFT config riding along
(``WeightBuckets.adapter_config``). ``WeightBuckets`` carries the references: Ray resolves object references
passed as top-level arguments, not those inside an object, so the receiver fetches each bucket only when its
engine asks for it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from scaletrain.utils.byte_layout import aligned_offsets
from scaletrain.utils.prefetch import prefetched


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


@dataclass
class WeightChannel:
    """One push over the collective group: where its members meet (the store the export rank hosts), how many
    they are (1 + the rollout ranks), its device (cpu: gloo, cuda: NCCL) and timeout, and what it carries."""

    host: str
    port: int
    world_size: int
    device: str = "cpu"
    timeout_s: float = 600.0
    version: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.host, self.port


_STORES: dict[int, TCPStore] = {}  # the store this process hosts, by port
_GROUPS: dict[tuple[str, int], Any] = {}  # this process's member of each channel's group
_ARENAS: dict[tuple[str, int], list[torch.Tensor]] = {}  # a receiver's buffers, kept for the channel's next push
_ABORT, _END = -1, 0  # header values of a push's end and of a sender's failure
ARENAS = 3  # receive buffers per rollout rank, kept between pushes: one loading, one queued, one receiving
SMALL = 1 << 20  # tensors smaller than this go packed with their neighbours, one broadcast per run


def open_store(host: str, timeout_s: float) -> int:
    """On the export rank: a TCPStore on a free port of ``host`` (this node's address), kept for this process's
    life; returns the port."""
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(0, timeout_s))
    _STORES[store.port] = store
    return store.port


def _group(channel: WeightChannel, rank: int) -> Any:
    """This process's member of the channel's group (made on first use: every member joins then)."""
    if channel.key not in _GROUPS:
        timeout = datetime.timedelta(seconds=channel.timeout_s)
        store = _STORES.get(channel.port) if rank == 0 else None
        store = store or TCPStore(channel.host, channel.port, is_master=False, timeout=timeout)
        prefixed = PrefixStore("scaletrain-weights", store)
        if channel.device == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, channel.world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, channel.world_size, timeout)
        _GROUPS[channel.key] = group
    return _GROUPS[channel.key]


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _broadcast_json(group: Any, value) -> None:
    """``value`` as JSON (never a pickle: the push group's store listens on the network, and what arrives is data,
    not code), after its size."""
    packed = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    _broadcast(group, torch.tensor([packed.numel(), 0], dtype=torch.int64))
    _broadcast(group, packed)


def _received_json(group: Any, size: int):
    packed = torch.empty(size, dtype=torch.uint8)
    _broadcast(group, packed)
    return json.loads(packed.numpy().tobytes())


def _dtype(name: str) -> torch.dtype:
    """A pushed tensor's dtype, by its torch name; anything else is refused."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight push: '{name}' is not a torch dtype")
    return dtype


def _layout(sizes: list[int]) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
    """Where each tensor of a bucket lies in the receiver's buffer (64-byte aligned, so any dtype views it), and
    the bucket's broadcasts as (start, length, tensor indices): each tensor of at least ``SMALL`` bytes alone (sent
    as it is: no packing copy), each run of smaller ones packed into one."""
    offsets, _ = aligned_offsets(sizes)
    parts: list[list[int]] = []
    for i, size in enumerate(sizes):
        if size >= SMALL or not parts or sizes[parts[-1][-1]] >= SMALL:
            parts.append([i])
        else:
            parts[-1].append(i)
    spans = [(offsets[p[0]], offsets[p[-1]] + sizes[p[-1]] - offsets[p[0]], p) for p in parts]
    return offsets, spans


def send_buckets(
    channel: WeightChannel, buckets: Iterable[list[tuple[str, torch.Tensor]]], adapter_config: dict | None
) -> int:
    """On the export rank: every bucket to every rollout rank (first ``adapter_config``: None, or the LoRA adapter
    the buckets hold); returns the bytes sent. The next bucket is gathered (a collective of the training ranks)
    while this one is broadcast."""
    group, sent = _group(channel, 0), 0
    _broadcast_json(group, adapter_config)
    try:
        for bucket in prefetched(buckets, name="weight-export"):
            raw = [t.detach().to(channel.device).contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
            _broadcast_json(group, [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket])
            offsets, spans = _layout([r.numel() for r in raw])
            for start, length, part in spans:
                if len(part) == 1:
                    _broadcast(group, raw[part[0]])
                    continue
                packed = torch.zeros(length, dtype=torch.uint8, device=channel.device)
                for i in part:
                    packed[offsets[i] - start : offsets[i] - start + raw[i].numel()] = raw[i]
                _broadcast(group, packed)
            sent += sum(r.numel() for r in raw)
    except BaseException:
        # the receivers raise instead of waiting; a group already broken (a dead receiver) fails this at once
        with contextlib.suppress(Exception):
            _broadcast(group, torch.tensor([_ABORT, 0], dtype=torch.int64))
        raise
    _broadcast(group, torch.tensor([_END, 0], dtype=torch.int64))
    return sent


def _received(channel: WeightChannel, group: Any, counted: list[int]):
    """The buckets as they arrive, into ``ARENAS`` buffers used in turn and kept for the channel's later pushes
    (as verl's and slime's collective pushes keep theirs: memory is not faulted in again for each bucket, at the
    cost of ``ARENAS`` buckets held between pushes): a bucket's tensors stay valid until the consumer has drawn the
    bucket ``ARENAS - 1`` after it; a consumer that keeps tensors longer copies them."""
    arenas = _ARENAS.setdefault(channel.key, [])
    for index in itertools.count():
        header = torch.empty(2, dtype=torch.int64)
        _broadcast(group, header)
        size = int(header[0])
        if size == _END:
            return
        if size == _ABORT:
            raise RuntimeError(f"weight push {channel.version}: the trainer's export failed mid-push (see its error)")
        meta = [(name, _dtype(dtype), tuple(shape)) for name, dtype, shape in _received_json(group, size)]
        sizes = [dtype.itemsize * int(torch.Size(shape).numel()) for _, dtype, shape in meta]
        offsets, spans = _layout(sizes)
        need = spans[-1][0] + spans[-1][1] if spans else 0
        arena = arenas[index % ARENAS] if len(arenas) == ARENAS else None
        if arena is None or arena.numel() < need:
            arena = torch.empty(need, dtype=torch.uint8, device=channel.device)
            arenas[index % ARENAS : index % ARENAS + 1] = [arena]
        for start, length, _ in spans:
            _broadcast(group, arena[start : start + length])
        counted[0] += sum(sizes)
        yield [
            (name, arena[offset : offset + nbytes].view(dtype).reshape(shape))
            for (name, dtype, shape), offset, nbytes in zip(meta, offsets, sizes)
        ]


class ReceivedPush:
    """On rollout rank ``rank``: one push's adapter config (None: full weights) and its buckets (``buckets``),
    over the push group (``channel``: each bucket received while the previous one loads) or from the object store
    (``WeightBuckets``); ``nbytes`` counts what arrived. Call ``finish`` after the load, even a failed one: a
    collective push is read to its end, so the sender and the other ranks are not left waiting."""

    def __init__(self, weights: WeightChannel | WeightBuckets, rank: int) -> None:
        self.version = weights.version
        if isinstance(weights, WeightBuckets):
            self.adapter_config, self.buckets = weights.adapter_config, read_buckets(weights)
            self._counted, self._collective = [weights.nbytes], False
            return
        group = _group(weights, 1 + rank)
        header = torch.empty(2, dtype=torch.int64)
        _broadcast(group, header)
        self.adapter_config = _received_json(group, int(header[0]))
        self._counted, self._collective = [0], True
        self.buckets = prefetched(_received(weights, group, self._counted), name="weight-receive")

    @property
    def nbytes(self) -> int:
        return self._counted[0]

    def finish(self) -> None:
        if self._collective:
            drain(self.buckets)


def drain(buckets: Iterator) -> None:
    for _ in buckets:
        pass
