"""`make bench-peers`: our code vs verl 0.9.1 (and TRL, when trl_step.py is there), side by side, one table.

    .venv/bin/python benchmarks/peers/run.py [--quick] [--docs]

Runs each side of each comparison as its own subprocess: ours with .venv's python, the peer with .venv-peers'
(benchmarks/peers/setup_venv.sh builds it), on the same shapes with one torch thread. The sides print
``BENCH_JSON`` lines; this driver pairs them, checks that both sides' algorithm outputs agree (1e-4), prints one
table of ours / peer ratios against the targets (benchmarks/peers/table.py), emits the project's ``BENCH_JSON``
line (baseline_name "verl 0.9.1") and, with --docs, rewrites docs/performance.md between the peers markers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit_results  # noqa: E402
from benchmarks.peers import table  # noqa: E402
from benchmarks.run_all import machine_info, parse_output, run_group  # noqa: E402

TOLERANCE = 1e-4
PEER_PACKAGES = ("verl", "tensordict", "trl")
# glibc keeps freed heap memory for reuse (no page faults on the next allocation) or hands it back to the kernel
# (a fault per 4 KiB page on the next one) depending on the order of earlier frees, so two processes timing the same
# op on 112 MiB of rows measured 3-14x apart on allocator luck alone (repeat(4) of the batch: 25 ms warm, 435 ms
# faulting). Both sides run with the same fixed policy, memory kept for reuse, so a ratio compares the code.
SIDE_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def run_side(python: Path, script: str, args: list[str], timeout: float) -> dict:
    """One side's subprocess (its own process group, killed whole on timeout): status, rows, output tail."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **SIDE_MALLOC_ENV}
    cmd = [str(python), str(PEERS_DIR / script), *args]
    status, output, _, seconds = run_group(cmd, ROOT, env, timeout)
    rows = parse_output(output)
    tail = "\n".join(output.splitlines()[-15:])
    print(f"[peers] {python.parent.parent.name} {script}: {status}, {seconds:.0f} s", flush=True)
    if status != "ok":
        print(tail, flush=True)
    return {"status": status, "rows": rows}


def output_notes(out_dir: Path) -> dict:
    """Measure -> 'same numbers' / 'DIFFER' note from both sides' saved algorithm outputs."""
    import torch

    paths = [out_dir / "ours_algos.pt", out_dir / "verl_algos.pt"]
    if not all(p.exists() for p in paths):
        return {}
    ours, verl = (torch.load(p) for p in paths)
    notes = {}
    for measure, tensors in ours.items():
        other = verl.get(measure, [])
        if len(other) != len(tensors) or any(a.shape != b.shape for a, b in zip(tensors, other)):
            notes[measure] = "outputs DIFFER in shape"
            continue
        diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(tensors, other))
        agree = all(torch.allclose(a, b, atol=TOLERANCE, rtol=TOLERANCE) for a, b in zip(tensors, other))
        notes[measure] = f"{'same numbers' if agree else 'outputs DIFFER'} (max |diff| {diff:.1e})"
    return notes


def side_note(res: dict, who: str) -> str:
    return "" if res["status"] == "ok" else f"{who} side {res['status']}"


def compare(script: str, pythons: dict, quick: bool, timeout: float, extra: list[str]) -> tuple[dict, dict]:
    flags = (["--quick"] if quick else []) + extra
    return (
        run_side(pythons["ours"], script, ["--impl", "ours", *flags], timeout),
        run_side(pythons["verl"], script, ["--impl", "verl", *flags], timeout),
    )


def peer_rows(ours: dict, verl: dict, notes: dict) -> list[dict]:
    failed = "; ".join(n for n in (side_note(ours, "ours"), side_note(verl, "verl")) if n)
    rows = table.pair_rows(ours["rows"], verl["rows"], table.VERL_NAME, notes)
    for r in rows:
        r["note"] = "; ".join(n for n in (r["note"], failed) if n)
    return rows


def trl_rows(peers_python: Path, quick: bool, timeout: float) -> tuple[list[dict], str]:
    """trl_step.py's rows (it reports ours and TRL's figures itself); skipped with a note while it is missing."""
    if not (PEERS_DIR / "trl_step.py").exists():
        return [], "benchmarks/peers/trl_step.py is not there yet: TRL rows skipped"
    # --ours: trl_step.py also runs benchmarks/e2e_step.py in .venv at the same shape, so its rows carry the ratio
    res = run_side(peers_python, "trl_step.py", ["--ours", *(["--quick"] if quick else [])], timeout)
    note = "" if res["status"] == "ok" and res["rows"] else f"trl_step.py: {res['status']}, {len(res['rows'])} rows"
    return table.extra_rows(res["rows"]), note


def peer_versions(peers_python: Path) -> dict:
    code = f"import json, importlib.metadata as m\nprint(json.dumps({{p: m.version(p) for p in {PEER_PACKAGES!r}}}))"
    try:
        out = subprocess.run([str(peers_python), "-c", code], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def build_rows(pythons: dict, quick: bool, timeout: float) -> tuple[list[dict], list[str]]:
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        rows = peer_rows(*compare("dataproto_side.py", pythons, quick, timeout, []), {})
        ours, verl = compare("algos_side.py", pythons, quick, timeout, ["--out-dir", tmp])
        rows += peer_rows(ours, verl, output_notes(Path(tmp)))
    extra, note = trl_rows(pythons["verl"], quick, timeout)
    return rows + extra, [note] if note else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke test")
    parser.add_argument(
        "--docs", "--readme", dest="readme", action="store_true", help="rewrite docs/performance.md's peers table"
    )
    parser.add_argument(
        "--docs-path",
        "--readme-path",
        dest="readme_path",
        type=Path,
        default=ROOT / "docs" / "performance.md",
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per side (default 600 quick, 1800)")
    parser.add_argument("--ours-python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    parser.add_argument("--peers-python", type=Path, default=ROOT / ".venv-peers" / "bin" / "python")
    args = parser.parse_args(argv)
    if not args.peers_python.exists():
        print(f"{args.peers_python} missing: run benchmarks/peers/setup_venv.sh (make bench-peers does)")
        return 1
    timeout = args.timeout or (600.0 if args.quick else 1800.0)
    rows, notes = build_rows({"ours": args.ours_python, "verl": args.peers_python}, args.quick, timeout)

    print("\nours vs the peers, ratio = ours / peer (lower is better); " + table.summary(rows))
    print(table.format_table(rows))
    for note in notes:
        print(f"note: {note}")
    emit_results(rows)
    if args.readme:
        info = {
            "machine": machine_info(),
            "peers": peer_versions(args.peers_python),
            "quick": args.quick,
            "notes": notes,
        }
        info["date"] = date.today().isoformat()
        args.readme_path.write_text(table.update_readme(args.readme_path.read_text(), table.readme_section(rows, info)))
        print(f"updated the peers section of {args.readme_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
