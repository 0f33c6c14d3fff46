"""``run_python``: runs one Python program in the sandbox (``sandbox.py``) or, where there is none and the caller
allows it, unsandboxed with limits only; the process plumbing under the ``code_runner`` tool and the reward
layer's sandbox server (scaletrain/reward/sandbox_server.py). ``code_runner.py``'s docstring says what each limit
and mode does.

A run takes ``stdin`` (fed while the program runs: a program that never reads it is not blocked) and reports
its output merged (``text``, what the tool shows a model) or, with ``split_stderr``, as ``stdout`` and ``stderr``
each capped at ``max_output_chars``; ``returncode``, ``timed_out`` and ``elapsed_s`` say how it ended.
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
import time
from dataclasses import dataclass
from typing import Any

from scaletrain.agent.tools import sandbox
from scaletrain.agent.tools.pids_cgroup import RunCgroup

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


@dataclass
class RunResult:
    text: str  # what the program printed (stdout and stderr merged, or stdout alone with split_stderr) and why it
    # stopped when it failed
    ok: bool  # False on timeout, non-zero exit, output over the cap, a refused or failed start
    network_isolated: bool | None = None  # None: the child never got that far
    process_limit: str | None = None  # "cgroup", "rlimit" or "none"; None: the child never started
    sandboxed: bool = False
    stdout: str = ""  # with split_stderr: each stream as printed (capped), no error lines added
    stderr: str = ""
    returncode: int | None = None  # None: it never started; negative: killed by that signal
    timed_out: bool = False
    truncated: bool = False  # the output went over max_output_chars: the program was stopped there
    elapsed_s: float = 0.0


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
    """Kill the child's process group (and cgroup) and return its exit status. The rest of the pipes is drained:
    asyncio's ``wait()`` waits for their EOF too; bounded, since a process that escaped both may hold them."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if cgroup is not None:
        cgroup.kill_all()

    async def drain(stream: asyncio.StreamReader | None) -> None:
        while stream is not None and await stream.read(READ_CHUNK):
            pass

    async def drain_and_wait() -> None:
        await asyncio.gather(drain(proc.stdout), drain(proc.stderr))
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


async def _start(launch: Launch, cgroup: RunCgroup | None, opts: dict[str, Any], piped_stdin: bool, split: bool):
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
            stdin=asyncio.subprocess.PIPE if piped_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE if split else asyncio.subprocess.STDOUT,
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


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    """Write ``data`` to the child's stdin and close it; a child that exits (or closes stdin) first is no error."""
    assert proc.stdin is not None  # started with stdin=PIPE (_start)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.close()


async def _collect(proc: asyncio.subprocess.Process, outputs: list[CappedOutput], stdin: bytes | None) -> None:
    """Read every output until EOF (or over its cap: then stop) and wait for the exit, feeding stdin meanwhile.
    Cancelled (the timeout), it stops its readers first: ``_stop`` drains the same pipes."""
    streams = [proc.stdout, proc.stderr][: len(outputs)]
    tasks = [asyncio.ensure_future(out.read_from(s)) for out, s in zip(outputs, streams) if s is not None]
    if stdin is not None:
        tasks.append(asyncio.ensure_future(_feed(proc, stdin)))
    try:
        for finished in asyncio.as_completed(tasks[: len(outputs)]):
            await finished
            if any(out.truncated for out in outputs):
                return
        await proc.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _ending(opts: dict[str, Any], returncode: int, truncated: bool, timed_out: bool, sandboxed: bool) -> str:
    """The line added to the output of a run that failed ("" for one that did not)."""
    if truncated:
        return f"Error: the output exceeded {opts['max_output_chars']} characters; the program was stopped"
    if timed_out:
        return f"Error: timed out after {opts['timeout']} s"
    return _exit_text(returncode, sandboxed) if returncode != 0 else ""


async def _run(launch: Launch, cgroup: RunCgroup | None, opts: dict[str, Any], stdin: bytes | None) -> RunResult:
    start = time.monotonic()
    split = opts["split_stderr"]
    proc, net_err, joined, error = await _start(launch, cgroup, opts, stdin is not None, split)
    isolated = None if net_err is None else net_err == 0
    if proc is None:
        return RunResult(error, False, network_isolated=isolated, sandboxed=launch.sandboxed)
    # the sandbox's uid is never root, so RLIMIT_NPROC binds it; unsandboxed root is exempt from it
    limit = "cgroup" if joined else ("rlimit" if launch.sandboxed or os.geteuid() != 0 else "none")
    outputs = [CappedOutput(opts["max_output_chars"]) for _ in range(2 if split else 1)]
    timed_out = False
    try:
        await asyncio.wait_for(_collect(proc, outputs, stdin), opts["timeout"])
    except asyncio.TimeoutError:
        timed_out = True
    except asyncio.CancelledError:  # the caller gave up (e.g. the agent's tool_timeout_s): so does the child
        await _stop(proc, cgroup)  # milliseconds once killed (at most DRAIN_S)
        raise
    truncated = any(out.truncated for out in outputs)
    returncode = await _stop(proc, cgroup) if timed_out or truncated else proc.returncode
    assert returncode is not None  # else _collect waited for the exit
    ok = not (timed_out or truncated or returncode)
    ending = _ending(opts, returncode, truncated, timed_out, launch.sandboxed)
    text = outputs[0].text() + ("\n" + ending if ending else "")
    result = RunResult(text if ok else text.strip(), ok, isolated, limit, launch.sandboxed)
    result.stdout, result.stderr = outputs[0].text(), outputs[1].text() if split else ""
    result.returncode, result.timed_out, result.truncated = returncode, timed_out, truncated
    result.elapsed_s = time.monotonic() - start
    return result


async def _run_sandboxed(code: str, cgroup: RunCgroup | None, opts: dict[str, Any], stdin: bytes | None) -> RunResult:
    """The code goes in through a memfd (no file of ours on disk, copied read-only into the jail)."""
    code_fd = os.memfd_create("scaletrain-code")
    try:
        with open(code_fd, "wb", closefd=False) as f:
            f.write(code.encode("utf-8", errors="surrogatepass"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        launch = Launch(sandbox.jail_argv(code_fd, opts["disk_mb"]), "/", (code_fd,), True)
        return await _run(launch, cgroup, opts, stdin)
    finally:
        os.close(code_fd)


async def _run_unsandboxed(code: str, cgroup: RunCgroup | None, opts: dict[str, Any], stdin: bytes | None) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="scaletrain-code-") as workdir:
        path = os.path.join(workdir, "main.py")
        with open(path, "w") as f:
            f.write(PRELUDE + code)
        return await _run(Launch([sys.executable, "-I", path], workdir, (), False), cgroup, opts, stdin)


async def run_python(code: str, stdin: str | None = None, split_stderr: bool = False, **limits: Any) -> RunResult:
    """Run ``code`` in the sandbox with the limits, ``stdin`` on its standard input (None: /dev/null);
    ``limits``: keys of ``LIMITS`` (code_runner.py's docstring)."""
    unknown = set(limits) - set(LIMITS)
    if unknown:
        raise TypeError(f"run_python: unknown limits {sorted(unknown)}; known: {', '.join(LIMITS)}")
    opts = {**LIMITS, **limits, "split_stderr": split_stderr}
    problem = sandbox.sandbox_problem()
    if problem and not opts["allow_unsandboxed"]:
        return RunResult(f"Error: code_runner has no sandbox here ({problem}): the code was not run", False)
    cgroup = RunCgroup.make(opts["max_processes"])
    data = None if stdin is None else stdin.encode("utf-8", errors="surrogatepass")
    try:
        run = _run_unsandboxed if problem else _run_sandboxed
        return await run(code, cgroup, opts, data)
    finally:
        if cgroup is not None:
            await cgroup.close()
