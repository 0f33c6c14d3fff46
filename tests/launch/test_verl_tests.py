"""launch/testing/verl_tests.py's verdict on a junit report (the run itself is `make test-verl`, in CI): a failing
test in scope fails the run unless the scope file lists it as a gap, a listed gap that passes fails it too, and a
file that could not even be collected counts as failed; the scope file parses and names real counts."""

import runpy

from tests.trainer.runs import ROOT

vt = runpy.run_path(str(ROOT / "launch" / "testing" / "verl_tests.py"), run_name="verl_tests")

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
<testcase classname="tests.test_a_on_cpu" name="test_ok" />
<testcase classname="tests.test_a_on_cpu" name="test_known_gap"><failure message="x" /></testcase>
<testcase classname="tests.sub.test_b_on_cpu.TestGroup" name="test_bad[1]"><failure message="y" /></testcase>
<testcase classname="" name="tests.sub.test_c_on_cpu"><error message="collection failure" /></testcase>
</testsuite></testsuites>"""


def _files(**gaps):
    FileScope = vt["FileScope"]
    return [
        FileScope("tests/test_a_on_cpu.py", 2, "a", dict(gaps)),
        FileScope("tests/sub/test_b_on_cpu.py", 1, "b"),
        FileScope("tests/sub/test_c_on_cpu.py", 4, "c"),
    ]


def test_failures_outside_the_gap_list_fail_the_run_and_healed_gaps_too(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    results = vt["read_report"](report)
    assert results["tests/sub/test_b_on_cpu.py"].failed == {"TestGroup::test_bad[1]"}
    assert results["tests/sub/test_c_on_cpu.py"].errors == {"<collection>"}
    unexpected, healed = vt["judge"](_files(test_known_gap="why"), results)
    assert unexpected == [
        "tests/sub/test_b_on_cpu.py::TestGroup::test_bad[1]",
        "tests/sub/test_c_on_cpu.py::<collection>",
    ]
    assert healed == []
    unexpected, healed = vt["judge"](_files(test_ok="listed, yet it passes"), results)
    assert "tests/test_a_on_cpu.py::test_known_gap" in unexpected
    assert healed == ["tests/test_a_on_cpu.py::test_ok"]


def test_the_scope_file_lists_files_with_counts_and_reasons():
    version, files, out_of_scope = vt["load_scope"]()
    assert version == "0.9.1"
    assert files and all(f.tests > 0 and f.surface for f in files)
    assert all(why for f in files for why in f.gaps.values())
    assert out_of_scope and all(why for why in out_of_scope.values())


def test_files_the_sdist_lacks_come_from_a_checkout_at_their_tag_tests_only(tmp_path):
    import subprocess

    import pytest

    repo, root = tmp_path / "verl", tmp_path / "root"
    (repo / "tests" / "w").mkdir(parents=True)
    (repo / "tests" / "w" / "test_x_on_cpu.py").write_text("def test_tagged():\n    pass\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    subprocess.run([*git, "tag", "v1"], check=True)
    (repo / "tests" / "w" / "test_x_on_cpu.py").write_text("def test_after_the_tag():\n    pass\n")  # not at v1
    FileScope = vt["FileScope"]
    vt["copy_git_tests"](repo, [FileScope("tests/w/test_x_on_cpu.py", 1, "x", git_tag="v1")], root)
    assert "test_tagged" in (root / "tests" / "w" / "test_x_on_cpu.py").read_text()
    with pytest.raises(SystemExit, match="only files under tests/"):
        vt["copy_git_tests"](repo, [FileScope("verl/protocol.py", 1, "x", git_tag="v1")], root)
    files = vt["load_scope"]()[1]
    assert {f.path for f in files if f.git_tag} >= {"tests/workers/reward_manager/test_naive_on_cpu.py"}
