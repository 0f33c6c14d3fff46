"""Interactions: a simulated user that answers the model between assistant turns (``INTERACTING`` state).

``generate_response`` returns ``(should_terminate, response, reward, metrics)``; the response becomes a user turn
(mask 0) and the reward is appended to the trajectory's ``turn_scores``. Interactions come from a YAML file
(``actor_rollout_ref.rollout.multi_turn.interaction_config_file``)::

    interaction:
      - name: checker                 # what extra_info.interaction_kwargs.name selects (default: the first)
        class_name: answer_checker    # a registered name or module.Class
        config: {max_attempts: 3}
"""

from __future__ import annotations

import importlib
import uuid
from typing import Any

import yaml

from scaletrain.utils.registry import Registry

INTERACTIONS = Registry("interaction", lazy={"answer_checker": "scaletrain.agent.interactions.answer_checker"})


def register_interaction(name: str):
    return INTERACTIONS.register(name)


class BaseInteraction:
    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.name = self.config.get("name", type(self).__name__)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = dict(kwargs)
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        raise NotImplementedError

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


def _resolve(class_name: str) -> type:
    if class_name in INTERACTIONS:
        return INTERACTIONS.get(class_name)
    module, _, attr = class_name.rpartition(".")
    if not module:
        raise ValueError(f"unknown interaction '{class_name}'; registered: {', '.join(INTERACTIONS.names())}")
    return getattr(importlib.import_module(module), attr)


def load_interactions(path: str) -> dict[str, BaseInteraction]:
    """name -> interaction, in file order; errors name the file and entry."""
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    entries = spec.get("interaction")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty top-level 'interaction' list")
    out: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where}: needs 'class_name'")
        name = entry.get("name") or entry["class_name"].rsplit(".", 1)[-1]
        try:
            out[name] = _resolve(entry["class_name"])({**(entry.get("config") or {}), "name": name})
        except Exception as exc:
            raise ValueError(f"{where}: cannot build interaction '{entry['class_name']}': {exc}") from exc
    return out
