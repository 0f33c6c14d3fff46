"""Tracking: each logger backend writes what it should, offline, and leaves no process behind."""

import json
import sys
import time

import numpy as np
import psutil
import pytest

from scaletrain.trainer.run.mlflow_logger import flatten_config, mlflow_safe_name
from scaletrain.trainer.run.tracking import LoggerBackend, Tracking, format_console_line, register_logger

METRICS = {
    "critic/score/mean": 0.5,
    "val/gsm8k/acc": np.float32(0.25),
    "response_length/mean": np.int64(123),
    "actor/pg_loss": -0.0125,
    "actor/entropy": 1.5,
    "timing_s/step": 2.0,
    "perf/throughput": 1000.0,
    "val/gsm8k/acc@4": 0.75,
}
CONFIG = {"trainer": {"total_epochs": 2, "logger": ["console", "jsonl"]}, "actor": {"lr": 1e-6}, "note": "x" * 900}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_jsonl_one_line_per_step_with_every_metric_as_float(tmp_path):
    torch = pytest.importorskip("torch")
    with Tracking("proj", "exp", ["jsonl"], tmp_path) as tracking:
        tracking.log(METRICS, step=1)
        tracking.log({"critic/score/mean": torch.tensor(0.75), "bad": "text"}, step=2)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0] == {"step": 1, **{k: float(v) for k, v in METRICS.items()}}
    assert records[1] == {"step": 2, "critic/score/mean": 0.75}  # the string metric is dropped


def test_jsonl_resume_drops_steps_from_resume_step(tmp_path):
    with Tracking("proj", "exp", "jsonl", tmp_path) as tracking:
        for step in range(1, 6):
            tracking.log({"x": step}, step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x"')  # a half-written line from a crash
    with Tracking("proj", "exp", ["jsonl"], tmp_path, resume_step=4) as tracking:
        tracking.log({"x": 40}, step=4)
        tracking.log({"x": 50}, step=5)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in records] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]


def test_console_prints_compact_line_per_step(tmp_path, capsys):
    with Tracking("proj", "exp", ["console"], tmp_path, total_steps=10) as tracking:
        tracking.log(METRICS, step=3)
        tracking.log({"critic/score/mean": 0.6, "other/metric": 1.0}, step=4)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 3/10 | score 0.5 | val/gsm8k/acc 0.25 | val/gsm8k/acc@4 0.75 | resp_len 123 | pg_loss -0.0125"
        " | entropy 1.5 | step_s 2 | tput 1000",
        "step 4/10 | score 0.6",
    ]
    assert format_console_line({}, 7) == "step 7"
    line = format_console_line({"val-core/a/acc/mean@1": 0.5, "val/a/reward/mean": 0.1, "validity": 1.0}, 1)
    assert line == "step 1 | val-core/a/acc/mean@1 0.5"


def test_unknown_logger_raises_listing_known_ones(tmp_path):
    known = r"registered: console, jsonl, .*mlflow, tensorboard, wandb"
    with pytest.raises(ValueError, match=rf"unknown logger 'nope'; {known}"):
        Tracking("proj", "exp", ["jsonl", "nope"], tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing started before the names were checked


@register_logger("memory-for-tests")
class MemoryLogger(LoggerBackend):
    records = []

    def log(self, metrics, step):
        self.records.append((self.run.experiment_name, step, metrics))


def test_user_registered_logger(tmp_path):
    with Tracking("proj", "mine", ["memory-for-tests"], tmp_path) as tracking:
        tracking.log({"a": np.float64(1.5)}, step=1)
    assert MemoryLogger.records[-1] == ("mine", 1, {"a": 1.5})


def test_missing_package_names_it_and_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    hint = r"'wandb' logger needs the 'wandb' package.*pip install scaletrain\[loggers\]"
    with pytest.raises(ImportError, match=hint):
        Tracking("proj", "exp", ["wandb"], tmp_path)


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking("proj", "exp", ["tensorboard"], tmp_path, config=CONFIG) as tracking:
        tracking.log(METRICS, step=1)
        tracking.log({"critic/score/mean": 0.75}, step=2)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scores = events.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in scores] == [(1, 0.5), (2, 0.75)]
    assert "val/gsm8k/acc@4" in events.Tags()["scalars"]


def test_wandb_offline_writes_run_and_leaves_no_process(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default must be offline
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    before = children()
    with Tracking("proj", "exp", ["wandb"], tmp_path, config=CONFIG) as tracking:
        tracking.log(METRICS, step=1)
        tracking.log({"critic/score/mean": 0.75}, step=2)
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    data = run_files[0].read_bytes()
    assert b"critic/score/mean" in data and b"total_epochs" in data
    deadline = time.time() + 10
    while children() - before and time.time() < deadline:
        time.sleep(0.1)
    assert not children() - before, "wandb left a child process running"


def test_mlflow_local_store_metrics_and_params_read_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Tracking("proj", "exp", ["mlflow"], tmp_path, config=CONFIG) as tracking:
        tracking.log(METRICS, step=1)
        tracking.log({"critic/score/mean": 0.75}, step=2)
        uri, run_id = tracking.backends["mlflow"].tracking_uri, tracking.backends["mlflow"].run_id
    assert uri.startswith("sqlite:///") and (tmp_path / "mlruns" / "mlflow.db").is_file()
    client = MlflowClient(uri)
    history = client.get_metric_history(run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    run = client.get_run(run_id)
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.metrics["val/gsm8k/acc_at_4"] == 0.75
    assert run.data.params["trainer.total_epochs"] == "2"
    assert run.data.params["trainer.logger"] == "['console', 'jsonl']"
    assert len(run.data.params["note"]) == 500
    # a resumed run continues the same MLflow run
    with Tracking("proj", "exp", ["mlflow"], tmp_path, config=CONFIG, resume_step=3) as tracking:
        assert tracking.backends["mlflow"].run_id == run_id
        tracking.log({"critic/score/mean": 1.0}, step=3)
    assert [m.step for m in client.get_metric_history(run_id, "critic/score/mean")] == [1, 2, 3]


def test_mlflow_names_and_params():
    assert mlflow_safe_name("val/gsm8k/acc@4") == "val/gsm8k/acc_at_4"
    assert mlflow_safe_name("/a//b/./c:d(e)") == "a/b/_/c_d_e_"
    assert mlflow_safe_name("@") == "_at_" and mlflow_safe_name("//") == "_"
    assert flatten_config({"a": {"b": {"c": 1}, "d": []}, "e": {}}) == {"a.b.c": "1", "a.d": "[]", "e": "{}"}
