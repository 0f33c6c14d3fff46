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

import logging

from scaletrain.trainer.config.verl_keys import (
    BACKEND_SELECTORS,
    IGNORED,
    RENAMED,
    RENAMED_PREFIXES,
    RESCALED,
    UNSUPPORTED,
    VERL_CONFIG_NAMES,
    VERL_CONFIG_PATH,
    Unsupported,
)
from scaletrain.utils.typed_config import ConfigError

logger = logging.getLogger(__name__)


def translate_overrides(overrides: list[str], known: set[str], mappings: frozenset[str] = frozenset()) -> list[str]:
    """The override list Hydra should see; ``known`` holds the dotted keys of the typed config's leaves,
    ``mappings`` those of its free-form mappings (``ray_kwargs.ray_init.runtime_env``), whose entries are set with
    or without ``+`` (Hydra's ``++``: added or replaced)."""
    out, backend, selectors = [], None, {}
    for item in overrides:
        plus, body = _split_plus(item)
        key, sep, value = body.partition("=")
        if not sep:
            out.append(item)
            continue
        if key in ("--config-name", "--config-path"):
            kept, selected = _verl_config_argument(key, value)
            out += [item] if kept else []
            selectors.update({f"{key}={value}": selected} if selected else {})
            continue
        if _dropped(key, value):
            continue
        renamed = _renamed(key, value)
        if renamed != (key, value):
            key, value = renamed
            body, item = f"{key}={value}", f"{plus}{key}={value}"
        if key in BACKEND_SELECTORS:
            selectors[key] = _selected_backend(key, value)
            if key not in known:  # verl's model_engine group, the ref's strategy: read, then dropped
                continue
        elif key.startswith("reward.") and key not in known:  # reward.health.* is this project's
            raise ConfigError(f"{key}={value}: not supported by scaletrain; verl's reward.* keys taken here: {_REWARD}")
        if key == "backend":
            backend = value
        if any(key.startswith(m + ".") for m in mappings):
            out.append(f"++{key}={value}")
            continue
        out.append(body if plus and key in known else item)
    wanted = _one_backend(selectors, backend)
    return out if wanted is None or backend is not None else [f"backend={wanted}", *out]


_REWARD = ", ".join(
    sorted(
        [k for k in (*RENAMED, *RESCALED, *IGNORED) if k.startswith("reward.")] + ["reward.custom_reward_function.*"]
    )
)


def _split_plus(item: str) -> tuple[str, str]:
    stripped = item.lstrip("+")
    return item[: len(item) - len(stripped)], stripped


def _longest_match(key: str, table: dict) -> str | None:
    matches = [prefix for prefix in table if key == prefix or key.startswith(prefix + ".")]
    return max(matches, key=len) if matches else None


def _dropped(key: str, value: str) -> bool:
    """True for a verl key accepted and dropped; ConfigError naming what to use for one refused (a key renamed
    exactly is neither, though it falls under a refused prefix)."""
    if key in RENAMED:
        return False
    prefix = _longest_match(key, UNSUPPORTED)
    if prefix is not None:
        rule: Unsupported = UNSUPPORTED[prefix]
        if value.strip("'\"") in rule.accepted:
            return True
        raise ConfigError(f"{key}={value}: not supported by scaletrain; {rule.instead}")
    prefix = _longest_match(key, IGNORED)
    if prefix is not None:
        logger.info("%s: ignored; %s", key, IGNORED[prefix])
        return True
    return False


def _renamed(key: str, value: str) -> tuple[str, str]:
    for old, new in RENAMED_PREFIXES.items():
        if key.startswith(old):
            return new + key[len(old) :], value
    if key in RESCALED:
        new, factor = RESCALED[key]
        try:
            return new, str(int(float(value.strip("'\"")) * factor))
        except ValueError:
            raise ConfigError(f"{key}={value}: expected a number") from None
    if key not in RENAMED:
        return key, value
    if key.endswith("lr_warmup_steps") and value.strip("'\"") == "-1":
        value = "0"
    return RENAMED[key], value


def _verl_config_argument(key: str, value: str) -> tuple[bool, str | None]:
    """verl's ``--config-path=config`` / ``--config-name=ppo_megatron_trainer``: (keep the argument for Hydra,
    the backend it selects)."""
    if key == "--config-path":
        return value != VERL_CONFIG_PATH, None
    name = value.removesuffix(".yaml")
    if name not in VERL_CONFIG_NAMES:
        return True, None  # a config of the user's own: Hydra's to find
    return False, VERL_CONFIG_NAMES[name]


def _selected_backend(key: str, value: str) -> str:
    table = BACKEND_SELECTORS[key]
    if value not in table:
        raise ConfigError(f"{key}: unknown strategy '{value}'; known: {', '.join(table)}")
    return table[value]


def _one_backend(selectors: dict[str, str], backend: str | None) -> str | None:
    """The backend verl's selectors pick (None: they pick none); ConfigError when they disagree with each other or
    with an explicit ``backend=``."""
    chosen = set(selectors.values())
    if len(chosen) > 1:
        raise ConfigError(
            f"{' and '.join(selectors)} select different backends ({', '.join(sorted(chosen))}): "
            "the roles share one backend"
        )
    if not chosen:
        return None
    (wanted,) = chosen
    if backend is not None and backend != wanted:
        raise ConfigError(
            f"backend={backend} conflicts with {next(iter(selectors))} (backend {wanted}): set one of the two"
        )
    return wanted
