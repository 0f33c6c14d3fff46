"""Running one engine test module's checks on several real gloo ranks (each rank a fresh process).

``launch(module, work, world, timeout_s)`` starts ``world`` processes that call ``module.run_rank(work)`` with
RANK / WORLD_SIZE / MASTER_* set, waits (killing stragglers after ``timeout_s``) and returns each rank's
``{check: error text or None}``. ``run_checks(work, fn)`` is the rank side: it runs ``fn(work, rank, results)``
and always writes the results, so one launch serves many checks; ``rank_check`` records one check there,
``assert_close`` compares tensors inside a check, ``counted_collectives`` counts a block's collective calls,
``assert_step_matches_reference`` compares one engine step with the single-process reference step,
``assert_nonfinite_step_skipped`` / ``assert_empty_batch_refused`` are the shared train_step guards every HF engine
must keep alike, and ``assert_ranks_passed`` reports a check in the parent test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scaletrain.utils.net import free_port, local_rank_env

ROOT = Path(__file__).resolve().parents[2]


def launch(module: str, work: Path, world: int, timeout_s: float) -> dict[int, dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = local_rank_env(rank, world, port, str(ROOT))
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


@contextmanager
def counted_collectives(*names: str) -> Iterator[dict[str, int]]:
    """The calls of each ``torch.distributed`` function in ``names`` made while the block runs, by name."""
    import torch.distributed as dist

    calls, originals = dict.fromkeys(names, 0), {name: getattr(dist, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in names:
            setattr(dist, name, counted(name))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


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


def assert_nonfinite_step_skipped(engine, batch, loss_fn, outputs, exported) -> None:
    """An HF engine's train_step with a NaN loss (so a NaN gradient norm) skips the update the same way on every
    backend (backends/accumulation.py): the weights stay bit-equal, the metrics say so, and the step still counts
    (step counter and LR schedule advance once, as after an applied step)."""
    import math

    import torch

    before, step, lr = exported(engine), engine.global_step, engine.scheduler.get_last_lr()[0]
    lr_after_applied_step = engine.scheduler.lr_lambdas[0](step + 1) * engine.optim_config.lr
    metrics = engine.train_step(batch, lambda o, mb: (loss_fn(o, mb)[0] * float("nan"), {}), outputs)
    assert metrics["step_skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"]), metrics
    assert math.isnan(metrics["loss"]) and metrics["lr"] == lr, metrics
    assert engine.global_step == step + 1 and engine.scheduler.get_last_lr()[0] == lr_after_applied_step
    for k, v in exported(engine).items():
        assert torch.equal(v, before[k]), k


def assert_empty_batch_refused(engine, batch, loss_fn, outputs) -> None:
    """An engine given no rows on every rank refuses forward and train_step with a ValueError on every rank (so
    none waits in a collective) and leaves its step counter alone."""
    empty, step = batch.select_idxs([]), engine.global_step
    with pytest.raises(ValueError, match="empty batch"):
        engine.forward(empty, outputs)
    with pytest.raises(ValueError, match="empty batch"):
        engine.train_step(empty, loss_fn, outputs)
    assert engine.global_step == step
