"""Training curves from a run's ``metrics.jsonl``: ``python -m scaletrain.plot <run dir>``.

Reads ``<run dir>/metrics.jsonl`` (written by the ``jsonl`` logger) and writes into ``<run dir>/plots/``:

- ``reward.png``: ``critic/score/mean`` (or ``critic/rewards/mean`` when there is no score)
- ``val_accuracy.png``: every ``val*`` metric ending in ``acc``, ``acc/mean`` or ``reward/mean`` (``@N`` suffix
  allowed, e.g. ``val/gsm8k/acc@4``), one line each
- ``response_length.png``: ``response_length/mean``
- ``step_time.png``: ``timing_s/step``
- ``summary.png``: the curves above side by side

A curve whose metrics are absent is skipped (and logged). The trainer calls ``plot_run(run_dir)`` at the end.
Uses matplotlib's Agg canvas through ``Figure`` directly (no pyplot, no display needed).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

Series = dict[str, tuple[list[int], list[float]]]  # metric name -> (steps, values)


def reward_keys(keys: set[str]) -> list[str]:
    return [k for k in ("critic/score/mean", "critic/rewards/mean") if k in keys][:1]


def val_keys(keys: set[str]) -> list[str]:
    """``val*`` metrics ending in ``acc``, ``acc/mean`` or ``reward/mean``, an ``@N`` suffix allowed."""
    ends = ("acc", "acc/mean", "reward/mean")
    return sorted(k for k in keys if k.startswith("val") and re.sub(r"@\d+$", "", k).endswith(ends))


# (file stem, title, y label, picks the metric names to draw from the names present)
CURVES: list[tuple[str, str, str, Callable[[set[str]], list[str]]]] = [
    ("reward", "Reward", "mean reward", reward_keys),
    ("val_accuracy", "Validation", "accuracy / reward", val_keys),
    ("response_length", "Response length", "tokens", lambda keys: [k for k in ["response_length/mean"] if k in keys]),
    ("step_time", "Step time", "seconds", lambda keys: [k for k in ["timing_s/step"] if k in keys]),
]


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; FileNotFoundError if missing, ValueError if it holds no record.

    Unreadable lines (e.g. a half-written last line after a crash) are skipped with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (a run writes it with trainer.logger including 'jsonl')")
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        else:
            bad += 1
    if bad:
        logger.warning("%s: skipped %d unreadable line(s)", path, bad)
    if not records:
        raise ValueError(f"{path} holds no metrics records")
    return records


def to_series(records: list[dict]) -> Series:
    """Per metric, its finite values in step order; a step logged twice keeps the last value."""
    by_key: dict[str, dict[int, float]] = {}
    for record in records:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                by_key.setdefault(key, {})[step] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_key.items()}


def _draw(ax, series: Series, keys: list[str], title: str, ylabel: str) -> None:
    for key in keys:
        steps, values = series[key]
        ax.plot(steps, values, marker="o" if len(steps) <= 50 else None, markersize=3, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(keys) > 1:
        ax.legend(fontsize="small")


def plot_run(run_dir: str | Path) -> list[Path]:
    """Writes the curves of ``<run_dir>/metrics.jsonl`` into ``<run_dir>/plots/``; returns the PNG paths written."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    series = to_series(read_metrics(run_dir / "metrics.jsonl"))
    present = set(series)
    curves = []
    for stem, title, ylabel, pick in CURVES:
        keys = pick(present)
        if keys:
            curves.append((stem, title, ylabel, keys))
        else:
            logger.info("plot %s skipped: none of its metrics are in %s", stem, run_dir / "metrics.jsonl")
    if not curves:
        logger.warning("no plottable metrics in %s", run_dir / "metrics.jsonl")
        return []
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, ylabel, keys in curves:
        fig = Figure(figsize=(6, 4), layout="constrained")
        _draw(fig.subplots(), series, keys, title, ylabel)
        written.append(out_dir / f"{stem}.png")
        fig.savefig(written[-1], dpi=100)
    fig = Figure(figsize=(5 * len(curves), 4), layout="constrained")
    for ax, (_, title, ylabel, keys) in zip(fig.subplots(1, len(curves), squeeze=False)[0], curves):
        _draw(ax, series, keys, title, ylabel)
    fig.suptitle(run_dir.resolve().name)
    written.append(out_dir / "summary.png")
    fig.savefig(written[-1], dpi=100)
    return written


def main(argv: list[str] | None = None) -> int:
    description = __doc__.splitlines()[0] if __doc__ else None
    parser = argparse.ArgumentParser(prog="python -m scaletrain.plot", description=description)
    parser.add_argument("run_dir", type=Path, help="a run's log dir (holding metrics.jsonl)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        paths = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        logger.error("error: %s", e)
        return 1
    for path in paths:
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
