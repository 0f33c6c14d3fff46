"""``verl.base_config``: the base of verl's config dataclasses, read like a mapping (``cfg["key"]``, ``cfg.get``).

scaletrain's own config dataclasses are plain (omegaconf reads them); this base is for config classes a verl user
wrote for their reward function or worker, so ``cfg["key"]`` and ``cfg.get("key", default)`` keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass
class BaseConfig:
    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str):
            raise TypeError(f"config keys are strings, got {type(key).__name__}: {key!r}")
        return getattr(self, key)  # AttributeError for an unknown key, as verl's

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def _keys(self) -> list[str]:
        fields = [f.name for f in dataclasses.fields(self)]
        return fields + [k for k in vars(self) if k not in fields and not k.startswith("_")]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


__all__ = ["BaseConfig"]
