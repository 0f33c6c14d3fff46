"""The jail model-written code runs in (layer: agent tools): bubblewrap (``bwrap``, Debian's ``bubblewrap``
package, installed by ``make install`` as root), not a home-made one.

What the code gets: new pid, network, mount, IPC, UTS and cgroup namespaces; a root file system that holds only
``/usr`` (and the ``/lib*`` links), the interpreter's own prefix, all read-only, a fresh ``/proc`` of its own pid
namespace, a minimal ``/dev`` and a private ``/tmp`` (its working directory, a tmpfs of ``disk_mb``); an empty
environment; its own session. It never sees the trainer's files, tokens, checkpoints, data or environment, the
driver's pid (so it cannot signal it) or the host's network (only its own loopback). Its uid is unprivileged:

- driver running as root: bwrap sets the namespaces up as root, then ``setpriv`` becomes uid/gid ``SANDBOX_UID``
  (65534, "nobody") with no capabilities, no supplementary groups and ``no_new_privs`` before the interpreter
  starts: the kernel's own checks then apply (``RLIMIT_NPROC`` binds, limits cannot be raised, nothing of root's);
- otherwise: an unprivileged user namespace mapping the driver's uid to ``SANDBOX_UID`` inside, with further user
  namespaces disabled (needs the kernel to allow unprivileged user namespaces).

``sandbox_problem()`` probes once whether that works here; code_runner refuses to run model code when it does not
(unless its ``allow_unsandboxed`` key says otherwise).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

SANDBOX_UID = 65534  # "nobody": owns nothing on the host
CODE_PATH = "/sandbox/main.py"
BWRAP = "bwrap"  # looked up on PATH; module-level so that a test can name a missing one
SETPRIV = "/usr/bin/setpriv"  # util-linux, essential on Debian; bound in with /usr
PROBE_TIMEOUT_S = 30.0


def interpreter() -> tuple[str, str]:
    """(the base interpreter's real path, its prefix): a venv's python is a link into the base prefix, and the
    venv itself (the trainer's packages) stays outside the jail."""
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return executable, os.path.realpath(sys.base_prefix)


def _parents(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _mounts(prefix: str, code_fd: int, disk_mb: int) -> list[str]:
    mounts = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, where the host has them
        path = f"/{name}"
        if os.path.islink(path):
            mounts += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            mounts += ["--ro-bind", path, path]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        # its parents are made (empty, searchable) first: bwrap would copy their modes, and a prefix under
        # /root (pyenv) would then be unreachable to the sandbox's uid
        parents = [p for p in _parents(prefix) if p != "/"]
        for parent in parents:
            mounts += ["--perms", "0755", "--dir", parent]
        mounts += ["--ro-bind", prefix, prefix]
    mounts += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    mounts += ["--proc", "/proc", "--dev", "/dev"]
    mounts += ["--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", "/tmp"]
    mounts += ["--perms", "0444", "--ro-bind-data", str(code_fd), CODE_PATH]
    return mounts + ["--remount-ro", "/", "--chdir", "/tmp"]


def jail_argv(code_fd: int, disk_mb: int, bwrap: str | None = None) -> list[str]:
    """The command that runs the code readable at ``code_fd`` (passed to the child) in the jail."""
    executable, prefix = interpreter()
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup"]
    argv = [bwrap or shutil.which(BWRAP) or BWRAP, *namespaces, "--die-with-parent", "--new-session"]
    if os.geteuid() != 0:
        argv += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns"]
    argv += _mounts(prefix, code_fd, disk_mb)
    argv += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "OMP_NUM_THREADS", "1"]
    if os.geteuid() == 0:
        drop = [f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--no-new-privs"]
        argv += [SETPRIV, *drop, "--inh-caps=-all", "--bounding-set=-all", "--"]
    return argv + [executable, "-I", CODE_PATH]


@functools.lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """None when a jailed interpreter runs here (tried once, with the real command), else why not."""
    bwrap = shutil.which(BWRAP)
    if bwrap is None:
        return f"bubblewrap ({BWRAP}) is not installed"
    if os.geteuid() == 0 and not os.access(SETPRIV, os.X_OK):
        return f"{SETPRIV} (util-linux) is missing, so the sandbox cannot drop root"
    code_fd = os.memfd_create("scaletrain-sandbox-probe")
    try:
        os.write(code_fd, b"import os\nprint(os.getuid())\n")
        os.lseek(code_fd, 0, os.SEEK_SET)
        try:
            done = subprocess.run(
                jail_argv(code_fd, 1, bwrap), pass_fds=(code_fd,), capture_output=True, text=True,
                timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{bwrap} could not be run: {type(exc).__name__}: {exc}"
    finally:
        os.close(code_fd)
    if done.returncode != 0 or done.stdout.strip() != str(SANDBOX_UID):
        detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"{bwrap} cannot make the sandbox here ({detail[0]})"
    return None
