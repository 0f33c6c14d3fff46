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
import codecs
import contextlib
import ctypes
import errno
import logging
import os
import resource
import signal
import sys
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any

from scaletrain.agent.tools import sandbox
from scaletrain.agent.tools.base import BaseTool, ToolResponse, register_tool
from scaletrain.agent.tools.pids_cgroup import RunCgroup, pids_cgroup_parent, read_text

logger = logging.getLogger(__name__)

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
# unsandboxed mode, tried in order: a plain network namespace (needs CAP_SYS_ADMIN, e.g. root), then user + network
# namespaces (unprivileged). Module-level so that a test can make every attempt fail.
UNSHARE_ATTEMPTS = (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET)
PRELUDE = (
    "import socket as _s\n"
    "def _no_net(*a, **k):\n    raise OSError('network access is disabled in code_runner')\n"
    "_s.socket = _no_net; _s.create_connection = _no_net; _s.socketpair = _no_net\n"
    "del _s, _no_net\n"
)
READ_CHUNK = 1 << 16
DRAIN_S = 2.0  # after a kill, how long the rest of the output pipe may take to reach EOF
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child should not dlopen between fork and exec
_WARNED: set[str] = set()
# run_python's limits and their defaults (also the tool's config keys)
LIMITS: dict[str, Any] = dict(
    timeout=5.0,
    memory_mb=512,
    max_output_chars=2000,
    max_processes=64,
    max_file_mb=16,
    disk_mb=64,
    require_network_isolation=False,
    allow_unsandboxed=False,
)
__all__ = ["CodeRunnerTool", "RunCgroup", "RunResult", "pids_cgroup_parent", "read_text", "run_python"]


@dataclass
class RunResult:
    text: str
    ok: bool  # False on timeout, non-zero exit, output over the cap, a refused or failed start
    network_isolated: bool | None = None  # None: the child never got that far
    process_limit: str | None = None  # "cgroup", "rlimit" or "none"; None: the child never started
    sandboxed: bool = False


# -------------------------------------------------------------------------------------------------- child
@dataclass
class Launch:
    """How one run starts: the command, where, the descriptors it inherits and whether it is the sandbox."""

    argv: list[str]
    cwd: str
    pass_fds: tuple[int, ...]
    sandboxed: bool


def _child_setup(limits: dict[int, tuple[int, int]], cgroup_procs: str | None, status_fd: int, sandboxed: bool,
                 require_isolation: bool):  # fmt: skip
    """preexec_fn: runs in the child (bwrap, or the bare interpreter) between fork and exec. Reports
    "net=<errno> cg=<0|1>" on ``status_fd`` (closed at exec, so the code cannot write there)."""

    def apply() -> None:
        os.setsid()
        joined = 0
        if cgroup_procs is not None:  # before anything else: every later fork is counted
            with contextlib.suppress(OSError):
                with open(cgroup_procs, "w") as f:
                    f.write(str(os.getpid()))
                joined = 1
        with contextlib.suppress(OSError):  # the OOM killer's first pick; set while privileged, so it stays
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        err = 0 if sandboxed else errno.EINVAL  # bwrap makes the namespaces itself (and fails if it cannot)
        for flags in () if sandboxed else UNSHARE_ATTEMPTS:
            if _LIBC.unshare(flags) == 0:
                err = 0
                break
            err = ctypes.get_errno()
        os.write(status_fd, f"net={err} cg={joined}".encode())
        if err and require_isolation:
            raise OSError(err, "network isolation unavailable")
        for limit, soft_hard in limits.items():
            # the sandbox's uid is shared by the runs going on at once: with the run's own cgroup bounding its
            # processes, RLIMIT_NPROC (a count over the uid) would let one run's forks refuse another's start
            if not (sandboxed and joined and limit == resource.RLIMIT_NPROC):
                resource.setrlimit(limit, soft_hard)

    return apply


class CappedOutput:
    """Decodes a byte stream keeping at most ``max_chars`` characters (memory bounded by that plus a chunk)."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.size, self.truncated = max_chars, 0, False
        self.parts: list[str] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    async def read_from(self, stream: asyncio.StreamReader) -> None:
        """Until EOF, or until more than ``max_chars`` came (``truncated``: the reading stops there)."""
        while True:
            chunk = await stream.read(READ_CHUNK)
            text = self._decoder.decode(chunk, final=not chunk)
            self.parts.append(text[: self.max_chars - self.size])
            self.size += len(self.parts[-1])
            if len(text) > len(self.parts[-1]):
                self.truncated = True
                return
            if not chunk:
                return

    def text(self) -> str:
        return "".join(self.parts) + ("...(truncated)" if self.truncated else "")


async def _stop(proc: asyncio.subprocess.Process, cgroup: RunCgroup | None) -> int:
    """Kill the child's process group (and cgroup) and return its exit status. The rest of the pipe is drained:
    asyncio's ``wait()`` waits for the pipe's EOF too; bounded, since a process that escaped both may hold it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if cgroup is not None:
        cgroup.kill_all()

    async def drain_and_wait() -> None:
        assert proc.stdout is not None  # started with stdout=PIPE (_start)
        while await proc.stdout.read(READ_CHUNK):
            pass
        await proc.wait()

    try:
        await asyncio.wait_for(drain_and_wait(), DRAIN_S)
    except asyncio.TimeoutError:
        logger.warning("code_runner: pid %d's output pipe is still open %s s after the kill", proc.pid, DRAIN_S)
    return -signal.SIGKILL if proc.returncode is None else proc.returncode


def _read_status(fd: int) -> tuple[int | None, bool]:
    """(unshare errno or None when the child did not report, joined the cgroup) from the status pipe."""
    try:
        words = dict(w.split("=", 1) for w in os.read(fd, 64).decode().split() if "=" in w)
    except (BlockingIOError, ValueError):
        return None, False
    finally:
        os.close(fd)
    net = words.get("net")
    return (int(net) if net and net.isdigit() else None), words.get("cg") == "1"


def _exit_text(returncode: int, sandboxed: bool) -> str:
    if sandboxed and returncode > 128 and returncode - 128 in signal.valid_signals():
        returncode = 128 - returncode  # bwrap passes a signal death on as exit status 128 + the signal
    if -returncode in signal.valid_signals():
        return f"Error: killed by signal {signal.Signals(-returncode).name}"
    return f"Error: exit code {returncode}"


def _rlimits(opts: dict[str, Any]) -> dict[int, tuple[int, int]]:
    cpu_s = max(1, int(opts["timeout"]) + 1)
    return {
        resource.RLIMIT_AS: (opts["memory_mb"] << 20,) * 2,
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        resource.RLIMIT_NPROC: (opts["max_processes"],) * 2,
        resource.RLIMIT_FSIZE: (opts["max_file_mb"] << 20,) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }


async def _start(launch: Launch, cgroup: RunCgroup | None, opts: dict[str, Any]):
    """(process or None, unshare errno or None, joined the cgroup, error text when it did not start)."""
    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    require = opts["require_network_isolation"]
    cgroup_procs = cgroup.procs if cgroup else None
    preexec = _child_setup(_rlimits(opts), cgroup_procs, status_w, launch.sandboxed, require)
    try:
        proc = await asyncio.create_subprocess_exec(
            *launch.argv,
            cwd=launch.cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
            preexec_fn=preexec,
            pass_fds=launch.pass_fds,
        )
    except Exception as exc:
        os.close(status_w)
        net_err, _ = _read_status(status_r)
        error = f"Error: could not start the interpreter: {type(exc).__name__}: {exc}"
        if net_err and require:
            error = f"Error: code_runner could not isolate the network ({os.strerror(net_err)}) and "
            error += "require_network_isolation is set: the code was not run"
        return None, net_err, False, error
    os.close(status_w)  # the child's copy closed at exec: the status is complete
    return (proc, *_read_status(status_r), "")


async def _run(launch: Launch, cgroup: RunCgroup | None, opts: dict[str, Any]) -> RunResult:
    proc, net_err, joined, error = await _start(launch, cgroup, opts)
    isolated = None if net_err is None else net_err == 0
    if proc is None:
        return RunResult(error, False, network_isolated=isolated, sandboxed=launch.sandboxed)
    # the sandbox's uid is never root, so RLIMIT_NPROC binds it; unsandboxed root is exempt from it
    limit = "cgroup" if joined else ("rlimit" if launch.sandboxed or os.geteuid() != 0 else "none")
    out, timed_out = CappedOutput(opts["max_output_chars"]), False

    async def collect() -> None:
        assert proc.stdout is not None  # started with stdout=PIPE (_start)
        await out.read_from(proc.stdout)
        if not out.truncated:
            await proc.wait()

    try:
        await asyncio.wait_for(collect(), opts["timeout"])
    except asyncio.TimeoutError:
        timed_out = True
    except asyncio.CancelledError:  # the caller gave up (e.g. the agent's tool_timeout_s): so does the child
        await _stop(proc, cgroup)  # milliseconds once killed (at most DRAIN_S)
        raise
    returncode = await _stop(proc, cgroup) if timed_out or out.truncated else proc.returncode
    assert returncode is not None  # else collect() waited for the exit
    text = out.text()
    if out.truncated:
        text += f"\nError: the output exceeded {opts['max_output_chars']} characters; the program was stopped"
    elif timed_out:
        text += f"\nError: timed out after {opts['timeout']} s"
    elif returncode != 0:
        text += "\n" + _exit_text(returncode, launch.sandboxed)
    ok = not (timed_out or out.truncated or returncode)
    return RunResult(text if ok else text.strip(), ok, isolated, limit, launch.sandboxed)


async def _run_sandboxed(code: str, cgroup: RunCgroup | None, opts: dict[str, Any]) -> RunResult:
    """The code goes in through a memfd (no file of ours on disk, copied read-only into the jail)."""
    code_fd = os.memfd_create("scaletrain-code")
    try:
        with open(code_fd, "wb", closefd=False) as f:
            f.write(code.encode("utf-8", errors="surrogatepass"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        launch = Launch(sandbox.jail_argv(code_fd, opts["disk_mb"]), "/", (code_fd,), True)
        return await _run(launch, cgroup, opts)
    finally:
        os.close(code_fd)


async def _run_unsandboxed(code: str, cgroup: RunCgroup | None, opts: dict[str, Any]) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="scaletrain-code-") as workdir:
        path = os.path.join(workdir, "main.py")
        with open(path, "w") as f:
            f.write(PRELUDE + code)
        return await _run(Launch([sys.executable, "-I", path], workdir, (), False), cgroup, opts)


async def run_python(code: str, **limits: Any) -> RunResult:
    """Run ``code`` in the sandbox with the limits; ``limits``: keys of ``LIMITS`` (see the module docstring)."""
    unknown = set(limits) - set(LIMITS)
    if unknown:
        raise TypeError(f"run_python: unknown limits {sorted(unknown)}; known: {', '.join(LIMITS)}")
    opts = {**LIMITS, **limits}
    problem = sandbox.sandbox_problem()
    if problem and not opts["allow_unsandboxed"]:
        return RunResult(f"Error: code_runner has no sandbox here ({problem}): the code was not run", False)
    cgroup = RunCgroup.make(opts["max_processes"])
    try:
        run = _run_unsandboxed if problem else _run_sandboxed
        return await run(code, cgroup, opts)
    finally:
        if cgroup is not None:
            await cgroup.close()


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
