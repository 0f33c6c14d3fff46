"""``code_runner``: runs model-written Python code in a sandbox (``sandbox.py``: bubblewrap, an unprivileged uid,
its own pid / network / mount namespaces, nothing of the trainer's visible) with time, memory, output, process,
file-size and disk limits, at most ``max_concurrency`` at once per tool.

Where no sandbox can be made (bubblewrap missing, user namespaces refused) the tool refuses to be built, naming why,
unless its config sets ``allow_unsandboxed: true``: then the code runs as the trainer's own user with the limits
below only (``python -I`` in an empty temporary directory, a fresh network namespace where one can be had, a
prelude making socket creation raise), and each call reports the metric ``code_runner/unsandboxed`` = 1.0.

Limits, in both modes: ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (``max_file_mb``: a bigger
write fails with ``OSError: File too large``), no core dumps, a wall-clock ``timeout``; the sandbox's ``/tmp`` holds
at most ``disk_mb``. Output (stdout + stderr) is streamed and kept up to ``max_output_chars``: a program that prints
more is stopped there ("...(truncated)"), so the driver's memory stays bounded whatever the child prints.

Processes: ``max_processes`` bounds the child and everything it forks: a per-run ``pids`` cgroup where one is
writable (``pids_cgroup.py``; at the end every process in it is killed, also those that left the session), else
``RLIMIT_NPROC`` (binding the sandbox's uid; unsandboxed it binds a non-root driver only and counts all of the
user's processes, and root without a cgroup reports ``code_runner/no_process_limit`` = 1.0).

Network (unsandboxed mode): whether the namespace was obtained is reported by the child before it execs, through a
pipe the code cannot reach; without it, ``require_network_isolation`` false (default) -> metric
``code_runner/no_network_isolation`` = 1.0 and a warning logged once, true -> the code is not run. A timeout, a
crash or a limit comes back to the model as text.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from scaletrain.agent.tools import sandbox
from scaletrain.agent.tools.base import BaseTool, ToolResponse, register_tool
from scaletrain.agent.tools.pids_cgroup import RunCgroup, pids_cgroup_parent, read_text
from scaletrain.agent.tools.python_process import LIMITS, RunResult, run_python

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()
__all__ = ["CodeRunnerTool", "RunCgroup", "RunResult", "pids_cgroup_parent", "read_text", "run_python"]


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


@register_tool("code_runner")
class CodeRunnerTool(BaseTool):
    """Config: ``timeout`` (s, 5), ``memory_mb`` (512), ``max_output_chars`` (2000), ``max_concurrency`` (4),
    ``max_processes`` (64), ``max_file_mb`` (16), ``disk_mb`` (64), ``allow_unsandboxed`` (false),
    ``require_network_isolation`` (false; unsandboxed mode only). Built only where the sandbox works, unless
    ``allow_unsandboxed`` is set."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "code_runner",
            "description": "Run Python code and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.options = {key: self._setting(key, default) for key, default in LIMITS.items()}
        self.max_concurrency = self._setting("max_concurrency", 4)
        problem = sandbox.sandbox_problem()
        if problem and not self.options["allow_unsandboxed"]:
            raise RuntimeError(
                f"code_runner runs model-written code only in a sandbox, and {problem}. Install bubblewrap "
                "(`apt-get install bubblewrap`; `make install` does it when run as root) and allow user namespaces, "
                "or set `allow_unsandboxed: true` in this tool's config to run the code as your own user with "
                "resource limits only (it could then read your files and signal your processes)"
            )
        if problem:
            _warn_once("sandbox", f"code_runner: model code runs WITHOUT a sandbox (allow_unsandboxed): {problem}")
        # an asyncio.Semaphore belongs to the loop it is first used on; a tool may serve several loops in turn
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _setting(self, key: str, default: Any) -> Any:
        """``config[key]`` as the type of ``default``; numbers must be positive."""
        value, kind = self.config.get(key, default), type(default)
        if kind is bool:
            return bool(value)
        try:
            number = kind(value)
        except (TypeError, ValueError):
            number = 0
        if not number > 0:
            raise ValueError(f"code_runner: config {key} must be a positive {kind.__name__}, got {value!r}")
        return number

    def _semaphore(self) -> asyncio.Semaphore:
        # (a Semaphore binds to a loop on first use, not when made: the spare one made here is harmless)
        return self._semaphores.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.max_concurrency))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text="Error: 'code' must be a string"), 0.0, {"error": 1.0}
        async with self._semaphore():
            result = await run_python(code, **self.options)
        metrics = {} if result.ok else {"error": 1.0}
        if not result.sandboxed:
            metrics["code_runner/unsandboxed"] = 1.0
        if result.network_isolated is False:
            metrics["code_runner/no_network_isolation"] = 1.0
            _warn_once("net", "code_runner: no network namespace could be made; only the socket prelude blocks it")
        if result.process_limit == "none":
            metrics["code_runner/no_process_limit"] = 1.0
            _warn_once("nproc", "code_runner: running as root without a writable pids cgroup: no process limit")
        return ToolResponse(text=result.text), 0.0, metrics
