"""A learning figure over several seeds: the trainer run once per seed, each run's held-out accuracy start -> end,
their median and spread, and every run's curve in one PNG (the measurement behind the README's learning figures).

    python launch/recipes/seeds.py --seeds 1 2 3 --out outputs/seeds/fsdp
    python launch/recipes/seeds.py --seeds 1 2 3 --out outputs/seeds/deepspeed -- backend=deepspeed
    python launch/recipes/seeds.py --out outputs/seeds/smollm2 --title "SmolLM2 recipe" \
        -- $(PRINT_ONLY=1 launch/recipes/smollm2_reasoning_gym.sh)

Each run is ``python -m scaletrain.trainer.main_ppo`` with the overrides after ``--`` (none: the embedded default,
as ``make run`` trains it; its SFT warm-up is cached per seed and backend, so a new seed pays it once), then
``trainer.seed=S trainer.default_local_dir=OUT/seed_S``, which win over a recipe's own seed and run directory.
The runs go one after another (each uses the machine's cores). The held-out
figure is the first validation metric the runs share (``--metric`` names another), read from each run's
``metrics.jsonl``: start = the first validation, end = the last. Prints a table and one summary line, writes
``OUT/seeds.json`` and ``OUT/curves.png``. A documented learning figure is the median of the runs this names,
never one run's best.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path


def validation_curve(metrics_file: Path, metric: str | None) -> tuple[str, list[tuple[int, float]]]:
    """(the metric, [(step, value)]) of one run's validations, in step order; the last row of a step wins (a resumed
    run re-logs the steps it re-ran)."""
    rows: dict[int, dict] = {}
    for line in metrics_file.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    if metric is None:
        names = sorted({k for row in rows.values() for k in row if k.startswith("val/") and k.endswith("/acc")})
        if not names:
            raise SystemExit(f"{metrics_file}: no validation accuracy (val/.../acc) logged; name one with --metric")
        metric = names[0]
    curve = [(step, float(row[metric])) for step, row in sorted(rows.items()) if metric in row]
    if len(curve) < 2:
        raise SystemExit(f"{metrics_file}: {metric} logged at {len(curve)} validation(s); start -> end needs two")
    return metric, curve


def summarize(curves: dict[int, list[tuple[int, float]]]) -> dict:
    """Per seed start, end, gain, best; the medians and the spread (min, max) of start, end and gain."""
    runs = {}
    for seed, curve in curves.items():
        best_step, best = max(curve, key=lambda point: point[1])
        runs[seed] = {"start": curve[0][1], "end": curve[-1][1], "gain": curve[-1][1] - curve[0][1]}
        runs[seed].update(best=best, best_step=best_step, last_step=curve[-1][0])
    summary = {"runs": runs}
    for key in ("start", "end", "gain"):
        values = [run[key] for run in runs.values()]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return summary


def plot(curves: dict[int, list[tuple[int, float]]], metric: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for seed, curve in sorted(curves.items()):
        ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", markersize=3, label=f"seed {seed}")
    ax.set(xlabel="step", ylabel=metric, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_seed(seed: int, out: Path, overrides: list[str]) -> float:
    """One run of the trainer with this seed; its wall-clock seconds. Its console goes to OUT/seed_S.log."""
    run_dir = out / f"seed_{seed}"
    # the seed and the run directory last: Hydra's later value of a key wins over a recipe's own
    cmd = [sys.executable, "-m", "scaletrain.trainer.main_ppo", *overrides]
    cmd += [f"trainer.seed={seed}", f"trainer.default_local_dir={run_dir}"]
    print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    with open(out / f"seed_{seed}.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: the run exited {done.returncode}; see {out / f'seed_{seed}.log'}")
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, required=True, help="one run directory per seed under it")
    parser.add_argument("--metric", help="the validation metric (default: the first val/.../acc logged)")
    parser.add_argument("--report-only", action="store_true", help="summarize the runs already under --out")
    parser.add_argument("--title", help="the PNG's title (default: the overrides, or 'embedded default')")
    parser.add_argument("overrides", nargs="*", help="trainer overrides for every run (after --)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wall = {}
    earlier = args.out / "seeds.json"
    if args.report_only and earlier.exists():  # the wall times the runs were measured with
        wall = {int(seed): s for seed, s in json.loads(earlier.read_text()).get("wall_s", {}).items()}
    for seed in args.seeds:
        if not args.report_only:
            wall[seed] = round(run_seed(seed, args.out, args.overrides), 1)
    curves, metric = {}, args.metric
    for seed in args.seeds:
        metric, curves[seed] = validation_curve(args.out / f"seed_{seed}" / "metrics.jsonl", metric)
    summary = summarize(curves)
    summary.update(metric=metric, overrides=args.overrides, wall_s=wall, date=date.today().isoformat())
    print(f"{'seed':>6} {'start':>7} {'end':>7} {'gain':>7} {'best (step)':>13} {'wall s':>7}")
    for seed, run in summary["runs"].items():
        best = f"{run['best']:.3f} ({run['best_step']})"
        print(
            f"{seed:>6} {run['start']:7.3f} {run['end']:7.3f} {run['gain']:+7.3f} {best:>13} {wall.get(seed, '-'):>7}"
        )
    spread = {key: summary[key] for key in ("start", "end", "gain")}
    print(
        f"{metric} over {len(curves)} seeds (median, min to max): "
        + ", ".join(f"{key} {v['median']:.3f} ({v['min']:.3f} to {v['max']:.3f})" for key, v in spread.items())
    )
    (args.out / "seeds.json").write_text(json.dumps(summary, indent=1))
    title = args.title or " ".join(args.overrides) or "embedded default"
    plot(curves, metric, args.out / "curves.png", f"{title}: {len(curves)} seeds")
    print(f"wrote {args.out / 'seeds.json'} and {args.out / 'curves.png'}")


if __name__ == "__main__":
    main()
