"""The embedded default (layer 4): null model/data paths select a tiny task built and cached locally.

With no model path, the PPO run starts from the embedded tiny Qwen2 after an SFT warm-up (cached: later runs
reuse the warmed-up checkpoint); with no data files, it trains on the synthetic addition task and validates on
its held-out test split.
"""

from __future__ import annotations

import logging

from scaletrain.trainer.config import PPOConfig

logger = logging.getLogger(__name__)


def resolve_embedded_default(cfg: PPOConfig) -> PPOConfig:
    if cfg.actor_rollout_ref.model.path and cfg.data.train_files:
        return cfg
    from scaletrain.data import build_embedded_default

    paths = build_embedded_default()
    if not cfg.data.train_files:
        cfg.data.train_files = paths["train"]
        cfg.data.val_files = cfg.data.val_files or paths["test"]
    if not cfg.actor_rollout_ref.model.path:
        cfg.actor_rollout_ref.model.path = warm_up(cfg, paths)
    return cfg


def warm_up(cfg: PPOConfig, paths: dict[str, str]) -> str:
    raise NotImplementedError("SFT warm-up of the embedded default is not wired yet")
