"""A soft time limit on the rollback side of a fenced block's exit (review rf2 #1, #2, #4).

* In Django's ``Atomic.__exit__`` after it dropped its atomic flag and before its ROLLBACK:
  its ``finally`` turns autocommit back on, which on SQLite COMMITs the open transaction.
  The block raised ("nothing committed") while its writes committed.
* In Django's ``rollback()`` after the ROLLBACK, before ``run_on_commit = []``: the
  rolled-back block's ``on_commit`` callbacks stayed on the connection, and the thread's
  next COMMIT ran them.
* On ``BaseLock.__exit__``'s ``except`` line, or ``_exit_failed``'s first line, after the
  exit raised (a COMMIT that failed: a deferred foreign key): ``fencing.leave_failed`` never
  ran, and the lock was renewed for ever. Released as the ``with`` is left (its exit token dies).

The time limit is raised by a line tracer at the chosen line, as a signal handler would.
"""

from __future__ import annotations

import gc
import inspect
import sys
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import pytest
from django.db import connections, transaction
from django.db.backends.base import base as db_base

from django_redlock import fencing, lock
from django_redlock.locking.base import BaseLock

from ..support.fenced_child import open_shop, sales, sell_one

PG = "postgres"
pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


def _line(func: Any, text: str, after: str | None = None) -> int:
    """The line of ``func`` holding ``text`` (after the line holding ``after``)."""
    lines, first = inspect.getsourcelines(func)
    start = 0 if after is None else next(i for i, line in enumerate(lines) if after in line)
    return first + next(i for i in range(start, len(lines)) if text in lines[i])


def _cutter(code: CodeType, line: int, hits: list[int]) -> Callable[..., Any]:
    """A tracer raising TimeLimit once, at ``line`` of ``code``."""

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == line and not hits:
            hits.append(line)
            sys.settrace(None)
            raise TimeLimit("soft time limit")
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    return tracer


ATOMIC_EXIT = transaction.Atomic.__exit__
BEFORE_ROLLBACK = _line(ATOMIC_EXIT, "closed_in_transaction", "in_atomic_block = False")
ROLLBACK = db_base.BaseDatabaseWrapper.rollback.__wrapped__  # (async_unsafe's)
AFTER_ROLLBACK = _line(ROLLBACK, "self.run_on_commit = []")
CUTS = {
    "Atomic.__exit__ before the ROLLBACK": (ATOMIC_EXIT.__code__, BEFORE_ROLLBACK),
    "rollback() after the ROLLBACK": (ROLLBACK.__code__, AFTER_ROLLBACK),
}


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("using", ["default", PG])
def test_a_time_limit_in_django_s_rollback_commits_nothing_and_drops_the_callbacks(
    using: str, cut: str
) -> None:
    open_shop(using, 1, 5)
    code, line = CUTS[cut]
    hits: list[int] = []
    ran: list[str] = []
    with pytest.raises(TimeLimit), lock("rf2-rollback", ttl=30, atomic=using):
        sell_one(using, 1, "rolled back")
        transaction.on_commit(lambda: ran.append("charge the card"), using=using)
        sys.settrace(_cutter(code, line, hits))
        raise ValueError("the body failed: roll back")
    sys.settrace(None)
    assert hits == [line]  # the time limit landed where it was meant to
    connection = connections[using]
    assert not connection.in_atomic_block
    assert sales(using, 1) == []  # nothing committed, as the block said
    assert connection.run_on_commit == []  # the block's callbacks dropped
    with transaction.atomic(using=using):  # the thread's next, unrelated transaction
        sell_one(using, 1, "next")
        transaction.on_commit(lambda: ran.append("its own"), using=using)
    assert ran == ["its own"]
    assert [buyer for buyer, _seen in sales(using, 1)] == ["next"]
    assert not lock("rf2-rollback").locked()


EXIT = BaseLock.__dict__["__exit__"]
EXIT_CODE = getattr(EXIT, "func", EXIT).__code__
EXIT_FAILED = BaseLock._exit_failed
EXIT_POINTS = {
    "__exit__'s except line": (
        EXIT_CODE,
        _line(getattr(EXIT, "func", EXIT), "except BaseException"),
    ),
    "_exit_failed's first line": (EXIT_FAILED.__code__, EXIT_FAILED.__code__.co_firstlineno + 1),
}


@pytest.mark.parametrize("point", list(EXIT_POINTS))
def test_a_time_limit_as_the_exit_hands_its_failure_on_releases_the_lock(point: str) -> None:
    open_shop("default", 1, 5)
    with connections["default"].cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS rf2_parent (id integer PRIMARY KEY)")
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS rf2_child (id integer PRIMARY KEY, parent_id integer"
            " REFERENCES rf2_parent (id) DEFERRABLE INITIALLY DEFERRED)"
        )
    code, line = EXIT_POINTS[point]
    name = f"rf2-except-{list(EXIT_POINTS).index(point)}"
    hits: list[int] = []
    with pytest.raises(TimeLimit), lock(name, ttl=5, atomic="default"):
        sell_one("default", 1, "not committed")
        with connections["default"].cursor() as cursor:  # its COMMIT fails
            cursor.execute("INSERT INTO rf2_child VALUES (1, 999)")
        sys.settrace(_cutter(code, line, hits))
    sys.settrace(None)
    assert hits == [line]
    assert not lock(name).locked()  # released as its ``with`` was left
    assert sales("default", 1) == []
    with lock(name, ttl=5, atomic="default", timeout=2):  # the thread's next block
        sell_one("default", 1, "next")
    assert [buyer for buyer, _seen in sales("default", 1)] == ["next"]
    assert not lock(name).locked()


class Callback:
    """An ``on_commit`` callback whose life is watched (dedupe_queued's ``_Uncommitted`` holds
    a key until it is freed)."""

    def __call__(self) -> None:
        raise AssertionError("a rolled-back block's callback ran")


WATCH_HOOKS = fencing._watch_hooks  # type: ignore[attr-defined]
FORGET_MARK = fencing._forget_mark  # type: ignore[attr-defined]
LET_GO_CUTS = {
    "_watch_hooks' loop": (WATCH_HOOKS.__code__, _line(WATCH_HOOKS, "hooks[i] = ")),
    "_forget_mark's first line": (FORGET_MARK.__code__, FORGET_MARK.__code__.co_firstlineno + 6),
}


@pytest.mark.parametrize("cut", list(LET_GO_CUTS))
def test_a_time_limit_in_the_exit_s_clean_up_frees_the_dropped_callbacks(cut: str) -> None:
    """Review rf2 #3: the raised exception, kept, must not keep the dropped callback alive
    (its traceback's frames: the block's, ``_watch_hooks``'), nor wait for a cyclic GC."""
    open_shop("default", 1, 5)
    with connections["default"].cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS rf2_parent (id integer PRIMARY KEY)")
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS rf2_child (id integer PRIMARY KEY, parent_id integer"
            " REFERENCES rf2_parent (id) DEFERRABLE INITIALLY DEFERRED)"
        )
    code, line = LET_GO_CUTS[cut]
    hits: list[int] = []
    callback = Callback()
    gone = weakref.ref(callback)
    gc.disable()  # freed at once, not by a collection
    try:
        with pytest.raises(TimeLimit) as raised, lock("rf2-let-go", ttl=30, atomic="default"):
            sell_one("default", 1, "not committed")
            with connections["default"].cursor() as cursor:  # its COMMIT fails
                cursor.execute("INSERT INTO rf2_child VALUES (1, 999)")
            transaction.on_commit(callback, using="default")
            del callback
            sys.settrace(_cutter(code, line, hits))
        sys.settrace(None)
        assert hits == [line]
        assert raised.value is not None  # the exception kept (an error reporter, einfo)
        assert gone() is None
    finally:
        gc.enable()
    assert sales("default", 1) == []
    assert connections["default"].run_on_commit == []
    assert not lock("rf2-let-go").locked()
