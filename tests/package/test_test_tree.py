"""The test tree itself: imports made inside test functions run only when the test does, so a
file moved to another folder can leave one pointing nowhere until that test runs."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from tests.support.sources import parse

TESTS = Path(__file__).resolve().parents[1]


def test_every_relative_import_in_the_tests_names_a_module_that_exists() -> None:
    missing = []
    for path in sorted(TESTS.rglob("*.py")):
        package = ".".join(("tests", *path.relative_to(TESTS).parent.parts))
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                name = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                where = TESTS.parent.joinpath(*name.split("."))
                if not (where.with_suffix(".py").exists() or (where / "__init__.py").exists()):
                    missing.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}: {name}")
    assert not missing, missing
