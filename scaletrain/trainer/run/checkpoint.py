"""Checkpoints of a training run (layer 4): one directory per saved step, complete or absent.

    <default_local_dir>/global_step_<N>/actor/...        sharded model + optimizer + LR scheduler + RNG (workers)
                                      /critic/...
                                      /trainer_state.json step, epoch, dataloader position, driver RNG, KL coef
    <default_local_dir>/latest_checkpointed_iteration.txt   N, written last

A checkpoint is complete when its directory is named ``global_step_<N>`` and holds ``trainer_state.json``.
Guarantees, for a crash at any moment (``kill -9``, power loss) and for a failed save (disk full):
  - A save writes into ``.global_step_<N>.incomplete``; the workers' shards and ``trainer_state.json`` (written
    last), and every directory, are fsync'd before the rename to ``global_step_<N>``; the root directory is fsync'd
    after the rename and after the pointer file is replaced (atomically). A complete-looking directory is
    therefore complete on disk.
  - Re-saving an existing step moves the old directory to ``.global_step_<N>.replaced`` before the rename and
    deletes it after; a crash in between is repaired by the next ``latest()`` or ``save()``.
  - A failed save raises an error naming the directory, removes the incomplete directory and leaves the pointer
    and the previous checkpoints as they were.
  - Pruning to ``max_to_keep`` runs only after a complete save, never removes the newest complete checkpoint or
    the one the pointer names, and removes only complete checkpoints (renamed to ``.global_step_<N>.deleting``
    first, so a crash mid-delete never leaves a partial ``global_step_<N>``) plus the leftovers of earlier
    crashed saves. Other entries of the root directory are never touched.
``latest()`` returns the pointer's checkpoint if complete, else the newest complete one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from scaletrain.utils.durable import fsync_dir, fsync_tree, replace_dir, restore_aside
from scaletrain.utils.seeding import rng_state, set_rng_state

logger = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LEFTOVER = re.compile(r"^\.global_step_(\d+)\.(incomplete|replaced|deleting)$")


def tree_bytes(path: str) -> int:
    """The bytes of the files under ``path`` (a checkpoint's size on disk, as written)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # the replace itself survives a power loss


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, tuple):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, list):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    return obj


class CheckpointManager:
    def __init__(self, root: str, max_to_keep: int | None = None) -> None:
        self.root = root
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def _hidden(self, step: int, kind: str) -> str:
        return os.path.join(self.root, f".global_step_{step}.{kind}")

    def save(self, step: int, save_workers: Callable[[str], None], trainer_state: dict[str, Any]) -> str:
        """``save_workers(tmp_dir)`` writes the workers' shards; the driver adds its state; then rename."""
        final, tmp = self.step_dir(step), self._hidden(step, "incomplete")
        self._recover()
        try:
            self._write(tmp, step, save_workers, trainer_state)
            replace_dir(tmp, final, self._hidden(step, "replaced"))
        except Exception as e:
            # the message first: it reports the free space at the failure, before the cleanup frees some
            message = self._failure(f"checkpoint save of step {step} to {final} failed", e)
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(message) from e
        pointer = os.path.join(self.root, POINTER)
        try:
            _write_atomic(pointer, str(step))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(f"{pointer}.tmp")
            raise RuntimeError(
                self._failure(f"checkpoint {final} is complete but the pointer {pointer} was not updated", e)
            ) from e
        self._prune(step)
        logger.info("saved checkpoint %s", final)
        return final

    def _write(self, tmp: str, step: int, save_workers: Callable[[str], None], trainer_state: dict[str, Any]) -> None:
        if not os.path.isdir(self.root):
            os.makedirs(self.root)
            fsync_dir(os.path.dirname(os.path.abspath(self.root)))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_workers(tmp)
        state = dict(trainer_state, global_step=step, rng=rng_state())
        with open(os.path.join(tmp, STATE), "w") as f:  # last: its presence marks the directory complete
            f.write(json.dumps(_jsonable(state)))
        fsync_tree(tmp)

    def _failure(self, what: str, error: Exception) -> str:
        """``what``, the error, the checkpoint a resume would now use, and the free space (the likeliest cause of
        a failed write is a full disk, and some writers, torch.save among them, do not say so)."""
        previous = self.latest()
        kept = f"the previous checkpoint {previous} is intact" if previous else f"no checkpoint under {self.root}"
        try:
            free = f"; {shutil.disk_usage(self.root).free / 2**20:.1f} MiB were free on {self.root}"
        except OSError:
            free = ""
        return f"{what}: {type(error).__name__}: {error}; {kept}{free}"

    def _recover(self) -> None:
        """Finish replaces that a crash interrupted (``.global_step_<N>.replaced`` without ``global_step_<N>``)."""
        for name in self._entries():
            match = _LEFTOVER.match(name)
            if match and match.group(2) == "replaced":
                step = int(match.group(1))
                try:
                    restore_aside(self.step_dir(step), self._hidden(step, "replaced"))
                except OSError as e:  # a read-only copy of a run directory: report, do not fail a lookup
                    logger.warning("cannot restore %s: %s", self._hidden(step, "replaced"), e)

    def _prune(self, current: int) -> None:
        """After a complete save of step ``current``: keep the newest ``max_to_keep`` complete checkpoints (always
        the newest and the pointer's), and remove leftovers of crashed saves of earlier steps."""
        steps = sorted(self.saved_steps())
        keep: set[int | None] = set(steps)  # None: no pointer (_pointer_step)
        if self.max_to_keep and self.max_to_keep > 0:
            keep = set(steps[-self.max_to_keep :])
        keep.update(steps[-1:])
        keep.add(self._pointer_step())
        for step in steps:
            if step not in keep:
                deleting = self._hidden(step, "deleting")
                try:  # one rename takes it out of sight: a crash mid-delete leaves no partial global_step_<N>
                    os.rename(self.step_dir(step), deleting)
                except OSError as e:
                    logger.warning("cannot remove old checkpoint %s: %s", self.step_dir(step), e)
                    continue
                shutil.rmtree(deleting, ignore_errors=True)
        for name in self._entries():
            match = _LEFTOVER.match(name)
            if match and (match.group(2) == "deleting" or int(match.group(1)) < current):
                logger.info("removing %s, left by an interrupted save or prune", os.path.join(self.root, name))
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _entries(self) -> list[str]:
        return os.listdir(self.root) if os.path.isdir(self.root) else []

    def _pointer_step(self) -> int | None:
        try:
            with open(os.path.join(self.root, POINTER)) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def saved_steps(self) -> list[int]:
        """The steps of the complete checkpoints, in no particular order."""
        steps = []
        for name in self._entries():
            match = _STEP_DIR.match(name)
            if match and os.path.exists(os.path.join(self.root, name, STATE)):
                steps.append(int(match.group(1)))
        return steps

    def latest(self) -> str | None:
        """The newest complete checkpoint: the pointer's if it is complete, else the newest complete directory."""
        self._recover()
        step = self._pointer_step()
        if step is not None and os.path.exists(os.path.join(self.step_dir(step), STATE)):
            return self.step_dir(step)
        pointer = os.path.join(self.root, POINTER)
        if os.path.exists(pointer):
            logger.warning("checkpoint pointer %s names no complete checkpoint; scanning", pointer)
        steps = self.saved_steps()
        return self.step_dir(max(steps)) if steps else None

    @staticmethod
    def load_state(path: str) -> dict[str, Any]:
        state_file = os.path.join(path, STATE)
        if not os.path.exists(state_file):
            raise FileNotFoundError(f"{path} is not a complete checkpoint: {STATE} is missing")
        with open(state_file) as f:
            state = json.load(f)
        try:
            set_rng_state(state["rng"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{state_file}: cannot restore the driver's RNG state ({e})") from e
        return state
