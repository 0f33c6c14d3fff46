"""Data: the RL prompt dataset (verl's parquet row format), collation to DataProto, a resumable loader, the
embedded default task (tiny Qwen2 + character tokenizer + synthetic addition) and preprocessing scripts.

    from scaletrain.data import RLDataset, StatefulDataLoader, build_embedded_default
    paths = build_embedded_default()                      # cached under ~/.cache/scaletrain/embedded
    dataset = RLDataset(paths["train"], tokenizer, max_prompt_length=8)
    for batch in StatefulDataLoader(dataset, batch_size=32, seed=1): ...   # DataProto batches

Layout: rl_dataset.py (RLDataset, collate_fn, left_pad), loader.py (StatefulDataLoader), tokenizer.py (the
character tokenizer), embedded.py (model + task + cache), preprocess/ (``python -m`` converters).

The names below are imported on first use (PEP 562), so ``python -m scaletrain.data.preprocess.gsm8k`` does not
pay for importing torch; transformers is only imported by the tokenizer and model builders, when called.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RLDataset": "scaletrain.data.rl_dataset",
    "collate_fn": "scaletrain.data.rl_dataset",
    "left_pad": "scaletrain.data.rl_dataset",
    "StatefulDataLoader": "scaletrain.data.loader",
    "build_arithmetic_tokenizer": "scaletrain.data.tokenizer",
    "build_embedded_default": "scaletrain.data.embedded",
    "default_cache_dir": "scaletrain.data.embedded",
    "write_arithmetic_task": "scaletrain.data.embedded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'scaletrain.data' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
