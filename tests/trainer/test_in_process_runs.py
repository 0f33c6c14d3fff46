"""``main_ppo.run(overrides)``: the command line's run inside the caller's process, on the Ray cluster it is
connected to (here the session's, shared by every in-process run of the suite).

Isolation between runs: each run frees its worker actors and placement groups when it ends, as it returns or as
it raises, so the next run in the same process finds the cluster as it was; the process stays connected to the
cluster (a cluster the run did not start is not shut down).
"""

import time
from pathlib import Path

import pytest

from tests.ray_state import alive_actors, placed_groups
from tests.trainer.runs import metrics, run_in_process

pytestmark = pytest.mark.slow

QUIET = ["trainer.val_before_train=false", "trainer.plot_at_end=false"]


def cluster_as(before: tuple[dict, dict], within_s: float = 30.0) -> tuple[dict, dict]:
    """The cluster's alive actors and placement groups once they are back to ``before`` (a kill takes effect
    asynchronously), or what is left after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        now = alive_actors(), placed_groups()
        if now == before or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def test_a_run_in_process_returns_its_result_and_frees_what_it_placed(ray_cluster, task, tmp_path):
    before = alive_actors(), placed_groups()
    first = run_in_process(task, tmp_path / "first", 2, QUIET)
    assert first.steps == 2 and Path(first.run_dir) == (tmp_path / "first").resolve()
    assert first.checkpoint == str(Path(first.run_dir) / "global_step_2")
    assert Path(first.hf_checkpoint, "config.json").exists() and first.preempted is None
    logged = metrics(first.run_dir)
    assert first.metrics["actor/pg_loss"] == logged[2]["actor/pg_loss"]  # the last step's, as logged
    assert first.val_metrics["val/scaletrain/arithmetic/acc"] == logged[2]["val/scaletrain/arithmetic/acc"]
    assert cluster_as(before) == before, "the run left actors or placement groups on the cluster"

    second = run_in_process(task, tmp_path / "second", 1, QUIET)  # same process, same cluster
    assert second.steps == 1 and sorted(metrics(second.run_dir)) == [1]
    assert cluster_as(before) == before
    assert ray_cluster.is_initialized(), "a cluster the run did not start stays connected"


def test_a_failed_run_frees_its_workers_too(ray_cluster, task, tmp_path):
    before = alive_actors(), placed_groups()
    reward = tmp_path / "broken.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    1 / 0\n")
    broken = [f"custom_reward_function.path={reward}", "reward_model.max_error_steps=1"]  # stop at the 1st step
    with pytest.raises(Exception, match="failed on more than 50%"):
        run_in_process(task, tmp_path / "run", 2, [*QUIET, *broken])
    assert cluster_as(before) == before, "the failed run left actors or placement groups on the cluster"
