"""Run every benchmark script, collect their results, and write a table, a JSON file and a chart.

    python -m benchmarks --quick              # every benchmarks/*.py with --quick, one subprocess each
    python -m benchmarks --quick --docs       # ... and rewrite docs/performance.md's generated table
    python benchmarks/run_all.py --only algos dispatch --timeout 120

Each script prints its own table plus one ``BENCH_JSON {...}`` line (``benchmarks.common.emit_results``); this
runner reads those lines. Every figure is measured in the same run as its baseline, so ratios compare like with
like on whatever machine runs this. A script that fails, times out or prints no results shows up as such in
the table; it never stops the other scripts.

Writes ``benchmarks/results/results.json`` and ``benchmarks/results/ratios.png`` (ours / baseline per measure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"common", "e2e_limit", "multirank", "run_all", "__init__", "__main__"}  # helpers, not scripts
MARKER = "BENCH_JSON "
PERF_START, PERF_END = "<!-- perf:start -->", "<!-- perf:end -->"
PERF_PAGE = "docs/performance.md"  # the page whose generated table --docs rewrites, from the project root
# scripts left out of --quick runs unless named with --only (empty: every script has a quick size that fits)
QUICK_SKIP: set[str] = set()


QUICK_NOTE = "Quick sizes: small batches and models, so fixed costs weigh more than at full size. "


def discover(bench_dir: Path) -> list[Path]:
    return sorted(p for p in bench_dir.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def parse_output(text: str) -> list[dict]:
    """All result rows from the ``BENCH_JSON`` lines of one script's output (malformed lines are skipped)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith(MARKER):
            continue
        try:
            rows += json.loads(line[len(MARKER) :])["rows"]
        except (ValueError, KeyError, TypeError):
            continue
    return rows


def run_group(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[str, str, int | None, float]:
    """Run ``cmd`` in its own process group; on timeout the whole group (Ray, spawned ranks) is killed.
    Returns (status, output, return code, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        status = f"timed out after {timeout:g} s"
    return status, output or "", proc.returncode, time.perf_counter() - start


def run_script(path: Path, quick: bool, timeout: float, cwd: Path) -> dict:
    """Run one benchmark script (run_group) and parse its rows."""
    cmd = [sys.executable, str(path)] + (["--quick"] if quick else [])
    status, output, returncode, seconds = run_group(cmd, cwd, {**os.environ, "PYTHONUNBUFFERED": "1"}, timeout)
    rows = parse_output(output)
    if status == "ok" and not rows:
        status = "no results"
    return {
        "script": path.stem,
        "status": status,
        "returncode": returncode,
        "seconds": round(seconds, 1),
        "rows": rows,
        "output_tail": "\n".join((output or "").splitlines()[-20:]),
    }


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def table_rows(results: list[dict]) -> list[dict]:
    """One row per measure; a script without results gives one row carrying its status."""
    out = []
    for res in results:
        if not res["rows"]:
            out.append(
                {
                    "script": res["script"],
                    "measure": "-",
                    "ours": None,
                    "baseline": None,
                    "baseline_name": "",
                    "ratio": None,
                    "unit": "",
                    "status": res["status"],
                }
            )
        for row in res["rows"]:
            out.append({"script": res["script"], **row, "status": res["status"]})
    return out


def _num(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.2f}"


def format_table(rows: list[dict]) -> str:
    lines = [f"{'script':<20}{'measure':<46}{'ours':>12}{'baseline':>12}{'ratio':>8}  {'unit':<6} status / baseline"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        note = (
            r["status"] if r["status"] != "ok" else (r.get("baseline_name") or "") if r["baseline"] is not None else ""
        )
        lines.append(
            f"{r['script']:<20}{r['measure'][:45]:<46}{_num(r['ours']):>12}{_num(r['baseline']):>12}"
            f"{ratio:>8}  {r.get('unit', ''):<6} {note}"
        )
    return "\n".join(lines)


def machine_info() -> dict:
    info = {"cpu_cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:  # noqa: BLE001 - torch missing only matters for the description
        info["torch"] = "not installed"
    info["gpu"] = "present (nvidia-smi found)" if shutil.which("nvidia-smi") else "none"
    return info


def write_results(results: list[dict], out_dir: Path, quick: bool) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "machine": machine_info(),
        "scripts": [{k: v for k, v in r.items() if k != "rows"} for r in results],
        "rows": table_rows(results),
    }
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def plot_ratios(rows: list[dict], path: Path) -> bool:
    """Horizontal bars of ours / baseline (1.0 = parity, lower is faster). False when nothing to plot."""
    pairs = [(f"{r['script']}: {r['measure']}", r["ratio"]) for r in rows if r["ratio"] is not None]
    if not pairs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.32 * len(pairs) + 1.2))
    labels, ratios = zip(*pairs)
    ax.barh(range(len(pairs)), ratios, color=["tab:green" if r <= 1.0 else "tab:orange" for r in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(pairs)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ours / baseline (log scale; < 1 is faster than the baseline)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def readme_section(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        PERF_START,
        "## The benchmarks, side by side with their baselines",
        "",
        f"Generated by `python -m benchmarks{' --quick' if doc['quick'] else ''} --docs` on {doc['created'][:10]}: "
        f"{m.get('cpu_cores')} CPU cores ({m.get('cpu_model', 'unknown CPU')}), {m.get('ram_gib', '?')} GiB RAM, "
        f"torch {m.get('torch')}, GPU: {m.get('gpu')}. Each baseline is measured in the same run; "
        "ratio = ours / baseline (lower is better for times). "
        f"{QUICK_NOTE if doc['quick'] else ''}"
        "Chart: `benchmarks/results/ratios.png`; raw figures: `benchmarks/results/results.json`.",
        "",
        "| script | measure | ours | baseline | ratio | unit | baseline / status |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in doc["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        note = (
            r["status"] if r["status"] != "ok" else (r.get("baseline_name") or "") if r["baseline"] is not None else ""
        )
        lines.append(
            f"| {r['script']} | {r['measure']} | {_num(r['ours'])} | {_num(r['baseline'])} | {ratio} "
            f"| {r.get('unit', '')} | {note} |"
        )
    lines.append(PERF_END)
    return "\n".join(lines)


def update_readme(readme: Path, section: str) -> None:
    """Replace the text between the perf markers, or append the section at the end when they are absent."""
    text = readme.read_text() if readme.exists() else ""
    start, end = text.find(PERF_START), text.find(PERF_END)
    if start != -1 and end > start:
        text = text[:start] + section + text[end + len(PERF_END) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per script (default 300 quick, 1800)")
    parser.add_argument("--only", nargs="*", default=None, help="script names to run (default: all)")
    parser.add_argument("--skip", nargs="*", default=[], help="script names to leave out")
    parser.add_argument(
        "--docs", "--readme", dest="readme", action="store_true", help="rewrite docs/performance.md's table"
    )
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: <bench dir>/results")
    parser.add_argument(
        "--docs-path", "--readme-path", dest="readme_path", type=Path, default=None, help=f"default: {PERF_PAGE}"
    )
    args = parser.parse_args(argv)
    bench_dir = args.bench_dir.resolve()
    out_dir = args.out_dir or bench_dir / "results"
    timeout = args.timeout or (300.0 if args.quick else 1800.0)

    scripts = discover(bench_dir)
    if args.only:
        scripts = [p for p in scripts if p.stem in args.only]
    skip = set(args.skip) | (QUICK_SKIP if args.quick and not args.only else set())
    scripts = [p for p in scripts if p.stem not in skip]

    results = []
    for path in scripts:
        print(f"[run_all] {path.stem} ...", flush=True)
        res = run_script(path, args.quick, timeout, cwd=bench_dir.parent)
        print(f"[run_all] {path.stem}: {res['status']} in {res['seconds']} s, {len(res['rows'])} rows", flush=True)
        if res["status"] != "ok":
            print(res["output_tail"], flush=True)
        results.append(res)

    doc = write_results(results, out_dir, args.quick)
    print("\n" + format_table(doc["rows"]))
    if plot_ratios(doc["rows"], out_dir / "ratios.png"):
        print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'ratios.png'}")
    if args.readme:
        page = args.readme_path or bench_dir.parent / PERF_PAGE
        update_readme(page, readme_section(doc))
        print(f"updated the generated table of {page}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH_DIR.parent))
    sys.exit(main())
