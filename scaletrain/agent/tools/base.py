"""Tools an agent loop can call: ``BaseTool`` (create / execute / release), ``ToolResponse``, the tool registry and
loading tools from a YAML file.

Tools YAML (``actor_rollout_ref.rollout.multi_turn.tools_config_file``)::

    tools:
      - class_name: calculator                       # a registered name or a dotted path module.Class
        config: {timeout: 5}                         # passed to the tool's __init__
        tool_schema:                                 # optional: OpenAI function schema; the class default if omitted
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

Per trajectory a tool is created (``create`` -> instance id), executed once per call and always released.
"""

from __future__ import annotations

import importlib
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import yaml

from scaletrain.utils.registry import Registry

logger = logging.getLogger(__name__)

TOOLS = Registry(
    "tool",
    lazy={
        "calculator": "scaletrain.agent.tools.calculator",
        "code_runner": "scaletrain.agent.tools.code_runner",
        "search": "scaletrain.agent.tools.search",
    },
)


def register_tool(name: str):
    return TOOLS.register(name)


@dataclass
class ToolResponse:
    text: str | None = None
    image: Any = None
    video: Any = None


class BaseTool:
    """A tool. Subclasses set ``default_schema`` (OpenAI function schema) and implement ``execute``."""

    default_schema: dict[str, Any] = {}

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.tool_schema = dict(tool_schema or self.default_schema)
        try:
            self.name = self.tool_schema["function"]["name"]
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"{type(self).__name__}: tool_schema needs function.name, got {self.tool_schema!r:.200}"
            ) from exc
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = dict(kwargs)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """(response shown to the model, reward, metrics)."""
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


def _resolve(class_name: str) -> type:
    if class_name in TOOLS:
        return TOOLS.get(class_name)
    module, _, attr = class_name.rpartition(".")
    if not module:
        raise ValueError(f"unknown tool '{class_name}'; registered: {', '.join(TOOLS.names())} (or module.Class)")
    return getattr(importlib.import_module(module), attr)


def load_tools(path: str) -> list[BaseTool]:
    """Tools listed in a YAML file (see the module docstring); errors name the file and entry."""
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    entries = spec.get("tools")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level 'tools' list")
    tools, names = [], set()
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where}: needs 'class_name'")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        try:
            cls = _resolve(entry["class_name"])
            tool = cls(entry.get("config") or {}, entry.get("tool_schema"))
        except Exception as exc:
            raise ValueError(f"{where}: cannot build tool '{entry['class_name']}': {exc}") from exc
        if tool.name in names:
            raise ValueError(f"{where}: duplicate tool name '{tool.name}'")
        names.add(tool.name)
        tools.append(tool)
    return tools
