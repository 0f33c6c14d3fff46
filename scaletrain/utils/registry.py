"""A name -> object registry with one decorator, used by every pluggable family.

Advantage estimators, policy losses, reward managers, backends, rollout engines, ... each own one
``Registry``; the config names an entry and the code looks it up with ``.get(name)``::

    POLICY_LOSSES = Registry("policy loss")

    @POLICY_LOSSES.register("vanilla")
    def vanilla(...): ...

    POLICY_LOSSES.get("vanilla")   # -> the function; an unknown name raises ValueError listing the known ones

A registry is also a mutable mapping of its imported entries, as verl's registries are plain dicts: code written
for verl reads ``REGISTRY[name]``, tests ``name in REGISTRY``, sets and clears entries.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any


def registry_key(name: Any) -> str:
    """The string a name is registered under."""
    # A str Enum member (e.g. AdvantageEstimator.GRPO) is looked up by its value, not its member name.
    if isinstance(name, enum.Enum):
        name = name.value
    if not isinstance(name, str):
        raise TypeError(f"registry names are strings, got {type(name).__name__}: {name!r}")
    return name


_NO_DEFAULT = object()


def register_into(registry: MutableMapping, kind: str, key: str, obj: Any, override: bool = False) -> Any:
    """Puts ``obj`` under ``key``; a second, different object under a taken name raises ValueError unless
    ``override`` (re-registering the same object, e.g. on module reload, is a no-op). Any mapping: verl code
    swaps its registry dicts for plain ones."""
    old = registry._entries.get(key) if isinstance(registry, Registry) else registry.get(key)  # no lazy import
    if old is not None and old is not obj and not override:
        raise ValueError(f"{kind} '{key}' is already registered ({old!r}); pass override=True to replace it")
    registry[key] = obj
    return obj


class Registry(MutableMapping):
    """Maps names to objects. ``kind`` (e.g. "advantage estimator") only appears in error messages.

    ``lazy`` maps built-in names to the module that registers them, imported on first ``get`` of that name, so
    heavy optional dependencies (DeepSpeed, vLLM, ...) load only when a run asks for them.
    """

    def __init__(self, kind: str, lazy: dict[str, str] | None = None):
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._lazy = dict(lazy or {})

    def register(self, name: Any, *, override: bool = False) -> Callable[[Any], Any]:
        """Decorator registering its target under ``name``; returns the target unchanged.

        Registering a second, different object under a taken name raises ValueError unless ``override=True``
        (re-registering the same object, e.g. on module reload, is a no-op).
        """
        key = registry_key(name)

        def decorator(obj: Any) -> Any:
            return register_into(self, self.kind, key, obj, override)

        return decorator

    def get(self, name: Any, default: Any = _NO_DEFAULT) -> Any:
        """The object registered under ``name``; without ``default``, ValueError listing the registered names if
        there is none (with one, ``default``, as a dict's ``get``)."""
        key = registry_key(name)
        if key not in self._entries and key in self._lazy:
            try:
                importlib.import_module(self._lazy[key])
            except ImportError as exc:
                raise ImportError(
                    f"{self.kind} '{key}' is not available: importing {self._lazy[key]} failed: {exc}"
                ) from exc
        if key in self._entries or default is not _NO_DEFAULT:
            return self._entries.get(key, None if default is _NO_DEFAULT else default)
        try:
            return self._entries[key]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} '{key}'; registered: {', '.join(self.names()) or '(none)'}"
            ) from None

    def names(self) -> list[str]:
        """Registered names (and not yet imported built-ins), sorted."""
        return sorted(set(self._entries) | set(self._lazy))

    def __contains__(self, name: Any) -> bool:
        return registry_key(name) in self._entries or registry_key(name) in self._lazy

    def __getitem__(self, name: Any) -> Any:
        try:
            return self.get(name)
        except ValueError as exc:
            raise KeyError(registry_key(name)) from exc

    def __setitem__(self, name: Any, obj: Any) -> None:
        self._entries[registry_key(name)] = obj

    def __delitem__(self, name: Any) -> None:
        del self._entries[registry_key(name)]
        self._lazy.pop(registry_key(name), None)

    def clear(self) -> None:
        self._entries.clear()
        self._lazy.clear()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
