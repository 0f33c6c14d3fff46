"""The code's layout stays walkable: the import graph of the project's packages has no cycle (arrows point down
the layers), and no package folder holds more than 15 modules.

Every import counts, wherever it sits (module level, inside a function, under ``TYPE_CHECKING``): a cycle kept out
of the interpreter's way by a lazy or type-only import is still two modules that each need the other. Read from
the source with ``ast`` (nothing imported), so the test also covers modules whose packages are not installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scaletrain", "backends")


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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_packages_import_graph_has_no_cycle():
    modules = module_names()
    assert len(modules) > 100 and "scaletrain.trainer.ppo_trainer" in modules
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert "scaletrain.trainer.rollout.producer" in graph["scaletrain.trainer.ppo_trainer"]  # the walk sees imports
    assert cycles(graph) == []


def test_the_walk_finds_a_cycle_through_a_type_only_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_folder_holds_more_than_15_modules():
    sizes = {}
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            sizes[str(init.parent.relative_to(ROOT))] = len(list(init.parent.glob("*.py")))
    assert sizes["scaletrain/trainer"] >= 5 and len(sizes) > 10
    assert {folder: n for folder, n in sizes.items() if n > 15} == {}
