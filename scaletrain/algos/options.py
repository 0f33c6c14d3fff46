"""Reading one option for an algorithm function: keyword argument, else config, else default.

``config`` may be None, a dict (or any Mapping, e.g. an OmegaConf DictConfig), or any object with attributes
(dataclass, namespace). Policy losses also look one level down in ``config.policy_loss`` so the actor config
(``clip_ratio`` at the top, ``policy_loss.clip_cov_ratio`` below) can be passed as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_MISSING = object()


def _lookup(config: Any, key: str) -> Any:
    if config is None:
        return _MISSING
    if isinstance(config, Mapping):
        return config.get(key, _MISSING)
    return getattr(config, key, _MISSING)


def get_option(
    config: Any, key: str, default: Any = None, overrides: Mapping | None = None, section: str | None = None
) -> Any:
    """``overrides[key]`` if given and not None, else ``config.key``, else ``config.<section>.key``, else ``default``.

    A None found in the config also falls through to the next source, so ``clip_ratio_low: null`` in YAML means
    "use the default".
    """
    if overrides is not None and overrides.get(key) is not None:
        return overrides[key]
    value = _lookup(config, key)
    if (value is _MISSING or value is None) and section is not None:
        sub = _lookup(config, section)
        if sub is not _MISSING and sub is not None:
            value = _lookup(sub, key)
    return default if value is _MISSING or value is None else value
