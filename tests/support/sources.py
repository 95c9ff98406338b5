"""Parsing the package's and the tests' own source files, for the tests that read them."""

from __future__ import annotations

import ast
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """``ast.parse`` of a file, tried again on CPython 3.11's spurious ``SystemError: AST
    constructor recursion depth mismatch`` (python/cpython#106905): its depth count is shared
    by every thread, and another thread of the test process building an AST meanwhile (3.11's
    traceback module parses source lines to place its carets, so any thread logging an
    exception) upsets it. The file is the same; a second try parses it."""
    text = path.read_text()
    for _ in range(4):
        try:
            return ast.parse(text)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(text)
