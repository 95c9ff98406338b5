"""Fenced transactions on a real PostgreSQL (READ COMMITTED, Django's default there): the
oversell of a lock released before the commit, and its end; real processes; holders paused
(SIGSTOP) past their TTL before and inside their block; a failover to an empty Redis."""

from __future__ import annotations

import contextlib
import datetime
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import DatabaseError, IntegrityError, OperationalError, connections, transaction
from django.db.models.signals import pre_delete
from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import path
from django.utils import timezone

from django_redlock import StaleFence, lock, lock_view, locks, read_write_lock
from django_redlock.fence_table import prune_fences, row_key
from django_redlock.models import Fence
from django_redlock.testing import RedisServer

from ..conftest import Child
from ..support.fenced_child import open_shop, sales, sell_one

PG = "postgres"
pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)


def eventually(condition: Callable[[], Any], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def waiting_on_a_row() -> int:
    """How many sessions of the test database wait for a lock (a row another holds)."""
    config = connections[PG].settings_dict
    with psycopg.connect(
        host=config["HOST"], port=config["PORT"], user=config["USER"], dbname=config["NAME"],
        autocommit=True,
    ) as conn:  # fmt: skip
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def run(target: Callable[[], None]) -> threading.Thread:
    """``target`` in a thread that closes its own database connections."""

    def body() -> None:
        try:
            target()
        finally:
            connections.close_all()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


# -- the oversell of a lock released before the commit ----------------------------------------


def two_buyers(name: str, atomic: bool) -> list[tuple[str, int]]:
    """One seat. The first buyer's lock is taken inside its transaction (ATOMIC_REQUESTS)
    and released before the commit; the second buyer takes the lock meanwhile. The first
    commits once the second read the stock, or waits for the first's transaction."""
    open_shop(PG, 1, 1)
    released, read = threading.Event(), threading.Event()
    database = PG if atomic else None

    def first() -> None:
        with transaction.atomic(using=PG):
            with lock(name, ttl=10, atomic=database):
                sell_one(PG, 1, "first")
            released.set()
            eventually(lambda: read.is_set() or waiting_on_a_row(), "the second buyer's read")

    def second() -> None:
        assert released.wait(30)
        with transaction.atomic(using=PG), lock(name, ttl=10, timeout=30, atomic=database):
            sell_one(PG, 1, "second", after_read=read.set)

    threads = [run(first), run(second)]
    for thread in threads:
        thread.join(60)
    return sales(PG)


def test_the_harness_reproduces_the_oversell_of_a_lock_released_before_the_commit(name: str):
    """Without atomic=: the second buyer reads the stock the first has not committed yet."""
    assert two_buyers(name, atomic=False) == [("first", 1), ("second", 1)]  # 2 of 1 seat


def test_atomic_inside_an_outer_transaction_waits_for_its_commit(name: str) -> None:
    """The lock's row stays locked until the first buyer's outer transaction ends: the
    second buyer's body starts after it, and reads the stock it committed."""
    assert two_buyers(name, atomic=True) == [("first", 1)]


@pytest.mark.parametrize("kind", ["plain", "reentrant", "fair", "write", "portable"])
def test_buyers_in_threads_sell_exactly_the_stock(name: str, kind: str, monkeypatch: Any):
    """Each exclusive kind; "portable": the SELECT FOR UPDATE path of other databases (the
    first blocks race to insert the row)."""
    open_shop(PG, 1, 6)
    if kind == "portable":
        features = type(connections[PG].features)
        monkeypatch.setattr(features, "can_return_columns_from_insert", False)

    def held() -> Any:
        if kind == "write":
            return read_write_lock(name, ttl=10).write(atomic=PG)
        return lock(name, ttl=10, atomic=PG, reentrant=kind == "reentrant", fair=kind == "fair")

    def buyer(tag: str) -> None:
        for _ in range(4):
            with transaction.atomic(using=PG):
                with held():
                    sell_one(PG, 1, tag)
                time.sleep(0.005)  # released, not committed yet

    threads = [run(lambda tag=str(i): buyer(tag)) for i in range(4)]  # type: ignore[misc]
    for thread in threads:
        thread.join(60)
    assert [seen for _, seen in sales(PG)] == [6, 5, 4, 3, 2, 1]
    if kind == "portable":
        with CaptureQueriesContext(connections[PG]) as queries, held():
            pass
        assert any("FOR UPDATE" in q["sql"] for q in queries.captured_queries)


class Buyer(Child):
    """A process of tests/support/fenced_child.py on the suite's Redis and the test's database."""

    def __init__(self, env: dict[str, str], url: str, *args: str) -> None:
        super().__init__("--url", url, *args, module="tests.support.fenced_child", env=env)


@pytest.fixture
def buyer(
    redis_server: RedisServer, postgres_env: dict[str, str]
) -> Iterator[Callable[..., Buyer]]:
    started: list[Buyer] = []

    def start(*args: str) -> Buyer:
        started.append(Buyer(postgres_env, redis_server.url, *args))
        return started[-1]

    yield start
    for proc in started:
        proc.signal(signal.SIGCONT)
        proc.close()


def test_four_processes_of_eight_purchases_sell_exactly_twelve(
    redis_server: RedisServer, buyer: Callable[..., Buyer]
) -> None:
    open_shop(PG, 1, 12)
    start = "fenced:start"
    buyers = [
        buyer("buy", "--start", start, "--buyer", f"p{i}", "--purchases", "8", "--atomic")
        for i in range(4)
    ]
    redis_server.client().set(start, 1)
    assert sum(int(b.expect("BOUGHT")) for b in buyers) == 12
    assert [seen for _, seen in sales(PG)] == list(range(12, 0, -1))  # no stock read twice


# -- holders paused past their TTL -------------------------------------------------------------


@pytest.mark.parametrize("renewed", [False, True])
def test_a_holder_paused_before_its_block_commits_nothing_after_resuming(
    name: str, buyer: Callable[..., Buyer], renewed: bool
) -> None:
    """Resumed, its watchdog may notice the loss first (LockLost), or not yet (not renewed
    here): then the database refuses the fence (StaleFence)."""
    open_shop(PG, 1, 5)
    renewal = [] if renewed else ["--no-renew"]
    paused = buyer("paused", "--name", name, "--when", "before", "--ttl", "1", *renewal)
    old = int(paused.expect("ACQUIRED"))
    paused.signal(signal.SIGSTOP)  # its watchdog too: the hold runs out
    eventually(lambda: not lock(name).locked(), "the paused hold's expiry")
    with lock(name, ttl=10, atomic=PG) as held:
        sell_one(PG, 1, "next")
        assert held.fence and held.fence > old
    paused.signal(signal.SIGCONT)
    paused.send("go")
    refused = paused.expect("REFUSED").split()[0]
    assert refused in (["StaleFence", "LockLost"] if renewed else ["StaleFence"])
    assert sales(PG) == [("next", 5)]


def test_the_next_holder_s_body_starts_after_a_paused_holder_s_transaction_ended(
    name: str, buyer: Callable[..., Buyer]
) -> None:
    open_shop(PG, 1, 5)
    paused = buyer("paused", "--name", name, "--when", "inside", "--ttl", "1")
    paused.expect("INSIDE")  # sold one seat, not committed yet
    paused.signal(signal.SIGSTOP)
    eventually(lambda: not lock(name).locked(), "the paused hold's expiry")
    seen: list[list[tuple[str, int]]] = []

    def next_holder() -> None:
        with lock(name, ttl=10, timeout=30, atomic=PG):
            seen.append(sales(PG))
            sell_one(PG, 1, "next")

    thread = run(next_holder)
    eventually(waiting_on_a_row, "the next holder waiting for the lock's row")
    assert seen == []  # holding the lock in Redis, its body not started
    paused.signal(signal.SIGCONT)
    paused.send("go")
    assert paused.expect("COMMITTED") == ""  # the lost-hold rule: it committed, in order
    thread.join(30)
    assert seen == [[("paused", 5)]]  # the body started after that commit, and saw it
    assert sales(PG) == [("paused", 5), ("next", 4)]


def test_after_a_failover_to_an_empty_redis_the_old_holder_commits_nothing(
    name: str, redis_factory: Callable[..., RedisServer]
) -> None:
    open_shop(PG, 1, 5)
    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "failover": config}):
        old = lock(name, using="failover", ttl=30, auto_renew=False)
        assert old.acquire()
        server.client().flushall()  # the replica promoted had nothing: lock and counter gone
        time.sleep(0.002)  # (a fence in the same ms: the Lua's fence-after-flush fix)
        with lock(name, using="failover", ttl=30, atomic=PG, timeout=5) as new:
            sell_one(PG, 1, "new")
            assert new.fence and old.fence and new.fence > old.fence
        with pytest.raises(StaleFence), old.atomic(PG):
            sell_one(PG, 1, "old")
    assert sales(PG) == [("new", 5)]


# -- isolation levels and cost -----------------------------------------------------------------


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_stricter_isolation_fails_where_read_committed_waits(name: str, level: str) -> None:
    """The predecessor's transaction is open when the block checks its fence: READ COMMITTED
    waits, then reads what it committed; REPEATABLE READ and SERIALIZABLE cannot see that
    commit, and fail with a serialization error: nothing committed, the lock released."""
    open_shop(PG, 1, 1)
    released, failed = threading.Event(), []

    def first() -> None:
        with transaction.atomic(using=PG):
            with lock(name, ttl=10, atomic=PG):
                sell_one(PG, 1, "first")
            released.set()
            eventually(waiting_on_a_row, "the second buyer waiting")

    def second() -> None:
        assert released.wait(30)
        try:
            with transaction.atomic(using=PG):
                connections[PG].cursor().execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
                with lock(name, ttl=10, timeout=30, atomic=PG):
                    sell_one(PG, 1, "second")
        except OperationalError as exc:
            failed.append(exc)

    for thread in [run(first), run(second)]:
        thread.join(60)
    assert len(failed) == 1 and "could not serialize" in str(failed[0])
    assert sales(PG) == [("first", 1)] and not lock(name).locked()


def test_one_statement_of_fence_work_on_postgresql(name: str) -> None:
    with lock(name, atomic=PG):
        pass
    with CaptureQueriesContext(connections[PG]) as queries, lock(name, atomic=PG):
        pass
    table = Fence._meta.db_table
    assert [q["sql"][:11] for q in queries.captured_queries if table in q["sql"]] == ["INSERT INTO"]


def test_a_block_rewrites_no_indexed_column_so_its_upsert_can_be_a_hot_update() -> None:
    """Every block rewrites its row's fence, previous fence and time: with none of them
    indexed, PostgreSQL updates the row in place (HOT), with no new index entries and no
    dead index entry per block for the next block's lookup to step over."""
    with connections[PG].cursor() as cursor:
        cursor.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
            " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = %s::regclass",
            [Fence._meta.db_table],
        )
        indexed = {row[0] for row in cursor.fetchall()}
    assert indexed == {"key"}


# -- prune-fences beside fenced blocks ---------------------------------------------------------


def stale_then_newer(name: str) -> tuple[Any, int]:
    """A hold taken, then lost (force-released, not renewed: its holder does not know), and a
    newer hold's committed block: (the stale lock, the newer fence)."""
    stale = lock(name, ttl=30, auto_renew=False)
    assert stale.acquire()
    locks["default"].force_release(name)
    with lock(name, ttl=10, timeout=5, atomic=PG) as newer:
        sell_one(PG, 1, "newer")
        fence = newer.fence
    assert fence and stale.fence and fence > stale.fence
    return stale, fence


def age(name: str) -> None:
    """Make a lock's row look untouched for two days."""
    old = timezone.now() - datetime.timedelta(days=2)
    Fence.objects.using(PG).filter(name=name).update(touched=old)


def test_prune_fences_never_deletes_a_row_a_block_committed_meanwhile(name: str) -> None:
    """With a delete-signal receiver connected, the ORM's delete() selected the old rows,
    then deleted them by key: a block committed in between lost its fresh row, the floor rose
    only to the old fence, and a stale holder found no row and committed after it. The prune
    is now one DELETE ... WHERE age RETURNING: the receiver is never called for these rows
    (it would commit the block in that window); the block commits after the prune here."""
    open_shop(PG, 1, 5)
    with lock(name, ttl=10, timeout=5, atomic=PG):
        sell_one(PG, 1, "first")
    age(name)
    stale = lock(name, ttl=30, auto_renew=False)
    assert stale.acquire()
    locks["default"].force_release(name)
    called: list[str] = []

    def newer_block() -> None:
        with lock(name, ttl=10, timeout=5, atomic=PG) as newer:
            sell_one(PG, 1, "newer")
            assert newer.fence and stale.fence and newer.fence > stale.fence

    def receiver(sender: Any, **kwargs: Any) -> None:
        if not called:
            called.append("pre_delete")
            run(newer_block).join(30)  # a block commits while the prune runs

    pre_delete.connect(receiver, sender=Fence, weak=False, dispatch_uid="audit")
    try:
        with CaptureQueriesContext(connections[PG]) as queries:
            prune_fences(PG, datetime.timedelta(days=1))
    finally:
        pre_delete.disconnect(sender=Fence, dispatch_uid="audit")
    if not called:
        newer_block()
    with pytest.raises(StaleFence), stale.atomic(PG):
        sell_one(PG, 1, "stale")
    assert [buyer for buyer, _ in sales(PG)] == ["first", "newer"]
    deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("DELETE")]
    assert len(deletes) == 1 and "RETURNING" in deletes[0]


@pytest.mark.parametrize("floor", ["none yet", "raised"])
@pytest.mark.parametrize("level", ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"])
def test_a_first_block_waiting_for_a_prune_reads_the_floor_it_raised(
    name: str, level: str, floor: str
) -> None:
    """The stale holder's block starts (its snapshot, under REPEATABLE READ) while a prune
    holds its deleted row; once the prune commits, the block finds no row and must read the
    floor the prune raised: a plain SELECT read the snapshot's floor and let it commit. READ
    COMMITTED: StaleFence; REPEATABLE READ: a serialization error (the floor changed, or was
    created, after the snapshot). Nothing committed either way."""
    open_shop(PG, 1, 5)
    if floor == "raised":
        Fence.objects.using(PG).create(key=row_key("default", ""), backend="default", name="",
                                       fence=1, touched=timezone.now())  # fmt: skip
    stale, _newer = stale_then_newer(name)
    age(name)
    pruned, outcome = threading.Event(), []

    def prune() -> None:
        with transaction.atomic(using=PG):
            prune_fences(PG, datetime.timedelta(days=1))
            pruned.set()
            eventually(waiting_on_a_row, "the stale block waiting for the pruned row")

    def stale_block() -> None:
        assert pruned.wait(30)
        try:
            with transaction.atomic(using=PG):
                connections[PG].cursor().execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
                with stale.atomic(PG):
                    sell_one(PG, 1, "stale")
            outcome.append("committed")
        except (StaleFence, OperationalError) as exc:
            outcome.append(type(exc).__name__)

    for thread in [run(prune), run(stale_block)]:
        thread.join(60)
    expected = "StaleFence" if level == "READ COMMITTED" else "OperationalError"
    assert outcome == [expected]
    assert [buyer for buyer, _ in sales(PG)] == ["newer"]


# -- a transaction the body left unable to commit, callbacks after the COMMIT --------------------


@pytest.mark.parametrize("outer", [False, True])
def test_an_error_caught_in_the_body_without_a_savepoint_commits_nothing_and_raises(
    name: str, outer: bool
) -> None:
    """PostgreSQL aborts the transaction at the error; its COMMIT then rolls back, silently
    (plain atomic() returns as if committed): the fenced block raises instead."""
    open_shop(PG, 1, 5)

    def block() -> None:
        with lock(name, ttl=10, atomic=PG):
            sell_one(PG, 1, "a")
            with contextlib.suppress(IntegrityError):  # no savepoint: the transaction aborts
                connections[PG].cursor().execute("INSERT INTO shop_ticket VALUES (1, 1)")

    with pytest.raises(DatabaseError, match="cannot commit"):
        if outer:
            with transaction.atomic(using=PG):
                block()
        else:
            block()
    assert sales(PG) == [] and not lock(name).locked()


def test_a_failing_on_commit_callback_leaves_a_committed_block_committed(name: str) -> None:
    open_shop(PG, 1, 5)

    def mail() -> None:
        raise ConnectionRefusedError("mail server down")

    with lock(name, ttl=10, atomic=PG):
        sell_one(PG, 1, "a")
        transaction.on_commit(mail, using=PG)
    assert sales(PG) == [("a", 5)] and not lock(name).locked()


# (A COMMIT's reply lost, interrupted, or cut: tests/fenced/test_fenced_outcomes.py.)


# -- a wait cycle through Redis and PostgreSQL --------------------------------------------------


def test_a_wait_cycle_through_redis_and_the_database_ends(name: str) -> None:
    """T1, in an outer transaction: a fenced block on B (released in Redis, its row locked
    until the outer commit), then one on A. T2: a fenced block on A, and inside it one on B.
    T2 holds A in Redis and waits for B's row; T1 holds B's row and waits for A in Redis:
    PostgreSQL sees one waiter, the renewers keep both holds, and without a bound both waited
    for ever. The row wait is bounded (no timeout=: the lock's TTL): T2's block on B raises
    LockNotAcquired, T2 rolls back and releases A, T1 goes on and commits."""
    open_shop(PG, 1, 5)
    with connections[PG].cursor() as cursor:  # T2 sells its own ticket: no row in common
        cursor.execute("INSERT INTO shop_ticket (id, stock) VALUES (2, 5)")
    a, b = f"{name}:A", f"{name}:B"
    b_done, a_held = threading.Event(), threading.Event()
    outcome: dict[str, str] = {}

    def t1() -> None:
        try:
            with transaction.atomic(using=PG):
                with lock(b, ttl=3, atomic=PG):
                    sell_one(PG, 1, "t1-b")
                b_done.set()
                assert a_held.wait(30)
                # (on a loaded machine T2's wait may run out before this sees it)
                eventually(lambda: waiting_on_a_row() or "t2" in outcome, "T2 waiting for B")
                with lock(a, ttl=3, atomic=PG):
                    sell_one(PG, 1, "t1-a")
            outcome["t1"] = "committed"
        except Exception as exc:
            outcome["t1"] = type(exc).__name__

    def t2() -> None:
        try:
            with lock(a, ttl=3, atomic=PG):
                sell_one(PG, 2, "t2-a")
                a_held.set()
                assert b_done.wait(30)
                with lock(b, ttl=3, atomic=PG):
                    sell_one(PG, 2, "t2-b")
            outcome["t2"] = "committed"
        except Exception as exc:
            outcome["t2"] = type(exc).__name__

    threads = [run(t1), run(t2)]
    try:
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "the wait cycle never ended"
    finally:
        if any(thread.is_alive() for thread in threads):  # end the hang: cancel the waits
            config = connections[PG].settings_dict
            with psycopg.connect(host=config["HOST"], port=config["PORT"],
                                 user=config["USER"], dbname=config["NAME"],
                                 autocommit=True) as conn:  # fmt: skip
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            for thread in threads:
                thread.join(60)
    assert outcome == {"t1": "committed", "t2": "LockNotAcquired"}
    assert [buyer for buyer, _ in sales(PG)] == ["t1-b", "t1-a"]
    assert not lock(a).locked() and not lock(b).locked()


@lock_view("pg-order:{pk}", atomic=PG, ttl=1)
def pg_buy(request: HttpRequest, pk: int) -> HttpResponse:
    sell_one(PG, pk, "view")
    return HttpResponse("sold")


urlpatterns = [path("pg-buy/<int:pk>/", pg_buy)]


def test_lock_view_answers_busy_when_the_lock_s_row_stays_locked(settings: Any) -> None:
    """The previous holder released in Redis, its outer transaction still open: the view's
    block waits for the row at most the lock's TTL, then answers busy, the view not run."""
    settings.ROOT_URLCONF = __name__
    open_shop(PG, 1, 5)
    with transaction.atomic(using=PG):
        with lock("pg-order:1", ttl=10, atomic=PG):
            sell_one(PG, 1, "outer")
        response = run_request("/pg-buy/1/")
    assert response.status_code == 409
    assert sales(PG) == [("outer", 5)] and not lock("pg-order:1").locked()


def run_request(url: str) -> Any:
    """A request served in another thread (its own database connection)."""
    responses: list[Any] = []
    run(lambda: responses.append(Client().get(url))).join(60)
    return responses[0]


def test_the_session_s_own_lock_timeout_without_a_bound_is_a_clear_lock_not_acquired(
    name: str,
) -> None:
    """check_fence without a bound (wait=None) leaves the database's lock_timeout in charge;
    when it fires the message says so (it formatted None as a number: TypeError)."""
    from django_redlock.exceptions import LockNotAcquired
    from django_redlock.fence_table import check_fence

    with lock(name, ttl=10, atomic=PG) as held:
        fence = held.fence
    assert fence
    locked, done = threading.Event(), threading.Event()

    def holder() -> None:
        with transaction.atomic(using=PG):
            check_fence(PG, "default", name, fence + 1)
            locked.set()
            assert done.wait(30)

    thread = run(holder)
    assert locked.wait(30)
    try:
        with transaction.atomic(using=PG):
            connections[PG].cursor().execute("SET LOCAL lock_timeout = '100ms'")
            with pytest.raises(LockNotAcquired, match="the database's lock_timeout"):
                check_fence(PG, "default", name, fence + 2)
    finally:
        done.set()
        thread.join(30)


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_first_blocks_of_two_names_do_not_wait_for_each_other_s_floor_probe(
    name: str, level: str
) -> None:
    """With no floor yet, a first block under a strict level probes for one with an insert
    rolled back to a savepoint: a floor row inserted for good would stay locked until the
    transaction ends, and every other name's first block would wait for it."""
    opened, done = threading.Event(), threading.Event()

    def first() -> None:
        with transaction.atomic(using=PG):
            connections[PG].cursor().execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
            with lock(f"{name}:a", ttl=10, atomic=PG):
                pass
            opened.set()
            assert done.wait(30)  # the transaction stays open

    thread = run(first)
    try:
        assert opened.wait(30)
        with lock(f"{name}:b", ttl=10, timeout=1, atomic=PG):  # LockNotAcquired if it waited
            pass
        assert Fence.objects.using(PG).filter(name="").count() == 0
    finally:
        done.set()
        thread.join(30)


# -- prune-fences and the floor: bounded waits ------------------------------------------------


def other_session() -> psycopg.Connection[Any]:
    config = connections[PG].settings_dict
    return psycopg.connect(host=config["HOST"], port=config["PORT"], user=config["USER"],
                           dbname=config["NAME"])  # fmt: skip


def put_floor(key: str) -> None:
    found = {"backend": "default", "name": "", "fence": 1, "touched": timezone.now()}
    Fence.objects.using(PG).update_or_create(key=key, defaults=found)


def test_a_first_block_s_wait_for_the_floor_is_bounded_like_the_row_s(name: str) -> None:
    """A prune holds the backend's floor (it raises it) while it waits for something else: a
    name's first block reads the floor with a locking read, and waits for it at most its
    ``timeout=``, like for its row. Unbounded, prune-fences and two backends made a wait
    cycle through Redis and PostgreSQL that never ended."""
    from django_redlock.exceptions import LockNotAcquired

    floor = row_key("default", "")
    put_floor(floor)
    with other_session() as pruning:
        pruning.execute("SELECT 1 FROM django_redlock_fence WHERE key = %s FOR UPDATE", [floor])
        release = threading.Timer(20, pruning.rollback)  # unbounded: the block waits until then
        release.start()
        try:
            with (
                pytest.raises(LockNotAcquired, match="stayed locked"),
                lock(name, ttl=30, timeout=1, atomic=PG),
            ):
                pass
        finally:
            release.cancel()
    assert not lock(name).locked()
    with lock(name, ttl=30, timeout=1, atomic=PG), connections[PG].cursor() as cursor:
        cursor.execute("SHOW lock_timeout")  # the transaction's own, restored after the read
        assert cursor.fetchone()[0] == "0"


def test_prune_fences_skips_rows_in_use_and_never_holds_fresh_holders(name: str) -> None:
    """A fenced transaction stays open on one old row: prune-fences deletes the others
    without waiting for it (it would hold their rows locked meanwhile, and fresh holders of
    those idle names would wait behind it), and keeps that row."""
    busy, idle = f"{name}:busy", f"{name}:idle"
    old = timezone.now() - datetime.timedelta(days=10)
    for held in (idle, busy):
        Fence.objects.using(PG).create(key=row_key("default", held), backend="default",
                                       name=held, fence=5, touched=old)  # fmt: skip
    with other_session() as open_block:
        open_block.execute("SELECT 1 FROM django_redlock_fence WHERE key = %s FOR UPDATE",
                           [row_key("default", busy)])  # fmt: skip
        pruned: list[int] = []
        pruner = run(lambda: pruned.append(prune_fences(PG, datetime.timedelta(days=1))))
        pruner.join(20)
        open_block.rollback()
        pruner.join(20)
    assert pruned == [1]
    assert list(Fence.objects.using(PG).exclude(name="").values_list("name", flat=True)) == [busy]
    with lock(idle, ttl=30, timeout=1, atomic=PG):
        pass


def test_prune_fences_waits_for_a_floor_at_most_a_moment_and_deletes_nothing(name: str) -> None:
    """A first block's open transaction holds the floor (FOR SHARE): prune-fences, holding
    the rows it deleted, gives up after PRUNE_WAIT instead of making their fresh holders wait
    behind it (with two backends, a wait cycle through Redis that never ended)."""
    floor = row_key("default", "")
    put_floor(floor)
    old = timezone.now() - datetime.timedelta(days=10)
    Fence.objects.using(PG).create(key=row_key("default", name), backend="default", name=name,
                                   fence=5, touched=old)  # fmt: skip
    with other_session() as first_block:
        first_block.execute("SELECT 1 FROM django_redlock_fence WHERE key = %s FOR SHARE", [floor])
        release = threading.Timer(20, first_block.rollback)  # unbounded: the prune waits
        release.start()
        try:
            with pytest.raises(CommandError, match="nothing deleted") as raised:
                call_command("redlock", "prune-fences", "--older-than", "1d", "--database", PG)
        finally:
            release.cancel()
    assert raised.value.returncode == 1
    assert Fence.objects.using(PG).filter(name=name).exists()


@pytest.mark.parametrize("bound", ["ttl", "timeout"])
def test_a_bound_beyond_postgresql_s_largest_lock_timeout_is_clamped(name: str, bound: str):
    """lock_timeout is a 32-bit number of ms (about 24.8 days): a TTL or timeout above it
    made every fenced block fail (DataError). The wait is clamped to PostgreSQL's maximum."""
    open_shop(PG, 1, 5)
    days = 30 * 86400
    long = {"ttl": days} if bound == "ttl" else {"ttl": 30, "timeout": days}
    Fence.objects.using(PG).filter(key=row_key("default", "")).delete()  # the floor read too
    with lock(name, atomic=PG, **long):
        sell_one(PG, 1, "a")
    assert sales(PG) == [("a", 5)]
