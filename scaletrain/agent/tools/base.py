"""Tools an agent loop can call: ``BaseTool`` (create / execute / release), ``ToolResponse``, the tool registry and
loading tools from a YAML file.

Tools YAML (``actor_rollout_ref.rollout.multi_turn.tools_config_file``)::

    tools:
      - class_name: calculator                       # a registered name or a dotted path module.Class
        config: {timeout: 5}                         # passed to the tool's __init__
        tool_schema:                                 # optional: OpenAI function schema; the class default if omitted
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

Per call a tool is created (``create`` -> instance id), executed and always released. ``create`` and ``release``
are bounded by the tool's ``config.create_timeout_s`` / ``config.release_timeout_s`` (seconds, default 30) through
``create_with_timeout`` / ``release_with_timeout``, which raise ``ToolLifecycleTimeout`` and never wait for a
coroutine that ignores its cancellation (a hung tool service cannot hang the trajectory).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import yaml

from scaletrain.utils.registry import Registry

logger = logging.getLogger(__name__)
DEFAULT_LIFECYCLE_TIMEOUT_S = 30.0

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
        for phase in ("create", "release"):  # a bad value fails when the tools are loaded, not mid-rollout
            lifecycle_timeout_s(self, phase)

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


class ToolLifecycleTimeout(RuntimeError):
    """``create`` or ``release`` of a tool did not finish in time. Not a ``TimeoutError``: an agent loop that
    catches the execute timeout must not mistake this for it."""

    def __init__(self, tool_name: str, phase: str, timeout_s: float) -> None:
        super().__init__(
            f"tool '{tool_name}': {phase} did not finish within {timeout_s:g} s (config {phase}_timeout_s)"
        )
        self.tool_name, self.phase, self.timeout_s = tool_name, phase, timeout_s


def lifecycle_timeout_s(tool: BaseTool, phase: str) -> float:
    """``tool.config[f"{phase}_timeout_s"]`` (default 30 s), checked to be a positive number."""
    key = f"{phase}_timeout_s"
    value = tool.config.get(key, DEFAULT_LIFECYCLE_TIMEOUT_S)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"tool '{tool.name}': config {key} must be a positive number of seconds, got {value!r}")
    return seconds


def _ignore_late_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log "exception was never retrieved"


async def _bounded(tool: BaseTool, phase: str, awaitable: Any) -> Any:
    """The result of ``awaitable`` if it finishes within the tool's ``<phase>_timeout_s``; otherwise it is
    cancelled *without waiting for it* (``asyncio.wait_for`` would wait for a coroutine that swallows the
    cancellation) and ``ToolLifecycleTimeout`` is raised."""
    timeout_s = lifecycle_timeout_s(tool, phase)
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:  # the caller gave up: do not leave the tool call running behind it
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(_ignore_late_outcome)
    raise ToolLifecycleTimeout(tool.name, phase, timeout_s)


async def create_with_timeout(tool: BaseTool, **kwargs: Any) -> tuple[str, ToolResponse]:
    """``tool.create(**kwargs)`` bounded by ``config.create_timeout_s``."""
    return await _bounded(tool, "create", tool.create(**kwargs))


async def release_with_timeout(tool: BaseTool, instance_id: str) -> None:
    """``tool.release(instance_id)`` bounded by ``config.release_timeout_s``."""
    await _bounded(tool, "release", tool.release(instance_id))


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
