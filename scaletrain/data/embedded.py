"""The embedded default: a tiny Qwen2 model, its tokenizer and a synthetic addition task, built once and cached.

The task (run by scaletrain/trainer/embedded_default.py): two 3-digit operands (100-999), prompt ``"437+258="``,
answer ``"695"`` followed by EOS. Problems are distinct (a, b) pairs drawn without replacement from the 810,000
possible ones, seeded; the test set is drawn first, then validation, then train, so held-out sets are disjoint
from train and don't change when ``n_train`` does.

Files written by ``write_arithmetic_task(output_dir, ...)``:
  - ``train.parquet``, ``val.parquet``, ``test.parquet``: verl's RL row format, ``data_source``
    ``"scaletrain/arithmetic"``, ``reward_model={"style": "rule", "ground_truth": "695"}``,
    ``extra_info={"split", "index", "a", "b"}``.
  - ``sft_train.parquet``, ``sft_val.parquet`` (same problems as train / val): ``prompt`` (``"437+258="``) and
    ``response`` (``"695"``, without EOS: an SFT trainer appends ``tokenizer.eos_token``), plus ``messages``
    (a user/assistant pair; the tokenizer's chat template renders it as ``"437+258=695<eos>"``) and
    ``data_source``.

``build_embedded_default(cache_dir, ...)`` also writes the model directory: a random-init Qwen2ForCausalLM
(hidden 128, 2 layers, 4 heads / 2 KV heads, intermediate 512, tied embeddings, 16-token vocabulary,
max_position_embeddings 64, float32) and the tokenizer, both via ``save_pretrained``, so the model path is also
the tokenizer path. The build goes into a temporary sibling directory that is renamed into place after its stamp
file (written last) is in: a directory without a valid stamp is a half-built cache and is rebuilt.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from scaletrain.data import tokenizer as tok
from scaletrain.utils.cache import build_once, cache_root

logger = logging.getLogger(__name__)

DATA_SOURCE = "scaletrain/arithmetic"
ABILITY = "arithmetic"
LOW, HIGH = 100, 999
NUM_PROBLEMS = (HIGH - LOW + 1) ** 2
BUILD_VERSION = 1
DEFAULT_N_TRAIN = 50_000


def default_cache_dir() -> Path:
    """``$SCALETRAIN_CACHE/embedded`` when that variable is set, else ``~/.cache/scaletrain/embedded``."""
    return cache_root() / "embedded"


# ------------------------------------------------------------------------------------------------- the task
def sample_problems(seed: int, n_train: int, n_val: int, n_test: int) -> dict[str, list[tuple[int, int]]]:
    """Disjoint (a, b) operand pairs per split, drawn without replacement (test, then val, then train)."""
    sizes = {"train": n_train, "val": n_val, "test": n_test}
    for name, n in sizes.items():
        if n < 0:
            raise ValueError(f"n_{name} must be >= 0, got {n}")
    total = n_train + n_val + n_test
    if total > NUM_PROBLEMS:
        raise ValueError(f"asked for {total} distinct problems; only {NUM_PROBLEMS} exist")
    codes = np.random.default_rng(seed).permutation(NUM_PROBLEMS)[:total]
    pairs = [(LOW + int(c) // (HIGH - LOW + 1), LOW + int(c) % (HIGH - LOW + 1)) for c in codes]
    return {"test": pairs[:n_test], "val": pairs[n_test : n_test + n_val], "train": pairs[n_test + n_val :]}


def problem_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """One RL row in verl's format for ``a+b=``."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def sft_row(a: int, b: int) -> dict[str, Any]:
    """One SFT row: prompt / response strings (no EOS in the response) and the same as chat messages."""
    prompt, response = f"{a}+{b}=", str(a + b)
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt,
        "response": response,
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
    }


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_arithmetic_task(
    output_dir: str | os.PathLike, seed: int = 0, n_train: int = DEFAULT_N_TRAIN, n_val: int = 300, n_test: int = 500
) -> dict[str, str]:
    """Write the RL and SFT parquet files of the addition task; returns split name -> path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = sample_problems(seed, n_train, n_val, n_test)
    paths = {}
    for split, pairs in splits.items():
        paths[split] = _write_parquet(
            [problem_row(a, b, split, i) for i, (a, b) in enumerate(pairs)], out / f"{split}.parquet"
        )
    for split in ("train", "val"):
        paths[f"sft_{split}"] = _write_parquet([sft_row(a, b) for a, b in splits[split]], out / f"sft_{split}.parquet")
    logger.info(
        "arithmetic task: %s problems (train/val/test) written to %s",
        "/".join(str(len(splits[s])) for s in ("train", "val", "test")),
        out,
    )
    return paths


# ------------------------------------------------------------------------------------------------ the model
def tiny_qwen2_config(**overrides: Any) -> Any:
    """The embedded model's ``Qwen2Config`` (scaletrain/models/tiny.py's ``embedded`` shape; vocabulary and special
    ids from the tokenizer)."""
    return tiny_model_config("qwen2", **overrides)


def tiny_model_config(architecture: str, **overrides: Any) -> Any:
    """The embedded model's shape and vocabulary in ``architecture`` (scaletrain/models/tiny.py's ``ARCHITECTURES``)."""
    from scaletrain.models.tiny import tiny_config

    ids = dict(vocab_size=len(tok.arithmetic_vocab()), pad_token_id=tok.PAD_ID, bos_token_id=tok.BOS_ID)
    settings = {**ids, "eos_token_id": tok.EOS_ID, "max_position_embeddings": tok.MODEL_MAX_LENGTH, **overrides}
    return tiny_config(architecture, shape="embedded", **settings)


def save_tiny_model(path: str | os.PathLike, seed: int = 0, architecture: str = "qwen2", dtype: str = "float32") -> str:
    """Random-init the tiny model in ``architecture`` (seeded, without touching the caller's RNG) and save it with
    the task's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_model_config(architecture), dtype=torch.float32)
    model.to(getattr(torch, dtype))
    model.generation_config.pad_token_id = tok.PAD_ID
    model.generation_config.eos_token_id = tok.EOS_ID
    model.generation_config.bos_token_id = tok.BOS_ID
    model.save_pretrained(path)
    tok.save_arithmetic_tokenizer(str(path))
    return str(path)


# ------------------------------------------------------------------------------------------------ the cache
def _paths(root: Path) -> dict[str, str]:
    model = str(root / "model")
    data = root / "data"
    paths = {"dir": str(root), "model": model, "tokenizer": model}
    for name in ("train", "val", "test", "sft_train", "sft_val"):
        paths[name] = str(data / f"{name}.parquet")
    return paths


def build_embedded_default(
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    n_train: int = DEFAULT_N_TRAIN,
    n_val: int = 300,
    n_test: int = 500,
) -> dict[str, str]:
    """Build (once) the embedded default's model, tokenizer and data; return their paths.

    Keys: ``dir``, ``model`` and ``tokenizer`` (the same HF directory), ``train`` / ``val`` / ``test`` (RL parquet),
    ``sft_train`` / ``sft_val`` (SFT parquet). Each (seed, sizes) combination gets its own subdirectory of
    ``cache_dir`` (default ``default_cache_dir()``); a complete one is returned as is.
    """
    params = {"version": BUILD_VERSION, "seed": seed, "n_train": n_train, "n_val": n_val, "n_test": n_test}
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = base / f"v{BUILD_VERSION}-seed{seed}-train{n_train}-val{n_val}-test{n_test}"

    def build(tmp: Path) -> None:
        logger.info("building the embedded default into %s", root)
        save_tiny_model(tmp / "model", seed=seed)
        write_arithmetic_task(tmp / "data", seed=seed, n_train=n_train, n_val=n_val, n_test=n_test)

    return _paths(build_once(root, params, build))
