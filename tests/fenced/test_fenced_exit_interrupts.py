"""An exception a signal handler raises (Celery's soft time limit, an ``Exception``; or a
``KeyboardInterrupt``) on a line of a fenced block's exit: every line of ``with lock``'s exit
(``BaseLock.__exit__``, ``fencing.leave_block``), of the block's own exit and its steps after
the body, of the release after the COMMIT, of Django's ``Atomic.__exit__`` and of
``@single_instance(atomic=)``'s run and ``lock_all``'s exit, and at the entry of every function
those lines call.

The rules checked after each one, on PostgreSQL (docs/topics/fencing.md's outcome table):
a block that returned committed, one that raised committed nothing (a soft time limit once
the COMMIT happened is logged, and the block returns: ``autoretry_for`` must not run the
committed work again); the connection is out of any transaction (the thread's next fenced
block commits); and the lock is released at once, not renewed on by the watchdog.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from types import CodeType, FrameType
from typing import Any

import pytest
from django.db import connections, transaction

from django_redlock import fencing, lock, lock_all, single_instance
from django_redlock.contrib import single
from django_redlock.locking.base import BaseLock
from django_redlock.locking.multi import MultiLock

from ..support.fenced_child import open_shop, sales, sell_one

PG = "postgres"
pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


class Interrupt(KeyboardInterrupt):
    """An interrupt (``BaseException``): after the COMMIT it goes on, the COMMIT stands."""


def _codes(owner: Any, *names: str) -> set[CodeType]:
    # getattr: the test runs against older code too (to show it failed before the fix).
    found = (getattr(owner, n, None) for n in names)
    return {f.__code__ for f in found if f is not None and hasattr(f, "__code__")}


STEPS = _codes(fencing, "_fenced_steps") or {
    fencing.fenced_transaction.__wrapped__.__code__  # type: ignore[attr-defined]
}
EXIT = (
    _codes(BaseLock, "__exit__", "_exit")
    | _codes(fencing, "leave_block", "release_after_commit", "_release", "_forget_mark")
    | _codes(getattr(fencing, "FencedTransaction", object), "__exit__", "_leave")
    | _codes(transaction.Atomic, "__exit__")
    | _codes(single, "run_held")  # @single_instance(atomic=): Celery's and Django Tasks' runs
    | _codes(contextlib.ExitStack, "__exit__")
    | _codes(MultiLock, "__exit__", "_exit", "_leave_block", "_leave_members")
)
WATCHED = EXIT | STEPS


def _quiet_lines(code: CodeType) -> set[int]:
    """As in tests/interrupts/test_record_interrupts.py: a ``with`` statement's own line and
    a bare ``try:`` line, where no signal is looked for, are left out."""
    lines, first = inspect.getsourcelines(code)
    return {
        first + i
        for i, line in enumerate(lines)
        if line.lstrip().startswith("with ") or line.strip() == "try:"
    }


QUIET = {code: _quiet_lines(code) for code in WATCHED}


class Interrupter:
    """A tracer that raises ``error`` at the ``at``-th point (None: counts them) once armed
    (the body ended): each line of the watched frames, and each entry into a function they
    call."""

    def __init__(self, at: int | None, error: type[BaseException]) -> None:
        self.at, self.error, self.armed, self.points = at, error, False, 0
        self.fired: str | None = None

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise self.error(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code in WATCHED:
            return self._line
        back = frame.f_back
        collected = frame.f_code.co_name == "__del__"  # its exception is only printed
        if self.armed and back is not None and back.f_code in WATCHED and not collected:
            self._point(frame)  # at the callee's entry
        return None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.armed and frame.f_lineno not in QUIET[frame.f_code]:
            self._point(frame)
        return self._line


def run_block(name: str, how: str, buyer: str, tracer: Interrupter) -> str:
    """One fenced block that sells a ticket, with ``tracer`` armed at the body's end:
    "returned", or the name of what it raised."""

    def body() -> None:
        sell_one(PG, 1, buyer)
        if how == "body raises":
            tracer.armed = True
            raise ValueError("the body failed")
        tracer.armed = True

    held = lock(name, ttl=30, atomic=PG)
    sys.settrace(tracer)
    try:
        if how == "lock_all":
            with lock_all(name, f"{name}:b", ttl=30, atomic=PG):
                body()
        elif how == "@single_instance":
            single_instance(key=name, ttl=30, atomic=PG)(body)()
        elif how == "atomic()":
            held.acquire()
            try:
                with held.atomic(PG):
                    body()
            finally:
                sys.settrace(None)
                held.release()
        else:
            with held:
                body()
        return "returned"
    except BaseException as exc:
        return type(exc).__name__
    finally:
        sys.settrace(None)


def points(name: str, how: str) -> int:
    counting = Interrupter(None, TimeLimit)
    out = run_block(name, how, "count", counting)
    assert out == ("ValueError" if how == "body raises" else "returned"), out
    return counting.points


@pytest.mark.parametrize("error", [TimeLimit, Interrupt], ids=["time limit", "interrupt"])
@pytest.mark.parametrize(
    "how", ["with lock", "body raises", "atomic()", "@single_instance", "lock_all"]
)
def test_an_exception_on_any_line_of_a_fenced_block_s_exit(
    name: str, how: str, error: type[BaseException]
) -> None:
    open_shop(PG, 1, 10_000)
    n = points(name, how)
    assert n > 20
    expected = ["count"] if how != "body raises" else []
    for at in range(1, n + 1):
        buyer = f"b{at}"
        tracer = Interrupter(at, error)
        out = run_block(name, how, buyer, tracer)
        where = (at, tracer.fired, out)
        in_transaction = connections[PG].in_atomic_block
        if in_transaction:  # so that the next point starts clean
            fencing._abandon(PG)  # type: ignore[attr-defined]
        assert not in_transaction, where
        committed = buyer in [who for who, _ in sales(PG)]
        if committed:
            expected.append(buyer)
        assert not lock(name).locked(), where  # released now, not renewed on
        assert not lock(f"{name}:b").locked(), where
        if error is Interrupt and tracer.fired:  # "stop": it goes on, committed or not
            assert out == "Interrupt", where
        if how == "body raises":
            assert out != "returned" and not committed, where
        elif out == "returned":
            assert committed, where
        else:  # raised: nothing committed, save an interrupt after the COMMIT (it goes on)
            assert not committed or out == error.__name__ == "Interrupt", where
    # The thread's next fenced block commits (its connection is not in a stale transaction).
    with lock(f"{name}:next", ttl=30, atomic=PG):
        sell_one(PG, 1, "next")
    assert [who for who, _ in sales(PG)] == [*expected, "next"]


def test_the_interrupter_reaches_the_release_after_the_commit(name: str) -> None:
    """The points include the release after the COMMIT (the window of a committed block
    raising, which autoretry_for then ran again)."""
    open_shop(PG, 1, 5)
    seen: set[str] = set()

    class Watching(Interrupter):
        def _point(self, frame: FrameType) -> None:
            seen.add(frame.f_code.co_name)
            super()._point(frame)

    run_block(name, "with lock", "a", Watching(None, TimeLimit))
    assert {"release_after_commit", "leave_block", "__exit__"} <= seen


# -- MultiLock.atomic() used directly: one case per phase of its exit ---------------------------

MEMBER_EXIT = getattr(fencing, "FencedTransaction", object).__exit__.__code__


class AtMemberExit:
    """Raises ``error`` once the body ended, at one phase of the multi-lock block's exit:
    "first" (the innermost member's exit, at its entry), "between" (the outer member's exit,
    at its entry: the inner one's ran, its savepoint released), "after" (the first line run
    once the outer member's exit, the COMMIT, returned)."""

    def __init__(self, phase: str, error: type[BaseException]) -> None:
        self.phase, self.error, self.armed = phase, error, False
        self.entered = self.returned = 0
        self.fired: str | None = None

    def _fire(self, where: str) -> None:
        self.fired = where
        raise self.error(where)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.armed or self.fired or frame.f_code is not MEMBER_EXIT:
            return None
        self.entered += 1
        if (self.phase, self.entered) in (("first", 1), ("between", 2)):
            self._fire(f"{self.phase}: member exit {self.entered}")
        return self._member

    def _member(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return" and not self.fired:
            self.returned += 1
            caller = frame.f_back
            if self.phase == "after" and self.returned == 2 and caller is not None:
                caller.f_trace, caller.f_trace_lines = self._after, True
        return self._member

    def _after(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and not self.fired:
            self._fire(f"after: {frame.f_code.co_name}:{frame.f_lineno}")
        return None


@pytest.mark.parametrize("error", [TimeLimit, Interrupt], ids=["time limit", "interrupt"])
@pytest.mark.parametrize("phase", ["first", "between", "after"])
def test_an_exception_in_each_phase_of_a_multi_lock_atomic_exit(
    name: str, phase: str, error: type[BaseException]
) -> None:
    """``held.atomic()`` of a ``lock_all`` taken without ``atomic=`` (its own exit, not the
    ``with lock_all(atomic=)`` one): the same rules, each member's block left."""
    open_shop(PG, 1, 10)
    held = lock_all(name, f"{name}:b", ttl=30)
    tracer = AtMemberExit(phase, error)
    with held:
        sys.settrace(tracer)
        try:
            with held.atomic(PG):
                sell_one(PG, 1, "a")
                tracer.armed = True
            out = "returned"
        except BaseException as exc:
            out = type(exc).__name__
        finally:
            sys.settrace(None)
        in_transaction = connections[PG].in_atomic_block
        if in_transaction:  # so that the next test starts clean
            fencing._abandon(PG)  # type: ignore[attr-defined]
    where = (phase, tracer.fired, out)
    assert tracer.fired, where
    assert not in_transaction, where  # every member's block left: no transaction open
    committed = "a" in [who for who, _ in sales(PG)]
    if out == "returned":
        assert committed, where
    else:  # raised: nothing committed, save an interrupt after the COMMIT (it goes on)
        assert out == error.__name__, where
        assert not committed or error is Interrupt, where
    assert not lock(name).locked() and not lock(f"{name}:b").locked()  # released by `with`
    with lock(f"{name}:next", ttl=30, atomic=PG):  # the thread's next fenced block commits
        sell_one(PG, 1, "next")
    assert "next" in [who for who, _ in sales(PG)]


def test_an_exception_on_any_line_of_the_ended_marks_record_leaves_no_lock_held(
    name: str,
) -> None:
    """The exit records the block's mark among its row's ended ones (``_Seen.close``, called
    twice by the steps' ``finally``). It did so under a module lock: an exception on its
    ``with`` line as the body ended (before the lock's exit was called) left the lock held,
    the second call waited for it forever, and so did every later fenced block of the process.
    Here at each line event of the record, the with lines too: the block ends, and a block of
    another lock in another thread still runs."""
    open_shop(PG, 1, 1000)
    record = fencing._Seen.close.__code__  # type: ignore[attr-defined]

    def tracer_at(at: int | None, seen: list[int]) -> Any:
        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                seen.append(frame.f_lineno)
                if len(seen) == at:
                    raise TimeLimit(f"at line {frame.f_lineno} of the record")
            return local

        return lambda frame, event, arg: local if frame.f_code is record else None

    def block(lock_name: str, buyer: str, tracer: Any, out: list[str]) -> None:
        sys.settrace(tracer)
        try:
            with lock(lock_name, ttl=30, atomic=PG):
                sell_one(PG, 1, buyer)
            out.append("returned")
        except BaseException as exc:
            out.append(type(exc).__name__)
        finally:
            sys.settrace(None)
            connections[PG].close()

    def in_thread(*args: Any) -> list[str]:
        out: list[str] = []
        thread = threading.Thread(target=block, args=(*args, out), daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"{args[1]}: the fenced block hung"
        return out

    lines: list[int] = []
    assert in_thread(name, "count", tracer_at(None, lines)) == ["returned"]
    assert len(lines) >= 5
    for at in range(1, len(lines) + 1):
        in_thread(name, f"cut at {at}", tracer_at(at, []))
        assert not lock(name).locked()
        assert in_thread(f"{name}:other", f"after {at}", None) == ["returned"]


def _cut_autocommit_on(frame: FrameType, event: str, arg: Any) -> Any:
    """Trace function: ``TimeLimit`` as the driver's switch back to autocommit returns (Django's
    ``set_autocommit(True)`` in ``Atomic.__exit__``, after the COMMIT answered): Django has
    not stored ``autocommit = True`` nor run the ``on_commit`` callbacks yet."""
    called = event == "call" and frame.f_code.co_name == "_set_autocommit"
    return _time_limit_on_return if called and frame.f_locals.get("autocommit") else None


def _cut_commit_returned(frame: FrameType, event: str, arg: Any) -> Any:
    """Trace function: ``TimeLimit`` as the driver's COMMIT (Django's ``_commit``) returns:
    answered, and ``commit()`` has not marked the callbacks to run yet."""
    called = event == "call" and frame.f_code.co_name == "_commit"
    return _time_limit_on_return if called else None


def _cut_callbacks_about_to_run(frame: FrameType, event: str, arg: Any) -> Any:
    """Trace function: ``TimeLimit`` as Django's loop over the callbacks begins (autocommit
    stored on, nothing run)."""
    if event == "call" and frame.f_code.co_name == "run_and_clear_commit_hooks":
        sys.settrace(None)
        raise TimeLimit("soft time limit")
    return None


def _cut_callbacks_loop(frame: FrameType, event: str, arg: Any) -> Any:
    """Trace function: ``TimeLimit`` on the line of Django's loop over the callbacks as it goes
    round again after the first (the block's own marker) ran: a line of the loop's own."""
    if event != "call" or frame.f_code.co_name != "run_and_clear_commit_hooks":
        return None
    lines, first = inspect.getsourcelines(frame.f_code)
    loop = first + next(i for i, line in enumerate(lines) if line.lstrip().startswith("while "))
    seen: list[int] = []

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == loop:
            seen.append(loop)
            if len(seen) == 2:
                sys.settrace(None)
                raise TimeLimit("soft time limit")
        return line

    return line


CUTS = {
    "autocommit on": _cut_autocommit_on,
    "COMMIT returned": _cut_commit_returned,
    "callbacks about to run": _cut_callbacks_about_to_run,
    "callbacks' loop": _cut_callbacks_loop,
}


def _time_limit_on_return(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "return":
        sys.settrace(None)
        raise TimeLimit("soft time limit")
    return _time_limit_on_return


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("using", ["default", PG])
@pytest.mark.parametrize("form", ["with", "decorator"])
def test_a_time_limit_after_the_commit_answered_runs_its_on_commit_callbacks(
    name: str, using: str, form: str, cut: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A soft time limit as Django switches autocommit back on after a COMMIT that answered:
    committed, so the block returns, its ``on_commit`` callbacks run (before the release), the
    log does not say the COMMIT went unanswered, and the connection is left usable."""
    open_shop(using, 1, 10)
    ran: list[bool] = []

    def body() -> str:
        sell_one(using, 1, "first")
        transaction.on_commit(lambda: ran.append(lock(name).locked()), using=using)
        sys.settrace(CUTS[cut])  # (the frames called from here on: the exit's)
        return "sold"

    try:
        if form == "with":
            with lock(name, ttl=30, atomic=using):
                out = body()
        else:
            out = lock(name, ttl=30, atomic=using)(body)()
    finally:
        sys.settrace(None)
    assert out == "sold" and ran == [True]  # run once, before the release
    assert not lock(name).locked()
    assert "did not answer" not in caplog.text
    connection = connections[using]
    assert connection.autocommit and not connection.in_atomic_block
    with lock(name, ttl=30, atomic=using):
        sell_one(using, 1, "next")
    assert [who for who, _ in sales(using)] == ["first", "next"]
