"""An interrupt (a signal handler's exception, Ctrl-C: any BaseException) injected at every line
of a window of code, one run per line: the style of tests/interrupts/test_record_interrupts.py
for windows outside the lock objects (a queue marker written after a publish, an enqueue).

A window is a set of functions (``watched``) from the moment ``armed_when(frame)`` first holds
on one of their lines (e.g. "the publish returned"): each later line of theirs is a point, and
so is the entry of each function they call."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

#: Files of the callbacks the garbage collector runs at any line (not called by the window).
_CALLBACKS = ("weakref.py", "_weakrefset.py")


class Interrupt(BaseException):
    """What a signal handler may raise between two lines."""


@functools.cache  # a sweep asks once a point: reading the source was most of a point
def _quiet_lines(code: CodeType) -> set[int]:
    """A ``with`` statement's own lines and a ``try:`` (no signal is looked for there; a
    tracer raising there would do what no signal can)."""
    lines, first = inspect.getsourcelines(code)
    return {
        first + i
        for i, line in enumerate(lines)
        if line.lstrip().startswith("with ") or line.strip() == "try:"
    }


class LineInterrupter:
    """Raises :class:`Interrupt` at the ``at``-th point of the window (None: counts them)."""

    def __init__(
        self, at: int | None, watched: set[CodeType], armed_when: Callable[[FrameType], bool]
    ) -> None:
        self.at, self.watched, self.armed_when = at, watched, armed_when
        self.quiet = {code: _quiet_lines(code) for code in watched}
        self.armed = False
        self.points = 0
        self.fired: str | None = None

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise Interrupt(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code in self.watched:
            return self._line
        back = frame.f_back
        if frame.f_code.co_filename.endswith(_CALLBACKS):
            return None  # a weak reference's callback the collector ran: no callee
        if self.armed and back is not None and back.f_code in self.watched:
            self._point(frame)  # at the callee's entry
        return None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            if not self.armed and self.armed_when(frame):
                self.armed = True
            if self.armed and frame.f_lineno not in self.quiet[frame.f_code]:
                self._point(frame)
        return self._line


def interrupted(call: Callable[[], Any], tracer: LineInterrupter) -> BaseException | None:
    """``call()`` under ``tracer``: the Interrupt it raised (None: it returned)."""
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
    except Interrupt as exc:
        return exc
    finally:
        sys.settrace(previous)
    return None


def every_point(
    case: Callable[[LineInterrupter], None],
    make: Callable[[int | None], LineInterrupter],
    limit: int = 200,
) -> list[str]:
    """``case(tracer)`` once per point of the window, the interrupt at that point, until a run
    reaches the window's end without one; the points hit (for the failure message)."""
    fired: list[str] = []
    for at in range(1, limit):
        tracer = make(at)
        case(tracer)
        if tracer.fired is None:
            assert tracer.armed, "the window was never reached"
            return fired
        fired.append(tracer.fired)
    raise AssertionError(f"more than {limit} points: {fired[-5:]}")


def publish_path() -> set[CodeType]:
    """Celery's and django_redlock's functions a task's publish returns through, from the
    broker taking the message to ``apply_async`` returning (``after_task_publish``
    receivers, the result): watched lines of a window that starts at the broker's publish."""
    from celery.app.base import Celery
    from celery.app.task import Task
    from celery.utils.dispatch.signal import Signal

    from django_redlock.contrib.broker import PublishWatch, watched_publish
    from tests.support.celery_app import app

    return {
        PublishWatch.publish.__code__,
        watched_publish.__wrapped__.__code__,  # type: ignore[attr-defined]
        app.amqp.send_task_message.__code__,
        Celery.send_task.__code__,
        Task.apply_async.__code__,
        Signal.send.__code__,
    }
