"""Every Python block of the README runs as written: settings blocks as settings (on the
suite's own redis-server where they name 127.0.0.1), code blocks against the test servers."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import lock, locks
from django_redlock.checks import check_shared_cache_db, check_unknown_settings
from django_redlock.handler import LockHandler
from django_redlock.testing import RedisServer

from .readme import Block, apply_settings, newcomer_settings, python_blocks


def _placeholder(*args: Any, **kwargs: Any) -> None:
    """A function of the reader's own (``charge(...)``, ``sync()``): the README calls it."""


class _Ticket:
    """The reader's model in "Locks and database transactions" (``Ticket.objects.get(pk=7)``,
    ``.left``, ``.save()``): a row of the shop table of tests/fenced_child.py, so the
    README's fenced blocks really write in their transactions."""

    def __init__(self, pk: int, left: int) -> None:
        self.pk, self.left = pk, left

    class objects:  # the manager's name in Django
        @staticmethod
        def get(pk: int) -> _Ticket:
            from django.db import connection

            with connection.cursor() as cursor:
                cursor.execute("SELECT stock FROM shop_ticket WHERE id = %s", [pk])
                return _Ticket(pk, cursor.fetchone()[0])

    def save(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("UPDATE shop_ticket SET stock = %s WHERE id = %s", [self.left, self.pk])


#: Names the README's code uses for the reader's own code and data.
PLACEHOLDERS = {"charge": _placeholder, "invoice": object(), "sync": _placeholder,
                "export": _placeholder, "debit": _placeholder, "show": _placeholder,
                "rebuild": _placeholder, "catalog": object(), "Ticket": _Ticket}  # fmt: skip

LOCMEM = "django.core.cache.backends.locmem.LocMemCache"  # a new project's CACHES
BLOCKS = python_blocks()
SETTINGS = [b for b in BLOCKS if b.is_settings]
CODE = [b for b in BLOCKS if not b.is_settings]
_serial = itertools.count()


def _ours() -> list[str]:
    """What this app's system checks say (not the whole project's: the test URLconf)."""
    found = check_shared_cache_db() + check_unknown_settings()
    return [f"{m.id} {m.obj}" for m in found]


def _project_settings() -> dict[str, Any]:
    return {key: getattr(settings, key) for key in dir(settings) if key.isupper()}


def _on(server: RedisServer, block: Block) -> str:
    return block.source.replace("redis://127.0.0.1:6379", f"redis://127.0.0.1:{server.port}")


def test_the_readme_has_the_blocks_this_file_tests() -> None:
    assert len(SETTINGS) >= 5 and len(CODE) >= 7
    sections = [b.section for b in newcomer_settings()]
    assert sections == ["Install", "Settings", "Settings"]
    for name, value in PLACEHOLDERS.items():  # each stands in for something a block uses
        assert any(name in b.source for b in CODE), name
        assert value is not None


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.source, str(block), "exec")


def test_the_newcomer_s_settings_take_locks_on_every_alias(redis_server: RedisServer) -> None:
    """Install + Settings, pasted in order into a project's settings, on a real Redis."""
    project = _project_settings()
    # A new project has no django-redis cache: the block must bring the one it needs.
    applied = {**project, "CACHES": {"default": {"BACKEND": LOCMEM}}}
    for block in newcomer_settings():
        applied.update(apply_settings(_on(redis_server, block), applied))
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
    project = _project_settings()
    applied = {**project, "CACHES": {"default": {"BACKEND": LOCMEM}}}
    for block in newcomer_settings()[:2]:  # Install, and the Settings block with CACHES
        applied.update(apply_settings(_on(redis_server, block), applied))
    assert set(applied["DJANGO_REDLOCK"]) == {"default", "local"}
    with override_settings(DJANGO_REDLOCK=applied["DJANGO_REDLOCK"], CACHES=applied["CACHES"]):
        assert _ours() == []
        with lock("readme:main", timeout=1) as held:
            assert held.owned()


@pytest.mark.parametrize("block", [b for b in SETTINGS if b not in newcomer_settings()], ids=str)
def test_the_other_settings_blocks_are_valid_settings(block: Block) -> None:
    applied = apply_settings(block.source, _project_settings())
    if "DJANGO_REDLOCK" in applied:  # valid backends and keys: what startup checks
        assert LockHandler(applied["DJANGO_REDLOCK"]).settings
    with override_settings(**applied):
        assert check_unknown_settings() == []  # every setting name is one the app reads


#: Sections whose blocks open database transactions: they run with the test database, and
#: ticket 7 of tests/fenced_child.py's shop.
DATABASE = "Locks and database transactions"
SECTIONS = [
    pytest.param(s, marks=pytest.mark.django_db(transaction=True)) if s == DATABASE else s
    for s in dict.fromkeys(b.section for b in CODE)
]


@pytest.mark.parametrize("section", SECTIONS)
def test_every_code_block_runs(section: str, redis_server: RedisServer) -> None:
    """A section's blocks run in order in one namespace, as a reader reads them (the
    reentrant lock's block uses the ``lock`` that "Using locks" imported); a Redis URL in a
    block points at the suite's server."""
    if section == DATABASE:
        from .fenced_child import open_shop

        open_shop("default", 7, 10)
    namespace: dict[str, Any] = {"__name__": "readme", **PLACEHOLDERS}
    for block in (b for b in CODE if b.section == section):
        exec(compile(_on(redis_server, block), str(block), "exec"), namespace)
        for name in re.findall(r'lock\("([^"{]+)"', block.source):  # none left held
            assert not lock(name).locked(), f"{block} left {name!r} held"
    if section == DATABASE:  # the fenced blocks committed their sales
        assert _Ticket.objects.get(pk=7).left < 10


def test_every_local_link_of_the_readme_exists() -> None:
    from .conftest import ROOT
    from .readme import README

    links = re.findall(r"\]\(((?:docs|bench)/[^)#]+)\)", README.read_text())
    assert "docs/demo-home.png" in links
    assert [link for link in links if not (ROOT / link).exists()] == []
