"""benchmarks/peers on fake side results: pairing, ratios, targets, met/missed, the table and README rewriting.

Offline and fast: no peers venv, no verl; run.py's subprocess step is replaced by canned ``BENCH_JSON`` rows.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.peers import run, table


def _side(**ms):
    return [
        {"measure": m, "ours": v, "baseline": None, "baseline_name": "", "ratio": None, "unit": "ms"}
        for m, v in ms.items()
    ]


OURS = {"DataProto chunk(4)": 1.0, "DataProto pickle5 round trip (verl: numpy mode)": 2.0, "GAE (8 x 16)": 1.0}
VERL = {"DataProto chunk(4)": 0.5, "DataProto pickle5 round trip (verl: numpy mode)": 8.0, "GAE (8 x 16)": 20.0}


@pytest.mark.parametrize(
    "measure, target",
    [
        ("DataProto chunk(4)", 1.0),
        ("DataProto pickle5 round trip (verl: numpy mode)", 0.5),
        ("DataProto ray put + get (driver) (verl: numpy mode)", 0.5),
        ("DataProto pickle5 round trip (verl: default torch.save mode)", None),
        ("GAE (1024 x 2048)", 0.1),
        ("GRPO outcome advantage (groups of 8)", 1.0),
        ("policy loss vanilla fwd+bwd", 1.0),
        ("something else", None),
    ],
)
def test_targets(measure, target):
    assert table.target_for(measure) == target


def test_pair_rows_ratio_and_verdict():
    rows = table.pair_rows(_side(**OURS), _side(**VERL), notes={"GAE (8 x 16)": "same numbers"})
    by = {r["measure"]: r for r in rows}
    assert [r["measure"] for r in rows] == list(OURS)
    chunk = by["DataProto chunk(4)"]
    assert chunk["ratio"] == 2.0 and chunk["target"] == 1.0 and chunk["met"] == "missed"
    assert by["DataProto pickle5 round trip (verl: numpy mode)"]["met"] == "met"  # 0.25 <= 0.5
    gae = by["GAE (8 x 16)"]
    assert gae["ratio"] == pytest.approx(0.05) and gae["met"] == "met" and gae["note"] == "same numbers"
    assert all(r["baseline_name"] == "verl 0.9.1" for r in rows)
    assert table.summary(rows) == "2 of 3 targets met"


def test_pair_rows_missing_side_and_boundary():
    rows = table.pair_rows(_side(**{"GRPO x": 1.0, "ours only": 1.0}), _side(**{"GRPO x": 1.0, "verl only": 3.0}))
    by = {r["measure"]: r for r in rows}
    assert by["GRPO x"]["met"] == "met"  # exactly at the target counts as met
    assert (
        by["ours only"]["ratio"] is None
        and by["ours only"]["met"] == "-"
        and "no verl 0.9.1" in by["ours only"]["note"]
    )
    assert by["verl only"]["ours"] is None and "no ours figure" in by["verl only"]["note"]


def test_extra_rows_keep_their_own_baseline_and_target():
    trl = [{"measure": "GRPO step", "ours": 3.0, "baseline": 6.0, "baseline_name": "trl 1.16.0", "target": 1.0}]
    (row,) = table.extra_rows(trl + [])
    assert row["ratio"] == 0.5 and row["met"] == "met" and row["baseline_name"] == "trl 1.16.0" and row["unit"] == "ms"
    (untargeted,) = table.extra_rows([{"measure": "x", "ours": 1.0, "baseline": 2.0, "unit": "s"}])
    assert untargeted["met"] == "-" and untargeted["unit"] == "s"


def test_format_table_has_every_row_and_column():
    text = table.format_table(table.pair_rows(_side(**OURS), _side(**VERL)))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["measure", "ours", "peer", "unit"] and len(lines) == 1 + len(OURS)
    assert "2x" in text and "<= 0.1x" in text and "missed" in text and "verl 0.9.1" in text


INFO = {
    "machine": {"cpu_cores": 2, "cpu_model": "Fake CPU", "ram_gib": 8.0, "torch": "9.9"},
    "peers": {"verl": "0.9.1", "tensordict": "0.10.0"},
    "quick": False,
    "date": "2026-12-02",
    "notes": ["trl_step.py is not there yet"],
}


def test_readme_inserted_after_perf_then_replaced():
    before = "# proj\n\n<!-- perf:start -->\nperf\n<!-- perf:end -->\n\n## After\nkept\n"
    section = table.readme_section(table.pair_rows(_side(**OURS), _side(**VERL)), INFO)
    assert "2 CPU cores (Fake CPU), 8.0 GiB RAM, torch 9.9" in section and "verl 0.9.1, tensordict 0.10.0" in section
    assert "2026-12-02" in section and "Note: trl_step.py is not there yet" in section
    once = table.update_readme(before, section)
    assert once.index("<!-- perf:end -->") < once.index("## Against the peers") < once.index("<!-- peers:start -->")
    assert once.index("<!-- peers:end -->") < once.index("## After") and once.endswith("kept\n")
    assert "| DataProto chunk(4) | 1.00 | 0.50 | ms | 2x | <= 1x | missed | verl 0.9.1 |  |" in once

    again = table.update_readme(once, section.replace("Fake CPU", "Other CPU"))
    assert again.count("## Against the peers") == 1 and "Other CPU" in again and "Fake CPU" not in again
    assert table.update_readme("", section).startswith("## Against the peers\n\n<!-- peers:start -->")


def test_main_builds_the_table_emits_json_and_rewrites_readme(tmp_path, monkeypatch, capsys):
    def fake_side(python, script, args, timeout):
        impl = args[args.index("--impl") + 1]
        if script == "algos_side.py":
            return {"status": "ok", "rows": _side(**{"GAE (8 x 16)": OURS["GAE (8 x 16)"] if impl == "ours" else 20.0})}
        if impl == "verl":
            return {"status": "failed (exit 1)", "rows": []}
        return {"status": "ok", "rows": _side(**{"DataProto chunk(4)": 1.0})}

    monkeypatch.setattr(run, "run_side", fake_side)
    monkeypatch.setattr(run, "PEERS_DIR", tmp_path)  # no trl_step.py there: skipped with a note
    monkeypatch.setattr(run, "peer_versions", lambda python: {"verl": "0.9.1"})
    readme = tmp_path / "README.md"
    readme.write_text("<!-- perf:start -->\n<!-- perf:end -->\n")
    peers_python = tmp_path / "python"
    peers_python.write_text("")
    assert run.main(["--quick", "--readme", "--readme-path", str(readme), "--peers-python", str(peers_python)]) == 0

    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("BENCH_JSON ")]
    rows = {r["measure"]: r for r in json.loads(line[len("BENCH_JSON ") :])["rows"]}
    assert (
        rows["GAE (8 x 16)"]["ratio"] == pytest.approx(0.05) and rows["GAE (8 x 16)"]["baseline_name"] == "verl 0.9.1"
    )
    assert rows["DataProto chunk(4)"]["baseline"] is None
    assert "verl side failed (exit 1)" in out and "TRL rows skipped" in out
    text = readme.read_text()
    assert "## Against the peers" in text and "| GAE (8 x 16) | 1.00 | 20.00 | ms | 0.05x | <= 0.1x | met |" in text


def test_main_without_the_peers_venv_says_how_to_build_it(tmp_path, capsys):
    assert run.main(["--peers-python", str(tmp_path / "missing")]) == 1
    assert "setup_venv.sh" in capsys.readouterr().out
