"""The object types these docs define, so that the reference can be linked to (and checked):
settings, system checks by id, metrics and ``manage.py redlock`` subcommands; and the
``{bench}`name``` role, which quotes a figure of the last full `make bench` run
(bench/results.json, through bench/figures.py): a page cannot quote a figure that drifted,
and a missed target is shown as missed wherever its figure is quoted.

Once the HTML is written, two offline checks run, each finding a warning (so, under -W, a
failed build): every local link and image of the built site must reach an existing file,
and an ``#anchor`` an id of that page (Sphinx's own linkcheck needs the network, and would
not see a Markdown link's anchor); and codespell's list of common misspellings runs over the
pages' sources, the README, the CHANGELOG and the docstrings autodoc shows.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from docutils import nodes
from docutils.parsers.rst.states import Inliner
from sphinx.application import Sphinx
from sphinx.util import logging

from bench.figures import RESULTS, Figure, figures

_FIGURES: dict[str, Figure] = {}
ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)
#: Where a misspelling shows to a reader: the pages, what they include, the docstrings.
SPELLED = ["docs", "README.md", "CHANGELOG.md", "bench/README.md", "django_redlock"]
#: Words codespell's list takes for misspellings that are right here, one a line.
SPELLING_IGNORE = Path(__file__).with_name("spelling-ignore.txt")


def bench_role(
    name: str, rawtext: str, text: str, lineno: int, inliner: Inliner,
    options: dict[str, Any] | None = None, content: list[str] | None = None,
) -> tuple[list[nodes.Node], list[nodes.system_message]]:  # fmt: skip
    """``{bench}`contended.ours.handoff_p50``` -> "0.49 ms"; a missed target adds
    "(target < 1 ms: **missed**)". An unknown name is an error (so, with -W, a failed build)."""
    if not _FIGURES:
        _FIGURES.update(figures())
    figure = _FIGURES.get(text.strip())
    env = inliner.document.settings.env
    env.note_dependency(str(RESULTS))
    if figure is None:
        message = inliner.reporter.error(
            f"no bench figure {text!r} (python -m bench.figures --list)", line=lineno
        )
        return [inliner.problematic(rawtext, rawtext, message)], [message]
    quoted: list[nodes.Node] = [nodes.inline(rawtext, figure.value, classes=["bench-figure"])]
    if figure.missed:
        quoted += [
            nodes.Text(f" (target {figure.target}: "),
            nodes.strong("", "missed", classes=["bench-missed"]),
            nodes.Text(")"),
        ]
    return quoted, []


def broken_links(outdir: Path) -> list[str]:
    """Each local ``href`` or ``src`` of the built pages whose file is missing, or whose
    ``#anchor`` is no id of that page, as "page: link"."""
    pages = {p: p.read_text() for p in outdir.rglob("*.html")
             if not p.relative_to(outdir).parts[0].startswith("_")}  # fmt: skip
    ids: dict[Path, set[str]] = {}
    broken = []
    for page, html in sorted(pages.items()):
        for link in re.findall(r'(?:href|src)="([^"]+)"', html):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|//", link):
                continue  # another site (or mailto:): not checked, offline
            target, _, anchor = link.partition("#")
            target = target.partition("?")[0]  # a static file's ?v=<hash>
            path = (page.parent / unquote(target)).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(outdir)}: {link}")
                continue
            if anchor and path.suffix == ".html":
                if path not in ids:
                    text = pages.get(path) or path.read_text()
                    ids[path] = set(re.findall(r'\sid="([^"]+)"', text))
                if unquote(anchor) not in ids[path]:
                    broken.append(f"{page.relative_to(outdir)}: {link}")
    return broken


def misspellings(paths: list[str] = SPELLED) -> list[str]:
    """codespell's findings ("file:line: word ==> fix"), over what a reader reads."""
    command = [sys.executable, "-m", "codespell_lib", "--skip", "*/_build/*,*/_inventories/*,*.png",
               "--ignore-words", str(SPELLING_IGNORE), *paths]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 65):  # 65: it found misspellings
        return [f"codespell failed: {done.stderr.strip() or done.returncode}"]
    return done.stdout.splitlines()


def check_site(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    for link in broken_links(Path(app.outdir)):
        logger.warning("broken local link: %s", link, type="redlock", subtype="links")
    for found in misspellings():
        logger.warning("misspelt: %s", found, type="redlock", subtype="spelling")


def setup(app: Sphinx) -> dict[str, Any]:
    # As Django's own docs do for settings: {setting}`DJANGO_REDLOCK` links to its entry.
    app.add_crossref_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_crossref_type("check", "check", indextemplate="pair: %s; system check")
    app.add_crossref_type("metric", "metric", indextemplate="pair: %s; metric")
    app.add_crossref_type("djadmin", "djadmin", indextemplate="pair: %s; manage.py command")
    app.add_role("bench", bench_role)
    app.connect("build-finished", check_site)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
