"""benchmarks/run_all.py on fake benchmark scripts: discovery, parsing, failure reporting, JSON, chart, README."""

from __future__ import annotations

import json
import textwrap

from benchmarks import run_all

GOOD = """
import json, sys
print("a human-readable table")
rows = [{"measure": "fast op", "ours": 2.0, "baseline": 4.0, "baseline_name": "loop", "ratio": 0.5, "unit": "ms"},
        {"measure": "no baseline", "ours": 7.0, "baseline": None, "baseline_name": "", "ratio": None, "unit": "ms"}]
print("BENCH_JSON " + json.dumps({"rows": rows}))
print("quick" if "--quick" in sys.argv else "full")
"""
BAD = """
print("BENCH_JSON {not json")
raise SystemExit(3)
"""
SLOW = """
import time
time.sleep(120)
"""


def _fake_dir(tmp_path, scripts):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    for name in ("common", "multirank", "__init__", "__main__", "run_all"):
        (bench / f"{name}.py").write_text("raise SystemExit('must not run')\n")
    for name, body in scripts.items():
        (bench / f"{name}.py").write_text(textwrap.dedent(body))
    return bench


def test_parse_output_skips_noise_and_bad_lines():
    text = "x\nBENCH_JSON {bad\nBENCH_JSON " + json.dumps({"rows": [{"measure": "m", "ours": 1.0}]}) + "\n"
    assert run_all.parse_output(text) == [{"measure": "m", "ours": 1.0}]


def test_runner_collects_reports_failures_and_writes_outputs(tmp_path, capsys):
    bench = _fake_dir(tmp_path, {"good": GOOD, "bad": BAD, "slow": SLOW})
    readme = tmp_path / "README.md"
    readme.write_text("# proj\n\nintro\n\n<!-- perf:start -->\nold numbers\n<!-- perf:end -->\n\n## After\nkept\n")
    out = tmp_path / "results"
    assert [p.stem for p in run_all.discover(bench)] == ["bad", "good", "slow"]

    rc = run_all.main(
        [
            "--quick",
            "--timeout",
            "10",  # the fast scripts' interpreter start may take seconds while the suite loads both cores
            "--readme",
            "--bench-dir",
            str(bench),
            "--out-dir",
            str(out),
            "--readme-path",
            str(readme),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fast op" in printed and "failed (exit 3)" in printed and "timed out after 10 s" in printed

    doc = json.loads((out / "results.json").read_text())
    assert doc["quick"] is True and doc["machine"]["cpu_cores"] >= 1
    by_script = {s["script"]: s for s in doc["scripts"]}
    assert by_script["good"]["status"] == "ok" and "quick" in by_script["good"]["output_tail"]
    assert by_script["bad"]["status"] == "failed (exit 3)"
    assert by_script["slow"]["status"].startswith("timed out")
    rows = {(r["script"], r["measure"]): r for r in doc["rows"]}
    assert rows[("good", "fast op")]["ratio"] == 0.5
    assert rows[("good", "no baseline")]["ratio"] is None
    assert rows[("bad", "-")]["status"] == "failed (exit 3)"
    assert (out / "ratios.png").read_bytes()[:4] == b"\x89PNG"

    text = readme.read_text()
    assert "old numbers" not in text and "## After\nkept" in text and text.count("<!-- perf:start -->") == 1
    assert "| good | fast op | 2.00 | 4.00 | 0.50x | ms | loop |" in text
    assert "failed (exit 3)" in text and "GPU: " in text


def test_readme_section_appended_when_markers_absent(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# proj\n")
    doc = {"quick": False, "created": "2026-01-01T00:00:00", "machine": {"cpu_cores": 2}, "rows": []}
    run_all.update_readme(readme, run_all.readme_section(doc))
    run_all.update_readme(readme, run_all.readme_section(doc))
    text = readme.read_text()
    assert text.startswith("# proj\n\n<!-- perf:start -->\n## The benchmarks") and text.count("## The benchmarks") == 1
