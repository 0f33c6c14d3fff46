"""A resumable engine checkpoint's description of itself, and the registry of offline readers (layer 1).

Each engine's save writes, on rank 0 and inside the save (so the run's atomic publication covers it),
``scaletrain_checkpoint.json`` (the backend, its layout, the engine's step count, the model's kind and
architecture, the tied names, a LoRA adapter's config and scalings) and ``huggingface/`` (config, generation
config, tokenizer files). ``CHECKPOINT_READERS`` holds each backend's offline reader: ``reader(path, meta,
hf_names, bucket_bytes, state="param")`` yields buckets of (HF name, full tensor) from the files alone, in one
process with no process group: the parameters, or with ``state="exp_avg"`` / ``"exp_avg_sq"`` Adam's moments of
each trained parameter (fp32), under the same names (``python -m scaletrain.model_merger``; a resume on another
backend or layout: portable.py).
"""

from __future__ import annotations

import json
import os

from backends.checkpoint.hf_export import write_hf_config
from scaletrain.utils.registry import Registry

CHECKPOINT_META = "scaletrain_checkpoint.json"
HF_META_DIR = "huggingface"
META_FORMAT = 1
STATES = ("param", "exp_avg", "exp_avg_sq")  # what a reader reads: the parameters, or an Adam moment of each
CHECKPOINT_READERS = Registry(
    "checkpoint reader",
    lazy={
        "fsdp": "backends.fsdp.checkpoint",
        "deepspeed": "backends.deepspeed.checkpoint_reader",
        "megatron": "backends.megatron.checkpoint_reader",
    },
)


def write_checkpoint_meta(engine, path: str, backend: str, layout: dict, tied_names=()) -> None:
    """Rank 0's part of an engine's save: what an offline reader needs to turn the files into an HF model, and a
    resume on another backend or layout into a trainable state. ``tied_names``: the names an HF export leaves out
    (a tied ``lm_head.weight``)."""
    lora = getattr(engine, "lora", None)
    meta = {
        "format": META_FORMAT,
        "backend": backend,
        "layout": layout,
        "global_step": engine.global_step,  # optimizer updates so far: Adam's step count and the LR schedule's
        "kind": engine.model_config.kind,
        "architecture": engine.architecture,
        "dtype": engine.model_config.dtype,  # the parameters' (resolved: never "auto")
        "model_path": engine.model_config.path,
        "tied_names": sorted(tied_names),
        "lora": None if lora is None else {"config": engine.adapter_config(), "scales": lora.scales},
    }
    hf_dir = os.path.join(path, HF_META_DIR)
    os.makedirs(hf_dir, exist_ok=True)
    write_hf_config(hf_dir, engine.hf_config, engine.architecture, engine.generation_config, engine.model_config.path)
    with open(os.path.join(path, CHECKPOINT_META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def read_checkpoint_meta(path: str) -> dict:
    """The checkpoint's meta, checked; a clear error naming the file when it is missing or not ours."""
    file = os.path.join(path, CHECKPOINT_META)
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"{file} not found: {path} is not an engine checkpoint of scaletrain (a run's "
            "global_step_<N>/actor or /critic directory), or was written before checkpoints described themselves"
        )
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable checkpoint meta: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ValueError(f"{file}: not a checkpoint meta of format {META_FORMAT}")
    if not os.path.isfile(os.path.join(path, HF_META_DIR, "config.json")):
        raise FileNotFoundError(f"{os.path.join(path, HF_META_DIR, 'config.json')} not found: the checkpoint is cut")
    return meta


def resumes_natively(path: str, backend: str, layout: dict | None = None) -> bool:
    """Whether checkpoint ``path`` was written by ``backend`` with ``layout`` (None: any layout; per-rank files
    need their own), so the engine loads its own files; False: it resumes through HF names (portable.py). A
    checkpoint without meta (older) counts as native: the engine's load names what it misses."""
    if not os.path.isfile(os.path.join(path, CHECKPOINT_META)):
        return True
    meta = read_checkpoint_meta(path)
    saved = {k: v for k, v in meta["layout"].items() if k != "places"}
    return meta["backend"] == backend and (layout is None or saved == layout)
