"""The embedded default (layer 4): null model/data paths select a tiny task built and cached locally.

With no data files the run trains on the synthetic addition task and validates on its held-out test split.
With no model path it starts from the embedded tiny Qwen2 after an SFT warm-up (configs/sft_trainer.yaml's settings;
it stops once validation accuracy reaches ``stop_at_val_acc``), cached next to the task so later runs reuse it.
The task's small sizes (8-token prompts, 32 prompts a step, 700 steps, ...) are a recipe,
configs/recipe/embedded.yaml, laid over the config's real-model defaults by ``apply_embedded_overlay`` before the
config is built, on the keys the user left alone.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import replace
from importlib import resources
from typing import Any

from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.utils.typed_config import to_dict

logger = logging.getLogger(__name__)

SFT_RECIPE = {
    "stop_at_val_acc": 0.15,
    "total_steps": 1200,
    "test_freq": 25,
    "lr": 1e-3,
    "warmup_steps": 100,
    "train_batch_size": 128,
}


def embedded_overlay() -> dict[str, Any]:
    """configs/recipe/embedded.yaml as a nested dict."""
    import yaml

    return yaml.safe_load(resources.files("scaletrain.configs").joinpath("recipe", "embedded.yaml").read_text())


def apply_embedded_overlay(raw: dict[str, Any], explicit: Iterable[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """``raw`` (a composed PPO config dict) with the embedded recipe's sizes when ``data.train_files`` is null;
    returns (the new dict, the keys set). A key is set only where the user left it alone: not named in
    ``explicit`` (the command line's keys) and still at the dataclass default."""
    if (raw.get("data") or {}).get("train_files"):
        return raw, []
    explicit, defaults = set(explicit), to_dict(PPOConfig())
    out, applied = copy.deepcopy(raw), []
    for key, value in _leaves(embedded_overlay()):
        parts = key.split(".")
        node, default = out, defaults
        for part in parts[:-1]:
            node, default = node.setdefault(part, {}), default[part]
        if key not in explicit and node.get(parts[-1], default[parts[-1]]) == default[parts[-1]]:
            node[parts[-1]] = value
            applied.append(key)
    return out, applied


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    leaves = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        leaves += _leaves(value, f"{key}.") if isinstance(value, dict) else [(key, value)]
    return leaves


def needs_embedded(cfg: PPOConfig) -> bool:
    return not (cfg.actor_rollout_ref.model.path and cfg.data.train_files)


def resolve_embedded_default(cfg: PPOConfig) -> PPOConfig:
    """A copy of ``cfg`` with null data paths set to the embedded task's files and a null model path to the
    embedded model after its SFT warm-up (which runs on the Ray cluster when it is not cached)."""
    if not needs_embedded(cfg):
        return cfg
    from scaletrain.data import build_embedded_default

    paths = build_embedded_default()
    data, arr = cfg.data, cfg.actor_rollout_ref
    if not data.train_files:
        data = replace(data, train_files=paths["train"], val_files=data.val_files or paths["test"])
    if not arr.model.path:
        arr = replace(arr, model=replace(arr.model, path=warm_up(cfg, paths)))
    return replace(cfg, data=data, actor_rollout_ref=arr)


def warm_up(cfg: PPOConfig, paths: dict[str, str]) -> str:
    """The SFT'd embedded model (trained once per recipe and seed, then cached); returns its HF directory."""
    from scaletrain.trainer.sft_trainer import run_sft

    key = f"sft-acc{SFT_RECIPE['stop_at_val_acc']}-seed{cfg.trainer.seed}-{cfg.backend.name}"
    out_dir = os.path.join(paths["dir"], key)
    stamp = os.path.join(out_dir, "warmup.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            summary = json.load(f)
        logger.info("embedded default: reusing the SFT warm-up in %s (val acc %.3f)", out_dir, summary["val_acc"])
        return summary["hf_path"]
    shutil.rmtree(out_dir, ignore_errors=True)
    logger.info("embedded default: SFT warm-up until validation accuracy >= %s", SFT_RECIPE["stop_at_val_acc"])
    summary = run_sft(
        {
            "data": {"train_batch_size": SFT_RECIPE["train_batch_size"], "seed": cfg.trainer.seed},
            "optim": {"lr": SFT_RECIPE["lr"], "warmup_steps": SFT_RECIPE["warmup_steps"]},
            "backend": {"name": cfg.backend.name},
            "trainer": {
                "stop_at_val_acc": SFT_RECIPE["stop_at_val_acc"],
                "total_steps": SFT_RECIPE["total_steps"],
                "test_freq": SFT_RECIPE["test_freq"],
                "n_gpus_per_node": cfg.trainer.n_gpus_per_node,
                "nnodes": cfg.trainer.nnodes,
                "device": cfg.trainer.device,
                "default_local_dir": out_dir,
                "seed": cfg.trainer.seed,
                "logger": ["console", "jsonl"],
            },
        }
    )
    with open(stamp, "w") as f:
        json.dump(summary, f)
    return summary["hf_path"]
