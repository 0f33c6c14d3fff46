"""One run, one directory (layer 4): the run directory records which run it holds, and a run never mixes with
another one's checkpoints or metrics.

``claim_run_dir(cfg)`` runs once before Ray starts, with the resolved config:

- The settings that determine a run's results are written to ``<run dir>/run_config.json`` with their
  fingerprint: every config key except those its dataclass marks as changing only how the run executes
  (``EXECUTION_ONLY``: micro-batches, offloading, timeouts, logging, the number of steps, so a run can be
  extended). A key nobody marked counts as result-changing.
- ``trainer.resume_mode=auto`` with a checkpoint in the directory resumes only a run with the same settings;
  otherwise it fails naming the keys that differ (a new ``trainer.experiment_name`` gets a directory of its own).
  The layout's keys (``LAYOUT_ONLY``: the backend, the number of training ranks, megatron's TP / PP sizes) may
  differ where both backends reshard a checkpoint (``reshards_on_resume``: the built-in ones; fsdp's DCP, the
  others through HF names: backends/checkpoint/portable.py), logged as such; otherwise (another registered backend,
  LoRA adapters anywhere but on fsdp) they are refused as the rest.
- A run that starts fresh in a directory holding an earlier run's outputs (``resume_mode=disable``, or a restart
  before the first checkpoint) first moves them to ``<run dir>/previous/<time>/``: nothing is deleted, keep-N
  pruning never touches them, and ``metrics.jsonl`` holds one run, each step once.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any

from backends.base import backend_traits
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.run.checkpoint import CheckpointManager
from scaletrain.utils.secrets import redact_secrets
from scaletrain.utils.typed_config import ConfigError, execution_only, layout_only, leaf_fields, resolved, to_dict

logger = logging.getLogger(__name__)

RUN_CONFIG = "run_config.json"
PREVIOUS = "previous"
# what a run writes into its directory (checkpoint.py, tracking.py, plot.py, the HF export, stacks); anything else
# there is not ours and stays in place. The run log is not moved: it is already open for this run (console.py).
RUN_OUTPUTS = (
    "global_step_*",
    ".global_step_*",
    "latest_checkpointed_iteration.txt*",
    "metrics.jsonl",
    "val_generations.jsonl",
    "tensorboard",
    "mlruns",
    "plots",
    "hf",
    "hf.*",
    ".hf*",
    "stacks",
    RUN_CONFIG,
)


def result_keys(cls: type = PPOConfig) -> list[str]:
    """Every leaf key of the config except those its dataclass marks as execution-only (``EXECUTION_ONLY``)."""
    return [key for key, owner, f in leaf_fields(cls) if f.name not in execution_only(owner)]


def result_settings(cfg: PPOConfig) -> dict[str, Any]:
    """The values of ``result_keys`` in ``cfg``, as JSON-able values, by dotted key."""
    plain = to_dict(cfg)
    out: dict[str, Any] = {}
    for key in result_keys(type(cfg)):
        value: Any = plain
        for part in key.split("."):
            value = value[part]
        out[key] = json.loads(json.dumps(value, default=str))  # tuples -> lists, as read back from the file
    return redact_secrets(out)  # the file is not a place for an API key


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _differences(stored: dict[str, Any], current: dict[str, Any], keys=None) -> list[str]:
    return [
        f"{key}: {stored[key]!r} there, {current[key]!r} now"
        for key in sorted(set(stored) & set(current))
        if stored[key] != current[key] and (keys is None or key in keys)
    ]


def layout_keys(cls: type = PPOConfig) -> set[str]:
    """The dotted keys of the run's parallel layout (``LAYOUT_ONLY``)."""
    return {key for key, owner, f in leaf_fields(cls) if f.name in layout_only(owner)}


def _resume_differences(cfg: PPOConfig, stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The differing settings that stop a resume: all of them, less the layout's (the backend and its parallel
    sizes) where both backends reshard a checkpoint (those are logged). LoRA adapters reshard only as fsdp's own
    (DCP, another number of ranks)."""
    layout = layout_keys(type(cfg))
    backends = {str(stored.get("backend.name", cfg.backend.name)), cfg.backend.name}
    if len(backends) > 1:
        layout.add("backend.extra")  # another backend brings its own settings (backend=megatron: its layout)
    moved = _differences(stored, current, layout)
    lora = cfg.actor_rollout_ref.model.lora_rank > 0 or cfg.critic.model.lora_rank > 0
    reshards = all(backend_traits(name).reshards_on_resume for name in backends) and (not lora or backends == {"fsdp"})
    if not moved or not reshards:
        return _differences(stored, current)
    logger.warning(
        "resuming on another layout (%s): the checkpoint is resharded; sums over ranks run in another order, and "
        "sampled rollouts (seeded per rank) draw other samples",
        "; ".join(moved),
    )
    return _differences(stored, current, set(current) - layout)


def _read_settings(run_dir: str) -> dict[str, Any] | None:
    path = os.path.join(run_dir, RUN_CONFIG)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)["settings"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{path} is unreadable ({err}); move it away or choose another trainer.default_local_dir"
        ) from err


def _move_previous_outputs(run_dir: str) -> str | None:
    """Moves an earlier run's outputs to ``previous/<time>/``; returns where, or None when there were none."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    names = [n for n in names if any(fnmatch.fnmatchcase(n, pattern) for pattern in RUN_OUTPUTS)]
    if not names:
        return None
    target = os.path.join(run_dir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    suffix, base = 1, target
    while os.path.exists(target):
        target, suffix = f"{base}-{suffix}", suffix + 1
    os.makedirs(target)
    for name in names:
        shutil.move(os.path.join(run_dir, name), os.path.join(target, name))
    return target


def claim_run_dir(cfg: PPOConfig) -> None:
    """Checks that a resumed run continues its own run, clears the way for a fresh one, and records this run's
    settings (see the module docstring). Raises ConfigError naming the differing keys."""
    tr = cfg.trainer
    run_dir = os.path.abspath(resolved(tr.default_local_dir, "trainer.default_local_dir"))
    current, stored = result_settings(cfg), _read_settings(run_dir)
    latest = CheckpointManager(run_dir).latest()
    resuming = tr.resume_mode == "resume_path" or (tr.resume_mode == "auto" and latest is not None)
    if resuming and tr.resume_mode == "auto":
        differences = [] if stored is None else _resume_differences(cfg, stored, current)
        if stored is None:
            logger.warning("%s has no %s (an older run): resuming without checking its settings", run_dir, RUN_CONFIG)
        elif differences:
            differ = "\n  ".join(differences)
            raise ConfigError(
                f"trainer.resume_mode=auto: {run_dir} holds a run with other settings, so it is not resumed:\n"
                f"  {differ}\nUse another trainer.experiment_name (or trainer.default_local_dir) for a new run, or "
                "trainer.resume_mode=disable to start over there (its outputs are moved to previous/)"
            )
    if resuming and stored is not None and set(stored) != set(current):
        logger.warning(
            "%s was written by another version of the config: not checked on resume: %s",
            RUN_CONFIG,
            ", ".join(sorted(set(stored) ^ set(current))),
        )
    if not resuming:
        moved = _move_previous_outputs(run_dir)
        if moved:
            logger.warning("starting fresh in %s: the earlier run's outputs were moved to %s", run_dir, moved)
    if not resuming or stored is None:
        os.makedirs(run_dir, exist_ok=True)
        record = {"fingerprint": fingerprint(current), "settings": current}
        tmp = os.path.join(run_dir, f".{RUN_CONFIG}.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(run_dir, RUN_CONFIG))
