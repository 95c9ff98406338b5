"""Fenced transactions (``atomic=``) on SQLite, the tests' default database, and on every
backend: the order of the steps, stale fences, the lost-hold rule, nesting, misuse, the
statements it costs, ``@lock_view(atomic=)`` on real requests, and ``prune-fences``.
PostgreSQL, processes and faults: tests/fenced/test_fenced_postgres.py."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS, connection, transaction
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import path
from django.utils import timezone

from django_redlock import (
    LockError,
    LockLost,
    LockNotOwned,
    StaleFence,
    fencing,
    lock,
    lock_all,
    lock_view,
    locks,
    read_write_lock,
    semaphore,
)
from django_redlock.fence_table import row_key
from django_redlock.models import Fence
from django_redlock.signals import lock_lost

from ..support.fenced_child import open_shop, sales, sell_one

pytestmark = pytest.mark.django_db(transaction=True)
DB = DEFAULT_DB_ALIAS


@pytest.fixture(autouse=True)
def shop() -> None:
    open_shop(DB, 1, 10)


def fence_statements(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if Fence._meta.db_table in q["sql"]]


def recorded(alias: str, name: str) -> int | None:
    row = Fence.objects.filter(key=row_key(alias, name)).first()
    return None if row is None else row.fence


def stock() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT stock FROM shop_ticket WHERE id = 1")
        return int(cursor.fetchone()[0])


# -- the order of the steps ----------------------------------------------------------------


def test_the_body_runs_in_a_transaction_committed_before_the_release(alias: str, name: str):
    seen: list[Any] = []
    with lock(name, using=alias, atomic=True) as held:
        assert connection.in_atomic_block
        sell_one(DB, 1, "a")
        # At the commit the lock is still held: the release comes after it.
        transaction.on_commit(lambda: seen.append(lock(name, using=alias).locked()))
        fence = held.fence
    assert seen == [True]
    assert not lock(name, using=alias).locked()
    assert sales(DB) == [("a", 10)] and recorded(alias, name) == fence


def test_the_body_s_exception_rolls_back_and_releases(alias: str, name: str) -> None:
    with pytest.raises(ZeroDivisionError), lock(name, using=alias, atomic=True):
        sell_one(DB, 1, "a")
        1 / 0  # noqa: B018
    assert sales(DB) == [] and stock() == 10
    assert not lock(name, using=alias).locked()


def test_a_stale_hold_raises_before_the_body_and_commits_nothing(alias: str, name: str):
    old = lock(name, using=alias, ttl=30)
    assert old.acquire()
    assert locks[alias].force_release(name)  # lost in Redis, without its holder knowing
    # (A timeout: this thread's own old hold would otherwise be refused as a self-wait.)
    with lock(name, using=alias, atomic=True, timeout=5) as new:
        sell_one(DB, 1, "new")
        newer = new.fence
    assert newer and old.fence and newer > old.fence
    ran = []
    with pytest.raises(StaleFence) as caught, old.atomic():
        ran.append(sell_one(DB, 1, "old"))
    assert ran == [] and sales(DB) == [("new", 10)]
    assert isinstance(caught.value, LockLost)
    assert (caught.value.fence, caught.value.recorded) == (old.fence, newer)
    assert recorded(alias, name) == newer


def test_with_a_stale_hold_releases_the_lock_it_took(name: str) -> None:
    Fence.objects.create(
        key=row_key("default", name), backend="default", name=name, fence=2**62,
        touched=timezone.now(),
    )  # fmt: skip
    with pytest.raises(StaleFence), lock(name, atomic=True):
        pytest.fail("the body ran")
    assert not lock(name).locked() and sales(DB) == []


def test_two_blocks_of_one_hold_keep_its_fence(name: str) -> None:
    held = lock(name)
    held.acquire()
    with held.atomic():
        sell_one(DB, 1, "first")
    with held.atomic():
        sell_one(DB, 1, "second")
    assert recorded("default", name) == held.fence
    held.release()
    assert [b for b, _ in sales(DB)] == ["first", "second"]


def test_the_decorator_form(name: str) -> None:
    @lock("ticket:{pk}", atomic=True)
    def sell(pk: int) -> bool:
        assert connection.in_atomic_block
        return sell_one(DB, pk, "decorated")

    assert sell(1)
    assert recorded("default", "ticket:1") is not None and sales(DB) == [("decorated", 10)]


# -- the lost-hold rule ---------------------------------------------------------------------


@pytest.fixture
def lost() -> Iterator[list[str]]:
    reasons: list[str] = []

    def note(**kwargs: Any) -> None:
        reasons.append(kwargs["reason"])

    lock_lost.connect(note, weak=False)
    yield reasons
    lock_lost.disconnect(note)


def test_a_hold_lost_in_the_body_commits_and_raises_nothing(name: str, lost: list[str]) -> None:
    """The transaction committed in fence order: raising would invite a retry, a second
    sale. The loss is signalled and logged instead."""
    with lock(name, ttl=30, atomic=True) as held:
        sell_one(DB, 1, "a")
        assert locks["default"].force_release(name)
    assert sales(DB) == [("a", 10)] and len(lost) == 1
    assert held.lost


def test_a_hold_lost_in_a_failing_body_rolls_back_and_raises_the_body_s_error(name: str):
    with pytest.raises(ZeroDivisionError), lock(name, ttl=30, atomic=True):
        sell_one(DB, 1, "a")
        assert locks["default"].force_release(name)
        1 / 0  # noqa: B018
    assert sales(DB) == []


def test_redis_down_at_the_release_after_a_commit_raises_nothing(
    name: str, redis_factory: Any
) -> None:
    from django.conf import settings
    from django.test import override_settings

    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
              "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "brief": config}):
        with lock(name, using="brief", ttl=30, atomic=True):
            sell_one(DB, 1, "a")
            server.kill()
        assert sales(DB) == [("a", 10)]  # committed, and no BackendUnavailable to retry on
        assert [d.lock.name for d in fencing._owed()] == [name]  # type: ignore[attr-defined]
        server.restart()  # back (empty): the owed release is settled (nothing held) ...
        fencing.pay_owed()  # ... as the thread's next fenced block or request end would
        assert not fencing._owed()  # type: ignore[attr-defined]


class BodyError(Exception):
    pass


@pytest.mark.parametrize("how", ["lock", "lock_all"])
def test_redis_down_at_the_release_after_a_rollback_raises_the_body_s_exception(
    name: str, redis_factory: Any, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """The body raised, Redis is gone as the rolled-back block releases: the body's exception
    comes out (``BackendUnavailable`` did: review fen, 4), the failed release is logged as
    failed (it said "released now") and stays owed."""
    from django.conf import settings
    from django.test import override_settings

    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
              "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "brief": config}):
        names = [name] if how == "lock" else [name, f"{name}:2"]
        held = lock(name, using="brief", ttl=30, atomic=True) if how == "lock" else (
            lock_all(*names, using="brief", ttl=30, atomic=True)
        )  # fmt: skip
        with pytest.raises(BodyError), held:
            sell_one(DB, 1, "a")
            server.kill()
            raise BodyError()
        assert sales(DB) == []
        assert "released now" not in caplog.text and "release then failed" in caplog.text
        owed = [d.lock.name for d in fencing._owed()]  # type: ignore[attr-defined]
        assert owed == names
        server.restart()  # back (empty): the owed release is settled (nothing held)
        fencing.pay_owed()
        assert not fencing._owed()  # type: ignore[attr-defined]


def test_on_redlock_the_fence_is_the_majority_s(name: str, redis_factory: Any) -> None:
    """Two of three nodes lose the hold and their counters (a failover to empty replicas):
    the next hold's fence, the majority's, is above the old one, which is refused."""
    from ..redlock.test_redlock import quorum_alias

    nodes = [redis_factory() for _ in range(3)]
    with quorum_alias("quorum", nodes):
        old = lock(name, using="quorum", ttl=30, auto_renew=False)
        assert old.acquire()
        for node in nodes[:2]:
            node.client().flushall()
        time.sleep(0.002)  # (a fence in the same ms: the Lua's fence-after-flush fix)
        with lock(name, using="quorum", ttl=30, atomic=True, timeout=5) as new:
            sell_one(DB, 1, "new")
            newer = new.fence
        assert newer and old.fence and newer > old.fence
        with pytest.raises(StaleFence), old.atomic():
            sell_one(DB, 1, "old")
    assert sales(DB) == [("new", 10)] and recorded("quorum", name) == newer


# -- nesting ---------------------------------------------------------------------------------


def test_a_reentry_keeps_the_fence_and_nests_as_a_savepoint(alias: str, name: str) -> None:
    held = lock(name, using=alias, reentrant=True, atomic=True)
    with held:
        fence = held.fence
        sell_one(DB, 1, "outer")
        with pytest.raises(ZeroDivisionError), held:
            assert held.fence == fence and held.hold_count() == 2
            assert connection.savepoint_ids  # a savepoint of the outer block
            sell_one(DB, 1, "inner")
            1 / 0  # noqa: B018
        with held:
            sell_one(DB, 1, "inner again")
    assert [b for b, _ in sales(DB)] == ["outer", "inner again"]
    assert recorded(alias, name) == fence and not held.locked()


def test_inside_an_outer_transaction_the_block_is_a_savepoint(name: str) -> None:
    with transaction.atomic():
        with lock(name, atomic=True):
            assert connection.savepoint_ids
            sell_one(DB, 1, "a")
        assert not lock(name).locked()  # released before the outer commit: harmless, as
        # the lock's row stays locked (on SQLite, the whole database) until that commit
    assert sales(DB) == [("a", 10)]


def fair_or_write(kind: str, alias: str, name: str, **atomic: Any) -> Any:
    if kind == "fair":
        return lock(name, using=alias, fair=True, **atomic)
    return read_write_lock(name, using=alias).write(**atomic)


@pytest.mark.parametrize("kind", ["fair", "write"])
def test_fair_locks_and_write_locks(alias: str, name: str, kind: str) -> None:
    with fair_or_write(kind, alias, name, atomic=True) as held:
        sell_one(DB, 1, kind)
        fence = held.fence
    assert recorded(alias, name) == fence and sales(DB) == [(kind, 10)]
    Fence.objects.filter(key=row_key(alias, name)).update(fence=2**62)
    with pytest.raises(StaleFence), fair_or_write(kind, alias, name, atomic=DB):
        pytest.fail("the body ran")
    assert not fair_or_write(kind, alias, name).locked()


# -- what it costs ---------------------------------------------------------------------------


def test_one_statement_of_fence_work_per_block_two_the_first_time(name: str) -> None:
    with CaptureQueriesContext(connection) as first, lock(name, atomic=True):
        pass
    with CaptureQueriesContext(connection) as common, lock(name, atomic=True):
        pass
    assert len(fence_statements(first)) == 2  # the upsert, and the floor of a new row
    assert len(fence_statements(common)) == 1  # the upsert alone
    assert fence_statements(common)[0].startswith("INSERT INTO")
    stale = lock(name)
    stale.acquire()
    Fence.objects.filter(key=row_key("default", name)).update(fence=2**62)
    with CaptureQueriesContext(connection) as refused, pytest.raises(StaleFence), stale.atomic():
        pass
    assert len(fence_statements(refused)) == 2  # the upsert, then the fence that won
    stale.release()


def test_the_portable_path_for_other_databases(name: str, monkeypatch: Any) -> None:
    """Databases without INSERT ... ON CONFLICT ... RETURNING: SELECT FOR UPDATE, then
    UPDATE or INSERT, with the same outcomes."""
    monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)
    fences = []
    for buyer in "ab":
        with lock(name, atomic=True) as held:
            sell_one(DB, 1, buyer)
            fences.append(held.fence)
    assert recorded("default", name) == fences[1] and fences[1] > fences[0]
    Fence.objects.filter(key=row_key("default", name)).update(fence=2**62)
    with pytest.raises(StaleFence), lock(name, atomic=True):
        pass
    assert len(sales(DB)) == 2


@pytest.mark.parametrize("path", ["returning", "portable"])
def test_a_block_keeps_the_fence_and_mark_it_overwrote(
    name: str, monkeypatch: Any, path: str
) -> None:
    """Each block's write keeps what it overwrote (``previous``, ``previous_mark``): a lost
    COMMIT's check looks there once another block wrote on top. "portable": the path of
    databases without RETURNING."""
    if path == "portable":
        monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)
    key = row_key("default", name)
    with lock(name, atomic=True):
        pass
    first = Fence.objects.get(key=key)
    assert first.mark is not None and (first.previous, first.previous_mark) == (None, None)
    with lock(name, atomic=True):
        pass
    second = Fence.objects.get(key=key)
    assert (second.previous, second.previous_mark) == (first.fence, first.mark)
    assert second.mark not in (None, first.mark)


# -- misuse: clear errors before any Redis call (backend "down" listens nowhere) ----------------


def test_bad_atomic_arguments() -> None:
    with pytest.raises(ValueError, match="names no database"):
        lock("x", using="down", atomic="nope")
    with pytest.raises(TypeError, match="atomic must be"):
        lock("x", using="down", atomic=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="atomic"):
        semaphore("x", 2, using="down", atomic=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="write"):
        read_write_lock("x", using="down").read(atomic=True)
    with pytest.raises(ValueError, match="names no database"):
        read_write_lock("x", using="down").write(atomic="nope")
    with pytest.raises(ValueError, match="limit"):
        lock_view("x", limit=2, atomic=True)
    with pytest.raises(ValueError, match="names no database"):
        lock_view("x", atomic="nope")
    with semaphore("x", 2, using="local") as held, pytest.raises(TypeError, match="exclusive"):
        held.atomic().__enter__()


def test_single_instance_checks_atomic_when_decorating() -> None:
    from django_redlock import single_instance

    with pytest.raises(ValueError, match="limit"):
        single_instance(limit=2, atomic=True)
    with pytest.raises(ValueError, match="names no database"):
        single_instance(atomic="nope")


def test_asyncio_refuses_a_fenced_block_naming_sync_to_async() -> None:
    held = lock("x", using="down", atomic=True)

    async def enter() -> None:
        async with held:
            pass

    for attempt in (enter(), held.aacquire()):
        with pytest.raises(LockError, match="sync_to_async") as caught:
            asyncio.run(attempt)  # type: ignore[arg-type]
        assert type(caught.value) is LockError  # not BackendUnavailable: Redis never asked
    with pytest.raises(LockError, match="sync_to_async"):

        @lock("x", using="down", atomic=True)
        async def locked() -> None: ...

    with pytest.raises(LockError, match="sync_to_async"):

        @lock_view("x", using="down", atomic=True)
        async def view(request: HttpRequest) -> HttpResponse: ...


def test_atomic_on_a_lock_not_held_raises_without_touching_the_database(name: str) -> None:
    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(LockNotOwned), lock(name).atomic():
            pass
        held = lock(name, ttl=30)
        held.acquire()
        locks["default"].force_release(name)
        assert not held.owned()  # now known lost
        with pytest.raises(LockLost), held.atomic():
            pass
    assert queries.captured_queries == []


# -- @lock_view(atomic=) on real requests -------------------------------------------------------


@lock_view("order:{pk}", atomic=True)
def buy(request: HttpRequest, pk: int) -> HttpResponse:
    sold = sell_one(DB, pk, "view")
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after selling")
    return HttpResponse(f"sold={sold} atomic={connection.in_atomic_block}")


urlpatterns = [path("buy/<int:pk>/", buy)]


@pytest.fixture
def urls(settings: Any) -> None:
    settings.ROOT_URLCONF = __name__


@pytest.mark.parametrize("atomic_requests", [False, True])
def test_lock_view_atomic(urls: None, atomic_requests: bool) -> None:
    from django.db import connections

    connections[DB].settings_dict["ATOMIC_REQUESTS"] = atomic_requests
    try:
        response = Client().get("/buy/1/")
        assert response.content == b"sold=True atomic=True"
        assert sales(DB) == [("view", 10)] and recorded("default", "order:1") is not None
        failed = Client(raise_request_exception=False).get("/buy/1/?fail=1")
        assert failed.status_code == 500 and sales(DB) == [("view", 10)]  # rolled back
        assert not lock("order:1").locked()
        Fence.objects.filter(key=row_key("default", "order:1")).update(fence=2**62)
        stale = Client().get("/buy/1/")
        assert stale.status_code == 409 and stale["Retry-After"] == "1"
        assert sales(DB) == [("view", 10)] and not lock("order:1").locked()
    finally:
        connections[DB].settings_dict["ATOMIC_REQUESTS"] = False


# -- manage.py redlock prune-fences ---------------------------------------------------------------


def test_prune_fences_drops_old_rows_and_keeps_refusing_what_they_refused(name: str) -> None:
    stale = lock(name, ttl=30)
    stale.acquire()
    locks["default"].force_release(name)
    with lock(name, atomic=True, timeout=5) as held:
        newer = held.fence
    with lock(f"{name}:recent", atomic=True):
        pass
    two_days_ago = timezone.now() - datetime.timedelta(days=2)
    Fence.objects.filter(name=name).update(touched=two_days_ago)
    call_command("redlock", "prune-fences", "--older-than", "1d")
    assert recorded("default", name) is None  # pruned
    assert recorded("default", f"{name}:recent") is not None  # touched today: kept
    assert recorded("default", "") == newer  # the backend's floor
    # The stale holder finds no row, but the floor: still refused.
    with pytest.raises(StaleFence), stale.atomic():
        pass
    # A new hold's fence comes from the server's clock: above the floor.
    with lock(name, atomic=True, timeout=5) as held:
        sell_one(DB, 1, "fresh")
        assert held.fence > newer  # type: ignore[operator]
    assert sales(DB) == [("fresh", 10)]


@pytest.mark.parametrize("path", ["returning", "portable"])
def test_prune_fences_deletes_by_age_in_one_statement_and_sends_no_delete_signal(
    name: str, path: str, monkeypatch: Any
) -> None:
    """The ORM's delete() with a receiver connected selected the rows, then deleted them by
    key, without their age: a row a block touched in between was lost (PostgreSQL's test
    shows the stale commit that followed). "portable": databases without DELETE ...
    RETURNING lock the old rows first, then delete them by key and age."""
    from django.db.models.signals import pre_delete

    from django_redlock.fence_table import prune_fences

    with lock(name, atomic=True) as held:
        fence = held.fence
    with lock(f"{name}:recent", atomic=True):
        pass
    Fence.objects.filter(name=name).update(touched=timezone.now() - datetime.timedelta(days=2))
    if path == "portable":
        monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)
    called: list[Any] = []
    pre_delete.connect(lambda **kw: called.append(kw), sender=Fence, weak=False,
                       dispatch_uid="audit")  # fmt: skip
    try:
        with CaptureQueriesContext(connection) as queries:
            assert prune_fences(DB, datetime.timedelta(days=1)) == 1
    finally:
        pre_delete.disconnect(sender=Fence, dispatch_uid="audit")
    assert called == []
    deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("DELETE")]
    assert len(deletes) == 1 and ("RETURNING" in deletes[0]) == (path == "returning")
    assert recorded("default", name) is None and recorded("default", "") == fence
    assert recorded("default", f"{name}:recent") is not None


def test_prune_fences_needs_an_age_and_a_known_database() -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="a number and a unit"):
        call_command("redlock", "prune-fences", "--older-than", "30")
    with pytest.raises(CommandError, match="names no database") as caught:
        call_command("redlock", "prune-fences", "--older-than", "30d", "--database", "nope")
    assert caught.value.returncode == 2
