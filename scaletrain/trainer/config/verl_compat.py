"""verl command lines, read before Hydra composes the config (layer 4).

A verl launch script ports by changing the module name. Three things need the raw override list:

- ``actor_rollout_ref.actor.strategy=X`` / ``critic.strategy=X`` pick the backend config group (``backend=Y``,
  the short form), so the group's own defaults load; an explicit ``backend=`` that disagrees is an error.
- ``+key=value`` for a key the config already has (Hydra refuses to "add" it) is taken as ``key=value``; verl
  names this project spells otherwise are renamed (``RENAMED``, ``RENAMED_PREFIXES``: verl's older top-level
  ``ray_init`` section); an entry of a free-form mapping (``ray_kwargs.ray_init.runtime_env.py_executable``) is
  set whether it exists or not.
- verl keys this project does not support fail here, naming the key and what to use instead
  (``UNSUPPORTED``); where verl's default value means "off", that value is accepted and dropped.
- verl keys whose job scaletrain does anyway (``IGNORED``, e.g. the LoRA recipe's ``layered_summon``) are dropped,
  the reason logged.
"""

from __future__ import annotations

import dataclasses
import logging

from scaletrain.trainer.config.role_checks import backend_of_strategy
from scaletrain.utils.typed_config import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Unsupported:
    instead: str  # what to use instead
    accepted: tuple = ()  # values that mean "off" in verl: accepted and dropped


UNSUPPORTED = {
    "trainer.use_legacy_worker_impl": Unsupported("remove it: scaletrain has one worker implementation", ("auto",)),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": Unsupported(
        "Ulysses sequence parallelism is not implemented: use backend=megatron with "
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        ("1",),
    ),
    "critic.ulysses_sequence_parallel_size": Unsupported(
        "Ulysses sequence parallelism is not implemented: use backend=megatron with "
        "critic.megatron.sequence_parallel=true",
        ("1",),
    ),
    "actor_rollout_ref.model.use_fused_kernels": Unsupported(
        "fused log-prob kernels are not implemented; log-probs are computed in chunks (remove the key)",
        ("false", "False"),
    ),
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": Unsupported(
        "fused log-prob kernels are not implemented (remove the key)"
    ),
    "algorithm.use_pf_ppo": Unsupported(
        "policy-filtration PPO is not implemented (remove the key)", ("false", "False")
    ),
    "algorithm.pf_ppo": Unsupported("policy-filtration PPO is not implemented (remove the key)"),
    "reward_model.use_reward_loop": Unsupported(
        "generative reward models are not supported; a discriminative one runs with reward_model.enable=true and "
        "reward_model.model.path",
        ("false", "False"),
    ),
    "reward_model.rollout": Unsupported(
        "generative reward models (a rollout for the reward model) are not "
        "supported; use a discriminative reward_model.model.path"
    ),
    "reward_model.num_workers": Unsupported(
        "reward computation runs in reward_model.num_processes worker processes "
        "(the reward loop of verl is not implemented)"
    ),
}


# verl keys accepted and dropped: what they do in verl, scaletrain does anyway (or needs not)
IGNORED = {
    "actor_rollout_ref.model.use_shm": "the model is read from its path directly (verl copies it to /dev/shm first)",
    "actor_rollout_ref.rollout.layered_summon": "the LoRA weight sync gathers and merges one tensor at a time anyway",
}


# verl's name -> this project's (same meaning); verl's lr_warmup_steps=-1 ("use the ratio") is our 0
RENAMED = {
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor_rollout_ref.actor.optim.warmup_steps",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.grad_clip",
    "critic.grad_clip": "critic.optim.grad_clip",
}


# verl's older top-level ``ray_init`` section (and this project's former name) -> verl's current ``ray_kwargs``
RENAMED_PREFIXES = {
    "ray_init.timeline_json_file": "ray_kwargs.timeline_json_file",
    "ray_init.": "ray_kwargs.ray_init.",
}


def _renamed(key: str, value: str) -> tuple[str, str]:
    for old, new in RENAMED_PREFIXES.items():
        if key.startswith(old):
            return new + key[len(old) :], value
    if key not in RENAMED:
        return key, value
    if key.endswith("lr_warmup_steps") and value.strip("'\"") == "-1":
        value = "0"
    return RENAMED[key], value


def translate_overrides(overrides: list[str], known: set[str], mappings: frozenset[str] = frozenset()) -> list[str]:
    """The override list Hydra should see; ``known`` holds the dotted keys of the typed config's leaves,
    ``mappings`` those of its free-form mappings (``ray_kwargs.ray_init.runtime_env``), whose entries are set with
    or without ``+`` (Hydra's ``++``: added or replaced)."""
    out, backend, strategies = [], None, {}
    for item in overrides:
        plus, body = _split_plus(item)
        key, sep, value = body.partition("=")
        if not sep:
            out.append(item)
            continue
        if key in IGNORED:
            logger.info("%s: ignored; %s", key, IGNORED[key])
            continue
        rule = _unsupported(key)
        if rule is not None:
            if value.strip("'\"") in rule.accepted:
                continue
            raise ConfigError(f"{key}={value}: not supported by scaletrain; {rule.instead}")
        renamed = _renamed(key, value)
        if renamed != (key, value):
            key, value = renamed
            body, item = f"{key}={value}", f"{plus}{key}={value}"
        if any(key.startswith(m + ".") for m in mappings):
            out.append(f"++{key}={value}")
            continue
        if key == "backend":
            backend = value
        elif key in ("actor_rollout_ref.actor.strategy", "critic.strategy"):
            strategies[key] = backend_of_strategy(value, key)
        out.append(body if plus and key in known else item)
    chosen = set(strategies.values())
    if len(chosen) > 1:
        raise ConfigError(
            f"{' and '.join(f'{k}' for k in strategies)} select different backends "
            f"({', '.join(sorted(chosen))}): the roles share one backend"
        )
    if chosen:
        (wanted,) = chosen
        if backend is not None and backend != wanted:
            raise ConfigError(
                f"backend={backend} conflicts with {next(iter(strategies))} (backend {wanted}): set one of the two"
            )
        if backend is None:
            out.insert(0, f"backend={wanted}")
    return out


def _split_plus(item: str) -> tuple[str, str]:
    stripped = item.lstrip("+")
    return item[: len(item) - len(stripped)], stripped


def _unsupported(key: str) -> Unsupported | None:
    for prefix, rule in UNSUPPORTED.items():
        if key == prefix or key.startswith(prefix + "."):
            return rule
    return None
