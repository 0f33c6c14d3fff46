"""LoRA in the PPO trainer (layer 4): the checks before Ray starts and the weight-sync mode's fallback.

``actor_rollout_ref.model.lora_rank > 0`` (and/or ``critic.model.lora_rank``) trains adapters on a frozen base
(backends/lora.py on fsdp and deepspeed, backends/megatron/lora.py on megatron: the actor's only). Two things
follow in the trainer:

- the reference policy is the actor's own base model, its adapters disabled for the ref log-prob pass
  (``ActorRolloutRefWorker.compute_ref_log_prob``): no second copy of the model is built. With
  ``lora_adapter_path`` the reference is the base model without that adapter too.
- ``actor_rollout_ref.rollout.lora_sync`` says what reaches the rollout engines after each update: ``adapter``
  (the adapter tensors alone; the vLLM engine serves them as a LoRA on its unchanged base weights,
  backends/rollout/vllm_lora.py) or ``merged`` (W + BA * alpha / r under the base model's names, the plain weight
  sync every engine takes). Null picks ``adapter`` where it works (``lora_sync_fallback``), else ``merged``.

``validate_lora`` raises ConfigError naming the key for what cannot work.
"""

from __future__ import annotations

import os

from backends.base import BACKEND_TRAITS, backend_traits
from backends.config import LoraSettings, check_lora_keys
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.utils.typed_config import ConfigError

LORA_SYNC_MODES = ("adapter", "merged")
MAX_VLLM_LORA_RANK = 512  # vLLM's largest max_lora_rank
SYNC_KEY = "actor_rollout_ref.rollout.lora_sync"


def _adapter_sync_blocker(cfg: PPOConfig) -> str | None:
    """Why the adapter-only sync cannot run with ``cfg`` (None: it can)."""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    if arr.model.lora_rank == 0:
        return "it needs actor_rollout_ref.model.lora_rank > 0"
    if rollout.name != "vllm":
        return f"only the vllm rollout engine serves LoRA adapters (actor_rollout_ref.rollout.name={rollout.name})"
    if rollout.load_format == "dummy":
        return "the engine's base weights must come from the checkpoint (actor_rollout_ref.rollout.load_format=dummy)"
    if arr.model.lora_rank > MAX_VLLM_LORA_RANK:
        return f"vLLM serves adapters of rank <= {MAX_VLLM_LORA_RANK} (lora_rank={arr.model.lora_rank})"
    return None


def lora_sync_fallback(cfg: PPOConfig) -> str:
    """``lora_sync``'s value when null: ``adapter`` where the adapter-only sync works, else ``merged``."""
    if cfg.actor_rollout_ref.rollout.lora_sync is not None:
        return cfg.actor_rollout_ref.rollout.lora_sync
    return "merged" if _adapter_sync_blocker(cfg) else "adapter"


def validate_lora(cfg: PPOConfig) -> None:
    """The LoRA keys of the actor's and the critic's model sections, and ``lora_sync``, of a resolved config."""
    sections: list[tuple[str, LoraSettings]] = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    if cfg.use_critic:
        sections.append(("critic.model", cfg.critic.model))
    for key, section in sections:
        try:
            check_lora_keys(section, key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if section.lora_rank > 0 and not backend_traits(cfg.backend.name).lora:
            supported = " | ".join(name for name, traits in BACKEND_TRAITS.items() if traits.lora)
            raise ConfigError(
                f"{key}.lora_rank={section.lora_rank}: LoRA is not supported by backend={cfg.backend.name}; "
                f"set {key}.lora_rank=0 or use backend={supported}"
            )
        if section.lora_rank > 0 and key == "critic.model" and not backend_traits(cfg.backend.name).lora_value:
            supported = " | ".join(name for name, traits in BACKEND_TRAITS.items() if traits.lora_value)
            raise ConfigError(
                f"critic.model.lora_rank={section.lora_rank}: backend={cfg.backend.name} trains LoRA adapters on the "
                f"policy only; set critic.model.lora_rank=0 or use backend={supported}"
            )
        path = section.lora_adapter_path
        if path is not None and not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ConfigError(
                f"{key}.lora_adapter_path: {path} is not a PEFT adapter directory (no adapter_config.json)"
            )
    mode = cfg.actor_rollout_ref.rollout.lora_sync
    if mode is not None and mode not in LORA_SYNC_MODES:
        raise ConfigError(f"{SYNC_KEY} must be one of {' | '.join(LORA_SYNC_MODES)} (or null), got '{mode}'")
    blocker = _adapter_sync_blocker(cfg) if mode == "adapter" else None
    if blocker is not None:
        raise ConfigError(f"{SYNC_KEY}=adapter: {blocker}; use {SYNC_KEY}=merged")


def reference_source(cfg: PPOConfig) -> str:
    """Where the reference log-probs come from, for the run plan's log line."""
    if cfg.actor_rollout_ref.model.lora_rank > 0:
        return "the actor's base model (LoRA adapters disabled, no separate ref engine)"
    return "a separate frozen ref engine"
