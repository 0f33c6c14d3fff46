"""Split placement and asynchronous training end to end (real Ray, torch.distributed, HF / vLLM engines; the runs
killed are subprocesses, the others in-process runs of the CLI's): one train rank and one rollout rank, weights
pushed through the object store.

- one_step_off (the agent loops on vLLM's AsyncLLM in the rollout worker), preempted by a SIGTERM to its whole
  process group after its step-2 checkpoint (it checkpoints the step in progress and exits 0), and fully_async,
  killed with SIGKILL there, each resumed: every step trains the prompts the synchronous run trained at that step
  (nothing skipped, nothing twice), no batch lags more weight versions than allowed, and the weight-version counter
  continues.
- fully_async with staleness_threshold=0 and a push every step trains exactly what the synchronous trainer
  trains, metric for metric, across the kill and resume too.
- fully_async with staleness_threshold=1 and partial rollout (segments of 2 tokens through the agent loops on
  vLLM), killed and resumed the same way: the same prompts per step, staleness at most 1.
(The staleness bound for other thresholds is asserted in test_async_scheduling.py; partial rollout's token
exactness across a push in tests/agent/test_partial_rollout.py.)
"""

import json
import logging
import signal
from pathlib import Path

import pytest

from tests.trainer.runs import COMPARED, command, metrics, run_in_process, signalled_when

pytestmark = pytest.mark.slow

# one train rank, one rollout rank; a step trains one mini-batch (fully_async's step) in every mode
SPLIT = [
    "actor_rollout_ref.hybrid_engine=false",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "data.train_batch_size=2",
]


def prompts_by_step(dump_dir: Path) -> dict[int, list[str]]:
    """The prompts each step trained on, in order (trainer.rollout_data_dir's dumps)."""
    out = {}
    for path in sorted(dump_dir.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        out[int(path.stem)] = [r["input"] for r in rows]
    return out


@pytest.fixture(scope="module")
def sync_run(ray_cluster, task, tmp_path_factory):
    """The synchronous trainer on split placement: 4 steps, the reference for every mode."""
    run = tmp_path_factory.mktemp("sync") / "run"
    run_in_process(task, run, 4, [*SPLIT, f"trainer.rollout_data_dir={run / 'dump'}"])
    return run


def test_split_sync_pushes_weights_and_measures_them(sync_run):
    rows = metrics(sync_run)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert rows[step]["async/weight_version"] == step  # one push after each update
        assert rows[step]["perf/weight_push_bytes"] > 1e6 and rows[step]["perf/weight_push_gib_per_s"] > 0


def stopped_after_checkpoint(args, run: Path, step: int, sig: int = signal.SIGKILL) -> int:
    """Start the run, send ``sig`` to its whole process group once the checkpoint pointer reaches ``step``; returns
    the step the pointer names once the run is gone (the checkpoint a resume starts from). SIGKILL: nothing cleans
    up. SIGTERM (a preemption, as ``kill -TERM -PGID`` sends it: the private Ray cluster's processes get it too): the
    run must finish its step, checkpoint it and exit 0 saying so."""
    pointer = run / "latest_checkpointed_iteration.txt"
    returncode, output = signalled_when(
        args,
        lambda: pointer.exists() and int(pointer.read_text() or 0) >= step,
        f"checkpoint {step}",
        sig,
        output=run.parent / f"{run.name}-output.txt",
    )
    caught = int(pointer.read_text())
    if sig != signal.SIGKILL:
        assert returncode == 0, output[-3000:]
        name = signal.Signals(sig).name
        assert f"preempted by {name} after step {caught}: checkpoint {run / f'global_step_{caught}'}" in output
    return caught


MODES = {  # extra overrides, the staleness bound
    # preempted by a SIGTERM to its process group (the others are killed with SIGKILL)
    "one_step_off": (["async_training.mode=one_step_off", "rollout=vllm", "actor_rollout_ref.rollout.mode=async"], 1),
    # staleness 0, a push every step: the synchronous schedule, so the resumed run equals sync metric for metric
    "fully_async": (["async_training.mode=fully_async", "data.train_batch_size=0"], 0),  # verl's 0: the mini-batch
    # the rollouter one version ahead, generations cut into 2-token segments a push can come between (partial
    # rollout), through the agent loops on vLLM
    "fully_async_stale1_partial": (
        [
            "async_training.mode=fully_async",
            "data.train_batch_size=0",
            "async_training.staleness_threshold=1",
            "async_training.partial_rollout=true",
            "async_training.partial_rollout_segment_tokens=2",
            "rollout=vllm",
            "actor_rollout_ref.rollout.mode=async",
        ],
        1,
    ),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kill_9_and_resume(mode, task, sync_run, tmp_path, caplog):
    extra, max_staleness = MODES[mode]
    run = tmp_path / mode
    overrides = [*SPLIT, *extra, f"trainer.rollout_data_dir={run / 'dump'}"]
    sig = signal.SIGTERM if mode == "one_step_off" else signal.SIGKILL
    caught = stopped_after_checkpoint(command(task, run, 4, overrides), run, 2, sig)
    assert caught < 4, "the run finished before it was stopped"
    assert set(range(caught + 1)) <= set(metrics(run)), "a checkpointed step's metrics line lost to the kill"
    caplog.set_level(logging.INFO, logger="scaletrain")
    run_in_process(task, run, 4, overrides)  # resumed in this process, on the session's cluster
    assert f"resumed from {run / f'global_step_{caught}'}" in caplog.text
    rows = metrics(run)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    # each step trained the synchronous run's prompts of that step: the resume regenerated what was in flight
    assert prompts_by_step(run / "dump") == prompts_by_step(sync_run / "dump")
    if mode == "fully_async":
        reference = metrics(sync_run)
        for step in (1, 2, 3, 4):
            for key in COMPARED:
                assert rows[step][key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-7), (step, key)
        assert rows[4]["val/scaletrain/arithmetic/acc"] == reference[4]["val/scaletrain/arithmetic/acc"]
    staleness = {s: rows[s]["async/staleness_max"] for s in (1, 2, 3, 4)}
    assert max(staleness.values()) <= max_staleness and staleness[1] == 0
    assert staleness[caught + 1] == 0, staleness  # the first step after the resume: generated by resumed weights
    if mode == "fully_async_stale1_partial":  # the segmented path ran (how many a push cut depends on timing)
        assert all("async/partial_rollouts" in rows[s] for s in (1, 2, 3, 4)), rows[4]
    if mode == "one_step_off":
        assert all(staleness[s] == 1 for s in (2, 3, 4) if s != caught + 1), staleness
        # vLLM's AsyncLLM in the rollout worker took the agent loops' requests one by one (no driver-side batches)
        assert all(rows[s]["agent/generate_requests"] > 0 and "agent/generate_batches" not in rows[s] for s in (1, 4))
    versions = [rows[s].get("async/weight_version") for s in (1, 2, 3, 4)]
    assert versions[-1] is not None and versions[-1] >= 3, versions  # the counter continues after the resume
