"""``code_runner``: runs Python code in a fresh interpreter subprocess with time, memory and output limits.

Isolation (best effort, Linux): the child runs ``python -I`` (no user site, no env-driven imports) in an empty
temporary directory with ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU`` and a wall-clock ``timeout``; it is
moved into fresh user + network namespaces when the kernel allows unprivileged ones (no network interface at
all), and in any case the code runs after a prelude that makes every socket creation raise. stdout + stderr
(truncated to ``max_output_chars``) come back to the model; a timeout or a crash comes back as text.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import sys
import tempfile
from typing import Any

from scaletrain.agent.tools.base import BaseTool, ToolResponse, register_tool

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PRELUDE = (
    "import socket as _s\n"
    "def _no_net(*a, **k):\n    raise OSError('network access is disabled in code_runner')\n"
    "_s.socket = _no_net; _s.create_connection = _no_net; _s.socketpair = _no_net\n"
    "del _s, _no_net\n"
)


def _limit(memory_mb: int, cpu_s: int):
    def apply() -> None:
        os.setsid()
        try:  # fresh user + network namespace: no interfaces, not even loopback up
            libc = ctypes.CDLL(None, use_errno=True)
            libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
        except Exception:
            pass
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))

    return apply


async def run_python(
    code: str, *, timeout: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000
) -> tuple[str, bool]:
    """(output text, ok). ``ok`` is False on timeout, non-zero exit or a failed start."""
    with tempfile.TemporaryDirectory(prefix="scaletrain-code-") as workdir:
        path = os.path.join(workdir, "main.py")
        with open(path, "w") as f:
            f.write(PRELUDE + code)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                path,
                cwd=workdir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                preexec_fn=_limit(memory_mb, max(1, int(timeout) + 1)),
            )
        except Exception as exc:
            return f"Error: could not start the interpreter: {exc}", False
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            await proc.wait()
            return f"Error: timed out after {timeout} s", False
        text = out.decode("utf-8", errors="replace")
        if len(text) > max_output_chars:
            text = text[:max_output_chars] + "...(truncated)"
        if proc.returncode != 0:
            return f"{text}\nError: exit code {proc.returncode}".strip(), False
        return text, True


@register_tool("code_runner")
class CodeRunnerTool(BaseTool):
    default_schema = {
        "type": "function",
        "function": {
            "name": "code_runner",
            "description": "Run Python code and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text="Error: 'code' must be a string"), 0.0, {"error": 1.0}
        text, ok = await run_python(
            code,
            timeout=float(self.config.get("timeout", 5.0)),
            memory_mb=int(self.config.get("memory_mb", 512)),
            max_output_chars=int(self.config.get("max_output_chars", 2000)),
        )
        return ToolResponse(text=text), 0.0, ({} if ok else {"error": 1.0})
