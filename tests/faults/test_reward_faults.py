"""Rewards cannot stall or poison a run: a step's scoring has a budget (hung samples score 0 as timeouts, progress
is logged while it scores) and a scorer failing on most samples step after step stops the run, naming it.
The CLI runs of the same faults are in test_run_faults.py."""

import logging
import time

import pytest

from scaletrain.reward import ScoringPool, load_custom_reward_fn
from scaletrain.reward import sandbox as sandbox_module
from scaletrain.trainer.rollout.reward_guard import RewardFailureError, RewardGuard
from tests.reward.conftest import TEST_SCORERS


@pytest.fixture(scope="module")
def misbehaving():
    return load_custom_reward_fn(TEST_SCORERS, "misbehaving")


def _calls(truths):
    return [(("d", str(t), t), {}) for t in truths]


def test_step_budget_bounds_a_map_where_half_the_samples_hang(misbehaving, monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "PROGRESS_EVERY_S", 0.5)
    truths = ["1", "hang", "2", "hang", "3", "hang", "4", "hang"]
    with ScoringPool(misbehaving, num_workers=2, timeout_s=30.0) as pool:
        pool.map(_calls(["0"]))  # workers started: the budget below measures scoring only
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="scaletrain.reward.sandbox"):
            out = pool.map(_calls(truths), budget_s=2.0)
        elapsed = time.monotonic() - start
        assert elapsed < 6, f"the step budget of 2 s must bound the map ({elapsed:.1f} s)"
        assert all(o is not None for o in out)
        assert out[0].status == "ok" and out[0].value == 1.0
        for truth, outcome in zip(truths, out):
            if truth == "hang":
                assert outcome.status == "timeout" and "scoring budget of 2s" in outcome.error
        assert any("samples scored after" in r.getMessage() for r in caplog.records), "no progress while scoring"
        assert [o.status for o in pool.map(_calls(["5", "6"]))] == ["ok", "ok"]  # usable afterwards


def test_manager_counts_unscored_samples_as_timeouts(tokenizer, make_batch):
    from scaletrain.reward import build_reward_manager

    rows = [{"prompt": "1+1=", "response": "2", "ground_truth": g} for g in ["2", "hang", "2", "hang"]]
    custom = {"path": str(TEST_SCORERS), "name": "misbehaving"}
    with build_reward_manager(
        tokenizer, "naive", custom, compute_score_timeout=30, num_processes=2, step_timeout_s=2
    ) as rm:
        start = time.monotonic()
        out = rm(make_batch(rows), return_dict=True)
    assert time.monotonic() - start < 30  # includes starting the two workers
    m = out["metrics"]
    assert m["reward/timeouts"] == 2 and m["reward/errors"] == 0 and m["reward/failed_fraction"] == 0.5
    assert out["reward_extra_info"]["score"] == [1.0, 0.0, 1.0, 0.0]
    assert "scoring budget" in rm.last_error


def _metrics(errors, timeouts=0):
    return {"reward/errors": errors, "reward/timeouts": timeouts}


def test_guard_stops_after_consecutive_bad_steps_naming_the_scorer():
    guard = RewardGuard(0.5, 3, "CustomRewardFn('/r.py', 'f')", lambda: "Traceback ...\nKeyError: 'x'")
    guard.observe(1, _metrics(10), 10)
    guard.observe(2, _metrics(6), 10)
    with pytest.raises(RewardFailureError) as info:
        guard.observe(3, _metrics(4, 4), 10)
    msg = str(info.value)
    assert "CustomRewardFn('/r.py', 'f')" in msg and "3 steps in a row" in msg and "KeyError: 'x'" in msg
    assert "100%, 60%, 80%" in msg


def test_guard_resets_on_a_good_step_and_adds_up_a_steps_batches():
    guard = RewardGuard(0.5, 2, "f", lambda: None)
    guard.observe(1, _metrics(9), 10)
    guard.observe(2, _metrics(1), 10)  # a good step: the streak starts over
    guard.observe(3, _metrics(9), 10)
    guard.observe(4, _metrics(3), 10)  # two batches of step 4 (dynamic sampling): 3 + 0 of 20 fail
    guard.observe(4, _metrics(0), 10)
    guard.observe(5, _metrics(10), 10)
    guard.observe(6, {"rm/score": 1.0}, 10)  # no rule-manager metrics: not counted
    with pytest.raises(RewardFailureError, match="up to step 6"):
        guard.observe(6, _metrics(10), 10)


def test_a_reward_file_that_never_finishes_importing_fails_the_run_naming_it(ray_cluster, task, tmp_path):
    """The trainer's own load (an in-process run on the session's cluster): ``reward_model.load_timeout_s``
    bounds the file's top-level code, and the run fails naming the file instead of freezing the driver."""
    from tests.trainer.runs import run_in_process

    stuck = tmp_path / "stuck_reward.py"
    stuck.write_text("import time\nwhile True:\n    time.sleep(0.05)\n\ndef compute_score(*a, **k):\n    return 0.0\n")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"stuck_reward\.py took more than 2 s"):
        run_in_process(
            task, tmp_path / "run", 1, [f"custom_reward_function.path={stuck}", "reward_model.load_timeout_s=2"]
        )
    assert time.monotonic() - start < 120
