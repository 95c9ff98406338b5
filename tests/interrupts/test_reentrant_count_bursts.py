"""A burst of interrupts (a second signal while the first unwinds) in a reentrant acquire or
release, once the server has answered.

The owner's hold count lives twice: on the server (the hash's count for the owner) and in
this process (``holds.believe``). The first interrupt lands after the server changed the count
and before the process did; the second lands in the clean-up that would fix it (the
acquire's hand-back, the release's own bookkeeping). The fault campaign found it (redis,
reentrant, seed 1601: interrupts at ``holds.believe``): the server kept one level more than
the process believed, every later take by the owner was a re-entry of that hold (the same
fence, 34 holds in 7 s) and every release left it held.

The rule: whatever a burst cuts short, the server's count and the process's agree again by
the owner's next operation on the lock (it settles a count marked unsure), so nothing is
left held once the owner has released all it believes it holds.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import django_redlock
from django_redlock import LockError, lock, locks
from django_redlock.locking.base import BaseLock
from django_redlock.locking.lock import Lock
from django_redlock.testing import RedisServer

from .test_record_interrupts import _quiet_lines

PACKAGE = str(Path(django_redlock.__file__).parent)


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


class Burst:
    """The first interrupt at the ``at``-th point (a Python function's entry or a line of the
    package's code) once ``armed_by`` ran (None: counts the points); the second at the entry
    of the next function of the package that runs after it, the clean-up's (a tracer that
    raises is unset by Python: the second comes from a profiler, set before the run and
    quiet until the first fires. Not set from inside the tracer as the first fires: CPython
    3.11 then called a freed profiler now and then, "'traceback' object is not callable" at
    the next function's entry, about one run in three under load)."""

    def __init__(self, at: int | None, armed_by: Any) -> None:
        self.at, self.armed_by = at, armed_by.__code__
        self.points, self.armed, self.fired = 0, False, [] if at else None
        self.quiet: dict[Any, set[int]] = {}
        self.profiler = self._second  # one object, kept for the whole run

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code is self.armed_by:
            self.armed = True
        if not code.co_filename.startswith(PACKAGE) or code.co_name in _COLLECTORS:
            return None  # (the collector's: Python ignores what it raises)
        self._point(frame, event)
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            code = frame.f_code
            if code not in self.quiet:
                self.quiet[code] = _quiet_lines(code)
            if frame.f_lineno not in self.quiet[code]:
                self._point(frame, event)
        return self._line

    def _point(self, frame: FrameType, event: str) -> None:
        if not self.armed:
            return
        self.points += 1
        if self.fired is not None and self.points == self.at:
            self.fired.append(f"{frame.f_code.co_name}:{frame.f_lineno}:{event}")
            raise Interrupt(self.fired[-1])

    def _second(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.fired or len(self.fired) > 1:
            return  # before the first, or after the second
        code = frame.f_code
        if code.co_name in _COLLECTORS:  # the collector's: Python ignores what it raises
            return
        if event == "call" and code.co_filename.startswith(PACKAGE):
            self.fired.append(f"{code.co_name}:{frame.f_lineno}:entry")
            raise Interrupt("the second, in the clean-up")


#: What the collector runs (a finalizer, the finisher's gc callback): an interrupt raised
#: there is unraisable, and pytest's hook for it, cut by the sweep too, failed the test.
_COLLECTORS = frozenset({"__del__", "_collecting"})


#: (the owner holds an outer level through another object, levels the swept object holds
#: before, the swept operation is a release)
CASES = {
    "a-new-hold": (False, 0, False),
    "a-re-entry": (True, 0, False),
    "a-re-entry-of-the-same-object": (False, 1, False),
    "a-nested-release": (True, 1, True),
    "a-nested-release-of-the-same-object": (False, 2, True),
    "the-last-release": (False, 1, True),
}


def _run(name: str, case: tuple[bool, int, bool], burst: Burst) -> tuple[Lock, Lock]:
    outer_held, levels, release = case
    outer = lock(name, ttl=10, reentrant=True)
    if outer_held:
        outer.acquire()
    inner = lock(name, ttl=10, reentrant=True)
    for _ in range(levels):
        inner.acquire()
    sys.setprofile(burst.profiler)
    sys.settrace(burst)
    try:
        inner.release() if release else inner.acquire(blocking=False)
    except Interrupt:
        assert burst.fired
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return outer, inner


def _armed_by(case: tuple[bool, int, bool]) -> Any:
    # A release from before its level leaves the object (the server's count changes
    # after); an acquire from the server's answer on.
    return BaseLock._unlevel if case[2] else BaseLock._nests_in_nothing


def _release_all(lk: BaseLock) -> None:
    for _ in range(5):
        if lk.token is None:
            return
        with contextlib.suppress(LockError):
            lk.release()


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_a_burst_after_the_server_answered_leaves_nothing_held_once_all_is_released(
    redis_server: RedisServer, name: str, case: tuple[bool, int, bool]
) -> None:
    burst = Burst(None, _armed_by(case))
    for lk in _run(name, case, burst):
        _release_all(lk)
    points = burst.points
    assert points >= 5, points
    key = locks["default"].key(name)
    assert not redis_server.client().exists(key)
    failed = []
    for at in range(1, points + 1):
        burst = Burst(at, _armed_by(case))
        outer, inner = _run(name, case, burst)
        # The owner goes on: one more take and release, then it lets go of all it holds.
        try:
            with lock(name, ttl=10, reentrant=True):
                pass
        except LockError as exc:
            failed.append(f"{burst.fired}: the owner's next take and release: {exc!r}")
        _release_all(inner)
        _release_all(outer)
        if redis_server.client().exists(key):
            failed.append(f"{burst.fired}: held after the owner released all it holds")
            redis_server.client().delete(key)
    assert not failed, failed
