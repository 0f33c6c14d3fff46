"""Running one engine test module's checks on several real gloo ranks (each rank a fresh process).

``launch(module, work, world, timeout_s)`` starts ``world`` processes that call ``module.run_rank(work)`` with
RANK / WORLD_SIZE / MASTER_* set, waits (killing stragglers after ``timeout_s``) and returns each rank's
``{check: error text or None}``. ``run_checks(work, fn)`` is the rank side: it runs ``fn(work, rank, results)``
and always writes the results, so one launch serves many checks; ``rank_check`` records one check there,
``assert_close`` compares tensors inside a check, ``assert_step_matches_reference`` compares one engine step with
the single-process reference step, and ``assert_ranks_passed`` reports a check in the parent test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

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
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
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


def rank_check(results: dict, name: str):
    """Decorator running one check, recording None or the failure text (the run continues either way)."""

    def wrap(fn):
        try:
            fn()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
        return fn

    return wrap


def assert_close(a, b, what: str, tol: float = 1e-5) -> None:
    import torch

    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if not (a.shape == b.shape and diff <= tol):
        raise AssertionError(f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}, max diff {diff}")
    assert torch.isfinite(a).all(), what


def assert_ranks_passed(results: dict[int, dict], check: str) -> None:
    """Every rank ran ``check`` and it passed."""
    for rank, res in results.items():
        assert check in res, f"rank {rank} did not run {check}"
        assert res[check] is None, f"rank {rank}: {res[check]}"


def assert_step_matches_reference(
    metrics: dict, loss: float, weights: dict, ref_loss: float, ref_norm: float, ref_sd: dict, optim
) -> None:
    """An engine's train_step (its metrics, the ``loss`` this rank reports: the whole batch's, its exported
    ``weights``) equals the reference step (tests/backends/reference.py ``ref_step``), which must have exercised
    gradient clipping."""
    import torch

    assert_close(torch.tensor(loss), torch.tensor(ref_loss), "loss")
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(ref_norm), "grad_norm")
    assert ref_norm > optim.grad_clip, "the reference step must exercise clipping"
    assert metrics["lr"] == optim.lr and metrics["step_skipped"] == 0.0 and "pg" in metrics, metrics
    assert list(weights) == list(ref_sd), "names differ from the HF state_dict"
    for k, v in weights.items():
        assert_close(v, ref_sd[k], f"weight {k}")
