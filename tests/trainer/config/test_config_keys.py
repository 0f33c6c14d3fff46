"""Every config key is reachable and read: the YAML lists each dataclass field (so Hydra accepts every key from
the command line), and each field is read by the code it configures.

The read check is static: a field counts as read when some module of the project (tests excluded) loads the
attribute by its name (``x.<field>``) or reads it through a generic consumer of that class (``fields(Cls)`` /
``asdict``), listed in GENERIC_CONSUMERS with where it happens. Targeted tests elsewhere check that the keys do
what they say (tests/trainer/config/test_ppo_config.py, tests/backends/rollout/test_rollout_lifecycle.py, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.config.sft_config import SFTConfig
from scaletrain.utils.typed_config import leaf_fields, to_dict

ROOT = Path(__file__).resolve().parents[3]
# functions that read a config field named by a string: getattr(cfg, "name"), the policy losses' option(cfg, "name")
NAMED_GETTERS = ("getattr", "option", "get_option")  # (obj, "field", ...) reads a field by name
# classes whose fields are consumed wholesale, and where
GENERIC_CONSUMERS = {
    "RolloutEngineSettings": "backends/rollout/base.py resolved_for / check (fields(RolloutEngineSettings))",
    "FSDPConfig": "scaletrain/workers/model_sections.py FSDPConfig.applied (fields(self))",
    "MegatronConfig": "scaletrain/workers/model_sections.py MegatronConfig.merged (LAYOUT_KEYS) and role_checks.py",
    "CustomRewardFunction": "scaletrain/trainer/ppo_trainer.py to_dict(cfg.custom_reward_function)",
}


def owner(cls, name):
    """The class in ``cls``'s MRO that declares field ``name``."""
    for base in reversed(cls.__mro__):
        if name in getattr(base, "__annotations__", {}):
            return base.__name__
    return cls.__name__


def composed(config_name):
    with initialize_config_module("configs", version_base=None):
        return OmegaConf.to_container(compose(config_name), resolve=False)


@pytest.mark.parametrize("config_name, cls", [("ppo_trainer", PPOConfig), ("sft_trainer", SFTConfig)])
def test_yaml_lists_every_key_with_the_dataclass_default(config_name, cls):
    """One place for each default: the YAML repeats the dataclass's (a Python user and a CLI user get one run)."""
    tree, missing, differ = composed(config_name), [], []
    defaults = to_dict(cls())
    for key, _, _field in leaf_fields(cls):
        node, value = tree, defaults
        for part in key.split("."):
            value = value[part]
            if not isinstance(node, dict) or part not in node:
                node = KeyError
                break
            node = node[part]
        if node is KeyError:
            missing.append(key)
        elif node != (list(value) if isinstance(value, tuple) else value):  # YAML has lists, not tuples
            differ.append(f"{key}: yaml {node!r} vs dataclass {value!r}")
    assert not missing, f"{config_name}.yaml lacks keys (Hydra would reject them): {missing}"
    assert not differ, f"{config_name}.yaml and the dataclasses disagree: {differ}"


def attribute_loads() -> set[str]:
    names = set()
    for path in list((ROOT / "scaletrain").rglob("*.py")) + list((ROOT / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in NAMED_GETTERS
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
            ):
                names.add(node.args[1].value)
    return names


@pytest.mark.parametrize("cls", [PPOConfig, SFTConfig])
def test_every_field_is_read(cls):
    loads = attribute_loads()
    unread = [
        key
        for key, owning, f in leaf_fields(cls)
        if f.name not in loads and owner(owning, f.name) not in GENERIC_CONSUMERS
    ]
    assert not unread, f"config fields no code reads: {unread}"


# pairs of unrelated config classes allowed to declare the same fields, and why
SHARED_FIELDS_ALLOWED = {
    ("RolloutWorkerConfig", "SamplingConfig"): "the rollout section's sampling keys are the defaults of the per-call "
    "SamplingConfig value it builds (train_sampling / validation_sampling)",
}


def config_classes() -> set[type]:
    """Every dataclass reachable from the trainers' configs and the workers' and engines' own settings, with bases."""
    import dataclasses
    import typing

    from backends.config import EngineConfig, ModelConfig
    from backends.rollout.base import RolloutConfig, SamplingConfig
    from scaletrain.workers.config import EngineSetup
    from scaletrain.workers.sft import SFTWorkerConfig

    seen: set[type] = set()
    todo = [
        PPOConfig,
        SFTConfig,
        ModelConfig,
        EngineConfig,
        EngineSetup,
        SFTWorkerConfig,
        SamplingConfig,
        RolloutConfig,
    ]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += [base for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)]
        for tp in typing.get_type_hints(cls).values():
            todo += [a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return seen


def declared_defaults(cls) -> dict[str, str]:
    """{field: repr of its default} for the fields ``cls``'s own body declares."""
    import dataclasses

    own = vars(cls).get("__annotations__", {})
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in own:
            factory = f.default_factory
            out[f.name] = repr(f.default if factory is dataclasses.MISSING else factory())
    return out


def test_no_config_class_repeats_another_ones_keys():
    """One place for each default: two config classes that do not extend one another never declare three or more
    of the same keys with the same defaults (a shared base class holds them instead)."""
    import itertools

    twins = []
    for a, b in itertools.combinations(sorted(config_classes(), key=lambda c: c.__qualname__), 2):
        if issubclass(a, b) or issubclass(b, a) or (a.__name__, b.__name__) in SHARED_FIELDS_ALLOWED:
            continue
        da, db = declared_defaults(a), declared_defaults(b)
        same = sorted(k for k in da.keys() & db.keys() if da[k] == db[k])
        if len(same) >= 3:
            twins.append(f"{a.__name__} ~ {b.__name__}: {same}")
    assert len(config_classes()) > 30
    assert not twins, f"config classes repeating each other's keys and defaults: {twins}"
