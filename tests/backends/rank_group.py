"""A group of real gloo ranks (one fresh process each) serving one test module's checks, one check per test.

``RankGroup(module, work, world)`` starts ``world`` processes that import ``module`` once (the ~15 s of imports a
launch costs) and then wait for checks; ``group.check(name, *args)`` has every rank run
``module.check_<name>(ctx, *args)`` (``args``: JSON values, e.g. a layout's name) and returns each rank's failure
text (None: passed). So each check is its own pytest test (``pytest -k name`` runs
that one check and only the set-up it asks for), and one failure does not hide the others. ``ctx`` (``RankContext``)
holds the rank, the world size, the work directory and ``ctx.once(key, build)``: set-up several checks share
(the reference step, an engine), built on first use by whichever check asks first.

``GroupsByWorld(module, work)`` serves a module whose checks run on several world sizes, one group at a time.

A check that fails on one rank while its peer waits in a collective leaves that peer stuck: after ``timeout_s`` the
group is killed (the test fails naming the check and showing each rank's log) and the next check starts a new one.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scaletrain.utils.net import free_port, local_rank_env

ROOT = Path(__file__).resolve().parents[2]


class RankContext:
    """What a check sees on its rank: ``rank``, ``world``, ``inputs`` (the module's directory: its model),
    ``work`` (this group's own scratch directory) and set-up shared between checks."""

    def __init__(self, inputs: str, work: str, rank: int, world: int) -> None:
        self.inputs, self.work, self.rank, self.world = inputs, work, rank, world
        self._built: dict[str, Any] = {}
        self._failed: dict[str, str] = {}

    def once(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()``'s value, built on the first call for ``key`` on this rank; a build that failed fails every
        later asker too (with the first failure's text), rather than building half a set-up again."""
        if key in self._failed:
            raise RuntimeError(f"set-up {key!r} failed earlier on rank {self.rank}:\n{self._failed[key]}")
        if key not in self._built:
            try:
                self._built[key] = build()
            except Exception:
                self._failed[key] = traceback.format_exc()
                raise
        return self._built[key]


def serve(module: str, inputs: str, work: str) -> None:
    """The rank side: read checks from stdin (a JSON ``[name, args]`` a line), run each, write
    ``reply_<rank>_<n>.json``; ``exit`` ends."""
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    checks = importlib.import_module(module)
    ctx = RankContext(inputs, work, rank, world)
    for n, line in enumerate(sys.stdin):
        if line.strip() == "exit":
            break
        name, args = json.loads(line)
        try:
            getattr(checks, f"check_{name}")(ctx, *args)
            error = None
        except Exception:  # noqa: BLE001 - reported to the parent test
            error = traceback.format_exc()
        reply = Path(work, f"reply_{rank}_{n}.json")
        reply.with_suffix(".tmp").write_text(json.dumps({"check": name, "error": error}))
        reply.with_suffix(".tmp").rename(reply)


class RankGroup:
    """The parent side (a module-scoped fixture holds one): start the ranks lazily, send checks, collect replies."""

    def __init__(self, module: str, work: Path, world: int, timeout_s: float = 240.0) -> None:
        self.module, self.work, self.world, self.timeout_s = module, Path(work), world, timeout_s
        self.procs: list[subprocess.Popen] = []
        self.sent = 0
        self.generation = 0

    def _start(self) -> None:
        self.generation += 1
        self.sent = 0
        # several groups may share the module's directory: each start gets a scratch directory of its own
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"ranks{self.world}_{self.generation}_", dir=self.work))
        port = free_port()
        code = (
            "from tests.backends.rank_group import serve; "
            f"serve({self.module!r}, {str(self.work)!r}, {str(self.run_dir)!r})"
        )
        for rank in range(self.world):
            env = local_rank_env(rank, self.world, port, str(ROOT))
            log = open(self.run_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code], env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=log, stderr=log
                )
            )

    def _logs(self) -> str:
        return "\n".join(
            f"--- rank {r} log:\n{(self.run_dir / f'rank{r}.log').read_text()[-3000:]}" for r in range(self.world)
        )

    def check(self, name: str, *args: Any) -> dict[int, str | None]:
        """Every rank's failure text for check ``name`` (None: passed); fails the test if a rank dies or hangs."""
        if not self.procs:
            self._start()
        n, self.sent = self.sent, self.sent + 1
        for proc in self.procs:
            proc.stdin.write((json.dumps([name, list(args)]) + "\n").encode())
            proc.stdin.flush()
        replies, deadline = {}, time.monotonic() + self.timeout_s
        while len(replies) < self.world:
            for rank in range(self.world):
                path = self.run_dir / f"reply_{rank}_{n}.json"
                if rank not in replies and path.exists():
                    replies[rank] = json.loads(path.read_text())["error"]
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None and r not in replies]
            if dead or time.monotonic() > deadline:
                logs = self._logs()
                self.close(kill=True)  # the next check gets a new group
                why = f"rank(s) {dead} died" if dead else f"no reply within {self.timeout_s:.0f} s"
                pytest.fail(f"check {name}{tuple(args) or ''}: {why}\n{logs}")
            time.sleep(0.05)
        return replies

    def assert_passed(self, name: str, *args: Any) -> None:
        for rank, error in self.check(name, *args).items():
            assert error is None, f"rank {rank}: {error}"

    def close(self, kill: bool = False) -> None:
        """Ends the ranks: ``exit`` to each (it leaves after the check it runs), or SIGKILL (a stuck group)."""
        for proc in self.procs if kill else []:
            proc.kill()
            proc.wait()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write(b"exit\n")
                    proc.stdin.close()
                    proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
        self.procs = []


class GroupsByWorld:
    """``groups(world)``: the serving group of ``module`` on that many ranks, started when a check first asks for it;
    a group of another world size ends first (one group's memory at a time). ``close()`` ends the last one."""

    def __init__(self, module: str, work: Path, timeout_s: float = 300.0) -> None:
        self.module, self.work, self.timeout_s = module, work, timeout_s
        self.groups: dict[int, RankGroup] = {}

    def __call__(self, world: int) -> RankGroup:
        for other in [w for w in self.groups if w != world]:
            self.groups.pop(other).close()
        if world not in self.groups:
            self.groups[world] = RankGroup(self.module, self.work, world, timeout_s=self.timeout_s)
        return self.groups[world]

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups = {}
