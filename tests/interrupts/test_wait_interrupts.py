"""An interrupt (KeyboardInterrupt, a signal handler's exception: any BaseException) that lands
in a wait: at every line of its clean-up (``BaseLock._wait``'s ``finally``, and
``leave_waiters``), and of its set-up (from the watch to the first try), and at the entry of
every function those lines call.

The rule checked after each one, on a real server: the waiter still leaves through the hub. A
waiter registered on the server whose leave was skipped stood first in line: the release woke
it instead of the real next waiter, which got the lock at the hold's expiry (5.6 s after the
release, its TTL 6 s; 0.0 s without the interrupt). And nothing stays in the hub's registry.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.locking import steps
from django_redlock.locking.base import BaseLock

TTL = 6.0  # a stranded next waiter gets the lock at its end


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


WAIT = BaseLock._wait.__code__
LEAVE = steps.leave_waiters.__code__


def _lines(code: CodeType) -> tuple[list[str], int]:
    lines, first = inspect.getsourcelines(code)
    return lines, first


def _region(where: str) -> set[int]:
    """The lines of ``_wait`` in the region: its set-up (after the watch, up to its first
    try) or its clean-up (the outer ``finally``), less ``try:`` lines (a no-op where no
    signal is looked for: a tracer raising there would do what no signal can)."""
    lines, first = _lines(WAIT)
    numbered = [(first + i, line) for i, line in enumerate(lines)]
    watch = max(n for n, line in numbered if "yield Watch(" in line)
    first_try = min(n for n, line in numbered if "yield by_deadline(deadline, take)" in line)
    cleanup = max(n for n, line in numbered if line.startswith("        finally:"))
    if where == "set-up":
        picked = {n for n, _ in numbered if watch < n <= first_try}
    else:
        picked = {n for n, _ in numbered if n > cleanup}
    return {n for n in picked if dict(numbered)[n].strip() != "try:"}


class Interrupter:
    """A tracer that raises :class:`Interrupt` at the ``at``-th point (None: counts them):
    each line of the region, each line of ``leave_waiters`` (the clean-up), and each entry
    into a function called from them."""

    def __init__(self, at: int | None, where: str) -> None:
        self.at, self.where = at, where
        self.lines = _region(where)
        self.points = 0
        self.fired: str | None = None

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise Interrupt(self.fired)

    def _in_region(self, frame: FrameType | None) -> bool:
        if frame is None:
            return False
        if frame.f_code is WAIT:
            return frame.f_lineno in self.lines
        return frame.f_code is LEAVE and self.where == "clean-up"

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code is WAIT or code is LEAVE:
            return self._line
        if event == "call" and self._in_region(frame.f_back):
            self._point(frame)  # an interrupt at the callee's entry
        return None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self._in_region(frame):
            self._point(frame)
        return self._line


def _waiters_on(name: str) -> int:
    backend = locks["default"]
    client = backend.client
    return int(client.zcard(backend.waiting_key(name)) + client.llen(backend.queue_key(name)))


def _joined(hub: Any) -> set[int]:
    """The waiters in the hub's registry (ids: an earlier one may leave it meanwhile)."""
    return {id(waiter) for group in list(hub._waiters.values()) for waiter in list(group)}


def _case(name: str, mode: str, at: int | None) -> tuple[Interrupter, float | None]:
    """A holder (TTL 6 s), a waiter that times out and is interrupted at point ``at`` of
    its wait, then the next waiter: how long after the release it got the lock."""
    fair = mode == "fair"
    holder = lock(name, ttl=TTL, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    first = lock(name, ttl=TTL, fair=fair)
    tracer = Interrupter(at, "set-up" if mode == "set-up" else "clean-up")
    sys.settrace(tracer)
    try:
        if mode == "async":
            asyncio.run(first.aacquire(timeout=0.2))
        else:
            first.acquire(timeout=0.2)
    except Interrupt:
        pass
    finally:
        sys.settrace(None)
    hub = locks["default"].hub
    joined = _joined(hub)  # (the first's, if the interrupt left it in the registry)
    after = lock(name, ttl=TTL, fair=fair)
    took: list[float] = []
    thread = threading.Thread(
        target=lambda: after.acquire(timeout=2 * TTL) and took.append(time.monotonic())
    )
    thread.start()
    until = time.monotonic() + 5
    while (_waiters_on(name) < 1 or not _joined(hub) - joined) and time.monotonic() < until:
        time.sleep(0.01)  # in line, and in the hub's registry (a release wakes it from there)
    released = time.monotonic()
    holder.release()
    thread.join(3 * TTL)
    if took:
        after.release()
    return tracer, (took[0] - released) if took else None


@pytest.mark.parametrize("mode", ["plain", "fair", "async", "set-up"])
def test_an_interrupt_at_any_line_of_a_wait_still_leaves_through_the_hub(
    mode: str, name: str
) -> None:
    counting, waited = _case(f"{name}:count", mode, None)
    points = counting.points
    assert points > 3, points  # the region's lines were seen
    assert waited is not None and waited < 1.0, waited
    failed = []
    for at in range(1, points + 1):
        tracer, waited = _case(f"{name}:{at}", mode, at)
        where = f"interrupted at {tracer.fired or 'nothing'} (point {at})"
        if waited is None or waited > 1.0:
            failed.append(f"{where}: the next waiter got the lock {waited} s after the release")
    hub = locks["default"].hub
    left = [c for c, group in hub._waiters.items() if group]
    assert not failed, "\n".join(failed)
    assert not left, f"waiters left in the hub: {left}"
