"""The fenced block's rules (docs/topics/fencing.md, "The fenced block, step by step"), on
SQLite: a block that returns committed, a block that raises committed nothing, whatever
raises where; on_commit callbacks; transactions the body left unable to commit; generator
functions refused. PostgreSQL's own cases: tests/fenced/test_fenced_postgres.py."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.db.transaction import TransactionManagementError
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.test import Client, RequestFactory
from django.test.utils import CaptureQueriesContext
from django.urls import path

from django_redlock import (
    BackendUnavailable,
    LockNotAcquired,
    StaleFence,
    fencing,
    lock,
    lock_view,
    single_instance,
)
from django_redlock.fence_table import row_key
from django_redlock.locking.base import BaseLock
from django_redlock.models import Fence

from ..support.fenced_child import open_shop, sales, sell_one

pytestmark = pytest.mark.django_db(transaction=True)
DB = DEFAULT_DB_ALIAS


@pytest.fixture(autouse=True)
def shop() -> None:
    open_shop(DB, 1, 10)


class MailServerDown(Exception):
    pass


def failing_callback() -> None:
    raise MailServerDown("mail server down")


# -- on_commit callbacks: after the COMMIT, before the release -------------------------------


def with_form(name: str, body: Callable[[], None]) -> None:
    with lock(name, ttl=30, atomic=True):
        body()


def atomic_form(name: str, body: Callable[[], None]) -> None:
    held = lock(name, ttl=30)
    held.acquire()
    try:
        with held.atomic():
            body()
    finally:
        held.release()


def decorator_form(name: str, body: Callable[[], None]) -> None:
    @lock(name, ttl=30, atomic=True)
    def run() -> None:
        body()

    run()


def task_form(name: str, body: Callable[[], None]) -> None:
    @single_instance(key=name, ttl=30, atomic=True)
    def run() -> None:
        body()

    run()


FORMS = {"with": with_form, "atomic": atomic_form, "decorator": decorator_form,
         "single_instance": task_form}  # fmt: skip


@pytest.mark.parametrize("form", FORMS)
def test_an_on_commit_callback_that_raises_does_not_make_a_committed_block_raise(
    name: str, form: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Django runs on_commit callbacks after the COMMIT, inside the transaction's exit: a
    callback's error looked like a failed commit ("nothing committed, retry": a second sale).
    The block committed: the error is logged, the lock released, nothing raised."""
    ran: list[str] = []

    def body() -> None:
        sell_one(DB, 1, "a")
        transaction.on_commit(failing_callback)
        transaction.on_commit(lambda: ran.append("later"))  # Django drops those after a raise

    with caplog.at_level(logging.ERROR, logger="django_redlock"):
        FORMS[form](name, body)
    assert sales(DB) == [("a", 10)] and not lock(name).locked()
    assert "an on_commit callback raised" in caplog.text and "mail server down" in caplog.text


def test_on_commit_callbacks_run_after_the_commit_with_the_lock_still_held(name: str) -> None:
    """The contract: callbacks of the block's transaction run once it committed, before the
    release: the lock is still this hold's (a slow callback delays the next holder)."""
    seen: list[Any] = []
    with lock(name, ttl=30, atomic=True) as held:
        sell_one(DB, 1, "a")
        transaction.on_commit(lambda: seen.append((held.owned(), connection.in_atomic_block)))
        assert seen == []
    assert seen == [(True, False)] and not held.locked()


def test_an_interrupt_from_a_callback_after_the_commit_propagates_and_releases(name: str):
    """A BaseException (KeyboardInterrupt) is not an error to log: it propagates, the lock
    released; the sale stands."""

    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), lock(name, ttl=30, atomic=True):
        sell_one(DB, 1, "a")
        transaction.on_commit(interrupt)
    assert sales(DB) == [("a", 10)] and not lock(name).locked()


class TimeLimit(Exception):
    """Stands for Celery's SoftTimeLimitExceeded."""


def _raise_as_it_returns(code: Any) -> Callable[[Any, str, Any], Any]:
    """A tracer raising ``TimeLimit`` once, as a frame of ``code`` returns: a signal handler's
    exception landing as that callback ends, deterministically."""
    armed = [True]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and armed:
            armed.clear()
            raise TimeLimit("a soft time limit, as the callback returned")
        return local

    return lambda frame, event, arg: local if frame.f_code is code else None


@pytest.mark.parametrize("hook", ["the fence's own", "on_commit_or_proved's"])
def test_the_body_s_on_commit_callbacks_all_run_after_a_library_callback_raised(
    name: str, hook: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Django logs a robust callback's error with the callback's ``__qualname__``: the
    library's callbacks (the fence's marker, registered first; on_commit_or_proved's wrapper,
    the Celery run's note) had none, so that log raised AttributeError, Django stopped, and
    every callback the body registered after them was dropped from a committed block."""
    ran: list[str] = []
    tracer = None

    def body() -> None:
        if hook == "on_commit_or_proved's":
            fencing.on_commit_or_proved(failing_callback, using=DB)
        sell_one(DB, 1, "a")
        transaction.on_commit(lambda: ran.append("ship"), using=DB)
        transaction.on_commit(lambda: ran.append("mail"), using=DB, robust=True)
        sys.settrace(tracer)

    if hook == "the fence's own":  # a soft time limit as the fence's marker returns
        tracer = _raise_as_it_returns(fencing._Committed.__call__.__code__)
    before = sys.gettrace()
    try:
        with caplog.at_level(logging.ERROR), lock(name, ttl=30, atomic=True):
            body()
    finally:
        sys.settrace(before)
    assert sales(DB) == [("a", 10)] and not lock(name).locked()
    assert ran == ["ship", "mail"]
    assert "AttributeError" not in caplog.text
    assert ("TimeLimit" if tracer else "mail server down") in caplog.text


@lock_view("order:{pk}", atomic=True)
def buy(request: HttpRequest, pk: int) -> HttpResponse:
    sell_one(DB, pk, "view")
    transaction.on_commit(failing_callback)
    return HttpResponse("sold")


@lock_view("stream:{pk}", atomic=True)
def stream(request: HttpRequest, pk: int) -> StreamingHttpResponse:
    sell_one(DB, pk, "stream")

    def chunks() -> Iterator[bytes]:
        # Runs once the view returned: committed, released, outside any transaction.
        yield f"{lock(f'stream:{pk}').locked()} {connection.in_atomic_block}".encode()
        yield f" {sales(DB)}".encode()

    return StreamingHttpResponse(chunks())


urlpatterns = [path("buy/<int:pk>/", buy), path("stream/<int:pk>/", stream)]


@pytest.fixture
def urls(settings: Any) -> None:
    settings.ROOT_URLCONF = __name__


def test_lock_view_answers_the_view_s_response_when_a_callback_fails_after_the_commit(
    urls: None,
) -> None:
    response = Client().get("/buy/1/")
    assert response.status_code == 200 and response.content == b"sold"
    assert sales(DB) == [("view", 10)] and not lock("order:1").locked()


def test_a_streaming_response_s_content_runs_after_the_commit_and_the_release(urls: None):
    """The documented rule: what the view did before returning is fenced and committed; the
    streaming content is produced afterwards, outside the lock and the transaction."""
    response = Client().get("/stream/1/")
    assert b"".join(response.streaming_content) == b"False False [('stream', 10)]"


# -- a transaction the body left unable to commit ---------------------------------------------


@pytest.mark.parametrize("form", ["with", "atomic"])
def test_a_block_marked_for_rollback_raises_and_commits_nothing(name: str, form: str) -> None:
    """transaction.set_rollback(True) (or a failed inner atomic(savepoint=False)): the exit
    rolls back silently, so the block must not return as if it had committed."""

    def body() -> None:
        sell_one(DB, 1, "a")
        transaction.set_rollback(True)

    with pytest.raises(TransactionManagementError, match="nothing committed"):
        FORMS[form](name, body)
    assert sales(DB) == [] and not lock(name).locked()


@pytest.mark.parametrize("form", ["with", "atomic"])
def test_sqlite_rolling_the_transaction_back_inside_the_body_raises(name: str, form: str) -> None:
    """SQLite rolls the whole transaction back on some errors (a trigger's RAISE(ROLLBACK),
    SQLITE_FULL, IOERR, NOMEM, INTERRUPT); the body catches the error and goes on, its next
    statements autocommit one by one, with no fence. The block must not return as committed."""
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS shop_audit")
        cursor.execute("CREATE TABLE shop_audit (msg text)")
        cursor.execute(
            "CREATE TRIGGER shop_audit_not_empty BEFORE INSERT ON shop_audit WHEN new.msg = ''"
            " BEGIN SELECT RAISE(ROLLBACK, 'empty audit message'); END"
        )

    def body() -> None:
        sell_one(DB, 1, "a")
        with pytest.raises(IntegrityError), connection.cursor() as cursor:
            cursor.execute("INSERT INTO shop_audit VALUES ('')")

    with pytest.raises(TransactionManagementError, match="rolled back by the database"):
        FORMS[form](name, body)
    assert sales(DB) == [] and not lock(name).locked()
    assert not Fence.objects.filter(key=row_key(DB, name)).exists()


# -- generator functions: refused when decorated ---------------------------------------------


def generator(request: HttpRequest, pk: int) -> Iterator[int]:
    yield pk


async def async_generator(request: HttpRequest, pk: int) -> AsyncIterator[int]:
    yield pk


@pytest.mark.parametrize("func", [generator, async_generator])
@pytest.mark.parametrize(
    "decorator",
    [
        lambda: lock("ticket:{pk}", using="down", atomic=True),
        lambda: lock("ticket:{pk}", using="down"),
        lambda: single_instance(key="ticket:{pk}", using="down", atomic=True),
        lambda: single_instance(key="ticket:{pk}", using="down"),
        lambda: lock_view("ticket:{pk}", using="down", atomic=True),
        lambda: lock_view("ticket:{pk}", using="down"),
    ],
)
def test_a_generator_function_is_refused_when_decorated(decorator: Any, func: Any) -> None:
    """Its body runs when iterated, after the call returned: with neither lock nor
    transaction. Refused before any Redis call (backend "down" listens nowhere)."""
    with pytest.raises(TypeError, match="generator"):
        decorator()(func)


def passthrough(func: Callable[..., Any]) -> Callable[..., Any]:
    """An ordinary decorator (logging, metrics): the generator function behind ``wraps``."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


class Streamer:
    def __call__(self, request: HttpRequest, pk: int) -> Iterator[int]:
        yield pk


HIDDEN = {
    "wraps": lambda: passthrough(generator),
    "partial": lambda: functools.partial(generator, None),
    "callable object": lambda: Streamer(),
    "staticmethod": lambda: staticmethod(generator),
    "contextmanager": lambda: contextlib.contextmanager(generator),
    "async wraps": lambda: passthrough(async_generator),
}


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("atomic", [True, False])
def test_a_generator_function_behind_a_wrapper_is_refused_when_decorated(hidden: str, atomic):
    with pytest.raises(TypeError, match="generator"):
        lock("ticket:{pk}", using="down", atomic=atomic)(HIDDEN[hidden]())


class Hidden:
    """A generator function no decorator-time look can see (``__wrapped__`` dropped)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def __call__(self, pk: int) -> Any:
        return self.make()


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("kind", ["generator", "async generator"])
def test_a_call_that_returns_a_generator_is_refused_released_and_rolled_back(
    name: str, atomic: bool, kind: str
) -> None:
    """Found at call time: the body would run after the release, outside the transaction."""
    ran: list[str] = []

    def body() -> Iterator[None]:
        ran.append("body")
        yield

    async def abody() -> AsyncIterator[None]:
        ran.append("body")
        yield

    def make() -> Any:
        sell_one(DB, 1, "a")
        return body() if kind == "generator" else abody()

    decorated = lock(name, ttl=30, atomic=atomic)(Hidden(make))
    with pytest.raises(TypeError, match="returned a"):
        decorated(1)
    assert ran == [] and not lock(name).locked()
    assert sales(DB) == ([] if atomic else [("a", 10)])


def plain(pk: int, extra: int = 0) -> int:
    return pk + extra


class Adder:
    def __call__(self, pk: int) -> int:
        return pk + 1


@pytest.mark.parametrize("atomic", [True, False])
def test_partials_and_callable_objects_are_locked_like_functions(name: str, atomic: bool):
    """No ``__qualname__`` on them: the lock's name template still builds (it crashed)."""
    assert lock(name + ":{pk}", ttl=30, atomic=atomic)(functools.partial(plain, extra=2))(1) == 3
    assert lock(name + ":{pk}", ttl=30, atomic=atomic)(Adder())(1) == 2
    with pytest.raises(ValueError, match=r"partial\(plain\)|Adder"):
        lock("{nope}", ttl=30, atomic=atomic)(Adder())(1)


# -- the state machine: every exit, with an exception at each step ----------------------------


class Boom(BaseException):
    """Not an Exception: an interrupt anywhere must still free the lock."""


def test_waiting_in_redis_runs_out_commits_nothing_and_holds_nothing(name: str) -> None:
    other = lock(name, ttl=30)
    other.acquire()
    with (
        CaptureQueriesContext(connection) as queries,
        pytest.raises(LockNotAcquired),
        lock(name, timeout=0.1, atomic=True),
    ):
        pytest.fail("the body ran")
    assert queries.captured_queries == []  # the database never touched
    other.release()


def test_redis_not_answering_while_waiting_touches_no_database() -> None:
    with (
        CaptureQueriesContext(connection) as queries,
        pytest.raises(BackendUnavailable),
        lock("x", using="down", atomic=True),
    ):
        pytest.fail("the body ran")
    assert queries.captured_queries == []


def test_an_interrupt_while_waiting_in_redis_leaves_nothing_held(name: str) -> None:
    """A signal handler raising in the middle of the wait (as Ctrl-C does)."""
    other = lock(name, ttl=30)
    other.acquire()

    def interrupt(signum: int, frame: Any) -> None:
        raise Boom()

    waiting = lock(name, ttl=30, timeout=10, atomic=True)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with CaptureQueriesContext(connection) as queries, pytest.raises(Boom), waiting:
            pytest.fail("the body ran")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert queries.captured_queries == [] and not waiting.owned()
    other.release()
    assert not lock(name).locked()  # the interrupted waiter did not take it meanwhile


@pytest.mark.parametrize("raised", [Boom, RuntimeError])
def test_an_exception_in_the_fence_check_releases_and_commits_nothing(
    name: str, raised: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    def check(*args: Any, **kwargs: Any) -> None:
        sell_one(DB, 1, "check")
        raise raised()

    monkeypatch.setattr(fencing, "check_fence", check)
    with pytest.raises(raised), lock(name, ttl=30, atomic=True):
        pytest.fail("the body ran")
    assert sales(DB) == [] and not lock(name).locked()


def test_a_stale_fence_releases_and_commits_nothing(name: str) -> None:
    with lock(name, atomic=True):
        pass
    Fence.objects.filter(key=row_key("default", name)).update(fence=2**62)
    with pytest.raises(StaleFence), lock(name, ttl=30, atomic=True):
        pytest.fail("the body ran")
    assert not lock(name).locked()


class SoftTimeLimit(Exception):
    """Celery's soft time limit: an ``Exception`` a signal handler raises."""


def _cut_first_release_send(backend: Any) -> Callable[[Any, str, Any], Any]:
    """A tracer raising :class:`SoftTimeLimit` as the first release sends its command (as a
    signal landing while it waits for Redis: the outcome unknown, the hold ``releasing``)."""
    execute, release = type(backend).execute.__code__, BaseLock.release.__code__

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is execute:
            up = frame.f_back
            while up is not None and up.f_code is not release:
                up = up.f_back
            if up is not None:
                sys.settrace(None)
                raise SoftTimeLimit("soft time limit")
        return None

    return tracer


@pytest.mark.parametrize("form", ["with", "decorator"])
def test_a_time_limit_during_a_failed_opening_s_release_leaves_nothing_held(
    name: str, form: str
) -> None:
    """The opening fails (a stale fence: nothing committed), and a soft time limit lands
    during the library's own release of the lock: released all the same (tried once more),
    not held by nobody until its TTL."""
    with lock(name, atomic=True):
        pass
    Fence.objects.filter(key=row_key("default", name)).update(fence=2**62)
    held = lock(name, ttl=30, atomic=True)

    def call() -> None:
        if form == "with":
            with held:
                pytest.fail("the body ran")
        else:
            held(lambda: pytest.fail("the body ran"))()

    sys.settrace(_cut_first_release_send(held.backend))
    try:
        with pytest.raises(SoftTimeLimit):
            call()
    finally:
        sys.settrace(None)
    assert not lock(name).locked()


@pytest.mark.parametrize("raised", [Boom, RuntimeError])
def test_an_exception_in_the_body_rolls_back_releases_and_propagates(
    name: str, raised: type[BaseException]
) -> None:
    with pytest.raises(raised), lock(name, ttl=30, atomic=True):
        sell_one(DB, 1, "a")
        raise raised()
    assert sales(DB) == [] and not lock(name).locked()


def test_a_failed_commit_releases_and_commits_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def commit() -> None:
        raise OperationalError("the COMMIT failed")

    with pytest.raises(OperationalError), lock(name, ttl=30, atomic=True):
        sell_one(DB, 1, "a")
        monkeypatch.setattr(connection, "_commit", commit)
    monkeypatch.undo()
    assert sales(DB) == [] and not lock(name).locked()


@pytest.mark.parametrize("raised", [Boom, RuntimeError])
def test_an_exception_at_the_release_after_the_commit(
    name: str, raised: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LockError there is the lost-hold rule (tests/fenced/test_fenced.py): logged. So is any
    other ``Exception`` (a signal handler's, as Celery's soft time limit): raised, it would say
    "not committed" and a retry would sell twice (it propagated). An interrupt (``Boom``, not
    an ``Exception``) propagates; the sale committed all the same."""
    held = lock(name, ttl=30, atomic=True)

    def release() -> None:
        raise raised()

    interrupt = not issubclass(raised, Exception)
    with pytest.raises(raised) if interrupt else contextlib.nullcontext(), held:
        sell_one(DB, 1, "a")
        monkeypatch.setattr(held, "release", release)
    monkeypatch.undo()
    assert sales(DB) == [("a", 10)]
    # Released, not force-released: a hold taken from under the watchdog is declared lost
    # at its next renewal, in a later test, whose block then met the loss's incident being
    # written ("database table is locked" on SQLite's shared in-memory cache).
    held.release()


@pytest.mark.parametrize(
    ("function", "line"),
    [
        ("leave_block", "block.__exit__(exc_type, exc, tb)"),
        ("enter_block", "_blocks().append(block)"),
    ],
)
def test_an_exception_between_the_block_and_its_with_rolls_back_and_releases_at_once(
    name: str, function: str, line: str
) -> None:
    """A signal handler's exception in ``with``'s own code, between the lock and its fenced
    block (the exit not yet run, or the block opened and not yet recorded): the block's
    transaction stayed open (the row locked, the lock held) until the garbage collector
    closed it. Now rolled back and released before the exception leaves."""
    open_shop(DB, 1, 10)
    code = getattr(fencing, function).__code__
    source, first = inspect.getsourcelines(getattr(fencing, function))
    target = first + next(i for i, text in enumerate(source) if line in text)
    armed = [function == "enter_block"]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == target and armed[0]:
            armed[0] = False
            raise Boom()
        return local

    def trace(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        with pytest.raises(Boom) as raised, lock(name, ttl=30, atomic=True):
            sell_one(DB, 1, "a")
            armed[0] = True
    finally:
        sys.settrace(previous)
    # While the exception lives (its traceback keeps the frames: a caller logs it, Celery
    # stores it), not only once the collector closed what it kept.
    assert raised.value is not None
    assert not connection.in_atomic_block and not lock(name).locked()
    assert sales(DB) == []
    with lock(name, ttl=30, atomic=True):
        sell_one(DB, 1, "b")
    assert sales(DB) == [("b", 10)]


# -- the wait for the lock's row --------------------------------------------------------------


@pytest.fixture
def sqlite_file(tmp_path: Any) -> Iterator[str]:
    """A SQLite database in a file (the in-memory test database shares one cache between its
    connections, where a second writer is refused at once: no wait to run out), waiting at
    most 0.3 s for another connection's write lock."""
    alias = "sqlite_file"
    database = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(tmp_path / "fences.sqlite3"),
        "OPTIONS": {"timeout": 0.3},
    }
    filled = connections.configure_settings({DB: dict(connections.settings[DB]), alias: database})
    connections.settings[alias] = filled[alias]
    connections[alias].connect()  # (pytest-django refuses to connect to an alias it does not know)
    with connections[alias].schema_editor() as editor:
        editor.create_model(Fence)
    open_shop(alias, 1, 10)
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def test_sqlite_s_busy_timeout_on_the_row_is_lock_not_acquired(name: str, sqlite_file: str):
    """The previous holder's transaction outlived its hold (released inside an outer
    transaction that goes on; SQLite locks the whole database for a writer): the next
    holder's wait for the row runs out at SQLite's busy timeout, ``LockNotAcquired`` (nothing
    committed, the lock released), not the driver's "database is locked"; ``@lock_view``
    answers its busy status."""
    db = sqlite_file

    @lock_view(name, ttl=30, atomic=db)
    def view(request: HttpRequest) -> HttpResponse:
        sell_one(db, 1, "view")
        return HttpResponse("sold")

    with lock(name, ttl=30, atomic=db):  # the row exists
        sell_one(db, 1, "first")
    previous = sqlite3.connect(connections.settings[db]["NAME"], isolation_level=None)
    try:
        previous.execute("BEGIN IMMEDIATE")  # the previous holder's outer transaction
        previous.execute("UPDATE shop_ticket SET stock = stock")
        with (
            pytest.raises(LockNotAcquired, match="busy timeout"),
            lock(name, ttl=30, atomic=db, timeout=5),
        ):
            sell_one(db, 1, "next")
        assert not lock(name).locked()
        assert view(RequestFactory().get("/")).status_code == 409
    finally:
        previous.execute("ROLLBACK")
        previous.close()
    assert [who for who, _ in sales(db)] == ["first"] and not lock(name).locked()
