"""Checkpoints of a training run (layer 4): one directory per saved step, complete or absent.

    <default_local_dir>/global_step_<N>/actor/...        sharded model + optimizer + LR scheduler + RNG (workers)
                                      /critic/...
                                      /trainer_state.json step, epoch, dataloader position, driver RNG, KL coef
    <default_local_dir>/latest_checkpointed_iteration.txt   N, written last

A checkpoint is written under a temporary name and renamed only when every worker and the driver have
finished, so a crash (even ``kill -9``) mid-save leaves the previous checkpoint as the latest. The pointer file is
replaced atomically after the rename; the oldest checkpoints beyond ``max_ckpt_to_keep`` are then removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from scaletrain.utils.seeding import rng_state, set_rng_state

logger = logging.getLogger(__name__)

POINTER = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

    def save(self, step: int, save_workers: Callable[[str], None], trainer_state: dict[str, Any]) -> str:
        """``save_workers(tmp_dir)`` writes the workers' shards; the driver adds its state; then rename."""
        final = self.step_dir(step)
        tmp = os.path.join(self.root, f".global_step_{step}.incomplete")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_workers(tmp)
        state = dict(trainer_state, global_step=step, rng=rng_state())
        _write_atomic(os.path.join(tmp, STATE), json.dumps(_jsonable(state)))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomic(os.path.join(self.root, POINTER), str(step))
        self._prune()
        logger.info("saved checkpoint %s", final)
        return final

    def _prune(self) -> None:
        if not self.max_to_keep or self.max_to_keep <= 0:
            return
        steps = sorted(self.saved_steps())
        for step in steps[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def saved_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            match = _STEP_DIR.match(name)
            if match and os.path.exists(os.path.join(self.root, name, STATE)):
                steps.append(int(match.group(1)))
        return steps

    def latest(self) -> str | None:
        """The newest complete checkpoint: the pointer's if it is complete, else the newest complete directory."""
        pointer = os.path.join(self.root, POINTER)
        if os.path.exists(pointer):
            with open(pointer) as f:
                text = f.read().strip()
            if text.isdigit() and os.path.exists(os.path.join(self.step_dir(int(text)), STATE)):
                return self.step_dir(int(text))
            logger.warning("checkpoint pointer %s names no complete checkpoint (%r); scanning", pointer, text)
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
