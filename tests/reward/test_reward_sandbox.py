"""The timed worker pool: errors and timeouts per call, hung workers killed (with their children) and
replaced, results in order, the pool reusable afterwards."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from scaletrain.reward import ScoringPool, load_custom_reward_fn
from tests.reward.conftest import TEST_SCORERS


@pytest.fixture
def misbehaving(test_scorers_path):
    return load_custom_reward_fn(test_scorers_path, "misbehaving")


def _calls(truths):
    return [(("d", str(t), t), {}) for t in truths]


def test_map_statuses_in_order(misbehaving):
    with ScoringPool(misbehaving, num_workers=2, timeout_s=1.0) as pool:
        start = time.monotonic()
        out = pool.map(_calls(["1", "hang", "boom", "2", "die", "hang", "3"]))
        elapsed = time.monotonic() - start
        assert [o.status for o in out] == ["ok", "timeout", "error", "ok", "error", "timeout", "ok"]
        assert [o.value for o in out if o.status == "ok"] == [1.0, 1.0, 1.0]
        assert "scorer exploded" in out[2].error and "exit code 3" in out[4].error
        assert elapsed < 15, f"hung calls must not stall the batch ({elapsed:.1f}s)"
        assert pool.restarts == 3  # two timeouts + one death
        assert [o.status for o in pool.map(_calls(["5", "6"]))] == ["ok", "ok"]  # still usable


def test_timeout_kills_grandchildren(test_scorers_path, tmp_path):
    pid_file = tmp_path / "pid"
    fn = load_custom_reward_fn(test_scorers_path, "hang_with_child")
    with ScoringPool(fn, timeout_s=1.0) as pool:
        (out,) = pool.map([((str(pid_file),), {})])
    assert out.status == "timeout"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        if state in ("gone", "Z", "X"):
            break
        time.sleep(0.05)
    assert state in ("gone", "Z", "X"), f"grandchild {pid} still running (state {state})"


def test_unpicklable_function_is_rejected_early():
    with pytest.raises(TypeError, match="load_custom_reward_fn"):
        ScoringPool(lambda *a: 1.0)


def test_worker_that_cannot_load_raises(tmp_path):
    f = tmp_path / "gone.py"
    f.write_text("def compute_score(*a):\n    return 1.0\n")
    pool = ScoringPool(load_custom_reward_fn(f), timeout_s=1.0)
    os.remove(f)  # the worker reloads by path and fails
    with pool, pytest.raises(RuntimeError, match="gone.py"):
        pool.map(_calls(["1"]))


def test_closed_pool_refuses(misbehaving):
    pool = ScoringPool(misbehaving)
    pool.map(_calls(["1"]))
    workers = [w.process for w in pool._workers]
    pool.close()
    assert all(not p.is_alive() for p in workers)
    with pytest.raises(RuntimeError, match="closed"):
        pool.map(_calls(["1"]))


GROUP_SIGNALLED = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    from scaletrain.reward import ScoringPool, load_custom_reward_fn

    caught = []
    signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))  # the driver's preemption handler
    fn = load_custom_reward_fn(sys.argv[1], "misbehaving")
    with ScoringPool(fn, num_workers=2, timeout_s=30) as pool:
        pool.map([(("d", "1", "1"), {})])  # the workers (and the fork server) are up
        # as `kill -TERM -PGID` sends it, one second into a map of 2 s calls
        threading.Timer(1.0, os.killpg, (0, signal.SIGTERM)).start()
        out = pool.map([(("d", "", "slow"), {})] * 2)
        print(json.dumps({"statuses": [o.status for o in out], "errors": [o.error for o in out],
                          "restarts": pool.restarts, "caught": len(caught)}))
    """
)


def test_a_preemption_signal_to_the_process_group_does_not_stop_the_scoring():
    """Fault: the run's process group gets SIGTERM (a preemption) while the step's rewards are scored; the driver
    handles it and finishes the step (preemption.py), so the scoring must finish too (before: the fork server, in
    the driver's group, died, its workers with it, and the calls in flight scored 0 as errors)."""
    proc = subprocess.run(
        [sys.executable, "-c", GROUP_SIGNALLED, str(TEST_SCORERS)],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # the group signalled is this script's alone
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["caught"] == 1  # the signal did reach the group
    assert report["statuses"] == ["ok", "ok"] and report["restarts"] == 0, report
