"""The package's layering, read from its source (no import): no import cycle, every import
counted (function-level and ``TYPE_CHECKING`` ones too), and no module taking another's
``_private`` names. ``make lint`` checks the layers themselves (import-linter's contracts in
pyproject.toml); these tests need no tool and say what is wrong in one line each.

What is left, each entry named with its reason, is in files other work is changing: an
entry that no longer occurs fails its test, so the lists only shrink."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.support.sources import parse

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "django_redlock"


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
        for node in ast.walk(parse(path)):
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
    assert cycles(import_graph()) == []


def test_the_single_instance_core_imports_none_of_its_adapters() -> None:
    graph = import_graph()
    adapters = {"django_redlock.contrib.celery", "django_redlock.contrib.tasks"}
    assert graph["django_redlock.contrib.single"] & adapters == set()
    for adapter in adapters:  # they import the core, never each other
        assert "django_redlock.contrib.single" in graph[adapter]
        assert graph[adapter] & adapters == set()


def test_the_core_gets_its_adapters_from_the_package_celerys_once_imported() -> None:
    # A fresh process: importing the core alone runs contrib/__init__.py, which registers
    # Django Tasks' adapter first; Celery stays unimported until something imports it.
    code = (
        "import django; django.setup()\n"
        "import sys\n"
        "from django_redlock.contrib import single\n"
        "single.single_instance()(len)\n"
        "print([type(a).__name__ for a in single.ADAPTERS], 'celery' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
        env={"DJANGO_SETTINGS_MODULE": "tests.support.settings", "PATH": "/usr/bin:/bin"},
    ).stdout.split("\n")  # fmt: skip
    assert out[0] == "['TasksAdapter', '_OnceCeleryIsImported'] False"


# -- private names -------------------------------------------------------------------------

#: ``from <module> import _name`` across the package's modules, still left: (importer, name).
PRIVATE_IMPORTS_LEFT: set[tuple[str, str]] = set()

#: ``obj._name`` where ``obj`` is not ``self``/``cls``/``super()`` and the module defines no
#: ``_name`` of its own: another module's object's private. (module, name) -> why it stays.
PRIVATE_ATTRIBUTES_LEFT = {
    # Other libraries' names that are their public API despite the underscore:
    ("django_redlock.acl", "_replace"): "namedtuple's documented _replace (urlsplit's)",
    ("django_redlock.fence_table", "_meta"): "Django's documented Model._meta API",
    ("django_redlock.contrib.celery", "_get_current_object"): "Celery's proxy, documented",
    # asyncio's running-loop lookup without get_running_loop()'s RuntimeError when there is
    # none (a few hundred ns on every acquire; CPython keeps it for that purpose).
    ("django_redlock.identity", "_get_running_loop"): "asyncio",
    ("django_redlock.locking.steps", "_get_running_loop"): "asyncio",
    # The frame a call's deadline belongs to (fast_path.begin_call): documented in sys.
    ("django_redlock.fast_path", "_getframe"): "sys._getframe, documented",
    # redis-py's internals, all in wire.py (the one module that touches them: see its
    # docstring, and tests/backends/test_wire.py for the test of each on the installed redis-py):
    ("django_redlock.wire", "_sock"): "redis-py Connection._sock",
    ("django_redlock.wire", "_command_packer"): "redis-py Connection._command_packer",
    ("django_redlock.wire", "_parser"): "redis-py Connection._parser (its parse_error)",
    ("django_redlock.wire", "_writer"): "redis.asyncio Connection._writer (its socket)",
    ("django_redlock.wire", "_django_redlock_threads"): "ours, planted on redis-py's pool",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(
    known: dict[str, tuple[Path, bool]] | None = None,
) -> set[tuple[str, str]]:
    found = set()
    for name, (path, _) in (modules() if known is None else known).items():
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("django_redlock")
            ):
                found |= {(name, a.name) for a in node.names if _private(a.name)}
    return found


def own_names(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, assigned names, and attributes it
    sets on ``self`` or ``cls`` (set on another object, an attribute is a reach-in too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and _own_object(node.value)
        ):
            names.add(node.attr)
    return names


def _own_object(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("super", "type")
    )


def private_attributes() -> set[tuple[str, str]]:
    found = set()
    for name, (path, _) in modules().items():
        tree = parse(path)
        own = own_names(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and node.attr not in own
                and not _own_object(node.value)
            ):
                found.add((name, node.attr))
    return found


def test_the_private_name_finders_find_both_forms(tmp_path: Path) -> None:
    tree = ast.parse("import x\nclass A:\n    def f(self):\n        self._mine = 1\n"
                     "        other._planted = 2\n"
                     "        return other._theirs, self._mine, super()._up\n")  # fmt: skip
    assert own_names(tree) >= {"A", "f", "_mine"}
    assert not {"_theirs", "_planted"} & own_names(tree)
    module = tmp_path / "mod.py"
    module.write_text("from .other import _hidden, shown\nfrom django_redlock.x import _y\n")
    found = private_imports({"pkg.mod": (module, False)})
    assert found == {("pkg.mod", "_hidden"), ("pkg.mod", "_y")}


def test_no_module_imports_another_modules_private_names() -> None:
    found = private_imports()
    assert found - PRIVATE_IMPORTS_LEFT == set()
    assert PRIVATE_IMPORTS_LEFT - found == set(), "gone: drop these entries"


def test_no_module_reaches_into_another_modules_objects_privates() -> None:
    found = private_attributes()
    assert found - set(PRIVATE_ATTRIBUTES_LEFT) == set()
    assert set(PRIVATE_ATTRIBUTES_LEFT) - found == set(), "gone: drop these entries"


# -- redis-py's internals -------------------------------------------------------------------

#: redis-py's (and hiredis's) private or internal names the package relies on, and the prefix
#: of the attributes it plants on redis-py's objects: said only in django_redlock/wire.py.
REDIS_PY_INTERNALS = {
    "_sock", "_command_packer", "_parser", "_retries", "HiredisRespSerializer", "_writer"
}  # fmt: skip
PLANTED_PREFIX = "_django_redlock_"


def redis_py_reach_ins(tree: ast.AST) -> set[str]:
    """redis-py's internal names a module says: as an attribute (``conn._sock``), or as a
    string (``getattr(retry, "_retries")``, an attribute name kept in a constant)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        if name in REDIS_PY_INTERNALS or name.startswith(PLANTED_PREFIX):
            found.add(name)
    return found


def test_the_reach_in_finder_sees_attributes_and_names_in_strings() -> None:
    tree = ast.parse('conn._sock\ngetattr(r, "_retries", 1)\nX = "_django_redlock_x"\n'
                     'self._socket, "_sock is"\n')  # fmt: skip
    assert redis_py_reach_ins(tree) == {"_sock", "_retries", "_django_redlock_x"}


def test_only_the_wire_module_touches_redis_pys_internals() -> None:
    reaching = {
        (name, found)
        for name, (path, _) in modules().items()
        for found in redis_py_reach_ins(parse(path))
    }
    assert {name for name, _ in reaching} == {"django_redlock.wire"}, sorted(reaching)
    assert {found for _, found in reaching} >= REDIS_PY_INTERNALS  # each one still listed


# -- the script layer and the fast path ----------------------------------------------------


def test_the_script_layer_and_the_fast_path_are_a_module_each() -> None:
    graph = import_graph()
    assert "django_redlock.fast_path" in graph["django_redlock.scripts"]  # it sends there
    assert "django_redlock.scripts" not in graph["django_redlock.fast_path"]
    tree = parse(PACKAGE / "scripts.py")
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    defined = {n.name for n in tree.body if isinstance(n, kinds)}
    fast = {"command", "commands", "disconnect_threads", "on_thread_connection", "_Bound"}
    assert not fast & defined
    assert {"script", "run", "run_many", "arun", "arun_many", "register"} <= defined


# -- the backend contract ---------------------------------------------------------------

MARKER_OPS = {
    "op_mark_queued",
    "op_clear_queued",
    "op_swap_queued",
    "op_read_queued",
    "queued_names",
}


def test_the_backend_contract_keeps_no_task_markers_nor_page_cursors() -> None:
    from django_redlock.backends.base import BaseLockBackend

    assert not (MARKER_OPS | {"queued_key"}) & set(dir(BaseLockBackend))
    tree = parse(PACKAGE / "backends" / "base.py")
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert not {"BadCursor", "parse_cursor"} & defined


def test_queue_markers_are_reached_only_through_the_markers_module() -> None:
    # The backends implement the ops (and Redlock's call its nodes'); everyone else calls
    # backends.markers' functions.
    calling = set()
    for name, (path, _) in modules().items():
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and node.attr in MARKER_OPS:
                calling.add(name)
    assert calling == {"django_redlock.backends.markers", "django_redlock.backends.redlock"}


# -- fork hooks ----------------------------------------------------------------------------


def test_every_fork_hook_goes_through_the_one_fork_helper() -> None:
    # os.register_at_fork however it is reached: an attribute, or a name imported from os.
    calling = set()
    for name, (path, _) in modules().items():
        for node in ast.walk(parse(path)):
            if (isinstance(node, ast.Attribute) and node.attr == "register_at_fork") or (
                isinstance(node, ast.ImportFrom)
                and any(alias.name == "register_at_fork" for alias in node.names)
            ):
                calling.add(name)
    assert calling == {"django_redlock.forks"}


# -- the map in the docs -------------------------------------------------------------------


def contract_layers(contract_id: str) -> list[set[str]]:
    """A layers contract's layers in pyproject.toml, top first (read as text: no TOML
    parser on Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split(f'id = "{contract_id}"', 1)[1].split("[[tool.importlinter", 1)[0]
    listed = block.split("layers = [", 1)[1].split("]", 1)[0]
    rows = [line.strip().strip(",").strip('"') for line in listed.splitlines() if line.strip()]
    return [{name.strip() for name in row.split("|")} for row in rows]


def documented_layers() -> list[set[str]]:
    """The first column of docs/topics/internals.md's table of layers, top first."""
    text = (ROOT / "docs" / "topics" / "internals.md").read_text()
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [set(row.split(" | ", 1)[0].strip("| ").replace("\\|", "").split()) for row in rows]


def test_the_docs_map_of_the_layers_is_the_contract() -> None:
    layers = contract_layers("package-layers")
    assert len(layers) > 5 and {"locking"} in layers
    assert [{name.strip("`") for name in row} for row in documented_layers()] == layers
