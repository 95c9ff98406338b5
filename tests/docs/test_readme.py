"""Every Python block of the README runs as written: settings blocks as settings (on the
suite's own redis-server where they name 127.0.0.1), code blocks against the test servers;
and every link of the README resolves. The docs pages: tests/docs/test_docs.py."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import lock, locks
from django_redlock.checks import check_shared_cache_db, check_unknown_settings
from django_redlock.testing import RedisServer

from ..conftest import ROOT
from ..support.docs_runner import LOCMEM, PLACEHOLDERS, on_server, project_settings, run_group
from ..support.readme import (
    README,
    Block,
    apply_settings,
    github_anchors,
    newcomer_settings,
    python_blocks,
)

BLOCKS = python_blocks()
SETTINGS = [b for b in BLOCKS if b.is_settings]
CODE = [b for b in BLOCKS if not b.is_settings]
_serial = itertools.count()


def _ours() -> list[str]:
    """What this app's system checks say (not the whole project's: the test URLconf)."""
    found = check_shared_cache_db() + check_unknown_settings()
    return [f"{m.id} {m.obj}" for m in found]


def test_the_readme_has_the_blocks_this_file_tests() -> None:
    assert len(SETTINGS) >= 3 and len(CODE) >= 4
    sections = [b.section for b in newcomer_settings()]
    assert sections == ["Install", "Settings", "Settings"]
    assert any(name in b.source for b in CODE for name in PLACEHOLDERS)


def test_the_readme_fits_a_newcomer_s_screens() -> None:
    """What it is, two commands, install, settings, three examples, features, links: the
    rest lives in docs/."""
    text = README.read_text()
    assert len(text.splitlines()) < 250
    headings = re.findall(r"^## (.+)$", text, re.M)
    for needed in ("Quick start", "Install", "Settings", "Three examples", "Features"):
        assert needed in headings
    assert "oversell" in text.split("## ", 1)[0]  # the why, before the first section


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.source, str(block), "exec")


def test_the_newcomer_s_settings_take_locks_on_every_alias(redis_server: RedisServer) -> None:
    """Install + Settings, pasted in order into a project's settings, on a real Redis."""
    project = project_settings()
    # A new project has no django-redis cache: the block must bring the one it needs.
    applied = {**project, "CACHES": {"default": {"BACKEND": LOCMEM}}}
    for block in newcomer_settings():
        applied.update(apply_settings(on_server(redis_server, block), applied))
    assert applied["INSTALLED_APPS"] == project["INSTALLED_APPS"]  # it was already there
    assert set(applied["DJANGO_REDLOCK"]) == {"default", "local", "cache"}
    assert applied["CACHES"]["default"]["BACKEND"] == "django_redis.cache.RedisCache"
    with override_settings(**{k: v for k, v in applied.items() if v != project.get(k)}):
        for alias in settings.DJANGO_REDLOCK:
            held = lock(f"readme:{alias}:{next(_serial)}", using=alias, timeout=1)
            with held:
                assert held.fence and held.owned() and locks[alias].is_locked(held.name)
            assert not held.locked()
        # As the README says: the "cache" alias, and only it, shares the cache's database.
        assert _ours() == ["django_redlock.W001 DJANGO_REDLOCK['cache']"]


def test_the_main_settings_block_alone_passes_manage_py_check(redis_server: RedisServer) -> None:
    project = project_settings()
    applied = {**project, "CACHES": {"default": {"BACKEND": LOCMEM}}}
    for block in newcomer_settings()[:2]:  # Install, and the Settings block with CACHES
        applied.update(apply_settings(on_server(redis_server, block), applied))
    assert set(applied["DJANGO_REDLOCK"]) == {"default", "local"}
    with override_settings(DJANGO_REDLOCK=applied["DJANGO_REDLOCK"], CACHES=applied["CACHES"]):
        assert _ours() == []
        with lock("readme:main", timeout=1) as held:
            assert held.owned()


SECTIONS = list(dict.fromkeys(b.section for b in CODE))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s or "intro")
def test_every_code_block_runs(section: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """A section's blocks run in order in one namespace, as a reader reads them; a Redis URL
    in a block points at the suite's server. A block marked as needing fenced transactions
    is compiled above, and run once that feature is merged (the marker removed)."""
    run_group([b for b in BLOCKS if b.section == section], redis_server, tmp_path)


def test_every_link_of_the_readme_resolves() -> None:
    """Local links only (nothing here can rot unseen): each file exists, and each #anchor is
    a heading or label of the page it points into (the docs keep GitHub's heading anchors)."""
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert "docs/demo-home.png" in links and "docs/tutorial/index.md" in links
    broken = []
    for link in links:
        assert not re.match(r"\w+://", link), f"an external link in the README: {link}"
        target, _, anchor = link.partition("#")
        path = ROOT / target
        if not path.exists() or (anchor and anchor not in github_anchors(path)):
            broken.append(link)
    assert broken == []


def test_no_readme_block_is_kept_from_running() -> None:
    assert [b for b in BLOCKS if b.needs] == []


def test_the_readme_s_figures_are_the_last_bench_run_s() -> None:
    """Each figure of the README is a span ``<!-- bench: name -->...<!-- /bench -->`` that
    ``python -m bench.figures`` writes from bench/results.json: one that differs fails here."""
    from bench.figures import SPAN, figures, render_spans

    text = README.read_text()
    spans = SPAN.findall(text)
    assert spans, "the README quotes the bench through spans"
    found = figures()
    assert [(n, v) for n, v in spans if found[n].markdown() != v] == []
    assert render_spans(text) == text
