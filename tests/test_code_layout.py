"""The code's layout stays walkable: the import graph of the project's packages has no cycle (arrows point down
the layers), no package folder holds more than 15 modules, and the tests mirror the code (a test module sits in the
folder of the package it tests).

Every import counts, wherever it sits (module level, inside a function, under ``TYPE_CHECKING``): a cycle kept out
of the interpreter's way by a lazy or type-only import is still two modules that each need the other. Read from
the source with ``ast`` (nothing imported), so the test also covers modules whose packages are not installed.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scaletrain", "backends")
# test folders named for where their tests run rather than for what they test
ENVIRONMENT_TEST_FOLDERS = ("faults", "gpu", "slurm")


def module_names() -> dict[str, Path]:
    """Every module of the packages: dotted name -> file (a package by its ``__init__``)."""
    names = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` (at ``path``) imports: ``from a.b import c`` names ``a.b.c`` when that is a
    module, else ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> the modules it imports) as [a, b, ..., a]; [] when there is none
    (found by the standard library's ``graphlib``)."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        return err.args[1]
    return []


def test_the_packages_import_graph_has_no_cycle():
    modules = module_names()
    assert len(modules) > 100 and "scaletrain.trainer.ppo_trainer" in modules
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert "scaletrain.trainer.rollout.producer" in graph["scaletrain.trainer.ppo_trainer"]  # the walk sees imports
    assert cycle(graph) == []


def test_the_cycle_finder_names_the_modules_of_a_cycle():
    found = cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert sorted(set(found)) == ["a", "b", "c"] and found[0] == found[-1]  # d imports the cycle, is not in it
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_no_package_folder_holds_more_than_15_modules():
    sizes = {}
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            sizes[str(init.parent.relative_to(ROOT))] = len(list(init.parent.glob("*.py")))
    assert sizes["scaletrain/trainer"] >= 5 and len(sizes) > 10
    assert {folder: n for folder, n in sizes.items() if n > 15} == {}


def code_folder_of(test_folder: Path) -> Path | None:
    """The code folder a test folder mirrors: ``tests/trainer/config`` -> ``scaletrain/trainer/config``,
    ``tests/backends/x`` -> ``backends/x``, ``tests/benchmarks`` -> ``benchmarks``; ``tests`` itself -> ``scaletrain``
    (its modules: the top-level modules and the project as a whole); None when none exists."""
    rel = test_folder.relative_to(ROOT / "tests")
    candidates = [ROOT / "scaletrain" / rel, ROOT / rel] if rel.parts else [ROOT / "scaletrain"]
    return next((c for c in candidates if c.is_dir() and c.name != "tests"), None)


def test_the_tests_mirror_the_code():
    misplaced = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        folder = path.parent
        if folder.relative_to(ROOT / "tests").parts[:1] in [(name,) for name in ENVIRONMENT_TEST_FOLDERS]:
            continue
        if code_folder_of(folder) is None:
            misplaced.append(str(path.relative_to(ROOT)))
    assert not misplaced, f"test modules in folders that mirror no code folder: {misplaced}"
    assert code_folder_of(ROOT / "tests" / "trainer" / "config") == ROOT / "scaletrain" / "trainer" / "config"
    assert code_folder_of(ROOT / "tests" / "trainer" / "nowhere") is None


def test_a_test_folder_holds_only_its_packages_tests():
    """Beside the end-to-end runs that test a layer as a whole, a folder's test modules do not outnumber 15 (as
    the code's folders)."""
    sizes = {
        str(p.relative_to(ROOT)): len(list(p.glob("test_*.py"))) for p in (ROOT / "tests").rglob("*") if p.is_dir()
    }
    assert {folder: n for folder, n in sizes.items() if n > 15} == {}
