"""An interrupt (KeyboardInterrupt, a signal handler's exception) that lands once an acquire's
steps have taken and recorded the hold: at every line the acquire still runs before it
returns (the rest of ``BaseLock._acquire``, the step driver's lines that return the outcome,
``__enter__``'s).

The rule (docs: faq, "at any line of an acquire ... leaves nothing held"): an acquire that
raises leaves nothing held, neither in the object nor on the server; one that returned holds.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import pytest

from django_redlock import lock
from django_redlock.locking import steps
from django_redlock.locking.base import BaseLock

from .test_record_interrupts import _quiet_lines


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


ARMING = BaseLock._announce_held.__code__
WATCHED: set[CodeType] = {
    BaseLock._acquire.__code__,
    BaseLock.__enter__.__code__,
    *(
        f.__code__
        for f in vars(steps).values()
        if callable(f) and getattr(f, "__code__", None) is not None
        and f.__code__.co_filename == steps.__file__
    ),
}  # fmt: skip
QUIET = {code: _quiet_lines(code) for code in WATCHED}


class Interrupter:
    """Raises at the ``at``-th line of the watched frames once the hold is recorded and
    announced (None: counts them)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.points, self.armed, self.fired = at, 0, False, ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is ARMING:
            return self._arming
        if frame.f_code in WATCHED:
            return self._line
        return None

    def _arming(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self.armed = True
        return self._arming

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event == "line" and self.armed and frame.f_lineno not in QUIET[code]:
            self.points += 1
            if self.points == self.at:
                self.fired = f"{code.co_name}:{frame.f_lineno}"
                raise Interrupt(self.fired)
        return self._line


def _enter(lk: BaseLock) -> None:
    lk.__enter__()


MODES: dict[str, Callable[[BaseLock], Any]] = {
    "acquire": lambda lk: lk.acquire(blocking=False),
    "with": _enter,
    "aacquire": lambda lk: asyncio.run(lk.aacquire(blocking=False)),
}


# (A reentrant aacquire is left out: its hold is its task's, and asyncio.run's task ends.)
@pytest.mark.parametrize(
    ("mode", "reentrant"),
    [(mode, False) for mode in MODES] + [("acquire", True), ("with", True)],
)
def test_an_interrupt_after_an_acquire_s_steps_took_the_hold_leaves_nothing_held(
    mode: str, reentrant: bool, name: str
) -> None:
    run = MODES[mode]
    counting = Interrupter(None)
    lk = lock(name, ttl=10, reentrant=reentrant, blocking=False)
    sys.settrace(counting)
    try:
        run(lk)
    finally:
        sys.settrace(None)
    assert counting.points >= 3, counting.points  # the driver's lines were seen
    lk.release()
    failed = []
    for at in range(1, counting.points + 1):
        lk = lock(name, ttl=10, reentrant=reentrant, blocking=False)
        tracer = Interrupter(at)
        sys.settrace(tracer)
        try:
            run(lk)
        except Interrupt:
            if lk.token is not None or lk.locked():
                failed.append(f"{tracer.fired}: the acquire raised, the lock is held")
        else:  # returned (an interrupt in the watches' leave is not raised): holds
            if lk.token is None or not lk.owned():
                failed.append(f"point {at}: the acquire returned, the lock is not held")
        finally:
            sys.settrace(None)
        while lk.token is not None:
            lk.release()
        assert not lk.locked()
    assert not failed, failed
