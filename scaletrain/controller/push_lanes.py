"""The two lanes of split placement's collective push (layer 3): shared memory to the sender's own node, a
broadcast to every other node.

A rollout rank on the export rank's node does not need the bytes sent to it: gloo's broadcast to it is a copy
through a loopback socket, slower here than Ray's object store, which is shared memory on a node. So, as NCCL
keeps a node's traffic in shared memory / NVLink, each bucket is written once into a ring of ``RING`` slots, files
in /dev/shm the sender keeps for every later push (``backends/rollout/ipc_transport.py``'s ``Slot``), and the ranks
of its node view them in place (their engine's load is the one copy out); the ranks of other nodes receive the
bytes over a group of their own with the sender. On CUDA the whole push stays one NCCL group (NCCL's own
transports already take the shortest path within a node).

Which ranks share the sender's node is agreed once, when the push group forms (``agree``): each member's node key
is its kernel's boot id and its /dev/shm's device and inode, so two containers on one host with separate /dev/shm
mounts count as two nodes. ``engine_kwargs.nccl.same_node=broadcast`` sends every rank the bytes (the former path).
A bucket the slots cannot hold (/dev/shm full: its pages are reserved before anything is written) goes to every
rank over the push group instead, and the push logs it once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage]

from backends.rollout.ipc_transport import PREFIX, Slot, SlotMaps, remove_orphans, shm_dir
from scaletrain.utils.byte_layout import ALIGN

logger = logging.getLogger(__name__)

RING = 4  # slots written in turn: a receiver's engine loads one, one is queued, one received, one written
_ACK = 0  # the tag of a receiver's acknowledgements (in a group of their own)


def node_key() -> bytes:
    """This process's node, as far as shared memory goes: the kernel's boot id and the shm folder's device and
    inode (a container with a /dev/shm of its own is a node of its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    st = os.stat(shm_dir())
    return hashlib.sha256(f"{boot}/{st.st_dev}/{st.st_ino}".encode()).digest()


def _all_gather_keys(group: Any, world_size: int) -> list[bytes]:
    mine = torch.frombuffer(bytearray(node_key()), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    group.allgather([out], [mine]).wait()
    return [bytes(t.numpy().tobytes()) for t in out]


@dataclass
class Lanes:
    """Who reads the slots (``local``: group ranks on the sender's node; every other rank is sent the bytes),
    and the groups: ``bytes_group`` (the sender and the other ranks: None when there are none; the push group
    itself when no rank is local); ``ack_group``: the sender and the local ranks (as ranks 1, 2, ... in
    ``local``'s order), for their acknowledgements alone (no collective runs in it: a point-to-point tag of the
    push group could meet a collective's)."""

    local: list[int] = field(default_factory=list)
    bytes_group: Any = None
    ack_group: Any = None


def agree(group: Any, rank: int, world_size: int, same_node: str, device: str, store: Any, timeout) -> Lanes:
    """Every member's lanes, the same on each (a collective of the push group, once, when it forms)."""
    keys = _all_gather_keys(group, world_size)
    lane = same_node == "shm" and device == "cpu"
    local = [r for r in range(1, world_size) if lane and keys[r] == keys[0]]
    remote = [r for r in range(1, world_size) if r not in local]
    if not local:
        return Lanes(local, group)
    acks = _subgroup("acks", [0, *local], rank, store, timeout)
    if not remote:
        return Lanes(local, None, acks)
    return Lanes(local, _subgroup("bytes", [0, *remote], rank, store, timeout), acks)


def _subgroup(name: str, members: list[int], rank: int, store: Any, timeout) -> Any:
    """A gloo group of ``members`` (push group ranks), None on the others (they never touch it)."""
    if rank not in members:
        return None
    prefixed = PrefixStore(f"scaletrain-weights-{name}", store)
    return dist.ProcessGroupGloo(prefixed, members.index(rank), len(members), timeout)


class SlotRing:
    """The sender's ``RING`` slots in /dev/shm, kept for its later pushes (freed at exit; a killed sender's are
    removed by the next sender that starts on the node)."""

    def __init__(self) -> None:
        folder = shm_dir()
        remove_orphans(folder)
        self.slots = [Slot(folder, i, "cpu") for i in range(RING)]
        self.warned = False
        weakref.finalize(self, _close, self.slots)

    def reserve(self, index: int, nbytes: int) -> Slot | None:
        """Bucket ``index``'s slot, large enough for ``nbytes`` (its tensors' aligned layout: ``Slot.write`` then
        makes nothing anew); None when /dev/shm cannot hold it (the bucket then goes over the push group)."""
        slot = self.slots[index % RING]
        try:
            slot.ensure(max(nbytes, ALIGN))
        except OSError as error:
            if not self.warned:
                self.warned = True
                logger.warning(
                    "weight push: %s cannot hold a %d-byte bucket (%s); such buckets go over the push group",
                    slot.folder,
                    nbytes,
                    error,
                )
            return None
        return slot


def _close(slots: list[Slot]) -> None:
    for slot in slots:
        slot.close()


class Acks:
    """The slots' pacing: each rank of the sender's node, reaching bucket i (i >= ``RING`` - 1; its consumer has
    then drawn i - 2, so it is done with i - 3), tells the sender so (``send``: a point-to-point message, which
    does not wait for the sender); the sender writes bucket i into the slot of bucket i - ``RING`` only once every
    such rank has told it of bucket i - 1 (``wait_for``), and at the push's end takes the rest, so every push
    starts even. (Point to point: an all-reduce over gloo costs some five times a broadcast here.)"""

    def __init__(self, lanes: Lanes) -> None:
        self.group, self.senders, self.taken = lanes.ack_group, len(lanes.local), RING - 1
        self.pending: list = []  # a receiver's sends (gloo's send completes once the sender has taken it)

    def wait_for(self, index: int) -> None:
        """On the sender: every acknowledgement up to bucket ``index``."""
        mark = torch.zeros(1, dtype=torch.int64)
        while self.taken <= index:
            for rank in range(1, 1 + self.senders):
                self.group.recv([mark], rank, _ACK).wait()
            self.taken += 1

    def send(self, index: int) -> None:
        """On a rank of the sender's node, reaching bucket ``index`` (or the push's end). Not waited for here:
        the sender takes it only before its next bucket; the one of bucket ``index`` - 2 has been taken by now
        (the sender took it before it announced bucket ``index`` - 1, which this rank has received)."""
        if index >= RING - 1:
            mark = torch.zeros(1, dtype=torch.int64)
            self.pending.append((index, mark, self.group.send([mark], 0, _ACK)))
        while self.pending and self.pending[0][0] <= index - 2:
            self.pending.pop(0)[2].wait()

    def finish(self) -> None:
        """On a rank of the sender's node, once the push's end has arrived (the sender took every one before)."""
        while self.pending:
            self.pending.pop(0)[2].wait()


class SlotViews:
    """A receiver's views of the sender's slots (``SlotMaps``: a slot made anew, larger, is mapped again)."""

    def __init__(self) -> None:
        self.maps = SlotMaps()

    def bucket(self, source: list, meta: list, offsets: list[int], sizes: list[int], need: int) -> list:
        """The bucket's (name, tensor) views of slot ``source`` (index, path, size), checked to be one of ours
        and large enough (what arrives over the push group is data: it names no other file)."""
        index, path, size = int(source[0]), str(source[1]), int(source[2])
        folder, name = os.path.split(path)
        if folder != shm_dir() or not name.startswith(PREFIX) or size < need:
            raise RuntimeError(f"weight push: slot {path!r} ({size} bytes) is not a sender's slot of {need} bytes")
        raw = self.maps.buffer(index, ("file", path, size))
        with warnings.catch_warnings():  # the views are read-only; the engine copies out of them
            warnings.simplefilter("ignore", UserWarning)
            return [
                (name, raw[offset : offset + nbytes].view(dtype).reshape(shape))
                for (name, dtype, shape), offset, nbytes in zip(meta, offsets, sizes)
            ]
