"""``manage.py redlock``: output and exit codes."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import lock, locks

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> tuple[str, int]:
    out, err = StringIO(), StringIO()
    try:
        call_command("redlock", *args, stdout=out, stderr=err)
        code = 0
    except CommandError as exc:
        return str(exc), exc.returncode
    except SystemExit as exc:
        code = int(exc.code or 0)
    return out.getvalue() + err.getvalue(), code


def test_list_as_a_table_and_as_json() -> None:
    with lock("cmd:a", using="redis", ttl=20), lock("cmd:b", using="local", reentrant=True):
        text, code = run("list", "--backend", "redis")
        assert code == 0 and "cmd:a" in text and "BACKEND" in text and "cmd:b" not in text
        text, code = run("list", "--match", "cmd:*", "--json", "--backend", "local")
        data = json.loads(text)
        assert code == 0 and [row["name"] for row in data["locks"]] == ["cmd:b"]
        assert data["locks"][0]["kind"] == "reentrant"


def test_list_with_a_backend_down_says_so_and_exits_3() -> None:
    text, code = run("list")
    assert code == 3 and "backend 'down' is unavailable" in text


def test_release() -> None:
    held = lock("cmd:r", using="redis", auto_renew=False)
    held.acquire()
    text, code = run("release", "cmd:r", "--backend", "redis")
    assert code == 0 and "released" in text
    assert not held.locked()
    text, code = run("release", "cmd:r", "--backend", "redis")
    assert code == 1 and "not held" in text
    text, code = run("release", "x", "--backend", "nope")
    assert code == 2 and "unknown backend" in text


def test_purge_needs_yes() -> None:
    for i in range(3):
        lock(f"purge:{i}", using="redis").acquire()
    text, code = run("purge", "--match", "purge:*", "--backend", "redis")
    assert code == 1 and "--yes" in text
    assert locks["redis"].is_locked("purge:0")
    text, code = run("purge", "--match", "purge:*", "--backend", "redis", "--yes")
    assert code == 0 and "released 3 locks" in text
    assert not any(locks["redis"].is_locked(f"purge:{i}") for i in range(3))
    text, code = run("purge", "--match", "purge:*", "--backend", "redis", "--yes")
    assert code == 1 and "no held lock matches" in text


def test_prune_incidents() -> None:
    text, code = run("prune-incidents")
    assert code == 0 and "deleted 0 lock incidents" in text
