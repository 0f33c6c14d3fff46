"""Config checks of a run whose actor is a vision-language model (layer 4): what such a run can do today is
trained and rolled out with images on fsdp or deepspeed with the HF rollout engine, the agent loops, LoRA, the
asynchronous schedules, a critic and a reward model included (both vision-language models: they read the images as
the actor does); every other combination is refused before Ray starts, naming the key (docs/multimodal.md says
what is next)."""

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
    critic_path = cfg.critic.model.path or model_path
    rm = cfg.reward_model
    reads_text = "which would read the images' placeholder tokens as text: use a vision-language model"
    refusals = [
        ("backend.name", cfg.backend.name == "megatron", NO_MEGATRON),
        ("actor_rollout_ref.rollout.name", arr.rollout.name != "hf", HF_ROLLOUT_ONLY),
        (
            "critic.model.path",
            cfg.use_critic and not is_vision_language_dir(critic_path),
            f"the critic ({critic_path}) is a text model, {reads_text}",
        ),
        (
            "reward_model.model.path",
            rm.enable and rm.model.path is not None and not is_vision_language_dir(rm.model.path),
            f"the reward model ({rm.model.path}) is a text model, {reads_text}",
        ),
        (
            "reward_model.model.input_tokenizer",
            rm.enable and rm.model.input_tokenizer is not None,
            "re-tokenizing the rollouts for the reward model would drop their images: leave it null (the reward "
            "model reads the policy's tokens and images)",
        ),
    ]
    refuse(what, refusals)
