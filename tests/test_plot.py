"""scaletrain.plot: PNG curves from a run's metrics.jsonl, skipping absent metrics, clear errors otherwise."""

import json
import logging

import pytest

pytest.importorskip("matplotlib")

from scaletrain.plot import main, plot_run, read_metrics, val_keys  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def full_records(n=12):
    records = [{"step": 0, "val/gsm8k/acc": 0.1, "val/math/reward/mean": 0.2, "val/gsm8k/acc@4": 0.3}]
    for step in range(1, n + 1):
        records.append(
            {
                "step": step,
                "critic/score/mean": step / n,
                "response_length/mean": 100 + 3 * step,
                "timing_s/step": 2.0 + 0.1 * step,
                "actor/pg_loss": 0.01,
            }
        )
        if step % 4 == 0:
            records.append({"step": step, "val/gsm8k/acc": step / n, "val/math/reward/mean": step / (2 * n)})
    return records


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 5000, path


def test_plot_run_writes_every_curve_and_summary(tmp_path):
    run_dir = write_run(tmp_path / "run", full_records())
    paths = plot_run(run_dir)
    names = [p.name for p in paths]
    assert names == ["reward.png", "val_accuracy.png", "response_length.png", "step_time.png", "summary.png"]
    for path in paths:
        assert path.parent == run_dir / "plots"
        assert_png(path)
    assert val_keys(set(full_records()[0])) == ["val/gsm8k/acc", "val/gsm8k/acc@4", "val/math/reward/mean"]


def test_absent_metrics_are_skipped_and_logged(tmp_path, caplog):
    run_dir = write_run(tmp_path / "run", [{"step": s, "critic/rewards/mean": s * 0.1} for s in range(1, 6)])
    with caplog.at_level(logging.INFO, logger="scaletrain.plot"):
        paths = plot_run(run_dir)
    assert [p.name for p in paths] == ["reward.png", "summary.png"]
    assert all(p.exists() for p in paths)
    skipped = " ".join(r.getMessage() for r in caplog.records)
    for stem in ("val_accuracy", "response_length", "step_time"):
        assert f"plot {stem} skipped" in skipped


def test_missing_or_empty_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file at .*metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics records"):
        plot_run(tmp_path)


def test_half_written_line_is_skipped(tmp_path):
    run_dir = write_run(tmp_path, [{"step": 1, "x": 1.0}])
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "x"')
    assert read_metrics(run_dir / "metrics.jsonl") == [{"step": 1, "x": 1.0}]


def test_cli(tmp_path, caplog):
    run_dir = write_run(tmp_path / "run", full_records(4))
    assert main([str(run_dir)]) == 0
    assert (run_dir / "plots" / "summary.png").exists()
    assert main([str(tmp_path / "missing")]) == 1
