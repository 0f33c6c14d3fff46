"""Turning a plain config dict (from Hydra/OmegaConf YAML) into typed dataclasses, strictly.

``build(cls, data)`` fills dataclass ``cls`` from ``data`` recursively: nested dataclasses, lists, dicts,
optionals and tuples. An unknown key, a missing required key or a value of the wrong type raises
``ConfigError`` naming the full dotted key (``actor_rollout_ref.actor.ppo_mini_batch_size``), so a typo in a
command-line override fails before anything starts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type; the message names the dotted key."""


def resolved(value: T | None, key: str) -> T:
    """``value`` of the dotted config ``key`` that the config resolve fills when it is null (a default derived
    from other keys); a ConfigError when it is still unset, i.e. the config was used before it was resolved."""
    if value is None:
        raise ConfigError(f"{key} is unset: the config must be resolved first (its null means a derived default)")
    return value


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {options}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return build(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
            return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: _convert(val_tp, v, _join(path, k)) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 1e-6 as a string
        except ValueError:
            pass
    if isinstance(tp, type):
        if tp is not bool and isinstance(value, bool):
            raise ConfigError(f"{path}: expected {tp.__name__}, got a boolean {value!r}")
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def build(cls: type, data: dict[str, Any] | None, path: str = "") -> Any:
    """An instance of dataclass ``cls`` from ``data``; ConfigError naming the dotted key on any mismatch."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {_join(path, unknown[0])!r}"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; "
            f"{path or 'the top level'} takes: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key {_join(path, name)!r}")
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """The plain-dict form of a (nested) dataclass, for logging and checkpoints."""
    if not dataclasses.is_dataclass(obj):
        return obj
    if isinstance(obj, type):
        raise TypeError("asdict() should be called on dataclass instances")  # dataclasses.asdict's own refusal
    return dataclasses.asdict(obj)


def execution_only(cls) -> frozenset[str]:
    """The fields of dataclass ``cls`` marked as changing only how a run executes, not its results (micro-batches,
    offloading, timeouts, logging, where outputs go): the names in the ``EXECUTION_ONLY`` class attribute of
    ``cls`` and of its bases ("*": all of its fields). Every other field counts as result-changing, so a new key
    is checked on resume until someone marks it (scaletrain/trainer/run/run_identity.py)."""
    return _marked(cls, "EXECUTION_ONLY")


def layout_only(cls) -> frozenset[str]:
    """The fields of dataclass ``cls`` marked as the run's parallel layout (``LAYOUT_ONLY``): a checkpoint resumes
    across a change of them where the backend reshards its state (the sums run in another order)."""
    return _marked(cls, "LAYOUT_ONLY")


def _marked(cls, attribute: str) -> frozenset[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        marked = vars(klass).get(attribute, ())
        names |= {f.name for f in dataclasses.fields(klass)} if "*" in marked else set(marked)
    return frozenset(names)


def leaf_fields(cls, prefix: str = ""):
    """(dotted key, declaring dataclass, field) of each leaf field of dataclass ``cls``, nested dataclasses walked
    (a dict-typed field is a leaf)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)] or [hints[f.name]]
        if dataclasses.is_dataclass(inner[0]):
            yield from leaf_fields(inner[0], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f
