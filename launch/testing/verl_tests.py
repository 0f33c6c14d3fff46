"""``make test-verl``: verl's own CPU unit tests, unedited, run against scaletrain's verl compatibility layer.

Fetches verl's source distribution from the package index at run time (``pip download --no-binary :all:``; only
its ``tests/`` folder is unpacked, verl's own code never is), makes every ``import verl...`` of that run resolve to
``scaletrain.compat.verl...`` (a ``sitecustomize`` on the run's PYTHONPATH, so Ray's worker processes get it too),
runs the files ``verl_scope.toml`` names and prints passed / failed / errors per file against the test count each
file has under verl itself.

A few test files of the surfaces in scope are not in the sdist (verl's reward-manager tests): the scope file names
the git tag they come from (``git_tag``), and they run when ``--verl-checkout DIR`` points at a clone of verl's
repository (read with ``git show TAG:PATH``, tests only); without one they are listed as not run (CI reaches
package indexes only).

Exit status 1 when a test in scope fails that the scope file does not list as a gap (with its reason), or when a
listed gap passes (the list must shrink as the layer grows). Usage:
``python launch/testing/verl_tests.py [--cache DIR] [--verl-checkout DIR] [-- extra pytest args]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SCOPE = HERE / "verl_scope.toml"
SITECUSTOMIZE = "from scaletrain.compat.verl_alias import install\n\ninstall()\n"


@dataclass
class FileScope:
    path: str
    tests: int  # how many tests verl itself collects in this file
    surface: str
    gaps: dict[str, str] = field(default_factory=dict)  # test id -> why it fails against scaletrain today
    gap_all: str = ""  # every test of the file is a gap, for this reason
    git_tag: str = ""  # not in the sdist: taken from verl's repository at this tag (--verl-checkout)


@dataclass
class Outcome:
    passed: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    errors: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)


def load_scope(path: Path = SCOPE) -> tuple[str, list[FileScope], dict[str, str]]:
    data = tomllib.loads(path.read_text())
    files = [
        FileScope(
            f["path"], f["tests"], f["surface"], dict(f.get("gaps", {})), f.get("gap_all", ""), f.get("git_tag", "")
        )
        for f in data["in_scope"]
    ]
    out = {o["path"]: o["why"] for o in data.get("out_of_scope", [])}
    return data["verl_version"], files, out


def fetch_tests(version: str, cache: Path) -> Path:
    """verl's ``tests/`` folder from its sdist, unpacked once under ``cache``; returns the folder holding it."""
    root = cache / f"verl-{version}"
    if (root / "tests").is_dir():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, "-q", "-d", tmp, f"verl=={version}"], check=True)
        (sdist,) = Path(tmp).glob("verl-*.tar.gz")
        prefix = f"verl-{version}/tests/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(f"verl-{version}/") :]
            root.mkdir(parents=True, exist_ok=True)
            tar.extractall(root, members=members, filter="data")
    return root


def _file_of(classname: str, name: str) -> tuple[str, str]:
    """(file, test id) of a junit testcase: ``tests.a.test_b.TestC`` + ``test_d`` -> ``tests/a/test_b.py``,
    ``TestC::test_d``; a collection error has an empty classname and the module path as its name."""
    parts = (classname or name).split(".")
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test"):
            return "/".join(parts[:i]) + ".py", "::".join([*parts[i:], name] if classname else ["<collection>"])
    return classname, name


def read_report(xml_path: Path) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        path, test = _file_of(case.get("classname", ""), case.get("name", ""))
        o = out.setdefault(path, Outcome())
        tags = {child.tag for child in case}
        bucket = (
            o.errors
            if "error" in tags
            else o.failed
            if "failure" in tags
            else o.skipped
            if "skipped" in tags
            else o.passed
        )
        bucket.add(test)
    return out


def run_pytest(root: Path, files: list[FileScope], extra: list[str]) -> dict[str, Outcome]:
    """Each file in its own pytest process, as verl's CI runs them: a file's import-time settings (e.g.
    ``DataProtoConfig.auto_padding = True``) and Ray clusters stay its own."""
    site = root / "_alias_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (root / "pytest.ini").write_text("[pytest]\n")  # the rootdir: no ini file of an enclosing folder applies
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(root), str(REPO)]))
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("RAY_ADDRESS", None)  # verl's tests start their own Ray
    # ... in a temp dir of their own: a `ray start` cluster's address file left in /tmp/ray would make their
    # ray.init(num_cpus=...) try to join it
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="vt-ray-", dir="/tmp")
    results: dict[str, Outcome] = {}
    for f in files:
        report = root / "report.xml"
        report.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--timeout", "300"]
        cmd += ["--junitxml", str(report), "-o", "junit_family=xunit1", *extra, f.path]
        print(f"== {f.path}", flush=True)
        subprocess.run(cmd, cwd=root, env=env)
        if report.exists():
            results.update(read_report(report))
    return results


def copy_git_tests(checkout: Path, files: list[FileScope], root: Path) -> None:
    """Each file from verl's repository at its tag into ``root`` (a test file only: never verl's code)."""
    for f in files:
        if not f.path.startswith("tests/"):
            raise SystemExit(f"{f.path}: only files under tests/ are taken from verl's repository")
        text = subprocess.run(
            ["git", "-C", str(checkout), "show", f"{f.git_tag}:{f.path}"], capture_output=True, text=True, check=True
        ).stdout
        target = root / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def judge(files: list[FileScope], results: dict[str, Outcome]) -> tuple[list[str], list[str]]:
    """Prints the table; returns (unexpected failures, gaps that now pass)."""
    unexpected, healed = [], []
    total = Counter()
    print(f"\n{'file':62} {'verl':>5} {'pass':>5} {'fail':>5} {'err':>5} {'skip':>5}")
    for f in files:
        o = results.get(f.path, Outcome())
        broken = o.failed | o.errors
        if not (o.passed or broken or o.skipped):
            broken = {"<not run>"}
        row = (f.tests, len(o.passed), len(o.failed), len(o.errors), len(o.skipped))
        total.update(dict(zip(("verl", "pass", "fail", "err", "skip"), row)))
        print(f"{f.path:62} " + " ".join(f"{n:>5}" for n in row))
        if not f.gap_all:
            unexpected += [f"{f.path}::{t}" for t in sorted(broken) if t not in f.gaps]
            healed += [f"{f.path}::{t}" for t in sorted(f.gaps) if t in o.passed]
        elif o.passed and not broken:
            healed.append(f"{f.path} (gap_all)")
    share = 100.0 * total["pass"] / max(total["verl"], 1)
    print(
        f"{'in scope':62} {total['verl']:>5} {total['pass']:>5} {total['fail']:>5} {total['err']:>5} "
        f"{total['skip']:>5}   {share:.1f}% of verl's count pass"
    )
    return unexpected, healed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scaletrain" / "verl-tests"
    parser.add_argument("--cache", type=Path, default=cache, help=f"where verl's tests are unpacked (default {cache})")
    parser.add_argument(
        "--verl-checkout",
        type=Path,
        help="a clone of verl's repository, for the in-scope test files "
        "its sdist lacks (each read at the scope file's git_tag)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    version, files, out_of_scope = load_scope()
    root = fetch_tests(version, args.cache)
    if (root / "verl").exists():
        raise SystemExit(f"{root}/verl exists: only verl's tests may be unpacked, never its code")
    from_git = [f for f in files if f.git_tag]
    if args.verl_checkout:
        copy_git_tests(args.verl_checkout, from_git, root)
    else:
        files = [f for f in files if not f.git_tag]
    results = run_pytest(root, files, args.pytest_args)
    unexpected, healed = judge(files, results)
    if not args.verl_checkout:
        for f in from_git:
            print(f"not run (not in the sdist; --verl-checkout runs it at {f.git_tag}): {f.path} ({f.tests} tests)")
    print(f"out of scope: {len(out_of_scope)} files (reasons in {SCOPE.relative_to(REPO)})")
    for name in unexpected:
        print(f"FAILED (in scope, not a listed gap): {name}")
    for name in healed:
        print(f"PASSES but is listed as a gap (remove it from {SCOPE.name}): {name}")
    return 1 if unexpected or healed else 0


if __name__ == "__main__":
    sys.exit(main())
