"""The documentation's shape: the README stays a front door (<= 250 lines), every page of docs/ is in mkdocs.yml's
nav (`make docs` builds them with --strict in CI), and every test a page names as its proof exists."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
# `tests/x/test_y.py`, `test_y.py` (somewhere under tests/), either with `::test_name` (a trailing "..." abbreviates it)
NAMED_TEST = re.compile(r"((?:tests/[\w/]+/)?test_\w+\.py)(?:::(\w+))?")


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference and measurements into docs/"


def _nav_pages(nav) -> set[str]:
    pages = set()
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_every_page_is_in_the_nav():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == nav, f"pages not in mkdocs.yml's nav: {pages - nav}; nav entries without a page: {nav - pages}"


def verls_test_files() -> set[str]:
    """verl's own test files `make test-verl` runs (launch/testing/verl_scope.toml): named in the docs, not ours."""
    scope = tomllib.loads((ROOT / "launch" / "testing" / "verl_scope.toml").read_text())
    return {Path(f["path"]).name for f in scope["in_scope"]}


def test_every_test_a_page_names_exists():
    missing = []
    verls = verls_test_files()
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for path, name in NAMED_TEST.findall(page.read_text()):
            if Path(path).name in verls:
                continue
            found = [ROOT / path] if path.startswith("tests/") else sorted((ROOT / "tests").rglob(path))
            source = found[0] if found else ROOT / "tests" / path
            if not source.exists():
                missing.append(f"{page.name}: {path}")
            elif name and not re.search(rf"def {name}", source.read_text()):
                missing.append(f"{page.name}: {path}::{name}")
    assert not missing, f"tests named in the docs that do not exist: {missing}"
