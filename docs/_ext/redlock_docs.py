"""The object types these docs define, so that the reference can be linked to (and checked):
settings, system checks by id, metrics and ``manage.py redlock`` subcommands; and the
``{bench}`name``` role, which quotes a figure of the last full `make bench` run
(bench/results.json, through bench/figures.py): a page cannot quote a figure that drifted,
and a missed target is shown as missed wherever its figure is quoted."""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.parsers.rst.states import Inliner
from sphinx.application import Sphinx

from bench.figures import RESULTS, Figure, figures

_FIGURES: dict[str, Figure] = {}


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


def setup(app: Sphinx) -> dict[str, Any]:
    # As Django's own docs do for settings: {setting}`DJANGO_REDLOCK` links to its entry.
    app.add_crossref_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_crossref_type("check", "check", indextemplate="pair: %s; system check")
    app.add_crossref_type("metric", "metric", indextemplate="pair: %s; metric")
    app.add_crossref_type("djadmin", "djadmin", indextemplate="pair: %s; manage.py command")
    app.add_role("bench", bench_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
