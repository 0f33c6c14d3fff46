"""``verl.utils.dataset.rl_dataset``: verl's ``RLHFDataset(data_files, tokenizer, config, processor, max_samples)``
over scaletrain's ``RLDataset``, and verl's ``collate_fn`` (rows -> a dict of stacked tensors and object arrays,
where scaletrain's returns a DataProto).

``config`` is the ``data`` section (a mapping): the keys with an effect here are mapped onto RLDataset's arguments
with verl's defaults (``return_raw_chat`` false, ``filter_overlong_prompts`` true); verl's keys that only tune
its own loading (workers, caches, shared memory) are accepted and have no effect; any other key is refused,
naming it. With a ``processor``, rows with images load as scaletrain's RLDataset loads them (``image_key``);
videos and audio are refused (not supported yet).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from scaletrain.data.rl_dataset import RLDataset, collate_rows
from scaletrain.utils.errors import InvalidInput

__all__ = ["RLHFDataset", "collate_fn"]

_MAPPED = {
    "prompt_key": ("prompt_key", "prompt"),
    "max_prompt_length": ("max_prompt_length", 1024),
    "return_raw_chat": ("return_raw_chat", False),
    "truncation": ("truncation", "error"),
    "filter_overlong_prompts": ("filter_overlong_prompts", True),
    "apply_chat_template_kwargs": ("chat_template_kwargs", None),
    "image_key": ("image_key", "images"),
    "video_key": ("video_key", "videos"),
}
# verl's loading knobs: how it filters and caches, not what a row becomes
_NO_EFFECT = {
    "cache_dir", "filter_overlong_prompts_workers", "use_shm", "shuffle", "seed", "filter_prompts",
    "dataloader_num_workers", "max_samples", "audio_key",
}  # fmt: skip


def collate_fn(data_list: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """verl's: rows -> {tensor field: stacked tensor, other field: 1-D object array}."""
    tensors, non_tensors = collate_rows(data_list)
    return {**tensors, **non_tensors}


class RLHFDataset(RLDataset):
    """scaletrain's RLDataset built from verl's arguments."""

    def __init__(
        self,
        data_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: Mapping[str, Any],
        processor: Any = None,
        max_samples: int = -1,
    ):
        unknown = sorted(set(config) - set(_MAPPED) - _NO_EFFECT)
        if unknown:
            raise InvalidInput(f"RLHFDataset: config keys {unknown} are not supported; known: {sorted(_MAPPED)}")
        kwargs = {name: config.get(key, default) for key, (name, default) in _MAPPED.items()}
        if max_samples is None or max_samples < 0:
            max_samples = config.get("max_samples", -1)
        self.config = config
        limit = None if max_samples < 0 else max_samples
        super().__init__(data_files, tokenizer, max_samples=limit, processor=processor, **kwargs)
