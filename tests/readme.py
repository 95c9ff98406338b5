"""The README's Python blocks, as the tests run them (tests/test_readme.py, test_newcomer.py).

A block is a *settings* block when every statement assigns a setting (an UPPERCASE name, or
an item of one); any other block is *code*. In a settings block, ``...`` in a list stands
for the list the project already has ("yours").
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass
from typing import Any

from .conftest import ROOT

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    section: str  # the nearest "## " heading above it
    source: str

    @property
    def is_settings(self) -> bool:
        return all(_sets_a_setting(node) for node in ast.parse(self.source).body)

    @property
    def local_only(self) -> bool:
        """Names no Redis but 127.0.0.1's (so a reader can run it on their machine)."""
        hosts = re.findall(r"redis://([^:/\"]+)", self.source)
        return all(host == "127.0.0.1" for host in hosts)

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.section})"


def python_blocks() -> list[Block]:
    text = README.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()]
        headings = re.findall(r"^## (.+)$", before, re.M)
        blocks.append(Block(before.count("\n") + 1, headings[-1] if headings else "", match[2]))
    return blocks


def newcomer_settings() -> list[Block]:
    """What a new user puts into settings.py: the settings blocks of Install and Settings
    that run on their own machine (not the ones naming a Sentinel or a cluster's hosts)."""
    return [
        b
        for b in python_blocks()
        if b.section in ("Install", "Settings") and b.is_settings and b.local_only
    ]


def _sets_a_setting(node: ast.stmt) -> bool:
    if not isinstance(node, ast.Assign):
        return False
    for target in node.targets:
        while isinstance(target, ast.Subscript):
            target = target.value
        if not (isinstance(target, ast.Name) and target.id.isupper()):
            return False
    return True


def apply_settings(source: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a block sets, run over ``settings`` (a copy): ``[..., x]`` keeps what
    was there."""
    namespace = copy.deepcopy(settings)
    exec(compile(source, str(README), "exec"), namespace)
    changed = {}
    for key, value in namespace.items():
        if not key.isupper() or (key in settings and value == settings[key]):
            continue
        if isinstance(value, list) and Ellipsis in value:
            mine = [item for item in value if item is not Ellipsis]
            yours = list(settings.get(key, []))
            value = yours + [x for x in mine if x not in yours]
        changed[key] = value
    return changed


def as_settings_py(source: str) -> str:
    """A settings block as a new user would paste it at the end of settings.py: ``...``
    becomes what the list already holds (without the items it already has)."""
    lines = []
    for node in ast.parse(source).body:
        assert isinstance(node, ast.Assign)
        text = ast.get_source_segment(source, node)
        assert text is not None
        target = node.targets[0]
        if isinstance(target, ast.Name) and isinstance(node.value, ast.List):
            items = [ast.get_source_segment(source, x) for x in node.value.elts]
            if "..." in items:
                new = ", ".join(x for x in items if x != "...")
                text = (
                    f"{target.id} = [*{target.id}, *(x for x in [{new}] if x not in {target.id})]"
                )
        lines.append(text)
    return "\n".join(lines) + "\n"
