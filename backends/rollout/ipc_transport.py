"""Weights into an engine running in another process through two reused slots: shared memory or CUDA IPC (layer 1).

The agent loops' AsyncLLM runs its model in an engine-core process of its own, which cannot take the trainer's
tensors by reference. Writing every bucket to a file in /dev/shm before one reload call (``checkpoint_engine
.backend=naive``) puts a whole copy of the model there: a 7B bf16 model on 8 ranks of a node needs ~120 GB, and a
container's /dev/shm is often 64 MB. Here the sender (``SlotSender``, in the rollout worker) owns two slots, files in
/dev/shm mapped into both processes, each as large as the largest bucket seen; the receiver (``receive_buckets``,
inside the engine's reload call) copies a bucket out of its slot and hands the slot back before vLLM loads it. So
at most two buckets sit in /dev/shm at any time, the slots are reused by every later sync (no per-sync files), and
the sender fills one slot (gathering the next bucket first: FSDP / DeepSpeed / megatron collectives) while the
engine copies and loads the other.

With ``checkpoint_engine.backend=cuda_ipc`` the two slots are device buffers the engine process opens through CUDA
IPC handles: the buckets never leave the device, and nothing goes through /dev/shm (tests/gpu; auto keeps shm
until that test has passed on a GPU).

Control messages go over a Unix socket in a private (0700) directory: the slot, its file, and each tensor's name,
dtype, shape and offset; the slot's number back once copied. Either side gone ends the other's wait with an error
(end of stream), never a hang: the sender also checks its engine call, which fails when the engine process dies.
Slot files carry the owner's pid in their names; files of owners that no longer run are removed when a sender
starts, so a killed worker's slots do not stay in /dev/shm.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import shutil
import socket
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch

from scaletrain.utils.byte_layout import ALIGN, aligned_offsets

PREFIX = "scaletrain-sync-"
SLOTS = 2  # buckets in flight: one being filled, one being read
POLL_S = 0.2  # how often a wait checks that the other side still runs


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_orphans(folder: str) -> int:
    """Slot files of owners that no longer run (killed before they could remove them); returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(folder, PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(PREFIX) :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
        except (ValueError, PermissionError):  # not ours, or another user's live process
            continue
    return removed


class Slot:
    """One slot: a file in ``folder`` mapped into this process (``device`` cpu), or a buffer on ``device`` (CUDA
    IPC); made anew, larger, when a bucket needs more. ``source`` tells the receiver how to open it."""

    def __init__(self, folder: str, index: int, device: str) -> None:
        self.folder, self.index, self.device, self.generation = folder, index, device, 0
        self.path, self.size, self.buffer, self.map = "", 0, None, None
        self.source: tuple = ()

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        self.close()
        self.generation += 1
        if self.device == "cpu":
            name = f"{PREFIX}{os.getpid()}-{id(self):x}-{self.index}-{self.generation}"
            self.path = os.path.join(self.folder, name)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # the pages reserved now: a full /dev/shm fails here with ENOSPC, not later with SIGBUS mid-write
                os.posix_fallocate(fd, 0, nbytes)
                self.map = mmap.mmap(fd, nbytes)
            except OSError:
                os.close(fd)
                os.unlink(self.path)
                self.path, self.size = "", 0
                raise
            os.close(fd)
            self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)  # pyright: ignore[reportArgumentType]
            self.source = ("file", self.path, nbytes)
        else:
            from torch.multiprocessing.reductions import reduce_tensor

            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.source = ("cuda", self.generation, reduce_tensor(self.buffer))
        self.size = nbytes

    def write(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple]:
        """The bucket's tensors into this slot; returns (name, dtype, shape, offset, nbytes) per tensor."""
        tensors = [(name, t.detach().to(self.device).contiguous()) for name, t in bucket]
        offsets, total = aligned_offsets(t.numel() * t.element_size() for _, t in tensors)
        self.ensure(max(total, ALIGN))
        assert self.buffer is not None
        entries = []
        for (name, t), offset in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            self.buffer[offset : offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
            entries.append((name, t.dtype, tuple(t.shape), offset, nbytes))
        if self.device != "cpu":
            torch.cuda.current_stream(self.device).synchronize()  # written before the receiver reads
        return entries

    def close(self) -> None:
        self.buffer = None
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped once it is collected
                self.map.close()
            self.map = None
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = ""


class SlotSender:
    """The sending side, kept by the engine for its lifetime (the slots are reused by every sync); ``close``
    frees the slots. ``device``: cpu (files in ``folder``, default /dev/shm) or a CUDA device (CUDA IPC)."""

    def __init__(self, device: str = "cpu", folder: str | None = None) -> None:
        self.folder = folder or shm_dir()
        if device == "cpu":
            remove_orphans(self.folder)
        self.slots = [Slot(self.folder, i, device) for i in range(SLOTS)]
        self.peak_bytes = 0  # the most bytes the slots held at once (every sync so far)
        self.close = weakref.finalize(self, _close_slots, self.slots)  # also at exit, or once unreferenced

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], start_receiver) -> tuple[object, int]:
        """Stream ``buckets`` to the receiver that ``start_receiver(address)`` starts (it returns the Future of
        the engine call running ``receive_buckets(address)``); returns (that call's result, bytes sent)."""
        control = tempfile.mkdtemp(prefix="scaletrain-sync-")  # 0700: only this user reaches the socket
        address = os.path.join(control, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
            listener.listen(1)
            call = start_receiver(address)
            conn = _accept(listener, call)
            try:
                sent = self._stream(conn, buckets, call)
                return call.result(), sent  # the receiver hands slots back until it ends: close after
            except _StreamLost as lost:  # the engine's side ended first: its own error says why, where it has one
                lost_error = "the engine process closed the weight stream mid-update"
                error = call.exception() if _settled(call) else None
                if error is not None:
                    raise RuntimeError(f"{lost_error}: {type(error).__name__}: {error}") from error
                raise RuntimeError(f"{lost_error} ({lost})") from None
            except BaseException:
                conn.close()  # the receiver's next read ends: its reload fails instead of waiting for the rest
                _settled(call, 60.0)  # and puts the model back on its device before anything else runs
                raise
            finally:
                conn.close()
        finally:
            listener.close()
            shutil.rmtree(control, ignore_errors=True)

    def _stream(self, conn: Connection, buckets: Iterable[list[tuple[str, torch.Tensor]]], call: Future) -> int:
        free, sent = list(range(SLOTS)), 0
        for bucket in buckets:
            if not free:
                free.append(_recv(conn, call))
            slot = self.slots[free.pop(0)]
            entries = slot.write(bucket)
            sent += sum(e[4] for e in entries)
            self.peak_bytes = max(self.peak_bytes, sum(s.size for s in self.slots))
            _send(conn, (slot.index, slot.source, entries))
        _send(conn, None)
        return sent


class _StreamLost(Exception):
    """The receiver's end of the control stream is gone (its reload failed, or its process died)."""


def _send(conn: Connection, message) -> None:
    try:
        conn.send(message)
    except OSError as error:
        raise _StreamLost(error) from None


def _close_slots(slots: list[Slot]) -> None:
    for slot in slots:
        slot.close()


def _accept(listener: socket.socket, call: Future) -> Connection:
    """The receiver's connection; raises the engine call's error if it ends first (it never connected)."""
    listener.settimeout(POLL_S)
    while True:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            if call.done():
                call.result()
                raise RuntimeError("the engine's weight reload ended without reading the weights") from None
            continue
        sock.setblocking(True)
        return Connection(sock.detach())


def _recv(conn: Connection, call: Future):
    """The receiver's next message (a slot handed back); _StreamLost once its call ended or its stream closed."""
    try:
        while not conn.poll(POLL_S):
            if call.done():
                raise _StreamLost("its reload call ended before it had read every bucket")
        return conn.recv()
    except (EOFError, OSError) as error:
        raise _StreamLost(error or "end of stream") from None


def _settled(call: Future, wait_s: float = 10.0) -> bool:
    """Whether the engine call ends within ``wait_s`` (its error explains a closed stream better than we can)."""
    deadline = time.monotonic() + wait_s
    while not call.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    return call.done()


def receive_buckets(address: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The receiving side, in the engine process: each bucket's tensors copied out of its slot (the slot is handed
    back at once: vLLM may keep a tensor until its layer is complete), in the order sent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    conn, maps = Connection(sock.detach()), SlotMaps()
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                raise RuntimeError(
                    "the weight sender closed the stream before its end (it failed mid-update)"
                ) from None
            if message is None:
                return
            index, source, entries = message
            raw = maps.buffer(index, source)
            bucket = [
                (name, raw[offset : offset + nbytes].view(dtype).reshape(shape).clone())
                for name, dtype, shape, offset, nbytes in entries
            ]
            if raw.is_cuda:
                torch.cuda.current_stream(raw.device).synchronize()  # copied out before the slot is refilled
            conn.send(index)
            yield bucket
    finally:
        conn.close()


class SlotMaps:
    """A receiver's mappings of a sender's slots, by slot index: a slot made anew (a new file, or a new CUDA
    buffer) is opened again, and the old mapping goes once its last view is collected."""

    def __init__(self) -> None:
        self.maps: dict[int, tuple] = {}

    def buffer(self, index: int, source: tuple) -> torch.Tensor:
        """A uint8 tensor over slot ``index`` as ``source`` describes it."""
        if self.maps.get(index, (None,))[0] != source[:2]:
            self.maps.pop(index, None)
            self.maps[index] = (source[:2], *open_slot(source))
        return self.maps[index][-1]


def open_slot(source: tuple) -> tuple:
    """(mapping or None, a uint8 tensor over the slot) of a slot's ``source``."""
    if source[0] == "cuda":
        rebuild, args = source[2]
        return None, rebuild(*args)
    fd = os.open(source[1], os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, source[2], access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # the mapping is read-only; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return mapping, torch.frombuffer(mapping, dtype=torch.uint8)  # pyright: ignore[reportArgumentType]
