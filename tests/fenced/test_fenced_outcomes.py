"""What leaving a fenced block reports, one test per row of the outcome table in
docs/topics/fencing.md: committed (it returns), nothing committed (``StaleFence``, the body's
exception, the database's error), or ``CommitOutcomeUnknown``; "nothing committed" only where
it is proven. The faults come from a proxy between Django and the suite's PostgreSQL that
forwards the COMMIT, reads the server's reply, then cuts the client or holds the reply back
(``tests/support/proxy.py``)."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import (
    DatabaseError,
    IntegrityError,
    OperationalError,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.test import RequestFactory, override_settings
from django.utils import timezone

from django_redlock import (
    CommitOutcomeUnknown,
    LockError,
    fence_table,
    fencing,
    lock,
    lock_all,
    lock_view,
    locks,
    single_instance,
)
from django_redlock.fence_table import commit_outcome, prune_fences, row_key
from django_redlock.locking import Lock
from django_redlock.models import Fence
from django_redlock.signals import lock_acquired
from django_redlock.testing import RedisServer

from ..support.fenced_child import open_shop, sales, sell_one
from ..support.proxy import LossyProxy

PG = "postgres"
PROXIED = "postgres_proxied"
pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> Iterator[LossyProxy]:
    """Database alias ``PROXIED``: the test PostgreSQL through a proxy that loses replies."""
    proxy = LossyProxy(int(connections[PG].settings_dict["PORT"]))
    connections.settings[PROXIED] = {**connections[PG].settings_dict, "PORT": str(proxy.port)}
    # The test case lets only its own aliases (re)connect: add this one for the test's time
    # (Django's patched ensure_connection holds the test case class in its closure).
    patched = BaseDatabaseWrapper.ensure_connection
    case = next(c.cell_contents for c in patched.__closure__ or ()
                if isinstance(c.cell_contents, type))  # fmt: skip
    monkeypatch.setattr(case, "databases", {*case.databases, PROXIED})
    try:
        yield proxy
    finally:
        with contextlib.suppress(DatabaseError):
            connections[PROXIED].close()
        del connections[PROXIED]
        del connections.settings[PROXIED]
        proxy.close()


@pytest.fixture
def failover(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    """Backend alias ``failover``: a Redis of its own, to be flushed (a failover to an empty
    replica: the holds and counters gone)."""
    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "failover": config}):
        yield server


def in_thread(target: Callable[[], None]) -> threading.Thread:
    def body() -> None:
        try:
            target()
        finally:
            connections.close_all()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def deferred_refusal() -> None:
    """A table whose deferred unique constraint refuses a COMMIT (see ``refused_at_commit``)."""
    with connections[PG].cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS outcome_deferred"
            " (id integer UNIQUE DEFERRABLE INITIALLY DEFERRED)"
        )
        cursor.execute("DELETE FROM outcome_deferred")


def refused_at_commit(using: str) -> None:
    """Make the open transaction on ``using`` fail at its COMMIT, not before."""
    with connections[using].cursor() as cursor:
        cursor.execute("INSERT INTO outcome_deferred VALUES (1), (1)")


def selling_next_holder(name: str, done: list[Any]) -> Callable[[], None]:
    """The next holder: waits up to 5 s, sells one as "n" in its fenced block."""

    def next_holder() -> None:
        with lock(name, ttl=30, timeout=5, atomic=PG):
            sell_one(PG, 1, "n")
        done.append("n")

    return next_holder


def selling_block(held: Lock, done: list[Any]) -> Callable[[], None]:
    """B2: another block of ``held``'s hold, selling one as "b2"."""

    def b2() -> None:
        with held.atomic(PG):
            sell_one(PG, 1, "b2")
        done.append("b2")

    return b2


# -- the COMMIT answered ---------------------------------------------------------------------


def test_a_commit_answered_returns_and_committed(name: str) -> None:
    open_shop(PG, 1, 5)
    with lock(name, ttl=30, atomic=PG):
        sell_one(PG, 1, "a")
    assert sales(PG) == [("a", 5)] and not lock(name).locked()


def test_the_body_s_exception_rolls_back_and_is_raised(name: str) -> None:
    open_shop(PG, 1, 5)
    with pytest.raises(ZeroDivisionError), lock(name, ttl=30, atomic=PG):
        sell_one(PG, 1, "a")
        1 / 0  # noqa: B018
    assert sales(PG) == [] and not lock(name).locked()


def test_a_commit_refused_by_the_database_raises_its_error_and_committed_nothing(
    name: str,
) -> None:
    """A deferred constraint fails at the COMMIT: the server answered, so the rows prove that
    nothing committed, and the database's error is raised as it came."""
    deferred_refusal()
    open_shop(PG, 1, 5)
    with pytest.raises(IntegrityError), lock(name, ttl=30, atomic=PG):
        sell_one(PG, 1, "a")
        refused_at_commit(PG)
    assert sales(PG) == [] and not lock(name).locked()
    with lock(name, ttl=30, atomic=PG):  # the connection is usable again
        sell_one(PG, 1, "b")
    assert sales(PG) == [("b", 5)]


@pytest.mark.parametrize("where", ["plain", "in an except clause"])
def test_a_first_block_s_refused_commit_raises_its_error_above_a_floor_a_prune_raised(
    name: str, where: str
) -> None:
    """The floor (one per backend) rose above the block's fence during its first block:
    another name's later row pruned. The server's error reply to the COMMIT proves nothing
    committed; the check's "no row, floor above: maybe pruned" said unknown (review fen, 3).
    Run in an ``except`` clause, the reply's error has that exception for its context: the
    same reply."""
    deferred_refusal()
    open_shop(PG, 1, 5)

    def other_name_then_prune() -> None:
        with lock(f"{name}:other", ttl=30, atomic=PG):
            pass
        assert prune_fences(PG, datetime.timedelta(0)) == 1

    def block() -> None:
        with lock(name, ttl=30, atomic=PG):
            sell_one(PG, 1, "a")
            refused_at_commit(PG)
            in_thread(other_name_then_prune).join(10)

    with pytest.raises(IntegrityError):
        if where == "plain":
            block()
        else:
            try:
                raise KeyError(name)
            except KeyError:
                block()
    assert Fence.objects.using(PG).filter(name="").exists()  # the floor, above the fence
    assert sales(PG) == [] and not lock(name).locked()


# -- the COMMIT's reply lost ---------------------------------------------------------------


def test_a_commit_whose_reply_is_lost_returns_as_committed(
    name: str, proxied: LossyProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The server committed; the client saw its connection fail. The lock's row carries the
    block's fence (written in the same transaction): the block committed, and says so. Saying
    "nothing committed" would make the retry recipe sell twice."""
    open_shop(PG, 1, 5)
    with lock(name, ttl=30, atomic=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.fault_commit("cut")
    assert proxied.commits_faulted == 1 and sales(PG) == [("a", 5)]
    assert not lock(name).locked() and "proves that it committed" in caplog.text


def test_a_pooler_s_connection_error_after_the_commit_is_not_its_refusal(
    name: str, proxied: LossyProxy
) -> None:
    """The server committed; a pooler in front of it (older PgBouncer) answered the client
    "08P01 server conn crashed?" at severity ERROR, as PostgreSQL's own refusal of a COMMIT
    is sent. Taken for a refusal, the block raised "nothing committed" with no outcome check
    and a retry sold twice (review fen2, 1). A connection-class error goes to the check."""
    open_shop(PG, 1, 5)

    def pooler_says_server_crashed() -> None:
        fields = ((b"S", "ERROR"), (b"C", "08P01"), (b"M", "server conn crashed?"))
        body = b"".join(k + v.encode() + b"\0" for k, v in fields) + b"\0"
        proxied._sockets[0].sendall(b"E" + struct.pack("!I", len(body) + 4) + body)

    with lock(name, ttl=30, atomic=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.fault_commit("cut", during=pooler_says_server_crashed)
    assert proxied.commits_faulted == 1 and sales(PG) == [("a", 5)]
    assert not lock(name).locked()


def test_a_lost_commit_whose_outcome_cannot_be_learned_raises_outcome_unknown(
    name: str, proxied: LossyProxy
) -> None:
    open_shop(PG, 1, 5)
    with pytest.raises(CommitOutcomeUnknown, match="UNKNOWN"), lock(name, ttl=30, atomic=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.lose_replies(100)  # the COMMIT's, and every reply to the question after it
    assert sales(PG) == [("a", 5)] and not lock(name).locked()  # it had committed


def test_a_server_error_in_django_s_reconnect_after_a_lost_commit_is_not_its_refusal(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The COMMIT's reply lost (committed), then Django's exit reconnects and the server
    answers a statement of that reconnect with an ERROR: an error reply, yet not the
    COMMIT's (raised while the lost reply's error was handled). Taken for a refused COMMIT,
    the block would say "nothing committed" for a committed one: the rows are asked."""
    open_shop(PG, 1, 5)
    wrapper = connections[PROXIED]
    original = wrapper.init_connection_state
    armed: list[bool] = []

    def init_connection_state() -> None:
        original()
        if armed:
            armed.clear()
            with wrapper.connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")  # the server's ERROR (22012)

    monkeypatch.setattr(wrapper, "init_connection_state", init_connection_state)
    with lock(name, ttl=30, atomic=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.fault_commit("cut", during=lambda: armed.append(True))
    assert proxied.commits_faulted == 1 and not armed and sales(PG) == [("a", 5)]


def test_a_lost_commit_whose_check_meets_a_silent_database_is_unknown_in_time(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The COMMIT's reply lost, then the database silent to the check (its first question
    answered by nothing, the connection left open): the block hung there, its lock renewed
    all along (review fen, 2). Now unknown past the check's bound (the wait, 5 s here, plus
    its slack: 1 s here), the lock released."""
    monkeypatch.setattr(fence_table, "CHECK_SLACK", 1.0, raising=False)
    open_shop(PG, 1, 5)
    proxied.mute_from(b"pg_backend_pid()")  # the check's first question
    out: list[Any] = []

    def block() -> None:
        started = time.monotonic()
        try:
            with lock(name, ttl=5, atomic=PROXIED):
                sell_one(PROXIED, 1, "a")
                proxied.fault_commit("cut")
        except Exception as exc:
            out.append(exc)
        out.append(time.monotonic() - started)

    thread = in_thread(block)
    thread.join(12)
    assert not thread.is_alive(), "the outcome check hangs on a silent database"
    assert isinstance(out[0], CommitOutcomeUnknown) and out[1] < 9, out
    assert proxied.muted.is_set() and sales(PG) == [("a", 5)] and not lock(name).locked()


def test_a_lost_commit_whose_reconnect_meets_a_silent_database_is_decided_in_time(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The COMMIT's reply lost, then Django's exit reconnects (to turn autocommit back on) and
    the database goes silent after the handshake: its ``set_config('TimeZone', ...)`` (sent
    whenever the server's time zone is not the one Django wants) got no answer, for ever
    (``connect_timeout`` bounds the handshake only), the lock renewed all along (review fen2,
    2). Now the exit's connection is cut past the check's bound and the outcome asked: the
    block is decided in time and the lock let go."""
    monkeypatch.setattr(fence_table, "CHECK_SLACK", 1.0, raising=False)
    monkeypatch.setitem(  # a server time zone Django sets on each new connection
        connections[PROXIED].settings_dict, "OPTIONS",
        {**connections[PROXIED].settings_dict.get("OPTIONS", {}),
         "options": "-c TimeZone=Europe/Paris", "connect_timeout": 2},
    )  # fmt: skip
    open_shop(PG, 1, 5)
    out: list[Any] = []

    def block() -> None:
        started = time.monotonic()
        try:
            with lock(name, ttl=5, atomic=PROXIED):
                sell_one(PROXIED, 1, "a")
                proxied.fault_commit("cut", during=lambda: proxied.mute_from(b"set_config"))
        except Exception as exc:
            out.append(exc)
        out.append(time.monotonic() - started)

    thread = in_thread(block)
    thread.join(20)
    assert proxied.muted.is_set(), "the reconnect sent no set_config"
    assert not thread.is_alive(), "the exit hangs in Django's reconnect to a silent database"
    assert len(out) == 1 and out[0] < 16, out  # returned (the row proves it committed), in time
    assert sales(PG) == [("a", 5)] and not lock(name).locked()


def test_a_check_given_up_on_mid_read_does_not_keep_the_next_holder_waiting(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check's row read (``FOR SHARE``) ran, its reply never came: the block said
    unknown and released, and the check's transaction, left open by a client gone silent,
    kept the row locked: the next holder's block waited for it till its own bound. The
    server now ends it (``idle_in_transaction_session_timeout``, the check's bound)."""
    monkeypatch.setattr(fence_table, "CHECK_SLACK", 1.0)
    open_shop(PG, 1, 5)
    with pytest.raises(CommitOutcomeUnknown), lock(name, ttl=5, atomic=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.mute_from(b"FOR SHARE")  # the check's read, not the block's own statements
        proxied.fault_commit("cut")
    assert proxied.muted.is_set()
    started = time.monotonic()
    with lock(name, ttl=30, timeout=10, atomic=PG):
        sell_one(PG, 1, "n")
    assert time.monotonic() - started < 5 and sales(PG) == [("a", 5), ("n", 4)]


def test_a_commit_cut_before_the_server_got_it_raises_and_committed_nothing(
    name: str, proxied: LossyProxy
) -> None:
    """The second block of one hold: the row carries the hold's fence from the first block,
    but not this block's time, so the lost COMMIT is not taken for a committed one."""
    open_shop(PG, 1, 5)
    held = lock(name, ttl=30)
    held.acquire()
    with held.atomic(using=PROXIED):
        pass
    with pytest.raises(OperationalError), held.atomic(using=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.cut()  # the COMMIT never reaches the server, which rolls back
    held.release()
    assert sales(PG) == []


# -- nested blocks of one hold -------------------------------------------------------------


@pytest.mark.parametrize("nesting", ["atomic inside", "reentry"])
def test_a_lost_commit_after_a_nested_block_of_the_same_hold_returns_as_committed(
    name: str, proxied: LossyProxy, nesting: str
) -> None:
    """The inner block's upsert keeps the outer block's mark in the row: the outer COMMIT's
    outcome check finds it (it found the inner block's time, and said "not committed")."""
    open_shop(PG, 1, 5)
    if nesting == "reentry":
        held = lock(name, ttl=30, reentrant=True, atomic=PROXIED)
        with held:
            with held:
                sell_one(PROXIED, 1, "a")
            proxied.fault_commit("cut")
    else:
        held = lock(name, ttl=30)
        with held, held.atomic(PROXIED):
            with held.atomic(PROXIED):
                sell_one(PROXIED, 1, "a")
            proxied.fault_commit("cut")
    assert proxied.commits_faulted == 1 and sales(PG) == [("a", 5)]
    assert not lock(name).locked()


def written_by_another_hold(name: str, using: str) -> None:
    """Lock ``name``'s row on ``using``: written by a hold that is not the next one's
    ``prior`` (a hold in between recorded nothing), so the next hold's block there re-fences."""
    for records in (True, False):
        other = lock(name, ttl=30)
        other.acquire()
        if records:
            with other.atomic(using):
                pass
        other.release()


@pytest.mark.parametrize(
    "refences", ["nested on another database", "itself, then nested", "reentrant, another object"]
)
def test_a_lost_commit_after_a_nested_block_re_fenced_the_hold_returns_as_committed(
    name: str, proxied: LossyProxy, refences: str
) -> None:
    """A block nested on another database re-fenced the hold: the outer COMMIT's outcome was
    asked with the hold's new fence, not the one the outer block wrote, found the smaller
    one in the row, and said "nothing committed" for a committed block."""
    open_shop(PG, 1, 5)
    written_by_another_hold(name, "default")  # the nested block re-fences
    if refences.startswith("itself"):
        written_by_another_hold(name, PG)  # the outer block's check re-fences too
    reentrant = refences.startswith("reentrant")
    held = lock(name, ttl=30, reentrant=reentrant)
    held.acquire()
    fences = [held.fence]
    with held.atomic(PROXIED):
        sell_one(PROXIED, 1, "a")
        fences.append(held.fence)
        inner = lock(name, ttl=30, reentrant=True) if reentrant else held
        with inner if reentrant else contextlib.nullcontext(), inner.atomic("default"):
            pass
        fences.append(held.fence)  # (a reentrant hold takes the other object's new fence)
        proxied.fault_commit("cut")
    held.release()
    assert fences[2] > fences[1] and (fences[1] > fences[0]) == refences.startswith("itself")
    assert proxied.commits_faulted == 1 and sales(PG) == [("a", 5)]
    assert not lock(name).locked()


# -- a hold lost meanwhile, and the next holder's block on top -------------------------------


def run_a_and_b(
    name: str,
    proxied: LossyProxy,
    server: RedisServer,
    *,
    second_block: bool = False,
    reaches_server: bool = True,
    b_nests: str = "",
) -> tuple[type[BaseException] | None, int, int]:
    """A holds the lock and is in its block when Redis fails over to an empty replica; B
    takes the lock and waits for A's row; A's COMMIT reply is lost after the server committed
    (or the COMMIT never reaches the server), and B commits on top before A asks. (A's error
    or None, A's fence, B's fence.)"""
    old = lock(name, using="failover", ttl=30, auto_renew=False)
    assert old.acquire()
    if second_block:
        with old.atomic(PROXIED):
            pass
    b_done = threading.Event()
    fences: list[int] = []

    def b() -> None:
        reentrant = b_nests == "re-entry"
        with lock(name, using="failover", ttl=30, atomic=PG, timeout=20,
                  reentrant=reentrant) as new:  # fmt: skip
            sell_one(PG, 1, "b")
            # A block of the same hold nested in B's: its write must not hide A's fence.
            with new if reentrant else new.atomic(PG) if b_nests else contextlib.nullcontext():
                pass
            fences.append(new.fence or 0)
        b_done.set()

    raised: type[BaseException] | None = None  # A's error, or None
    thread: threading.Thread | None = None
    try:
        with old.atomic(PROXIED):
            sell_one(PROXIED, 1, "a")
            server.client().flushall()  # the replica promoted had nothing
            time.sleep(0.002)  # (a fence in the same ms)
            thread = in_thread(b)
            deadline = time.monotonic() + 20
            while not lock(name, using="failover").locked():  # B holds it, waits for the row
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if reaches_server:
                proxied.fault_commit("cut", during=lambda: b_done.wait(20))
            else:
                proxied.cut()  # rolled back at the server; B goes on, and commits
                assert b_done.wait(20)
    except Exception as exc:
        raised = type(exc)
    assert thread is not None
    thread.join(20)
    assert b_done.is_set()
    return raised, old.fence or 0, fences[0]


def test_a_lost_hold_s_lost_commit_under_the_next_holder_s_fence_returns_as_committed(
    name: str, proxied: LossyProxy, failover: RedisServer
) -> None:
    """B's larger fence in the row proves only that B committed after A's transaction ended;
    the row's ``previous`` is A's fence, so A committed (A's first block of its hold)."""
    open_shop(PG, 1, 5)
    raised, a, b = run_a_and_b(name, proxied, failover)
    assert raised is None and b > a and sales(PG) == [("a", 5), ("b", 4)]


def test_a_nested_block_of_a_name_s_first_row_keeps_the_hold_s_fence(name: str) -> None:
    """A name's first row (written above a floor a prune left: its block re-fenced once):
    a block nested in it wrote the row again with the same mark. Keeping the previous fence
    of a row created in the transaction (none) made its write read as a new row, and the
    nested block re-fenced the hold again, unseen by the outer (the campaign's seed 29)."""
    with lock(f"{name}:other", ttl=30, atomic=PG):
        pass
    assert prune_fences(PG, datetime.timedelta(0)) >= 1  # a floor: the next first row asks
    held = lock(name, ttl=30)
    assert held.acquire()
    with held.atomic(PG):
        outer = held.fence
        with held.atomic(PG):
            pass
        assert held.fence == outer  # not re-fenced by the nested block
    held.release()
    assert Fence.objects.using(PG).get(name=name).fence == outer


@pytest.mark.parametrize("b_nests", ["re-entry", "atomic inside"])
def test_a_lost_hold_s_lost_commit_under_a_next_holder_s_nested_block_returns_as_committed(
    name: str, proxied: LossyProxy, failover: RedisServer, b_nests: str
) -> None:
    """B's block nests another block of its hold (a re-entry, ``lk.atomic()`` inside): that
    block's write of the row, in B's transaction, overwrote ``previous``, which B's first
    write had set to A's fence, with B's own: A's check could not prove A's commit and said
    unknown (review fen3, 2). A nested write keeps what its transaction's first one found."""
    open_shop(PG, 1, 5)
    raised, a, b = run_a_and_b(name, proxied, failover, b_nests=b_nests)
    assert raised is None and b > a and sales(PG) == [("a", 5), ("b", 4)]


def test_a_lost_hold_s_lost_commit_under_the_next_holder_s_fence_after_an_earlier_block_returns(
    name: str, proxied: LossyProxy, failover: RedisServer
) -> None:
    """The hold's second block: its fence in ``previous`` may be the first block's, which
    committed for sure; ``previous_mark`` is this block's mark: it committed."""
    open_shop(PG, 1, 5)
    raised, a, b = run_a_and_b(name, proxied, failover, second_block=True)
    assert raised is None and b > a and sales(PG) == [("a", 5), ("b", 4)]


def test_a_lost_hold_s_commit_that_never_reached_the_server_raises_under_the_next_holder(
    name: str, proxied: LossyProxy, failover: RedisServer
) -> None:
    """B created the row A's insert never committed: nothing of A committed, proven."""
    open_shop(PG, 1, 5)
    raised, a, b = run_a_and_b(name, proxied, failover, reaches_server=False)
    assert raised is OperationalError and b > a and sales(PG) == [("b", 5)]


@pytest.mark.parametrize(
    ("previous_mark", "outcome"),
    [(5, True), (7, False), (8, None), (None, None)],
    ids=["this-block-s", "an-ended-block-s", "another-block-s", "none-older-row"],
)
def test_the_next_holder_s_previous_mark_decides_whose_write_it_overwrote(
    name: str, previous_mark: int | None, outcome: bool | None
) -> None:
    """The next holder's row (fence 20) over the hold's fence 10; this block's mark 5, an
    ended block's 7: its ``previous_mark`` is this block's (committed), the ended block's
    (not), another's (unknown), or none (a row a version before the column wrote: unknown)."""
    Fence.objects.using(PG).create(
        key=row_key("default", name), backend="default", name=name, fence=20, previous=10,
        mark=9, previous_mark=previous_mark, touched=timezone.now(),
    )  # fmt: skip
    assert commit_outcome(PG, "default", name, 10, 5, False, 1.0, ended_marks=(7,)) is outcome


def test_a_lost_hold_s_commit_that_never_reached_the_server_after_an_earlier_block_raises(
    name: str, proxied: LossyProxy, failover: RedisServer
) -> None:
    """The hold's second block: B's ``previous`` is the hold's fence, and its
    ``previous_mark`` the first block's, which had ended when this one began (never written
    after it): nothing of this block committed, proven."""
    open_shop(PG, 1, 5)
    raised, a, b = run_a_and_b(name, proxied, failover, second_block=True, reaches_server=False)
    assert raised is OperationalError and b > a and sales(PG) == [("b", 5)]


# -- an exception raised by a signal handler while the COMMIT's reply is late -----------------


class TimeLimit(Exception):
    """As Celery's SoftTimeLimitExceeded: raised by a signal handler, anywhere."""


@contextlib.contextmanager
def signal_raises(raised: type[BaseException]) -> Iterator[Callable[[float], None]]:
    """``after(seconds)``: SIGUSR1 (Celery's soft time limit signal) to this process then,
    from a timer thread; its handler raises ``raised`` in the main thread. (SIGALRM is
    pytest-timeout's.)"""

    def handler(signum: int, frame: Any) -> None:
        raise raised()

    previous = signal.signal(signal.SIGUSR1, handler)
    timers: list[threading.Timer] = []

    def after(seconds: float) -> None:
        timers.append(threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGUSR1)))
        timers[-1].start()

    try:
        yield after
    finally:
        for timer in timers:
            timer.cancel()
            timer.join()
        signal.signal(signal.SIGUSR1, previous)


class SoftLimit(Exception):
    """As Celery's SoftTimeLimitExceeded: an Exception, raised by a signal handler."""


@pytest.mark.parametrize("where", ["enter", "exit"])
def test_a_time_limit_in_django_s_reconnect_leaves_the_connection_usable(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A soft time limit lands while Django's (re)connect waits for its ``set_config
    ('TimeZone', ...)``: at the block's enter (a request with no connection yet,
    CONN_MAX_AGE=0), or in the exit's reconnect after a lost COMMIT. Django then holds a
    driver connection mid-query (ACTIVE) as an idle autocommit one, and every later block of
    the thread raised "can't change 'autocommit' now" against a healthy database (review
    fen3, 1). Now the block's end closes a connection left mid-query."""
    monkeypatch.setitem(  # a server time zone Django sets on each new connection
        connections[PROXIED].settings_dict, "OPTIONS",
        {**connections[PROXIED].settings_dict.get("OPTIONS", {}),
         "options": "-c TimeZone=Europe/Paris"},
    )  # fmt: skip
    open_shop(PG, 1, 5)
    with lock(name, ttl=30, atomic=PROXIED):
        sell_one(PROXIED, 1, "warm")
    with signal_raises(SoftLimit) as after, contextlib.suppress(SoftLimit):
        if where == "enter":
            connections[PROXIED].close()  # a new request: no connection yet
            proxied.delay_from(b"set_config")
            after(0.3)
            with lock(name, ttl=30, atomic=PROXIED):
                pytest.fail("the block ran")  # pragma: no cover
        else:
            with lock(name, ttl=30, atomic=PROXIED):
                sell_one(PROXIED, 1, "a")
                proxied.fault_commit("cut")
                proxied.delay_from(b"set_config")
                after(0.3)
        time.sleep(1)  # (the limit lands in the wait, whatever the block does)
    proxied.let_go()
    with lock(name, ttl=30, atomic=PROXIED):  # usable: before, "can't change 'autocommit'"
        sell_one(PROXIED, 1, "later")
    assert [who for who, _ in sales(PG)][-1] == "later" and not lock(name).locked()


def test_a_time_limit_during_a_late_commit_reply_returns_as_committed(
    name: str, proxied: LossyProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Django turns the handler's exception into ``ProgrammingError: can't change
    'autocommit' now``; the server committed: the block says so (it said "the database's
    error, nothing committed", and released the lock). Its connection is usable again."""
    open_shop(PG, 1, 5)
    with signal_raises(TimeLimit) as after, lock(name, ttl=30, atomic=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.fault_commit("late", hold=2.0)
        after(0.5)  # while the COMMIT's reply is held back
    assert proxied.commits_faulted == 1 and sales(PG) == [("a", 5)]
    assert not lock(name).locked() and "proves that it committed" in caplog.text
    with lock(name, ttl=30, atomic=PROXIED):  # neither broken nor left with autocommit off
        sell_one(PROXIED, 1, "b")
    assert sales(PG) == [("a", 5), ("b", 4)]


def lost_commit_checked_under_the_next_holder(
    name: str, proxied: LossyProxy, limits: list[float], row_held: float
) -> BaseException | None:
    """A's hold is lost mid-block and the next holder N waits for A's row; A's COMMIT commits,
    its reply is cut; N then holds the row ``row_held`` s, so A's outcome check waits for it;
    a ``TimeLimit`` lands ``limits`` s after the cut (during the check). What A's block raised,
    or None."""
    n_done = threading.Event()

    def next_holder() -> None:
        with lock(name, ttl=30, timeout=20, atomic=PG):  # waits for the lost hold's row
            sell_one(PG, 1, "n")
            time.sleep(row_held)  # the row stays locked: the outcome check waits
        n_done.set()

    def during() -> None:
        for seconds in limits:
            after(seconds)

    thread: threading.Thread | None = None
    raised: BaseException | None = None
    with signal_raises(TimeLimit) as after:
        try:
            with lock(name, ttl=30, atomic=PROXIED):
                sell_one(PROXIED, 1, "a")
                locks["default"].force_release(name)  # the hold lost mid-block
                thread = in_thread(next_holder)
                deadline = time.monotonic() + 20
                while not lock(name).locked():  # N holds it, waits for the row
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                proxied.fault_commit("cut", during=during)
        except Exception as exc:
            raised = exc
    assert thread is not None
    thread.join(20)
    assert n_done.is_set() and proxied.commits_faulted == 1
    return raised


def test_a_time_limit_during_the_outcome_check_of_a_lost_commit_returns_as_committed(
    name: str, proxied: LossyProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The outcome check waits for the next holder's transaction (the row is locked); a soft
    time limit there escaped the block as itself, an ``Exception``: "nothing committed, retry"
    for a committed block. The check is asked again, and proves it committed."""
    open_shop(PG, 1, 5)
    raised = lost_commit_checked_under_the_next_holder(name, proxied, [1.0], row_held=2.0)
    assert raised is None and sales(PG) == [("a", 5), ("n", 4)]
    assert "proves that it committed" in caplog.text
    assert "TimeLimit interrupted the outcome check" in caplog.text  # logged, not lost


def test_a_check_cut_short_twice_by_time_limits_is_unknown(name: str, proxied: LossyProxy) -> None:
    """A second time limit during the check asked again: the outcome is not learnt, and the
    block says so (``CommitOutcomeUnknown``, from the time limit), never "nothing committed"."""
    open_shop(PG, 1, 5)
    raised = lost_commit_checked_under_the_next_holder(name, proxied, [1.0, 1.6], row_held=2.8)
    assert isinstance(raised, CommitOutcomeUnknown) and isinstance(raised.__cause__, TimeLimit)
    assert sales(PG) == [("a", 5), ("n", 4)]


class CheckInterrupter:
    """A tracer that raises ``TimeLimit`` at the ``at``-th point once armed (None: counts
    them): each line of the fenced block's steps, of the outcome check's retry and of the
    block's exit, and each entry into a function they call."""

    def __init__(self, at: int | None) -> None:
        self.at, self.armed, self.points, self.fired = at, False, 0, ""
        # getattr: the test runs against older code too (to show it failed before the fix).
        found = [getattr(fencing, "_fenced_steps", None), getattr(fencing, "_check", None),
                 fencing.FencedTransaction._settle, fencing.FencedTransaction._leave]  # fmt: skip
        self.codes = {f.__code__ for f in found if f is not None}

    def _point(self, frame: Any) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise TimeLimit(self.fired)

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code in self.codes:
            return self._line
        back = frame.f_back
        if self.armed and back is not None and back.f_code in self.codes:
            self._point(frame)  # at the callee's entry
        return None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and self.armed:
            self._point(frame)
        return self._line


def test_a_time_limit_on_any_line_after_a_lost_commit_never_says_nothing_committed(
    name: str, proxied: LossyProxy
) -> None:
    """The COMMIT committed, its reply lost: an ``Exception`` a signal handler raises on any
    line from there (the outcome check, its retry, the decision) leaves the block as
    committed or as ``CommitOutcomeUnknown``, never as itself ("nothing committed")."""
    open_shop(PG, 1, 10_000)

    def run(tracer: CheckInterrupter, buyer: str) -> str:
        def arm() -> None:
            tracer.armed = True  # the COMMIT reached the server, which committed

        sys.settrace(tracer)
        try:
            with lock(name, ttl=30, atomic=PROXIED):
                sell_one(PROXIED, 1, buyer)
                proxied.fault_commit("cut", during=arm)
            return "returned"
        except Exception as exc:
            return type(exc).__name__
        finally:
            sys.settrace(None)

    counting = CheckInterrupter(None)
    assert run(counting, "count") == "returned"
    assert counting.points > 10, counting.points
    for at in range(1, counting.points + 1):
        tracer = CheckInterrupter(at)
        out = run(tracer, f"b{at}")
        where = (at, tracer.fired, out)
        assert f"b{at}" in [who for who, _ in sales(PG)], where
        assert out in ("returned", "CommitOutcomeUnknown"), where
        assert not lock(name).locked() and not connections[PROXIED].in_atomic_block, where


# -- a prune between the COMMIT and the outcome check ------------------------------------------


def test_a_prune_deleting_the_row_before_the_outcome_check_makes_the_outcome_unknown(
    name: str, proxied: LossyProxy
) -> None:
    """The row is gone, the floor carries its fence: the row may have been this block's,
    committed and pruned (it said "not committed")."""
    open_shop(PG, 1, 5)

    def prune() -> None:
        try:
            assert prune_fences(PG, datetime.timedelta(0)) >= 1
        finally:
            connections.close_all()

    with pytest.raises(CommitOutcomeUnknown), lock(name, ttl=30, atomic=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.fault_commit("cut", during=prune)
    assert sales(PG) == [("a", 5)] and not lock(name).locked()


def test_a_pruned_row_re_created_by_a_re_fencing_next_holder_makes_the_outcome_unknown(
    name: str, proxied: LossyProxy, failover: RedisServer
) -> None:
    """The block's committed row pruned, Redis flushed, the next holder's first block
    re-fences over the floor: its row's ``previous`` is its own pre-re-fence fence, below
    the block's. That is no earlier writer: not "nothing committed" (review fen, 1)."""
    open_shop(PG, 1, 5)
    held = lock(name, using="failover", ttl=30)
    assert held.acquire()
    time.sleep(0.002)
    with lock(f"{name}:x", using="failover", ttl=30, atomic=PG):  # a later fence, pruned:
        pass
    assert prune_fences(PG, datetime.timedelta(0)) == 1  # the floor is above the hold's
    done: list[str] = []

    def prune_then_next_holder() -> None:
        try:
            assert prune_fences(PG, datetime.timedelta(0)) == 1  # the block's row
            failover.client().flushall()  # the hold and the counter lost
            with lock(name, using="failover", ttl=30, timeout=5, atomic=PG):
                sell_one(PG, 1, "n")
            done.append("n")
        finally:
            connections.close_all()

    with pytest.raises(CommitOutcomeUnknown), held.atomic(PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.fault_commit("cut", during=prune_then_next_holder)
    assert done == ["n"] and sales(PG) == [("a", 5), ("n", 4)]


# -- autocommit off --------------------------------------------------------------------------


def test_autocommit_off_is_refused_before_the_lock_is_taken(name: str) -> None:
    """atomic() neither begins nor commits then: the block returned as committed, nothing
    committed."""
    open_shop(PG, 1, 5)
    transaction.set_autocommit(False, using=PG)
    try:
        with pytest.raises(LockError, match="autocommit off"), lock(name, ttl=30, atomic=PG):
            sell_one(PG, 1, "a")
        assert not lock(name).locked()
        held = lock(name, ttl=30)
        held.acquire()
        with pytest.raises(LockError, match="autocommit off"), held.atomic(PG):
            sell_one(PG, 1, "a")
        held.release()
        with (
            transaction.atomic(using=PG),  # an outer atomic() without a COMMIT of its own
            pytest.raises(LockError, match="autocommit off"),
            lock(name, atomic=PG),
        ):
            pass
    finally:
        transaction.rollback(using=PG)
        transaction.set_autocommit(True, using=PG)
    assert sales(PG) == []


# -- blocks exited out of order, by hand -----------------------------------------------------


@pytest.mark.parametrize("outer", ["outermost", "in a transaction"])
def test_a_fenced_block_exited_before_one_opened_inside_it_commits_nothing(
    name: str, outer: str
) -> None:
    """Django's exit of the outer block released the inner block's savepoint and kept the
    transaction open: the outer block returned as committed and was released before any
    COMMIT. Now both roll back, and both say so."""
    open_shop(PG, 1, 5)
    a, b = lock(f"{name}:a", ttl=30, atomic=PG), lock(f"{name}:b", ttl=30, atomic=PG)
    with transaction.atomic(using=PG) if outer != "outermost" else contextlib.nullcontext():
        a.__enter__()
        sell_one(PG, 1, "a")
        b.__enter__()
        sell_one(PG, 1, "b")
        with pytest.raises(LockError, match="out of order"):
            a.__exit__(None, None, None)
        assert not a.locked()
        with pytest.raises(LockError, match="after its outer one"):
            b.__exit__(None, None, None)
        assert not b.locked()
    assert sales(PG) == []
    with lock(f"{name}:a", ttl=30, atomic=PG):  # the connection is usable again
        sell_one(PG, 1, "c")
    assert sales(PG) == [("c", 5)]


def test_a_fenced_block_left_by_its_body_s_exception_before_one_inside_it_commits_nothing(
    name: str,
) -> None:
    open_shop(PG, 1, 5)
    a, b = lock(f"{name}:a", ttl=30, atomic=PG), lock(f"{name}:b", ttl=30, atomic=PG)
    a.__enter__()
    sell_one(PG, 1, "a")
    b.__enter__()
    sell_one(PG, 1, "b")
    with pytest.raises(ZeroDivisionError):
        try:
            1 / 0  # noqa: B018
        except ZeroDivisionError as exc:
            a.__exit__(type(exc), exc, exc.__traceback__)
            raise
    with pytest.raises(LockError, match="after its outer one"):
        b.__exit__(None, None, None)
    assert sales(PG) == [] and not a.locked() and not b.locked()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_during_a_late_commit_reply_goes_on_and_logs_the_outcome(
    name: str, proxied: LossyProxy, caplog: pytest.LogCaptureFixture, interrupt: type
) -> None:
    """An interrupt says "stop", not "failed": it comes out as itself, released, the outcome
    learnt and logged (it was not learnt; had Django's exit turned the interrupt into
    ``ProgrammingError``, as it does an ``Exception``, the block returned as committed,
    swallowing it)."""
    open_shop(PG, 1, 5)
    with (
        signal_raises(interrupt) as after,
        pytest.raises(interrupt),
        lock(name, ttl=30, atomic=PROXIED),
    ):
        sell_one(PROXIED, 1, "a")
        proxied.fault_commit("late", hold=2.0)
        after(0.5)  # while the COMMIT's reply is held back
    assert sales(PG) == [("a", 5)] and not lock(name).locked()
    said = f"{interrupt.__name__} interrupted the COMMIT of its fenced transaction: it committed"
    assert said in caplog.text


# -- a name's first block: its row INSERTed by a COMMIT still running -------------------------


def slow_commit(delay: float, fails: bool) -> None:
    """This transaction's COMMIT runs a deferred trigger: ``delay`` seconds, then an error
    (``fails``: the COMMIT rolls back) or none."""
    with connections[PG].cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS outcome_slow (fails boolean, delay float)")
        cursor.execute(
            "CREATE OR REPLACE FUNCTION outcome_slow() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN PERFORM pg_sleep(NEW.delay); IF NEW.fails THEN RAISE EXCEPTION 'refused';"
            " END IF; RETURN NULL; END $$"
        )
        cursor.execute("DROP TRIGGER IF EXISTS outcome_slow ON outcome_slow")
        cursor.execute(
            "CREATE CONSTRAINT TRIGGER outcome_slow AFTER INSERT ON outcome_slow DEFERRABLE"
            " INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION outcome_slow()"
        )
        cursor.execute("INSERT INTO outcome_slow VALUES (%s, %s)", [fails, delay])


@pytest.mark.parametrize("fails", [False, True], ids=["committed", "refused"])
def test_a_time_limit_during_a_first_block_s_slow_commit_waits_for_its_end(
    name: str, fails: bool
) -> None:
    """The name's first block INSERTs its row: a read on a new connection neither sees nor
    waits for a row whose transaction is still committing, and took "no row" for "nothing
    committed" (the block raised ``ProgrammingError`` and the sale had committed). The check
    now first waits until the block's server process left the transaction: then the row
    proves either way."""
    open_shop(PG, 1, 5)
    with contextlib.ExitStack() as stack:
        after = stack.enter_context(signal_raises(TimeLimit))
        if fails:
            stack.enter_context(pytest.raises(DatabaseError))
        with lock(name, ttl=30, atomic=PG):
            sell_one(PG, 1, "a")
            slow_commit(1.5, fails)
            after(0.5)  # while the COMMIT runs the trigger
    assert sales(PG) == ([] if fails else [("a", 5)]) and not lock(name).locked()
    with lock(name, ttl=30, atomic=PG):  # the connection is usable again
        sell_one(PG, 1, "b")
    assert sales(PG)[-1][0] == "b"


# -- Django's atomic() cut short before its COMMIT or rollback ran -----------------------------


@pytest.mark.parametrize("where", ["__exit__", "__enter__", "nested __exit__"])
def test_an_exception_on_django_s_atomic_first_lines_rolls_back_and_leaves_no_transaction(
    name: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler's exception before ``Atomic.__exit__`` left the block (or after
    ``__enter__`` opened it, before the ``with`` took it) kept the transaction open: the
    thread's next fenced block became a savepoint of it and returned as committed, nothing
    committed, and the row stayed locked for the next holder. Now rolled back, raised."""
    open_shop(PG, 1, 5)
    nested, where = where.startswith("nested"), where.split()[-1]
    original = getattr(transaction.Atomic, where)
    armed = [False]

    def cut_short(self: Any, *args: Any) -> Any:
        if where == "__enter__":
            original(self, *args)
        if armed[0]:
            armed[0] = False
            raise TimeLimit()
        return original(self, *args)

    monkeypatch.setattr(transaction.Atomic, where, cut_short)
    if nested:  # the block's savepoint was kept: the outer transaction committed the sale
        with (
            transaction.atomic(using=PG),
            pytest.raises(TimeLimit),
            lock(name, ttl=30, atomic=PG),
        ):
            sell_one(PG, 1, "a")
            armed[0] = True
    elif where == "__exit__":
        with pytest.raises(TimeLimit), lock(name, ttl=30, atomic=PG):
            sell_one(PG, 1, "a")
            armed[0] = True
    else:
        armed[0] = True
        with pytest.raises(TimeLimit), lock(name, ttl=30, atomic=PG):
            pytest.fail("the body ran")
    monkeypatch.undo()
    assert not connections[PG].in_atomic_block and sales(PG) == []
    with lock(f"{name}:other", ttl=30, atomic=PG):  # the same thread's next block
        sell_one(PG, 1, "b")
    got: list[str] = []

    def next_holder() -> None:
        with lock(name, ttl=30, timeout=3, atomic=PG):
            sell_one(PG, 1, "c")
        got.append("c")

    in_thread(next_holder).join(20)
    assert got == ["c"] and sales(PG) == [("b", 5), ("c", 4)]


# -- blocks of one hold in two threads (a plain Lock handed to another thread) -------------------


def test_a_lost_commit_while_another_thread_s_block_of_the_hold_committed_returns(
    name: str, proxied: LossyProxy
) -> None:
    """B1's COMMIT committed, its reply held back; B2, another thread's block of the same
    hold (the same fence), commits on top. The row shows the hold's fence with B2's mark: it
    once said "not committed" for a committed block. B2's upsert kept the mark it overwrote,
    B1's, in ``previous_mark``: committed."""
    open_shop(PG, 1, 5)
    held = lock(name, ttl=30)
    held.acquire()
    with held.atomic(PROXIED):  # an earlier block: the row carries the hold's fence
        pass
    other: list[str] = []

    def b2() -> None:
        with held.atomic(PG):
            sell_one(PG, 1, "b2")
        other.append("committed")

    with held.atomic(PROXIED):
        sell_one(PROXIED, 1, "b1")
        proxied.fault_commit("cut", hold=0.3, during=lambda: in_thread(b2).join(20))
    held.release()
    assert other == ["committed"] and sales(PG) == [("b1", 5), ("b2", 4)]


def test_a_refused_commit_under_another_thread_s_block_and_the_next_holder_is_unknown(
    name: str, proxied: LossyProxy
) -> None:
    """B1's COMMIT is refused (rolled back), its reply lost; meanwhile B2, another thread's
    block of the same hold, commits the hold's fence, the hold is lost and the next holder
    commits on top: its ``previous`` is the hold's fence, B2's. B1 returned as committed,
    nothing of it committed; now unknown (the rows cannot tell B1's fence from B2's)."""
    deferred_refusal()
    open_shop(PG, 1, 5)
    with lock(name, ttl=30, atomic=PG):  # the row exists, written by the hold before
        pass
    held = lock(name, ttl=30)
    held.acquire()
    done: list[str] = []

    b2 = selling_block(held, done)

    next_holder = selling_next_holder(name, done)

    def meanwhile() -> None:
        in_thread(b2).join(20)
        locks["default"].force_release(name)  # the hold lost
        in_thread(next_holder).join(20)

    with pytest.raises(CommitOutcomeUnknown), held.atomic(PROXIED):
        sell_one(PROXIED, 1, "b1")
        refused_at_commit(PROXIED)
        proxied.fault_commit("cut", hold=0.1, during=meanwhile)
    with contextlib.suppress(LockError):
        held.release()
    assert done == ["b2", "n"] and sales(PG) == [("b2", 5), ("n", 4)]


def test_a_lost_commit_whose_check_meets_another_thread_s_block_of_the_hold_is_unknown(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B1's COMMIT never reaches the server (rolled back). Its outcome check begins with B1
    alone; before the row is read, B2, another thread's block of the same hold, commits the
    hold's fence, the hold is lost and the next holder commits on top (``previous``: the
    hold's fence, B2's). ``alone`` was decided before the check: "committed", nothing of B1
    committed; the rows cannot tell B1's fence from B2's: unknown."""
    open_shop(PG, 1, 5)
    with lock(name, ttl=30, atomic=PG):  # the row exists, written by the hold before
        pass
    held = lock(name, ttl=30)
    held.acquire()
    done: list[str] = []

    b2 = selling_block(held, done)

    next_holder = selling_next_holder(name, done)

    check = fencing.commit_outcome

    def meanwhile_then_check(*args: Any, **kwargs: Any) -> bool | None:
        if not done:  # the check's waits (the pid poll, FOR SHARE) stand in for this
            in_thread(b2).join(20)
            locks["default"].force_release(name)  # the hold lost
            in_thread(next_holder).join(20)
        return check(*args, **kwargs)

    monkeypatch.setattr(fencing, "commit_outcome", meanwhile_then_check)
    with pytest.raises(CommitOutcomeUnknown), held.atomic(PROXIED):
        sell_one(PROXIED, 1, "b1")
        proxied.cut()  # the COMMIT never reaches the server, which rolls back
    with contextlib.suppress(LockError):
        held.release()
    assert done == ["b2", "n"] and sales(PG) == [("b2", 5), ("n", 4)]


# -- a frozen clock (freezegun, time-machine) ------------------------------------------------


def test_a_frozen_clock_gives_each_block_of_a_hold_its_own_mark(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two blocks of one hold under ``timezone.now()`` returning one time wrote one mark; the
    second's COMMIT lost before the server got it was taken for the first's: "committed",
    nothing committed."""
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)
    open_shop(PG, 1, 5)
    held = lock(name, ttl=30)
    held.acquire()
    with held.atomic(using=PROXIED):
        pass
    with pytest.raises(OperationalError), held.atomic(using=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.cut()  # the COMMIT never reaches the server, which rolls back
    held.release()
    assert sales(PG) == []


def test_a_mark_a_burst_left_behind_is_not_taken_by_the_next_block_of_the_hold(
    name: str, proxied: LossyProxy
) -> None:
    """A burst of exceptions cutting both of the steps' forgetting of a block's mark short
    (two soft time limits in a row) left the mark in the thread's marks: every later block of
    the row on the thread took it for an outer block's and wrote it, so two blocks of one hold
    wrote one mark, and the second's COMMIT lost before the server got it was taken for the
    first's: "committed", nothing committed. A mark whose block ended is never taken again."""
    open_shop(PG, 1, 5)
    forget = fencing._forget_mark.__code__  # type: ignore[attr-defined]
    first: list[Any] = []

    # Python unsets a trace (or profile) function that raised: the tracer cuts the first call
    # short, the profiler the second (the steps' ``finally``).
    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is forget and not first:
            first.append(frame)
            raise TimeLimit("a soft time limit as the block's mark is forgotten")
        return None

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is forget and first and frame is not first[0]:
            raise TimeLimit("and another as it is forgotten again")

    held = lock(name, ttl=30)
    held.acquire()
    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        with held.atomic(using=PROXIED):  # commits: the exceptions after it are logged
            pass
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    # Unknown, not "nothing committed": the burst cut the record of the first block's end
    # short too (the proof that the row's mark is an ended block's).
    with pytest.raises(CommitOutcomeUnknown), held.atomic(using=PROXIED):
        sell_one(PROXIED, 1, "a")
        proxied.cut()  # the COMMIT never reaches the server, which rolls back
    held.release()
    assert sales(PG) == []


def _adopter(name: str, token: str) -> Callable[[], int]:
    """A forked child that ``adopt()``s the hold ``token`` and, once told (the returned
    callable, which waits for it), runs a block of it on ``PG``: its exit code (0: committed).
    The child's clock is the parent's, and its marks start from what the parent had made."""
    connections.close_all()  # (the child would share the parent's sockets)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: ended by the alarm should it hang
        code = 3
        try:
            signal.alarm(20)
            os.read(ready_r, 1)
            adopted = lock(name, ttl=30)
            adopted.adopt(token)
            with adopted.atomic(PG):
                sell_one(PG, 1, "child")
            code = 0
        finally:
            os._exit(code)
    os.close(ready_r)

    def run() -> int:
        os.write(ready_w, b"x")
        os.close(ready_w)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    return run


def test_a_refused_commit_under_another_process_s_block_of_the_hold_is_unknown(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen clock (freezegun) in two processes sharing a hold (a forked child adopts it):
    each made its marks unique only among its own, so the child's block and this process's
    next one wrote the same mark. This block's COMMIT is refused, its reply lost; the child's
    block commits on top meanwhile: the row showed the hold's fence with "this block's" mark,
    and it returned as committed, nothing of it committed. Another process's block of the hold
    on top: unknown."""
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)
    deferred_refusal()
    open_shop(PG, 1, 5)
    held = lock(name, ttl=30)
    held.acquire()
    with held.atomic(PROXIED):  # an earlier block: the row carries the hold's fence
        pass
    child = _adopter(name, held.token or "")
    exits: list[int] = []
    with pytest.raises(CommitOutcomeUnknown), held.atomic(PROXIED):
        sell_one(PROXIED, 1, "parent")
        refused_at_commit(PROXIED)
        proxied.fault_commit("cut", hold=0.1, during=lambda: exits.append(child()))
    held.release()
    assert exits == [0] and sales(PG) == [("child", 5)]


def test_a_lost_commit_under_another_process_s_block_of_the_hold_after_a_clock_step_returns(
    name: str, proxied: LossyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wall clock steps back (NTP) in two processes sharing a hold (a forked child adopts
    it): the child's first block and this process's first block after the fork had one mark.
    This process's second block commits, its reply lost; the child's block commits on top
    meanwhile, with the first block's mark: the check took it for an ended block's and said
    "nothing committed" for a committed block. The child's upsert kept this block's mark in
    ``previous_mark``: committed."""
    open_shop(PG, 1, 5)
    held = lock(name, ttl=30)
    held.acquire()
    with held.atomic(PROXIED):  # an earlier block, the real clock
        pass
    stepped = timezone.now() - datetime.timedelta(seconds=30)
    monkeypatch.setattr(timezone, "now", lambda: stepped)
    child = _adopter(name, held.token or "")
    with held.atomic(PROXIED):  # ended before the next block began
        pass
    exits: list[int] = []
    with held.atomic(PROXIED):
        sell_one(PROXIED, 1, "parent")
        proxied.fault_commit("cut", hold=0.1, during=lambda: exits.append(child()))
    held.release()
    assert exits == [0] and sales(PG) == [("parent", 5), ("child", 4)]


def test_a_refused_commit_under_another_process_s_block_and_the_next_holder_is_unknown(
    name: str, proxied: LossyProxy
) -> None:
    """The hold was re-fenced by its block on another database (``default``, whose row's
    writer was unknown), so this block's upsert is the first of that fence here. Its COMMIT
    is refused, its reply lost; meanwhile a forked child that ``adopt()``ed the hold commits
    exactly that fence (its writer known: no question to Redis), the hold is lost and the
    next holder commits on top, ``previous`` the hold's fence. This process saw no other
    block of the hold and said "committed": nothing of it committed. The child's mark in
    ``previous_mark``: unknown."""
    deferred_refusal()
    open_shop(PG, 1, 5)
    with lock(name, ttl=30, atomic="default"):  # an older hold writes the row on default
        pass
    with lock(name, ttl=30, atomic=PG):  # the hold before this one writes it on PG
        pass
    held = lock(name, ttl=30)
    held.acquire()
    with held.atomic(PG):  # its writer is the prior hold: no question to Redis
        pass
    before = held.fence
    with held.atomic("default"):  # its writer is unknown: the hold re-fenced
        pass
    assert (held.fence or 0) > (before or 0)
    child = _adopter(name, held.token or "")
    done: list[Any] = []

    next_holder = selling_next_holder(name, done)

    def meanwhile() -> None:
        done.append(child())
        locks["default"].force_release(name)  # the hold lost
        in_thread(next_holder).join(20)

    with pytest.raises(CommitOutcomeUnknown), held.atomic(PROXIED):
        sell_one(PROXIED, 1, "parent")
        refused_at_commit(PROXIED)
        proxied.fault_commit("cut", hold=0.1, during=meanwhile)
    with contextlib.suppress(LockError):
        held.release()
    assert done == [0, "n"] and sales(PG) == [("child", 5), ("n", 4)]


# -- an old interrupt being handled where the block runs --------------------------------------


def test_a_block_run_while_an_old_interrupt_is_handled_does_not_raise_it_again(
    name: str, proxied: LossyProxy
) -> None:
    """The lost reply's error has the handled ``KeyboardInterrupt`` as its context: it is not
    one that interrupted this COMMIT (the committed block raised it again)."""
    open_shop(PG, 1, 5)
    raised: BaseException | None = None
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        try:
            with lock(name, ttl=30, atomic=PROXIED):
                sell_one(PROXIED, 1, "a")
                proxied.fault_commit("cut")
        except BaseException as exc:  # (a KeyboardInterrupt would end the test run)
            raised = exc
    assert raised is None and proxied.commits_faulted == 1 and sales(PG) == [("a", 5)]


# -- an exception at the release after the COMMIT ---------------------------------------------


def test_a_time_limit_at_the_release_after_the_commit_does_not_make_single_instance_rerun(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A soft time limit while the release waits for Redis: the body committed; raised, the
    run looked failed, and a retry (``autoretry_for``) sold twice."""
    open_shop(PG, 1, 5)
    release = Lock.release

    def slow_release(self: Any) -> None:
        monkeypatch.setattr(Lock, "release", release)
        raise TimeLimit()

    @single_instance(key=name, ttl=30, atomic=PG)
    def sell() -> str:
        sell_one(PG, 1, "a")
        monkeypatch.setattr(Lock, "release", slow_release)
        return "sold"

    assert sell() == "sold" and sales(PG) == [("a", 5)]
    assert "committed; then the release raised" in caplog.text
    locks["default"].force_release(name)


@pytest.mark.parametrize("reentrant", [False, True], ids=["lock", "reentrant"])
def test_a_time_limit_in_the_release_after_the_commit_has_it_sent_again(
    name: str, reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release's Redis call is cut short before its reply (the release began: the hold
    counted out, marked releasing). The promised second try saw the level released and sent
    nothing: the name stayed held until its TTL."""
    open_shop(PG, 1, 5)
    backend = locks["default"]
    op_release, execute = backend.op_release, backend.execute
    releases: list[Any] = []

    def noted(*args: Any) -> Any:
        releases.append(op_release(*args))
        return releases[-1]

    def cut_once(op: Any) -> Any:
        if releases and op is releases[0] and len(releases) == 1:
            releases.append(None)  # once
            raise TimeLimit()  # before the call is sent: a signal handler's, on any line
        return execute(op)

    monkeypatch.setattr(backend, "op_release", noted)
    monkeypatch.setattr(backend, "execute", cut_once)
    held = lock(name, ttl=30, reentrant=reentrant, atomic=PG)
    with held:
        sell_one(PG, 1, "a")
    assert len(releases) >= 2, releases
    assert sales(PG) == [("a", 5)] and not lock(name).locked() and not held.owned()


def test_autocommit_off_is_refused_before_any_lock_is_taken_by_the_helpers(name: str) -> None:
    """lock_all(atomic=), @single_instance(atomic=) and @lock_view(atomic=) took their locks
    first, then refused (and released): a waiter saw the lock taken for nothing."""
    taken: list[str] = []

    def on_acquired(sender: Any, lock: Any, **kwargs: Any) -> None:
        taken.append(lock.name)

    @single_instance(key=f"{name}:task", ttl=30, atomic=PG)
    def task() -> None:
        pytest.fail("the task ran")

    def view(request: Any) -> Any:
        pytest.fail("the view ran")

    lock_acquired.connect(on_acquired, weak=False)
    transaction.set_autocommit(False, using=PG)
    try:
        with (
            pytest.raises(LockError, match="autocommit off"),
            lock_all(f"{name}:a", f"{name}:b", ttl=30, atomic=PG),
        ):
            pytest.fail("the body ran")
        with pytest.raises(LockError, match="autocommit off"):
            task()
        with pytest.raises(LockError, match="autocommit off"):
            lock_view(f"{name}:view", atomic=PG)(view)(RequestFactory().get("/"))
    finally:
        lock_acquired.disconnect(on_acquired)
        transaction.rollback(using=PG)
        transaction.set_autocommit(True, using=PG)
    assert taken == []
