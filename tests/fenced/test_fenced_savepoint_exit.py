"""A fenced block nested in an outer transaction (Django's ATOMIC_REQUESTS, a caller's
``atomic()``, a re-entry) is a savepoint of it. An exception a signal handler raises on a line
of Django's exit of that savepoint (Celery's soft time limit, ``SIGALRM``): Django pops the
savepoint's id first and releases it later, so the block must not raise "nothing committed"
while its writes commit with the outer transaction (docs/topics/fencing.md's outcome table).

Checked at every line of Django's ``Atomic.__exit__`` and of the savepoint calls it makes, and
at the entry of every function they call (on SQLite; one case each on PostgreSQL): a block that
raised committed nothing, one that returned committed with the outer transaction; the lock is
released; the connection ends out of any transaction.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_redlock import fencing, lock, lock_all
from django_redlock.locking.base import BaseLock
from django_redlock.locking.multi import MultiLock

from ..support.fenced_child import open_shop, sales, sell_one

PG = "postgres"
pytestmark = pytest.mark.django_db(databases=[DEFAULT_DB_ALIAS, PG], transaction=True)


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


def _codes() -> set[CodeType]:
    found = {transaction.Atomic.__exit__.__code__}
    for name in ("savepoint_commit", "savepoint_rollback", "_savepoint_commit", "_savepoint"):
        found.add(getattr(BaseDatabaseWrapper, name).__code__)
    for alias in (DEFAULT_DB_ALIAS, PG):  # the vendors' own (SQLite's _savepoint_allowed)
        allowed = type(connections[alias])._savepoint_allowed
        found.add(allowed.__code__)
    return found


class Interrupter:
    """Once armed (the inner body ended), raises ``TimeLimit`` at the ``at``-th point (None:
    counts them), once: each line of the watched frames, and each entry into a function they
    call; ``sid_popped``: at the first line of Django's exit once it popped the savepoint's
    id (the reviewer's case)."""

    def __init__(self, at: int | None, sid_popped: bool = False) -> None:
        self.at, self.sid_popped, self.armed, self.points = at, sid_popped, False, 0
        self.fired: str | None = None
        self.watched = _codes()

    def _point(self, frame: FrameType) -> None:
        if not self.armed or self.fired:
            return
        self.points += 1
        popped = self.sid_popped and "sid" in frame.f_locals
        if self.points == self.at or popped:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise TimeLimit(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code in self.watched:
            if frame.f_back is not None and frame.f_back.f_code in self.watched:
                self._point(frame)
            return self._line
        back = frame.f_back
        if back is not None and back.f_code in self.watched and frame.f_code.co_name != "__del__":
            self._point(frame)  # at the callee's entry
        return None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self._point(frame)
        return self._line


def run(alias: str, name: str, how: str, tag: str, tracer: Interrupter) -> str:
    """A fenced block nested in the caller's transaction, which commits whatever the block
    says (a view that caught the time limit): "returned", or the name of what it raised."""
    out = "returned"
    with transaction.atomic(using=alias):
        sell_one(alias, 1, f"outer {tag}")
        sys.settrace(tracer)
        try:
            if how == "with lock":
                with lock(name, ttl=30, atomic=alias):
                    sell_one(alias, 1, tag)
                    tracer.armed = True
            else:
                held = lock(name, ttl=30)
                held.acquire()
                try:
                    with held.atomic(alias):
                        sell_one(alias, 1, tag)
                        tracer.armed = True
                finally:
                    tracer.armed = False
                    held.release()
        except TimeLimit as exc:
            out = type(exc).__name__
        finally:
            tracer.armed = False
            sys.settrace(None)
        assert not lock(name).locked(), (tracer.fired, out)  # released, not renewed on
        if connections[alias].needs_rollback:  # marked: the outer transaction commits nothing
            out += " (outer rolled back)"
    assert not connections[alias].in_atomic_block
    return out


def check(alias: str, tag: str, out: str, where: Any) -> None:
    sold = [who for who, _ in sales(alias)]
    if out == "returned":
        assert tag in sold and f"outer {tag}" in sold, where
    else:  # raised: the block's write did not commit
        assert tag not in sold, where


@pytest.mark.parametrize("how", ["with lock", "atomic()"])
def test_an_exception_on_any_line_of_django_s_exit_of_a_nested_block(name: str, how: str) -> None:
    alias = DEFAULT_DB_ALIAS
    open_shop(alias, 1, 10_000)
    counting = Interrupter(None)
    assert run(alias, name, how, "count", counting) == "returned"
    n = counting.points
    assert n > 10
    fired = set()
    for at in range(1, n + 1):
        tracer = Interrupter(at)
        out = run(alias, name, how, f"b{at}", tracer)
        assert tracer.fired, at
        fired.add(out)
        check(alias, f"b{at}", out, (at, tracer.fired, out))
    assert "TimeLimit" in fired  # rolled back to its savepoint: the outer one commits


@pytest.mark.parametrize("how", ["with lock", "atomic()"])
def test_an_exception_once_django_s_exit_popped_the_savepoint_postgres(name: str, how: str) -> None:
    open_shop(PG, 1, 10)
    tracer = Interrupter(None, sid_popped=True)
    out = run(PG, name, how, "inner", tracer)
    assert tracer.fired and out.startswith("TimeLimit"), (tracer.fired, out)
    check(PG, "inner", out, (tracer.fired, out))
    assert [who for who, _ in sales(PG)] == ["outer inner"]  # the outer one committed
    with lock(f"{name}:next", ttl=30, atomic=PG):  # the thread's next fenced block commits
        sell_one(PG, 1, "next")
    assert [who for who, _ in sales(PG)] == ["outer inner", "next"]


def test_lock_all_abandoned_in_a_caller_s_transaction_is_rolled_back_as_its_with_is_left_postgres(
    name: str,
) -> None:
    """``lock_all(atomic=)`` inside a caller's transaction (a view under ATOMIC_REQUESTS), an
    exception as its exit is entered, handled by the caller, which writes and commits: the
    block's members are rolled back to their savepoints and both names released as its
    ``with`` is left, before the ``except`` clause runs; the caller's writes commit."""
    open_shop(PG, 1, 10)
    exit_code = MultiLock.__exit__.__code__

    def at_exit(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is exit_code:
            raise TimeLimit("entering the exit")

    with transaction.atomic(using=PG):
        sell_one(PG, 1, "request")
        try:
            with lock_all(name, f"{name}:2", ttl=30, atomic=PG):
                sell_one(PG, 1, "moved")
                sys.settrace(at_exit)
        except TimeLimit:
            assert not lock(name).locked() and not lock(f"{name}:2").locked()
            sell_one(PG, 1, "failure noted")
        finally:
            sys.settrace(None)
    assert not connections[PG].in_atomic_block
    assert [who for who, _ in sales(PG)] == ["request", "failure noted"]


class AfterRelease(Interrupter):
    """Armed as Django's exit of the block's savepoint returns (``RELEASE SAVEPOINT`` done: the
    block's writes are the outer transaction's), until the block's exit returns: raises
    ``TimeLimit`` once, at the ``at``-th point (None: counts them) of the rest of the exit,
    each line of ``fencing``'s frames (the steps' ``finally``, what it calls, ``with lock``'s
    release after the commit) and each entry into a function they call; ``only``: at the
    first entry into that function instead."""

    def __init__(self, at: int | None, only: str | None = None) -> None:
        super().__init__(at)
        self.only, self.released = only, False
        self.exits = {BaseLock.__exit__.__code__, fencing.FencedTransaction.__exit__.__code__}  # type: ignore[attr-defined]

    def _at(self, frame: FrameType) -> None:
        if not self.released or self.fired:
            return
        self.points += 1
        if self.points == self.at or frame.f_code.co_name == self.only:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise TimeLimit(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code is fencing._Scope.__exit__.__code__ and not self.fired:  # type: ignore[attr-defined]
            return self._scope
        back = frame.f_back
        if (
            back is not None
            and back.f_code.co_filename == fencing.__file__
            and code.co_name != "__del__"
        ):
            self._at(frame)  # at the callee's entry
        if code in self.exits:
            return self._exit
        return self._line if code.co_filename == fencing.__file__ else None

    def _scope(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return" and frame.f_locals.get("exc_type") is None and frame.f_back:
            steps = frame.f_back  # the block's, not another block's of the same exit
            self.released = self.released or steps.f_locals.get("outermost") is False
        return self._scope

    def _exit(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self.released = False  # the exit is over: the caller's code is not the block's
        return (
            self._line(frame, event, arg)
            if frame.f_code.co_filename == fencing.__file__
            else self._exit
        )

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self._at(frame)
        return self._line


@pytest.mark.parametrize("how", ["with lock", "atomic()"])
def test_an_exception_on_any_line_of_a_nested_block_s_exit_after_its_savepoint_was_released(
    name: str, how: str
) -> None:
    """Once the savepoint is released into the outer transaction, an exception (a soft time
    limit) on any later line of the block's exit (its steps' ``finally``, its release) never
    says "nothing committed" while the block's writes commit with the outer transaction: the
    block returns (the exception logged), as after an outermost block's COMMIT; its mark is
    forgotten (a later block of the row would take it for its outer block's)."""
    alias = DEFAULT_DB_ALIAS
    open_shop(alias, 1, 10_000)
    counting = AfterRelease(None)
    assert run(alias, name, how, "count", counting) == "returned"
    n = counting.points
    assert n > 10
    for at in range(1, n + 1):
        tracer = AfterRelease(at)
        out = run(alias, name, how, f"r{at}", tracer)
        assert tracer.fired, at
        check(alias, f"r{at}", out, (at, tracer.fired, out))
        assert not fencing._marks(), (at, tracer.fired)  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["with lock", "atomic()"])
def test_an_exception_forgetting_a_nested_block_s_mark_after_its_release_postgres(
    name: str, how: str
) -> None:
    """The reviewer's case: a soft time limit as the steps' ``finally`` forgets the block's
    mark, its savepoint released into the caller's transaction, which commits."""
    open_shop(PG, 1, 10)
    tracer = AfterRelease(None, only="_forget_mark")
    out = run(PG, name, how, "inner", tracer)
    assert tracer.fired, out
    check(PG, "inner", out, (tracer.fired, out))
