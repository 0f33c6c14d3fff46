"""The timed worker pool: errors and timeouts per call, hung workers killed (with their children) and
replaced, results in order, the pool reusable afterwards."""

import os
import time

import pytest

from scaletrain.reward import ScoringPool, load_custom_reward_fn


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
