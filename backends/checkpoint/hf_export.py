"""The Hugging Face export of a training engine (layer 1): durable, atomic directory writes.

``write_hf_checkpoint`` consumes an iterator of buckets of (HF name, full tensor) on every rank (the gathers behind
it are collective) and, on the writing rank, saves each bucket as one safetensors shard as it arrives, so no rank
ever holds more than one bucket. It then writes the shard index (when there are several shards), the config
(``use_cache`` back on, ``architectures`` set), the generation config, and copies the tokenizer and processor files
found next to the source model, so ``from_pretrained`` (transformers, vLLM) loads the directory directly.
Everything goes to ``<path>.incomplete`` first, is fsync'd and renamed to ``path`` when complete
(``scaletrain/utils/durable.py``, as the run checkpoints: scaletrain/trainer/run/checkpoint.py), so ``path`` is
never a half-written export and a failed export leaves the previous one in place.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable

import torch

from scaletrain.utils.durable import fsync_tree, replace_dir, restore_aside

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    # a vision-language model's processor: without these the export would load as a text model
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


def write_hf_config(dirpath: str, config, architecture: str, generation_config=None, tokenizer_dir=None) -> None:
    """An HF directory's non-weight files: config (``use_cache`` back on, ``architectures`` set), the generation
    config, and the tokenizer and processor files found in ``tokenizer_dir``."""
    config = copy.deepcopy(config)
    config.use_cache = True
    config.architectures = [architecture]
    config.save_pretrained(dirpath)
    if generation_config is not None:
        generation_config.save_pretrained(dirpath)
    if tokenizer_dir is not None and os.path.isdir(tokenizer_dir):
        copy_tokenizer_files(tokenizer_dir, dirpath)


# ------------------------------------------------------------------------------------------------ the HF export
def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer (and processor) files present in ``src_dir``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def save_engine_hf(engine, path: str, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
    """A training engine's ``save_hf``: its full tensors in ``buckets`` (consumed on every rank: the gathers are
    collective) written by rank 0 with the engine's HF config, architecture, generation config and source tokenizer."""
    collective_write(
        lambda is_writer: write_hf_checkpoint(
            path,
            buckets,
            engine.hf_config,
            engine.architecture,
            is_writer=is_writer,
            generation_config=engine.generation_config,
            tokenizer_dir=engine.model_config.path,
        ),
        what="the HF export",
    )


def collective_write(write: Callable[[bool], None], what: str) -> None:
    """Run ``write(is_writer)`` on every rank (rank 0 writes). Rank 0 then tells every rank whether it succeeded,
    so no rank returns before the files exist and a failure on rank 0 (disk full) raises on every rank instead of
    leaving the others waiting."""
    import torch.distributed as dist

    is_writer = dist.get_rank() == 0
    outcome: list[str | None] = [None]
    try:
        write(is_writer)
    except Exception as e:
        if not is_writer:
            raise
        outcome[0] = str(e)
        dist.broadcast_object_list(outcome, src=0)
        raise
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RuntimeError(f"rank 0 failed to write {what}: {outcome[0]}")


def write_hf_checkpoint(
    path: str,
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    config,
    architecture: str,
    is_writer: bool,
    generation_config=None,
    tokenizer_dir: str | None = None,
) -> None:
    """Save ``buckets`` as safetensors shards (one per bucket) plus config/tokenizer under ``path``, atomically: in
    ``<path>.incomplete``, fsync'd, then renamed over ``path`` (see ``replace_dir``). On failure the partial
    directory is removed and an error naming ``path`` is raised; the previous export at ``path`` stays intact."""
    if not is_writer:
        for _ in buckets:  # every rank iterates: the gathers are collective
            pass
        return
    summary = {}

    def fill(tmp: str) -> None:
        shard_names, weight_map, total_bytes = _write_shards(tmp, buckets)
        _write_index(tmp, shard_names, weight_map, total_bytes)
        write_hf_config(tmp, config, architecture, generation_config, tokenizer_dir)
        summary.update(shards=len(shard_names), bytes=total_bytes)

    publish_dir(path, fill, what="HF export")
    logger.info("wrote HF checkpoint %s (%d shards, %d bytes)", path, summary["shards"], summary["bytes"])


def publish_dir(path: str, fill: Callable[[str], None], what: str) -> None:
    """``fill(tmp)`` writes a directory's files into ``<path>.incomplete``, which is then fsync'd and renamed over
    ``path`` (see ``replace_dir``). On failure the partial directory is removed and an error naming ``path`` is
    raised; the previous copy at ``path`` stays intact."""
    path = os.path.normpath(path)  # "out/hf/" must not put the temporary directory inside the export
    tmp, aside = f"{path}.incomplete", f"{path}.replaced"
    restore_aside(path, aside)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        fill(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, path, aside)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):
            raise
        previous = f"the previous export {path} is intact" if os.path.isdir(path) else f"nothing was written at {path}"
        raise RuntimeError(f"{what} to {path} failed: {type(e).__name__}: {e}; {previous}") from e


def _write_shards(dirpath: str, buckets) -> tuple[list[str], dict[str, str], int]:
    """One safetensors shard per bucket. After a failed write the remaining buckets are still drawn (and dropped),
    because on the other ranks the same iteration runs collective gathers that would wait for this rank."""
    from safetensors.torch import save_file

    shard_names: list[str] = []
    weight_map: dict[str, str] = {}
    total_bytes = 0
    error: Exception | None = None
    for bucket in buckets:
        if error is not None:
            continue
        name = f"shard-{len(shard_names):05d}.safetensors"
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in bucket}
        try:
            save_file(tensors, os.path.join(dirpath, name), metadata={"format": "pt"})
        except Exception as e:
            error = e
            continue
        shard_names.append(name)
        for k, v in tensors.items():
            weight_map[k] = name
            total_bytes += v.numel() * v.element_size()
    if error is not None:
        raise error
    return shard_names, weight_map, total_bytes


def _write_index(dirpath, shard_names, weight_map, total_bytes) -> None:
    # final names in the usual HF pattern
    n = len(shard_names)
    final = (
        {"shard-00000.safetensors": "model.safetensors"}
        if n == 1
        else {old: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, old in enumerate(shard_names)}
    )
    for old, new in final.items():
        os.replace(os.path.join(dirpath, old), os.path.join(dirpath, new))
    if n > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
        with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
