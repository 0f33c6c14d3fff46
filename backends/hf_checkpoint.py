"""Writing a Hugging Face checkpoint from streamed weight buckets (any engine with ``export_weights``).

``write_hf_checkpoint`` consumes an iterator of buckets of (HF name, full tensor) on every rank (the gathers
behind it are collective) and, on the writing rank, saves each bucket as one safetensors shard as it arrives, so
no rank ever holds more than one bucket. It then writes the shard index (when there are several shards), the
config (``use_cache`` back on, ``architectures`` set), the generation config, and copies the tokenizer files found
next to the source model, so ``from_pretrained`` (transformers, vLLM) loads the directory directly.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterable

import torch

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
)


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer files present in ``src_dir``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def save_engine_hf(engine, path: str, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
    """A training engine's ``save_hf``: its full tensors in ``buckets`` (consumed on every rank: the gathers are
    collective) written by rank 0 with the engine's HF config, architecture, generation config and source tokenizer;
    then a barrier, so no rank returns before the files exist."""
    import torch.distributed as dist

    write_hf_checkpoint(
        path,
        buckets,
        engine.hf_config,
        engine.architecture,
        is_writer=dist.get_rank() == 0,
        generation_config=engine.generation_config,
        tokenizer_dir=engine.model_config.path,
    )
    dist.barrier()


def write_hf_checkpoint(
    path: str,
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    config,
    architecture: str,
    is_writer: bool,
    generation_config=None,
    tokenizer_dir: str | None = None,
) -> None:
    """Save ``buckets`` as safetensors shards (one per bucket) plus config/tokenizer under ``path``."""
    from safetensors.torch import save_file

    if is_writer:
        os.makedirs(path, exist_ok=True)
    shard_names: list[str] = []
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for bucket in buckets:  # every rank iterates: the gathers are collective
        if not is_writer:
            continue
        name = f"shard-{len(shard_names):05d}.safetensors"
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in bucket}
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        shard_names.append(name)
        for k, v in tensors.items():
            weight_map[k] = name
            total_bytes += v.numel() * v.element_size()
    if not is_writer:
        return

    # final names in the usual HF pattern
    n = len(shard_names)
    final = (
        {"shard-00000.safetensors": "model.safetensors"}
        if n == 1
        else {old: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, old in enumerate(shard_names)}
    )
    for old, new in final.items():
        os.replace(os.path.join(path, old), os.path.join(path, new))
    if n > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)

    config = copy.deepcopy(config)
    config.use_cache = True
    config.architectures = [architecture]
    config.save_pretrained(path)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, path)
