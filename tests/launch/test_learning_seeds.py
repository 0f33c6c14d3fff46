"""launch/recipes/seeds.py on fake runs: each run's validation curve read from its metrics.jsonl (the last row of a
re-run step wins), start -> end per seed, the medians and spread, the curves' PNG."""

import json
import runpy
import subprocess
from types import SimpleNamespace

import pytest

from tests.trainer.runs import ROOT

seeds = runpy.run_path(str(ROOT / "launch" / "recipes" / "seeds.py"), run_name="seeds")
METRIC = "val/scaletrain/arithmetic/acc"


def write_run(path, points, extra_rows=()):
    path.mkdir(parents=True)
    rows = [{"step": s, METRIC: v, "val/other/acc": 0.0} for s, v in points] + list(extra_rows)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_figure_is_the_median_of_the_runs_with_their_spread(tmp_path):
    write_run(tmp_path / "seed_1", [(0, 0.2), (100, 0.5), (200, 0.4)], [{"step": 50, "actor/pg_loss": 0.1}])
    # a resumed run re-logged step 100: its last row counts
    write_run(tmp_path / "seed_2", [(0, 0.1), (100, 0.9), (100, 0.3), (200, 0.6)])
    write_run(tmp_path / "seed_3", [(0, 0.3), (100, 0.35), (200, 0.45)])
    seeds["main"](["--seeds", "1", "2", "3", "--out", str(tmp_path), "--metric", METRIC, "--report-only"])
    summary = json.loads((tmp_path / "seeds.json").read_text())
    assert summary["runs"]["2"] == {
        "start": 0.1,
        "end": 0.6,
        "gain": 0.5,
        "best": 0.6,
        "best_step": 200,
        "last_step": 200,
    }
    assert summary["runs"]["1"]["best_step"] == 100 and summary["runs"]["1"]["end"] == 0.4
    assert summary["start"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    assert summary["end"] == {"median": 0.45, "min": 0.4, "max": 0.6}
    assert summary["gain"]["median"] == pytest.approx(0.2) and summary["gain"]["max"] == pytest.approx(0.5)
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_run_without_two_validations_is_refused_naming_it(tmp_path):
    write_run(tmp_path / "seed_1", [(0, 0.2)])
    with pytest.raises(SystemExit, match=r"seed_1/metrics.jsonl: val/scaletrain/arithmetic/acc logged at 1"):
        seeds["main"](["--seeds", "1", "--out", str(tmp_path), "--metric", METRIC, "--report-only"])


def test_the_seed_and_the_run_directory_win_over_a_recipes_own(tmp_path, monkeypatch):
    """A recipe's overrides (launch/recipes/smollm2_reasoning_gym.sh's PRINT_ONLY output names its own run
    directory) go first; each run's seed and directory come last, and Hydra keeps a key's last value."""
    from tests.trainer.config.test_ppo_config import composed

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or SimpleNamespace(returncode=0))
    recipe = ["trainer.seed=9", "trainer.default_local_dir=outputs/elsewhere", "data.train_batch_size=4"]
    seeds["run_seed"](2, tmp_path, recipe)
    (cmd,) = calls
    assert cmd[1:3] == ["-m", "scaletrain.trainer.main_ppo"]
    trainer = composed(*cmd[3:])["trainer"]
    assert (trainer["seed"], trainer["default_local_dir"]) == (2, str(tmp_path / "seed_2"))
