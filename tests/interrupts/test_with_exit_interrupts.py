"""An exception a signal handler raises as a plain ``with lock:`` is left (Celery's soft time
limit, Ctrl-C): at the entry of ``BaseLock.__exit__`` (CPython 3.11+ looks for pending signals
at a function's first instruction, before its one-line ``try:``), at each of its lines and of
``_exit``'s, and at the entry of each function they call (review rc, 2).

The rule checked after each one, on a real server: the ``with``'s level is released within
about a second (or was by the exit), never renewed on by the watchdog; the object works
again at once (its next ``with``). Reentrant kinds are not watched (see the xfail below)."""

from __future__ import annotations

import gc
import inspect
import sys
import time
from types import CodeType, FrameType
from typing import Any

import pytest

from django_redlock import lock
from django_redlock.locking.base import BaseLock

TTL = 1.5  # renewed every 0.5 s: an abandoned hold renewed on would outlive two TTLs

EXIT = BaseLock.__dict__["__exit__"].func.__code__
WATCHED = {EXIT, BaseLock._exit.__code__}


class Interrupt(BaseException):
    """What a signal handler may raise between two instructions."""


def _quiet(code: CodeType) -> set[int]:
    lines, first = inspect.getsourcelines(code)
    return {first + i for i, line in enumerate(lines) if line.strip() == "try:"}


QUIET = {code: _quiet(code) for code in WATCHED}


class ExitInterrupter:
    """Raises :class:`Interrupt` at the ``at``-th point (None: counts them): the entry of
    ``__exit__`` (its "call" event: a signal handled at its RESUME), each line of the watched
    frames, and the entry of each function they call."""

    def __init__(self, at: int | None) -> None:
        self.at, self.points, self.fired = at, 0, ""

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise Interrupt(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code in WATCHED:
            if code is EXIT:
                self._point(frame)  # as __exit__ is entered
            return self._line
        back = frame.f_back
        if back is not None and back.f_code in WATCHED and "weakref" not in code.co_filename:
            self._point(frame)
        return None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno not in QUIET[frame.f_code]:
            self._point(frame)
        return self._line


def _leave(lk: BaseLock, at: int | None) -> ExitInterrupter:
    tracer = ExitInterrupter(at)
    try:
        with lk:
            sys.settrace(tracer)
    except Interrupt:
        pass
    finally:
        sys.settrace(None)
    return tracer


def _free_within(name: str, seconds: float) -> float | None:
    """Seconds until nobody holds ``name`` (None: still held after ``seconds``)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not lock(name).locked():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def _points() -> int:
    return _leave(lock("count-points", ttl=TTL), None).points


def test_an_interrupt_anywhere_in_a_with_s_exit_leaves_nothing_held(name: str) -> None:
    """And a kept exception keeps nothing held (a test of its own before, with its own wait
    of two TTLs): both names are looked at after one wait."""
    points = _points()
    assert points >= 6  # the entry, the lines of __exit__ and _exit, their callees
    lk = lock(name, ttl=TTL)  # one object throughout: it lives on, as a module-level lock
    for at in range(1, points + 1):
        tracer = _leave(lk, at)
        assert tracer.fired, at
        took = _free_within(name, 1.5)
        assert took is not None, f"still held after 1.5 s: interrupted at {tracer.fired}"
        with lk:  # the object works again at once
            assert lk.locked()
        assert not lk.locked()
    # An error reporter keeps the traceback (and with it the lock object): still released.
    kept_lk = lock(f"{name}:kept", ttl=TTL)
    kept: list[BaseException] = []
    tracer = ExitInterrupter(1)
    try:
        with kept_lk:
            sys.settrace(tracer)
    except Interrupt as exc:
        kept.append(exc)
    finally:
        sys.settrace(None)
    assert kept
    assert _free_within(f"{name}:kept", 1.5) is not None
    # None was renewed on behind the checks: still free after two TTLs.
    time.sleep(2 * TTL)
    assert not lock(name).locked()
    assert not lock(f"{name}:kept").locked()


def test_an_interrupt_as_the_exit_began_is_released_at_once_not_at_the_ttl(name: str) -> None:
    lk = lock(name, ttl=30)
    tracer = _leave(lk, 1)
    assert tracer.fired.startswith("__exit__")
    took = _free_within(name, 2.0)
    assert took is not None and took < 1.5, "held on (the watchdog renews it, TTL 30 s)"
    assert lk.acquire(blocking=False)  # not "already held by this object"
    lk.release()


def test_the_same_object_s_next_with_right_after_works(name: str) -> None:
    # The next use pays the owed level itself, whatever the payer thread did meanwhile.
    lk = lock(name, ttl=30)
    _leave(lk, 1)
    with lk:
        pass
    assert _free_within(name, 1.0) is not None


@pytest.mark.xfail(
    strict=True,
    reason="reentrant kinds are not watched: their with statements may end out of order"
    " (generators, threads sharing a read lock: review rl 1-2, two holders when they were);"
    " a level left as its exit began stays held (faq.md, review rl 3)",
)
@pytest.mark.parametrize("at_entry_only", [True, False])
def test_a_nested_reentrant_with_releases_its_own_level_only(
    name: str, at_entry_only: bool
) -> None:
    lk = lock(name, ttl=TTL, reentrant=True)
    points = _points() if not at_entry_only else 1
    with lk:
        for at in range(1, points + 1):
            tracer = _leave(lk, at)
            assert tracer.fired, at
            deadline = time.monotonic() + 1.5
            while lk.hold_count() != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            # The outer level stays held (neither the exit nor the payer released it twice).
            assert lk.hold_count() == 1, f"interrupted at {tracer.fired}"
            assert lock(name).locked()
        time.sleep(2 * TTL)  # still renewed for the outer ``with``
        assert lk.hold_count() == 1
    assert _free_within(name, 1.0) is not None


def test_a_with_s_exit_that_ran_owes_nothing(name: str) -> None:
    # A reentrant owner that took one more level by hand in the body: the ``with``'s exit
    # released its level, and the one taken by hand stays (nothing released twice).
    lk = lock(name, ttl=TTL, reentrant=True)
    with lk:
        assert lk.acquire()
    gc.collect()
    time.sleep(0.5)
    assert lk.hold_count() == 1
    lk.release()
    assert not lk.locked()
