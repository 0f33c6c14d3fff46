"""Running one engine test module's checks on several real gloo ranks (each rank a fresh process).

``launch(module, work, world, timeout_s)`` starts ``world`` processes that call ``module.run_rank(work)`` with
RANK / WORLD_SIZE / MASTER_* set, waits (killing stragglers after ``timeout_s``) and returns each rank's
``{check: error text or None}``. ``run_checks(work, fn)`` is the rank side: it runs ``fn(work, rank, results)``
and always writes the results, so one launch serves many checks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, work: Path, world: int, timeout_s: float) -> dict[int, dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        code = f"from {module} import run_rank; run_rank({str(work)!r})"
        log = open(work / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=log, stderr=log))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = {}
    for rank in range(world):
        path = work / f"results_rank{rank}.json"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no results; log:\n{(work / f'rank{rank}.log').read_text()[-4000:]}")
        out[rank] = json.loads(path.read_text())
    return out


def run_checks(work: str, fn: Callable[[str, int, dict], None]) -> None:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results: dict[str, str | None] = {}
    try:
        fn(work, rank, results)
    finally:
        Path(work, f"results_rank{rank}.json").write_text(json.dumps(results))
