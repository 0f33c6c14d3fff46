"""Weights between worker groups (layer 3): split placement's weight push, over a collective or the object store.

Collective (``checkpoint_engine.backend`` nccl, auto's choice on CPU): the trainer's export rank and every rollout
rank form a ``torch.distributed`` group of their own (gloo on CPU, NCCL on CUDA; group rank 0 the sender, rollout
rank r is 1 + r), met through a TCPStore the export rank hosts (``open_store``) and kept for every later push. Each
bucket goes as one broadcast message (a 4 KiB header with its names, dtypes, shapes and slot as JSON), then its
bytes, by one of two lanes (``push_lanes``): the ranks on the sender's node view it in a shared-memory slot the
sender wrote once (and acknowledge it point to point, which paces the sender: ``Acks``); the ranks of other nodes
(every rank on CUDA) receive it by broadcast, each tensor of 1 MiB or more as it is (no packing copy), each run of
smaller ones packed into one. The
sender gathers the next bucket while it sends one, each receiver takes the next while its engine loads one
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

from scaletrain.controller.push_lanes import Acks, Lanes, SlotRing, SlotViews, agree
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
    same_node: str = "shm"  # shm: the sender's node reads the buckets from shared memory; broadcast: sent the bytes

    @property
    def key(self) -> tuple[str, int]:
        return self.host, self.port


_STORES: dict[int, TCPStore] = {}  # the store this process hosts, by port
_GROUPS: dict[tuple[str, int], Any] = {}  # this process's member of each channel's group
_LANES: dict[tuple[str, int], Lanes] = {}  # each channel's lanes, agreed when its group formed
_RINGS: dict[tuple[str, int], SlotRing] = {}  # the sender's slots for each channel, kept for its next push
_VIEWS: dict[tuple[str, int], SlotViews] = {}  # a receiver's mappings of them
_ARENAS: dict[tuple[str, int], list[torch.Tensor | None]] = {}  # a receiver's buffers, kept for the next push
_ABORT, _END, _DATA = -1, 0, 1  # a message's code: a sender's failure, the push's end, a value
HEADER_WORDS = 512  # a message's fixed header (int64s: code, JSON length, the JSON itself where it fits: 4 KiB)
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
        _LANES[channel.key] = agree(group, rank, channel.world_size, channel.same_node, channel.device, store, timeout)
        _GROUPS[channel.key] = group
    return _GROUPS[channel.key]


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    _broadcasts(group, [tensor])


def _broadcasts(group: Any, tensors: list[torch.Tensor]) -> None:
    """Each of ``tensors`` broadcast from group rank 0, all started before the first is waited for (each call's
    round trips overlap the others' instead of adding up)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for work in [group.broadcast([tensor], options) for tensor in tensors]:
        work.wait()


def _send_message(group: Any, code: int, value=None) -> None:
    """One message to every receiver: ``code`` and ``value`` as JSON (never a pickle: the push group's store
    listens on the network, and what arrives is data, not code), in a fixed header, the JSON after it where it
    does not fit (one broadcast per bucket where its names fit in 4 KiB)."""
    packed = json.dumps(value).encode()
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    header[0], header[1] = code, len(packed)
    inline = len(packed) <= 8 * (HEADER_WORDS - 2)
    if inline:
        header[2:].view(torch.uint8)[: len(packed)] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    _broadcast(group, header)
    if not inline:
        _broadcast(group, torch.frombuffer(bytearray(packed), dtype=torch.uint8))


def _received_message(group: Any) -> tuple[int, Any]:
    """(code, value) of the sender's next message."""
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    _broadcast(group, header)
    code, size = int(header[0]), int(header[1])
    if code != _DATA:
        return code, None
    if size <= 8 * (HEADER_WORDS - 2):
        return code, json.loads(header[2:].view(torch.uint8)[:size].numpy().tobytes())
    packed = torch.empty(size, dtype=torch.uint8)
    _broadcast(group, packed)
    return code, json.loads(packed.numpy().tobytes())


def _dtype(name: str) -> torch.dtype:
    """A pushed tensor's dtype, by its torch name; anything else is refused."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight push: '{name}' is not a torch dtype")
    return dtype


def _layout(sizes: list[int]) -> tuple[list[int], list[tuple[int, int, list[int]]], int]:
    """Where each tensor of a bucket lies in the receiver's buffer (64-byte aligned, so any dtype views it), the
    bucket's broadcasts as (start, length, tensor indices): each tensor of at least ``SMALL`` bytes alone (sent as
    it is: no packing copy), each run of smaller ones packed into one; and the layout's aligned end (a slot's size)."""
    offsets, end = aligned_offsets(sizes)
    parts: list[list[int]] = []
    for i, size in enumerate(sizes):
        if size >= SMALL or not parts or sizes[parts[-1][-1]] >= SMALL:
            parts.append([i])
        else:
            parts[-1].append(i)
    spans = [(offsets[p[0]], offsets[p[-1]] + sizes[p[-1]] - offsets[p[0]], p) for p in parts]
    return offsets, spans, end


def send_buckets(
    channel: WeightChannel, buckets: Iterable[list[tuple[str, torch.Tensor]]], adapter_config: dict | None
) -> int:
    """On the export rank: every bucket to every rollout rank (first ``adapter_config``: None, or the LoRA adapter
    the buckets hold); returns the bytes sent. The next bucket is gathered (a collective of the training ranks)
    while this one is sent."""
    group, lanes, sent = _group(channel, 0), _LANES[channel.key], 0
    if lanes.local and channel.key not in _RINGS:
        _RINGS[channel.key] = SlotRing()
    ring, acks = _RINGS.get(channel.key), Acks(lanes)
    _send_message(group, _DATA, adapter_config)
    try:
        index = -1
        for index, bucket in enumerate(prefetched(buckets, name="weight-export")):
            if ring is not None:
                acks.wait_for(index - 1)  # the node's ranks are done with the bucket this one's slot held
            sent += _send_bucket(channel, group, ring, index, bucket)
    except BaseException:
        # the receivers raise instead of waiting; a group already broken (a dead receiver) fails this at once
        with contextlib.suppress(Exception):
            _send_message(group, _ABORT)
        raise
    if ring is not None:
        acks.wait_for(index + 1)  # what the node's ranks said on reaching the end: the next push starts even
    _send_message(group, _END)
    return sent


def _send_bucket(
    channel: WeightChannel, group: Any, ring: SlotRing | None, index: int, bucket: list[tuple[str, torch.Tensor]]
) -> int:
    """One bucket: written into its slot for the sender's node, then announced (names, dtypes, shapes, the slot),
    then its bytes broadcast to the other nodes (to every rank where /dev/shm had no room for it). Its slot is
    free: the node's ranks said they were done with the bucket it held (``Acks``)."""
    raw = [t.detach().to(channel.device).contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    offsets, spans, end = _layout([r.numel() for r in raw])
    slot = ring.reserve(index, end) if ring is not None else None
    if slot is not None:
        slot.write([(name, r) for (name, _), r in zip(bucket, raw)])
    meta = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]
    lanes = _LANES[channel.key]
    _send_message(group, _DATA, {"meta": meta, "slot": [slot.index, slot.path, slot.size] if slot else None})
    target = lanes.bytes_group if slot is not None else group
    if target is not None:
        _broadcasts(target, [_span(raw, offsets, span, channel.device) for span in spans])
    return sum(r.numel() for r in raw)


def _span(raw: list[torch.Tensor], offsets: list[int], span: tuple, device: str) -> torch.Tensor:
    """One broadcast's bytes: a large tensor as it is, a run of small ones packed."""
    start, length, part = span
    if len(part) == 1:
        return raw[part[0]]
    packed = torch.zeros(length, dtype=torch.uint8, device=device)
    for i in part:
        packed[offsets[i] - start : offsets[i] - start + raw[i].numel()] = raw[i]
    return packed


def _arena(channel: WeightChannel, index: int, need: int) -> torch.Tensor:
    """Receive buffer ``index % ARENAS`` of the channel, at least ``need`` bytes (kept for later pushes)."""
    arenas = _ARENAS.setdefault(channel.key, [None] * ARENAS)
    arena = arenas[index % ARENAS]
    if arena is None or arena.numel() < need:
        arena = arenas[index % ARENAS] = torch.empty(need, dtype=torch.uint8, device=channel.device)
    return arena


def _received(channel: WeightChannel, group: Any, rank: int, counted: list[int]):
    """The buckets as they arrive (``rank``: this member's in the group). On the sender's node (``Lanes.local``)
    each is a view of the sender's slot; elsewhere it is received into ``ARENAS`` buffers used in turn and kept
    for the channel's later pushes (as verl's and slime's collective pushes keep theirs: memory is not faulted in
    again for each bucket). Either way a bucket's tensors stay valid until the consumer has drawn the bucket
    ``ARENAS - 1`` after it; a consumer that keeps tensors longer copies them. (Reaching bucket i's message, this
    generator has handed out bucket i - 1: the consumer has drawn i - 2, so it is done with i - 3.)"""
    lanes = _LANES[channel.key]
    acks = Acks(lanes) if rank in lanes.local else None
    for index in itertools.count():
        if acks is not None:
            acks.send(index)
        code, info = _received_message(group)
        if code == _END:
            if acks is not None:
                acks.finish()
            return
        if code != _DATA:
            raise RuntimeError(f"weight push {channel.version}: the trainer's export failed mid-push (see its error)")
        meta = [(name, _dtype(dtype), tuple(shape)) for name, dtype, shape in info["meta"]]
        sizes = [dtype.itemsize * int(torch.Size(shape).numel()) for _, dtype, shape in meta]
        offsets, spans, _ = _layout(sizes)
        need = spans[-1][0] + spans[-1][1] if spans else 0
        counted[0] += sum(sizes)
        if info["slot"] is not None and rank in lanes.local:
            yield _VIEWS.setdefault(channel.key, SlotViews()).bucket(info["slot"], meta, offsets, sizes, need)
            continue
        arena = _arena(channel, index, need)
        source = group if info["slot"] is None else lanes.bytes_group
        _broadcasts(source, [arena[start : start + length] for start, length, _ in spans])
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
        _, self.adapter_config = _received_message(group)
        self._counted, self._collective = [0], True
        self.buckets = prefetched(_received(weights, group, 1 + rank, self._counted), name="weight-receive")

    @property
    def nbytes(self) -> int:
        return self._counted[0]

    def finish(self) -> None:
        if self._collective:
            drain(self.buckets)


def drain(buckets: Iterator) -> None:
    for _ in buckets:
        pass
