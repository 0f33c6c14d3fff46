"""Python stacks of worker processes, taken from the driver while a call is stuck (layer 3).

A worker that is alive but stuck (a deadlock, a hung kernel, user code that never returns) cannot answer a Ray
call: its one execution thread is busy. So each worker arms ``faulthandler`` at start (``arm_stack_dump``) to write
every thread's stack into a file of its own when it receives ``STACK_SIGNAL``; faulthandler does this from the
signal handler itself, so it works even while the main thread is blocked in C code (a collective, a sleep).

When a group call overruns its deadline the driver runs ``collect_stacks``: one tiny Ray task per worker, pinned
to the worker's node, sends the signal to the worker's pid and reads the file back; the driver writes each stack to
``<dump dir>/<group>-rank<r>-pid<p>.txt``. A worker that does not answer within ``wait_s`` (stopped, or its node
gone) gets a file saying so.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import tempfile
import time
from typing import Any, cast

logger = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGUSR2
_STACK_DIR = os.path.join(tempfile.gettempdir(), "scaletrain-stacks")
_armed: dict[str, Any] = {}  # the open file faulthandler writes to (it must stay open)


def stack_file(pid: int) -> str:
    return os.path.join(_STACK_DIR, f"{pid}.txt")


def arm_stack_dump() -> None:
    """In a worker process: write all threads' stacks to ``stack_file(pid)`` on ``STACK_SIGNAL`` (once per process)."""
    if "file" in _armed:
        return
    try:
        os.makedirs(_STACK_DIR, exist_ok=True)
        handle = open(stack_file(os.getpid()), "w")  # noqa: SIM115 - faulthandler keeps writing to it
        faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
        _armed["file"] = handle
    except (OSError, ValueError, RuntimeError) as err:  # no stacks is a lesser evil than a worker that won't start
        logger.warning("worker pid %d: stack dumps unavailable (%s)", os.getpid(), err)


def _read_stack(pid: int, wait_s: float) -> str:
    """Runs on the worker's node: signal ``pid``, then read its stack file once it stops growing."""
    path = stack_file(pid)
    start = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return f"process {pid} is gone\n"
    deadline, size, stable_since = time.monotonic() + wait_s, start, None
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = os.path.getsize(path) if os.path.exists(path) else 0
        if now > start and now == size:
            if stable_since is not None and time.monotonic() - stable_since >= 0.3:
                break
            stable_since = stable_since or time.monotonic()
        else:
            stable_since = None
        size = now
    if size <= start:
        return f"process {pid} wrote no stack within {wait_s:g} s (stopped, or stack dumps unavailable)\n"
    with open(path) as f:
        f.seek(start)
        return f.read()


def in_collective(stack: str) -> bool:
    """Whether the thread running the worker call waits in a torch.distributed collective, i.e. is held up by a peer
    rather than stuck itself. That thread is the one that took the signal ("Current thread") when calls run on the
    main thread; a worker with Ray concurrency groups runs its calls on other threads, so then it is any thread in
    scaletrain code."""
    threads = [block for block in stack.split("\n\n") if block.strip()]
    current = [block for block in threads if "Current thread" in block]
    calls = current or [block for block in threads if "/scaletrain/" in block]
    return any("torch/distributed/" in block for block in calls)


def collect_stacks(group: str, infos: list[dict], dump_dir: str, wait_s: float = 5.0) -> list[tuple[str, str]]:
    """Each worker's stack, written under ``dump_dir``; returns (file written, stack text) per worker, in order."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    os.makedirs(dump_dir, exist_ok=True)
    read = ray.remote(num_cpus=0)(_read_stack)
    refs = []
    for info in infos:
        node = info.get("node_id")
        strategy = NodeAffinitySchedulingStrategy(node, soft=False) if node else "DEFAULT"
        refs.append(read.options(scheduling_strategy=strategy).remote(info["pid"], wait_s))
    written = []
    for info, ref in zip(infos, refs):
        try:
            text = cast(str, ray.get(ref, timeout=wait_s + 30))  # the worker's stack text (Ray's get is untyped)
        except Exception as err:  # the node may be gone: say so in the file
            text = f"no stack: {type(err).__name__}: {err}\n"
        path = os.path.join(dump_dir, f"{group}-rank{info.get('rank')}-pid{info.get('pid')}.txt")
        with open(path, "w") as f:
            f.write(f"# worker group '{group}' rank {info.get('rank')} pid {info.get('pid')} on {info.get('host')}\n")
            f.write(text)
        written.append((path, text))
    return written
