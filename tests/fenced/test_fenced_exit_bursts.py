"""Bursts of two interrupts on a fenced block's exit (review f3): a soft time limit, then a
second one (a ``SIGALRM`` timeout, another soft limit) while the first is still being handled,
each at the point the review proved harmful. The promise (docs/topics/fencing.md's outcome
table, "so too after a second soft time limit"): a committed block's ``on_commit`` callbacks
each run once; a block that did not commit leaves no transaction open and no flag off, and the
thread's next ordinary ``atomic()`` commits.

1. The first in ``owe`` (``_owe_until_left``: the block's exit not run), the second on
   ``BaseLock.__exit__``'s ``except`` line or ``_exit_failed``'s first line, the exception
   kept: the ``with``'s exit token stayed alive in ``_owe_until_left``'s frame on the kept
   traceback; the transaction stayed open after the ``with``, the next ``atomic()`` a
   savepoint of it, its write lost at the request's end.
2. The first in Django's loop over the callbacks (the marker ran), the second on the
   steps' ``except`` line (or in ``connections[using]`` on its next line): ``_run_rest`` never
   ran, and the callbacks Django had detached were dropped with the block committed.
3. The first just after the driver's COMMIT returned (Django's ``commit()``, before it set its
   flag for the callbacks), the second on Django's ``set_autocommit(True)``: the exit taken for
   a lost COMMIT, the connection closed with the callbacks pending; proved committed, only the
   ``on_commit_or_proved`` one ran.
4. The first in Django's ``set_autocommit(True)`` of a rollback (the driver switched, the flag
   not; or neither), the second on the steps' ``except`` line: Django's autocommit flag left
   off on an open connection; on PostgreSQL the next ``atomic()`` failed ("SAVEPOINT can only
   be used in transaction blocks") or returned with its write lost.

Interrupts come from a line tracer (a signal is handled between lines too); CPython unsets a
tracer that raised, so a profile hook puts it back for the second.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from django.core.signals import request_finished
from django.db import connections, transaction

from django_redlock import CommitOutcomeUnknown, fencing, lock
from django_redlock.fencing import on_commit_or_proved
from django_redlock.locking.base import BaseLock

from ..support.fenced_child import open_shop, sales, sell_one

PG = "postgres"
pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)

Point = Callable[[FrameType, str], bool]  # (the frame, its line's text): cut here?


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


class Burst:
    """``TimeLimit`` on the first line event ``first`` holds for, then on the first ``second``
    holds for, and so on (re-armed on every frame of the stack by :meth:`profile`)."""

    def __init__(self, first: Point, *more: Point) -> None:
        self.points = (first, *more)
        self.fired: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self.line

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        stage = len(self.fired)
        if event != "line" or stage >= len(self.points):
            return self.line
        text = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if self.points[stage](frame, text):
            self.fired.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            raise TimeLimit(("first", "second", "third")[stage] + " soft time limit")
        return self.line

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if 0 < len(self.fired) < len(self.points) and sys.gettrace() is None:
            sys.settrace(self)
            each: FrameType | None = frame
            while each is not None:
                each.f_trace = self.line
                each = each.f_back


@contextmanager
def disarmed() -> Iterator[None]:
    try:
        yield
    finally:
        sys.settrace(None)
        sys.setprofile(None)


def arm(burst: Burst) -> None:
    """From here on (the frames called: the block's exit)."""
    sys.setprofile(burst.profile)
    sys.settrace(burst)


def in_code(func: Any, text: str = "") -> Point:
    return lambda frame, line: frame.f_code is func.__code__ and text in line


def in_django(name: str, path: str, text: str) -> Point:
    return lambda frame, line: (
        frame.f_code.co_name == name and frame.f_code.co_filename.endswith(path) and text in line
    )


STEPS_EXCEPT = in_code(fencing._fenced_steps, "except BaseException as exc:")  # type: ignore[attr-defined]


def next_atomic_commits(using: str, name: str) -> None:
    """The thread's next ordinary ``atomic()`` (the task's next step) commits its write: not a
    savepoint of an abandoned transaction (its write rolled back at the request's end), nor
    refused by a connection whose flags say autocommit off."""
    with transaction.atomic(using=using):
        sell_one(using, 1, "next")
    request_finished.send(sender=None)  # the request's (or task's) end
    connections[using].close()
    assert [who for who, _ in sales(using)] == ["next"]
    assert not lock(name).locked()


# -- 1 ----------------------------------------------------------------------------------------

OWE_FIRST = lambda frame, line: (  # noqa: E731
    frame.f_code is fencing.owe.__code__
    and frame.f_back is not None
    and frame.f_back.f_code is fencing._owe_until_left.__code__  # type: ignore[attr-defined]
)
EXIT_FAILED: dict[str, Point] = {
    "except line": in_code(BaseLock.__exit__, "except BaseException as error"),
    "_exit_failed": in_code(BaseLock._exit_failed),
}


@pytest.mark.parametrize("second", list(EXIT_FAILED))
@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_before_the_exit_ran_with_the_exception_kept_leaves_nothing_open(
    name: str, using: str, second: str
) -> None:
    open_shop(using, 1, 10)
    burst = Burst(OWE_FIRST, EXIT_FAILED[second])
    kept: list[BaseException] = []  # (an error reporter's, Celery's einfo)
    try:
        with disarmed(), lock(name, ttl=30, atomic=using):
            sell_one(using, 1, "body")
            arm(burst)
    except TimeLimit as exc:
        kept.append(exc)
    assert len(burst.fired) == 2 and kept, burst.fired
    # Left with its ``with``: rolled back and released, whatever keeps the traceback.
    assert not connections[using].in_atomic_block
    assert not lock(name).locked()
    next_atomic_commits(using, name)
    assert kept  # (kept until here)


# -- 2 and 3 ----------------------------------------------------------------------------------


def pops(nth: int) -> Point:
    """Django's loop over the callbacks, on its ``pop(0)`` line the ``nth`` time."""
    seen: list[int] = []

    def point(frame: FrameType, line: str) -> bool:
        if frame.f_code.co_name == "run_and_clear_commit_hooks" and ".pop(0)" in line:
            seen.append(frame.f_lineno)
        return len(seen) == nth

    return point


def getitem_on_next_line(frame: FrameType, line: str) -> bool:
    """``ConnectionHandler.__getitem__`` (where a real signal is handled: its first
    instruction), called on the line after the steps' ``except`` line."""
    caller = frame.f_back
    return (
        frame.f_code.co_name == "__getitem__"
        and caller is not None
        and caller.f_code is fencing._fenced_steps.__code__  # type: ignore[attr-defined]
        and "elif outermost" in linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    )


COMMITTED_BURSTS: dict[str, Callable[[], tuple[Point, Point]]] = {  # (fresh counts each)
    # 2: the marker ran, the user's first callback next; then the except path cut.
    "loop, then except line": lambda: (pops(2), STEPS_EXCEPT),
    "loop, then connections[using]": lambda: (pops(2), getitem_on_next_line),
    # 3: the driver's COMMIT returned, Django's flag for the callbacks not set; then its
    # switch of autocommit back on.
    "commit returned, then set_autocommit": lambda: (
        in_django("commit", "base/base.py", "self.errors_occurred = False"),
        in_django("__exit__", "db/transaction.py", "connection.set_autocommit(True)"),
    ),
    # The review's suspected "unknown": Django's flag for the callbacks set, its loop entered
    # (not yet detached), or its switch of autocommit cut; then the except path cut.
    "loop entered, then except line": lambda: (
        in_django("run_and_clear_commit_hooks", "base/base.py", "= self.run_on_commit"),
        STEPS_EXCEPT,
    ),
    "switch, then except line": lambda: (
        in_django("set_autocommit", "base/base.py", "self.autocommit = autocommit"),
        STEPS_EXCEPT,
    ),
}


@pytest.mark.parametrize("cut", list(COMMITTED_BURSTS))
@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_after_the_commit_runs_every_callback_once(name: str, using: str, cut: str) -> None:
    open_shop(using, 1, 10)
    burst = Burst(*COMMITTED_BURSTS[cut]())
    ran: list[tuple[str, bool]] = []

    def callback(label: str) -> Callable[[], None]:
        return lambda: ran.append((label, lock(name).locked()))

    with disarmed(), lock(name, ttl=30, atomic=using):  # returns: committed
        sell_one(using, 1, "body")
        transaction.on_commit(callback("plain"), using=using)
        transaction.on_commit(callback("robust"), using=using, robust=True)
        on_commit_or_proved(callback("proved"), using=using)
        arm(burst)
    assert len(burst.fired) == 2, burst.fired
    assert [who for who, _ in sales(using)] == ["body"]
    # Each once, in order, before the release.
    assert ran == [("plain", True), ("robust", True), ("proved", True)]
    assert not lock(name).locked()
    assert not connections[using].in_atomic_block and not connections[using].run_on_commit


# -- 4 ----------------------------------------------------------------------------------------

ROLLBACK_FIRST: dict[str, Point] = {
    # The driver switched back to autocommit, Django's flag not yet.
    "flag": lambda frame, line: (
        in_django("set_autocommit", "base/base.py", "self.autocommit = autocommit")(frame, line)
        and frame.f_locals.get("autocommit") is True
    ),
    # Neither switched (the driver still out of autocommit).
    "switch": in_django("__exit__", "db/transaction.py", "connection.set_autocommit(True)"),
}


@pytest.mark.parametrize("first", list(ROLLBACK_FIRST))
@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_on_the_rollback_leaves_no_flag_off(name: str, using: str, first: str) -> None:
    open_shop(using, 1, 10)
    burst = Burst(ROLLBACK_FIRST[first], STEPS_EXCEPT)
    raised = ""
    try:
        with disarmed(), lock(name, ttl=30, atomic=using):
            sell_one(using, 1, "body")
            arm(burst)
            raise ValueError("the body failed")
    except TimeLimit as exc:
        raised = str(exc)  # (not kept: see test 1 for that)
    assert raised == "second soft time limit" and len(burst.fired) == 2, burst.fired
    connection = connections[using]
    # Closed, or left as after an exit: out of any block, autocommit on. (Django's close()
    # leaves an in-memory SQLite database open: the driver's autocommit makes no harm there.)
    kept_open = connection.vendor == "sqlite" and connection.is_in_memory_db()
    assert connection.connection is None or connection.autocommit or kept_open
    assert not connection.in_atomic_block
    next_atomic_commits(using, name)


# -- 5: the review's sweep, "other first points" --------------------------------------------

BEFORE_LEFT: dict[str, Point] = {
    # Django's exit not yet out of the block's transaction (its atomic flag still set).
    "_Scope.__exit__": in_code(fencing._Scope.__exit__, "released = "),  # type: ignore[attr-defined]
    "Atomic.__exit__": in_django("__exit__", "db/transaction.py", "= get_connection(self.using)"),
    "_roll_back_first": in_code(fencing._roll_back_first, "= connections[using]"),  # type: ignore[attr-defined]
}


@pytest.mark.parametrize("body", ["raises", "returns"])
@pytest.mark.parametrize("first", list(BEFORE_LEFT))
@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_before_djangos_exit_left_the_transaction_rolls_it_back(
    name: str, using: str, first: str, body: str
) -> None:
    """The first before Django's exit left the transaction, the second on the steps' ``except``
    line (before the step that rolls back a transaction an exit left open)."""
    if first == "_roll_back_first" and body == "returns":
        pytest.skip("rolled back first only when the body raised")
    open_shop(using, 1, 10)
    burst = Burst(BEFORE_LEFT[first], STEPS_EXCEPT)
    raised = ""
    try:
        with disarmed(), lock(name, ttl=30, atomic=using):
            sell_one(using, 1, "body")
            arm(burst)
            if body == "raises":
                raise ValueError("the body failed")
    except TimeLimit as exc:
        raised = str(exc)  # (not kept)
    assert raised == "second soft time limit" and len(burst.fired) == 2, burst.fired
    assert not connections[using].in_atomic_block  # rolled back as the block ended
    next_atomic_commits(using, name)


# -- 6: bursts of three (review f4) -----------------------------------------------------------


def in_loop(text: str, label: str, robust: bool | None = None) -> Point:
    """Django's loop over the callbacks, on the line ``text`` for the callback ``label``."""

    def point(frame: FrameType, line: str) -> bool:
        func = frame.f_locals.get("func")
        return (
            frame.f_code.co_name == "run_and_clear_commit_hooks"
            and line.strip() == text
            and getattr(func, "__qualname__", "") == label
            and (robust is None or frame.f_locals.get("robust") is robust)
        )

    return point


def labelled(ran: list[str], label: str) -> Callable[[], None]:
    def callback() -> None:
        ran.append(label)

    callback.__qualname__ = label
    return callback


@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_of_three_in_the_loop_runs_a_robust_callback_once(name: str, using: str) -> None:
    """Review f4, 1: the first on a robust callback's call line, inside Django's ``try:`` (it
    never ran), the second after the last one was popped (the loop cut), the third as the
    except path's ``_run_rest`` began running the two put back. The block's end counted the
    entries taken from the list's length, which the put-back had changed: the robust one was
    put back again, and ran twice."""
    open_shop(using, 1, 10)
    burst = Burst(
        in_loop("func()", "r", robust=True),
        in_loop("if robust:", "b"),
        in_code(fencing._run_each),  # type: ignore[attr-defined]
    )
    ran: list[str] = []
    with disarmed(), lock(name, ttl=30, atomic=using):  # returns: committed
        sell_one(using, 1, "body")
        transaction.on_commit(labelled(ran, "r"), using=using, robust=True)
        transaction.on_commit(labelled(ran, "a"), using=using)
        transaction.on_commit(labelled(ran, "b"), using=using)
        arm(burst)
    assert len(burst.fired) == 3, burst.fired
    assert [who for who, _ in sales(using)] == ["body"]
    assert ran == ["a", "r", "b"]  # each once (r after a: Django's try swallowed its cut)
    assert not lock(name).locked()


COMMIT_RETURNED = in_django("commit", "base/base.py", "self.errors_occurred = False")
SWITCH_BACK = in_django("__exit__", "db/transaction.py", "connection.set_autocommit(True)")


def committed_block_with_three(name: str, using: str, burst: Burst) -> tuple[Any, list[str]]:
    """A committing block, its callbacks plain ``a``, robust ``r``, ``on_commit_or_proved``
    ``p``, its exit cut by ``burst``: what came out of the ``with`` (None: it returned), and
    the callbacks run as the ``with`` was left."""
    open_shop(using, 1, 10)
    ran: list[str] = []
    raised: Exception | None = None
    try:
        with disarmed(), lock(name, ttl=30, atomic=using):
            sell_one(using, 1, "body")
            transaction.on_commit(labelled(ran, "a"), using=using)
            transaction.on_commit(labelled(ran, "r"), using=using, robust=True)
            on_commit_or_proved(labelled(ran, "p"), using=using)
            arm(burst)
    except Exception as exc:
        raised = exc
    assert len(burst.fired) == 3, burst.fired
    assert [who for who, _ in sales(using)] == ["body"]  # committed
    assert not lock(name).locked()
    return raised, list(ran)


@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_of_three_runs_the_kept_callbacks_from_where_they_are_kept(
    name: str, using: str
) -> None:
    """Review f4, 2: f3's two (the driver's COMMIT returned, then Django's switch of
    autocommit), the connection closed with the callbacks kept off it; a third as the row
    proved the COMMIT: they had been put back on the closed connection's list, which nothing
    ran (its next connect() clears it), and the block returned committed with none run."""
    burst = Burst(
        COMMIT_RETURNED,
        SWITCH_BACK,
        in_code(fencing._fenced_steps, "_pending_hooks(using, committed)"),  # type: ignore[attr-defined]
    )
    raised, ran = committed_block_with_three(name, using, burst)
    assert raised is None and ran == ["a", "r", "p"]


# Inside _driver_idle's ``try``, as the driver is asked (SQLite's line, psycopg's).
DRIVER_ASKED: Point = lambda frame, line: (  # noqa: E731
    frame.f_code is fencing._driver_idle.__code__  # type: ignore[attr-defined]
    and ("raw.in_transaction" in line or "getattr(raw" in line)
)


@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_of_three_is_not_taken_for_a_closed_driver(name: str, using: str) -> None:
    """Review f4, 3: the third inside ``_driver_idle`` (whether the kept callbacks are kept):
    its ``except Exception`` took the soft time limit for a closed driver and answered "not
    idle", so the block returned committed with only ``p`` run, the time limit swallowed. Now
    the time limit goes on, and the block's end proves the COMMIT (review f4, 4, below): every
    callback runs (else the block would say unknown, caused by it). (In-memory SQLite, the
    tests' database: Django's close() leaves it open and its callbacks on it, which run:
    passes either way.)"""
    burst = Burst(
        COMMIT_RETURNED,
        SWITCH_BACK,
        DRIVER_ASKED,
    )
    raised, ran = committed_block_with_three(name, using, burst)
    if raised is None:  # the time limit not swallowed: committed with every callback run
        assert ran == ["a", "r", "p"]
    else:
        assert isinstance(raised, CommitOutcomeUnknown), raised
        assert isinstance(raised.__cause__, TimeLimit) and "third" in str(raised.__cause__)


EXCEPT_PATH_THIRD: dict[str, Point] = {
    "except path's first line": in_code(
        fencing._fenced_steps,  # type: ignore[attr-defined]
        "elif outermost and (connections[using].in_atomic_block",
    ),
    "_driver_idle": DRIVER_ASKED,
    # As the close's ``with`` is left (the connection closed), before the callbacks kept were
    # returned: they were lost with the frame.
    "after _drop_unfinished's close": lambda frame, line: (
        in_code(fencing._drop_unfinished, "suppress(Exception)")(frame, line)  # type: ignore[attr-defined]
        and getattr(frame.f_locals.get("connection"), "connection", True) is None
    ),
}


@pytest.mark.parametrize("third", list(EXCEPT_PATH_THIRD))
@pytest.mark.parametrize("using", ["default", PG])
def test_a_burst_of_three_before_the_outcome_check_proves_the_commit(
    name: str, using: str, third: str
) -> None:
    """Review f4, 4: f3's two, the third on the except path before its outcome check (on its
    first line, inside ``_driver_idle``, after ``_drop_unfinished``'s close): the block raised
    ``CommitOutcomeUnknown`` ("its outcome check was cut short") with no check made, no
    callback run, though the COMMIT had committed (the third after that close, only ``p``
    ran: the kept list was lost with its frame). The block's end now asks the row
    (``prove_late``): committed, each runs once."""
    if third != "except path's first line" and using == "default":
        pytest.skip("in-memory SQLite: Django's close() leaves it open, its callbacks on it")
    burst = Burst(COMMIT_RETURNED, SWITCH_BACK, EXCEPT_PATH_THIRD[third])
    raised, ran = committed_block_with_three(name, using, burst)
    assert raised is None and ran == ["a", "r", "p"]
