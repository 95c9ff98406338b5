"""The package's layering, read from its source (no import): no import cycle, every import
counted (function-level and ``TYPE_CHECKING`` ones too), and no module taking another's
``_private`` names. ``make lint`` checks the layers themselves (import-linter's contracts in
pyproject.toml); these tests need no tool and say what is wrong in one line each.

What is left, each entry named with its reason, is in files other work is changing: an
entry that no longer occurs fails its test, so the lists only shrink."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "django_redlock"

#: Import edges (importer -> imported) still closing a cycle.
CYCLE_EDGES_LEFT = {
    # contrib/single.py, the core shared by the Celery and Django Tasks adapters, imports
    # them at call time to pick its framework, while both import the core.
    ("django_redlock.contrib.single", "django_redlock.contrib.celery"),
    ("django_redlock.contrib.single", "django_redlock.contrib.tasks"),
}


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The dotted names an import statement names (a module, or a module's attribute)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    for alias in node.names:
        yield f"{prefix}.{alias.name}"


def import_graph() -> dict[str, set[str]]:
    """importer -> the package's modules it imports, wherever the import statement is."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, (path, is_package) in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in imported(name, is_package, node):
                while target not in known and "." in target:  # an attribute: its module
                    target = target.rsplit(".", 1)[0]
                if target in known and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_graph_reader_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    # apps.py imports these inside ready(); the package imports its modules relatively.
    assert {"django_redlock.checks", "django_redlock.incidents"} <= graph["django_redlock.apps"]
    assert "django_redlock.locking.base" in graph["django_redlock.locking"]
    assert "django_redlock.backends.base" in graph["django_redlock.renewer"]


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    for importer, target in CYCLE_EDGES_LEFT:
        assert target in graph[importer], f"{importer} -> {target} is gone: drop its entry"
        graph[importer].discard(target)
    assert cycles(graph) == []


@pytest.mark.parametrize("edge", sorted(CYCLE_EDGES_LEFT))
def test_each_edge_left_still_closes_a_cycle(edge: tuple[str, str]) -> None:
    graph = import_graph()
    for importer, target in CYCLE_EDGES_LEFT - {edge}:
        graph[importer].discard(target)
    assert cycles(graph), f"{edge[0]} -> {edge[1]} closes no cycle any more: drop its entry"
