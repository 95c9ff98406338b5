"""The code blocks of the README and of the docs/ pages, as the tests run them
(tests/docs/test_readme.py, test_docs.py, test_newcomer.py).

A fence is ```` ```python ```` (or another language), or MyST's ```` ```{code-block} python ````
with option lines (``:caption: shop/models.py``: the block is that file of the reader's
project). A Python block is a *settings* block when every statement assigns a setting (an
UPPERCASE name, or an item of one); any other is *code*. In a settings block, ``...`` in a
list stands for the list the project already has ("yours").

The line ``<!-- docs-test: needs fenced transactions -->`` (invisible on GitHub and in the
built docs) right above a fence marks a block that uses fenced transactions, which this
branch does not have yet: it is compiled but not run. It is the only marker there is.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- docs-test: needs (.+?) -->$")
#: The one thing a block may be marked as needing (see the module's docstring).
NEEDS = "fenced transactions"


@dataclass
class Block:
    path: Path  # the page
    line: int  # of the opening fence, 1-based
    section: str  # the nearest "## " heading above it
    lang: str  # "python", "sh", "text", ... ("" for none)
    source: str
    caption: str | None = None  # a file of the reader's project (MyST :caption:)
    needs: str | None = None  # what the marker above it says it needs, if any

    @property
    def is_settings(self) -> bool:
        try:
            body = ast.parse(self.source).body
        except SyntaxError:
            return False  # code, then: the compile test names the error
        return all(_sets_a_setting(node) for node in body)

    @property
    def local_only(self) -> bool:
        """Names no Redis but 127.0.0.1's (so a reader can run it on their machine)."""
        hosts = re.findall(r"redis://([^:/\"]+)", self.source)
        return all(host == "127.0.0.1" for host in hosts)

    @property
    def page(self) -> str:
        return str(self.path.relative_to(ROOT))

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.section})"


def pages() -> list[Path]:
    """The README and every page of the docs site (not its build output)."""
    found = sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0][0] not in "_.")
    return [README, *found]


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of a page, in order (directives such as ``{toctree}`` included,
    with their name as ``lang``)."""
    lines = path.read_text().split("\n")
    found: list[Block] = []
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:]
        if not line.startswith("```"):
            i += 1
            continue
        info = line[3:].strip()
        start = i + 1
        lang, caption = info, None
        i += 1
        if info.startswith("{code-block}"):
            lang = info.removeprefix("{code-block}").strip()
            while i < len(lines) and re.match(r"^:\w+:", lines[i]):
                key, _, value = lines[i][1:].partition(":")
                if key == "caption":
                    caption = value.strip().replace("\\", "")  # Markdown escapes: \_\_init
                i += 1
            if i < len(lines) and not lines[i].strip():
                i += 1  # the blank line after the options
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        above = next((x for x in reversed(lines[: start - 1]) if x.strip()), "")
        marked = MARKER.match(above)
        source = "\n".join(body) + "\n"
        found.append(Block(path, start, section, lang, source, caption, marked and marked[1]))
    return found


def python_blocks(path: Path = README) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "python"]


def newcomer_settings() -> list[Block]:
    """What a new user puts into settings.py: the README's settings blocks of Install and
    Settings that run on their own machine (not the ones naming a Sentinel or a cluster's
    hosts)."""
    return [
        b
        for b in python_blocks()
        if b.section in ("Install", "Settings") and b.is_settings and b.local_only
    ]


def github_anchors(path: Path) -> set[str]:
    """The anchors a link into a Markdown page may use: GitHub's slug of each heading (which
    the docs' ``myst_heading_anchors`` makes too) and each MyST label ``(name)=``."""
    text = path.read_text()
    found = set(re.findall(r"^\(([\w-]+)\)=$", text, re.M))
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


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
