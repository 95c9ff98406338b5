"""The object types these docs define, so that the reference can be linked to (and checked):
settings, system checks by id, metrics and ``manage.py redlock`` subcommands."""

from __future__ import annotations

from typing import Any

from sphinx.application import Sphinx


def setup(app: Sphinx) -> dict[str, Any]:
    # As Django's own docs do for settings: {setting}`DJANGO_REDLOCK` links to its entry.
    app.add_crossref_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_crossref_type("check", "check", indextemplate="pair: %s; system check")
    app.add_crossref_type("metric", "metric", indextemplate="pair: %s; metric")
    app.add_crossref_type("djadmin", "djadmin", indextemplate="pair: %s; manage.py command")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
