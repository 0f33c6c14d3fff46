"""Per-run ``pids`` cgroups for code_runner (layer: agent tools): a cgroup with ``pids.max`` bounds a run's
processes even for root (which the kernel exempts from ``RLIMIT_NPROC``), and killing every task in it ends
processes that left the run's session or process group."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import uuid

logger = logging.getLogger(__name__)


def read_text(path: str) -> str:
    """The file's text; "" when it cannot be read (a cgroup file of a kernel without that feature)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cgroup_candidates() -> list[str]:
    """Our own pids-controlled cgroup directory for each mounted hierarchy that has the controller."""
    mounts = [line.split() for line in read_text("/proc/self/mounts").splitlines()]
    own = [line.split(":", 2) for line in read_text("/proc/self/cgroup").splitlines()]
    v1 = [m[1] for m in mounts if len(m) > 3 and m[2] == "cgroup" and "pids" in m[3].split(",")]
    v2 = [m[1] for m in mounts if len(m) > 3 and m[2] == "cgroup2"]
    found = []
    for _, controllers, path in (entry for entry in own if len(entry) == 3):
        if "pids" in controllers.split(","):
            found += [mount + path for mount in v1]
        elif controllers == "":
            found += [mount + path for mount in v2]
    return found


@functools.lru_cache(maxsize=1)
def pids_cgroup_parent() -> str | None:
    """A cgroup directory under which a per-run ``pids`` cgroup can be made, or None. In v2 the controller must
    already be delegated (``subtree_control``): enabling it ourselves would clash with the rule that a cgroup
    with controllers for its children holds no processes (we are in it)."""
    for path in _cgroup_candidates():
        control = os.path.join(path, "cgroup.subtree_control")  # exists in v2 only
        if os.access(path, os.W_OK) and (not os.path.exists(control) or "pids" in read_text(control).split()):
            return path
    return None


class RunCgroup:
    """A per-run ``pids`` cgroup: at most ``max_processes`` tasks in it (root included); ``close`` kills them all."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.procs = os.path.join(path, "cgroup.procs")

    @classmethod
    def make(cls, max_processes: int) -> RunCgroup | None:
        parent = pids_cgroup_parent()
        if parent is None:
            return None
        path = os.path.join(parent, f"scaletrain-code-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(max_processes))
        except OSError as exc:
            logger.debug("code_runner: cannot make the pids cgroup %s: %s", path, exc)
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return None
        return cls(path)

    def kill_all(self) -> None:
        for pid in (int(line) for line in read_text(self.procs).split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def close(self) -> None:
        """Kill every process in the cgroup (again and again: a fork bomb forks while it is killed) and remove
        it; a cgroup that will not go is logged and left."""
        for _ in range(200):
            self.kill_all()
            try:
                os.rmdir(self.path)
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    break
            await asyncio.sleep(0.01)
        logger.warning("code_runner: could not remove the cgroup %s (processes left in it?)", self.path)
