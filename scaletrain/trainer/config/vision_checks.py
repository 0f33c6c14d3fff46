"""Config checks of a run whose actor is a vision-language model (layer 4): what such a run can do today is
trained and rolled out with images on fsdp or deepspeed with the HF rollout engine, the agent loops, LoRA and the
asynchronous schedules included; every other combination is refused before Ray starts, naming the key
(docs/multimodal.md says what is next)."""

from __future__ import annotations

import json
import os

from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.utils.typed_config import ConfigError


def is_vision_language_dir(path: str) -> bool:
    """Whether the HF model directory ``path`` holds a vision-language model (its config has a vision tower)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return "vision_config" in json.load(f)


NO_MEGATRON = "the megatron backend does not take one: use fsdp or deepspeed"
HF_ROLLOUT_ONLY = "only rollout=hf generates from images yet"


def refuse(what: str, refusals: list[tuple[str, bool, str]]) -> None:
    """ConfigError ``<key>: <what>: <why>`` for the first (key, refused, why) that is refused."""
    for key, refused, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {what}: {why}")


def validate_vision_language(cfg: PPOConfig) -> None:
    """ConfigError naming the key of what a run of a vision-language actor cannot do yet (nothing for a text one)."""
    arr = cfg.actor_rollout_ref
    model_path = arr.model.path
    if model_path is None or not is_vision_language_dir(model_path):
        if arr.actor.freeze_vision_tower:
            raise ConfigError(
                f"actor_rollout_ref.actor.freeze_vision_tower: actor_rollout_ref.model.path={model_path} has no "
                "vision tower (not a vision-language model)"
            )
        return
    what = f"actor_rollout_ref.model.path={model_path} is a vision-language model"
    not_yet = "is not supported on a vision-language model yet"
    refusals = [
        ("backend.name", cfg.backend.name == "megatron", NO_MEGATRON),
        ("actor_rollout_ref.rollout.name", arr.rollout.name != "hf", HF_ROLLOUT_ONLY),
        ("critic.enable", cfg.use_critic, f"a critic {not_yet}"),
        ("reward_model.enable", cfg.reward_model.enable, f"a reward model {not_yet}"),
    ]
    refuse(what, refusals)
