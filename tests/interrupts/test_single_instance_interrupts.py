"""A burst of exceptions from a signal handler (Celery's soft time limit, a user's ``SIGALRM``
timeout on top of it) on the way out of a ``@single_instance`` run: the campaign's
``jolt_burst`` move (tests/campaign/README.md) left the key held and renewed by the watchdog
after the run had ended, so every later call was refused until the worker child exited.

A ``sys.settrace`` tracer stands for the signal: once the body ended (it raised a time limit
itself, or returned), it raises at ``COUNT`` points in a row, from each point of the clean-up
in turn: each line of the run's clean-up functions and each entry into a function they call
that calls or loops back (a signal's handler runs at a function's entry, a call's return
and a loop's back-edge, nowhere else). The
rule after each: the key is free in Redis at once (released, not left renewed), and the run
raised. A finalizer that runs among the points (an object's last reference went there) gets
its exception too, which CPython discards ("Exception ignored in"): the run never saw that
one (CI once had three in a row there, other tests' garbage collected on the way out, and
the run rightly returned); no collection runs in a run, so the points stay the same.
"""

from __future__ import annotations

import dis
import gc
import inspect
import sys
import uuid
from types import CodeType, FrameType
from typing import Any, NoReturn

import pytest
from celery import shared_task

from django_redlock import lock, single_instance
from django_redlock.contrib import celery as celery_glue
from django_redlock.contrib import single
from django_redlock.locking.base import BaseLock
from tests.support import celery_app  # noqa: F401  # the app the shared task binds to

COUNT = 6  # exceptions in a row, each at the next point (the campaign's bursts: 3 to 60, spaced)


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


def _codes(owner: Any, *names: str) -> set[CodeType]:
    # getattr: the test runs against older code too (to show it failed before the fix).
    found = (getattr(owner, n, None) for n in names)
    codes = {f.__code__ for f in found if f is not None and hasattr(f, "__code__")}
    # The functions defined inside them (a run's body as a closure).
    return codes | {c for code in codes for c in code.co_consts if isinstance(c, CodeType)}


WATCHED = (
    _codes(single, "guarded", "let_go", "_letting_go", "_release_held", "run_held", "run_direct")
    | _codes(celery_glue, "run_task", "_run")
    | _codes(BaseLock, "release")
)


#: Instructions after which CPython looks for a signal (a call's return, a loop's back-edge);
#: it does at a function's entry too (the tracer's "call" event).
LOOKS = {"CALL", "JUMP_BACKWARD", "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE",
         "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE"}  # fmt: skip


def _quiet_lines(code: CodeType) -> set[int]:
    """Lines where no signal's handler runs, left out (raising there would do what no signal
    can): a ``with`` statement's own line (as the other interrupt tests), and a line that
    neither calls nor loops back (an ``except`` clause, an assignment, a ``return``)."""
    lines, first = inspect.getsourcelines(code)
    looking = {i.positions.lineno for i in dis.get_instructions(code) if i.opname in LOOKS}
    return {
        first + i
        for i, line in enumerate(lines)
        if line.lstrip().startswith("with ") or first + i not in looking
    }


QUIET = {code: _quiet_lines(code) for code in WATCHED}


class Burst:
    """Once armed, raises at the points ``start`` .. ``start + COUNT - 1`` (None: counts
    the points): a line of the watched code that calls or loops back (the tracer), a call's
    entry from it and a C call's return in it (the profile function).

    Python unsets a hook that raised. Each puts the other back at its next event (on the
    frames of the watched code still running), so the point right after a hit, a call's
    entry, where a signal pending since the unwinding runs, is never missed."""

    def __init__(self, start: int | None) -> None:
        self.start, self.armed, self.points, self.fired = start, False, 0, 0
        self.trace_unset = self.profile_unset = False
        self.discarded = 0  # raised in a finalizer, which CPython discards (see discard)
        self.unraisable_hook: Any = None  # the hook discard passes other reports to

    @property
    def landed(self) -> int:
        """The exceptions raised into the run (not discarded by CPython in a finalizer)."""
        return self.fired - self.discarded

    def discard(self, unraisable: Any) -> None:
        """``sys.unraisablehook``: a finalizer (``__del__``, a weak reference's callback) that
        runs in the watched code (an object whose last reference went there, a collection)
        meets the points' "call" as any function does, but CPython discards what it raises,
        before any code of the run could see it: the run never got that one."""
        if isinstance(unraisable.exc_value, TimeLimit):
            self.discarded += 1
        else:
            self.unraisable_hook(unraisable)

    def _point(self) -> bool:
        self.points += 1
        return self.start is not None and self.start <= self.points < self.start + COUNT

    def _raise(self) -> NoReturn:
        self.fired += 1
        raise TimeLimit(f"burst {self.fired}")

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.trace_unset:
            self.trace_unset = False
            sys.settrace(self)
            running: FrameType | None = frame
            while running is not None:
                if running.f_code in WATCHED:
                    running.f_trace = self._line
                running = running.f_back
        if not self.armed:
            return
        back = frame.f_back
        if frame.f_code is DISCARD:  # called by CPython, not by the watched code
            return
        entry = event == "call" and back is not None and back.f_code in WATCHED
        returned = event == "c_return" and frame.f_code in WATCHED
        if (entry or returned) and self._point():
            self.profile_unset = True
            self._raise()

    def _put_back(self) -> None:
        if self.profile_unset:
            self.profile_unset = False
            sys.setprofile(self.profile)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        self._put_back()
        return self._line if frame.f_code in WATCHED else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        self._put_back()
        quiet = event != "line" or not self.armed or frame.f_lineno in QUIET[frame.f_code]
        if not quiet and self._point():
            self.trace_unset = True
            self._raise()
        return self._line


DISCARD = Burst.discard.__code__
_tracer: Burst | None = None


class Finalized:
    """Garbage whose finalizer runs when its last reference goes, wherever that is."""

    def __del__(self) -> None:
        pass


def _finalized_on_the_way_out() -> None:
    """Three finalizers that run as the run's lock object goes, in the clean-up's code (as on
    CI, where other tests' garbage was finalized there): an exception raised in one of them
    CPython discards ("Exception ignored in"), never the library's to see."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and not isinstance(frame.f_locals.get("held"), BaseLock):
        frame = frame.f_back
    assert frame is not None
    frame.f_locals["held"].finalized_with_it = [Finalized() for _ in range(3)]


def body(name: str, how: str) -> str:
    assert _tracer is not None
    if how == "body returns, finalizers on the way out":
        _finalized_on_the_way_out()
    _tracer.armed = True
    if how == "body raises":
        raise TimeLimit("the time limit, in the body")
    return "ran"


@single_instance(key="burst:{name}", ttl=30)
def direct(name: str, how: str) -> str:
    return body(name, how)


@shared_task(bind=True, name="tests.interrupts.test_single_instance_interrupts.task")
@single_instance(key="burst:{name}", ttl=30, on_duplicate="skip")
def task(self: Any, name: str, how: str) -> str:
    return body(name, how)


def run(kind: str, name: str, how: str, tracer: Burst) -> str:
    global _tracer
    _tracer = tracer
    # No collection in the run: one the watched code's allocations started would run the
    # finalizers of earlier tests' garbage among the points (see discard), as on CI.
    collecting = gc.isenabled()
    gc.disable()
    tracer.unraisable_hook, sys.unraisablehook = sys.unraisablehook, tracer.discard
    sys.settrace(tracer)
    sys.setprofile(tracer.profile)
    try:
        if kind == "celery":  # in this process, as a worker runs it (a task id, Celery's trace)
            outcome = task.apply((name, how))
            assert outcome.state in ("SUCCESS", "FAILURE"), outcome.state
            if outcome.state == "FAILURE":
                return type(outcome.result).__name__
            return str(outcome.result)
        return direct(name, how)
    except BaseException as exc:
        return type(exc).__name__
    finally:
        sys.setprofile(None)
        sys.settrace(None)
        sys.unraisablehook = tracer.unraisable_hook
        if collecting:
            gc.enable()
        _tracer = None


@pytest.mark.parametrize(
    "how", ["body raises", "body returns", "body returns, finalizers on the way out"]
)
@pytest.mark.parametrize("kind", ["direct", "celery"])
def test_a_burst_of_interrupts_on_the_way_out_leaves_no_hold(kind: str, how: str) -> None:
    name = uuid.uuid4().hex[:8]
    counting = Burst(None)
    assert run(kind, name, how, counting) == ("TimeLimit" if how == "body raises" else "ran")
    assert counting.points >= 3
    fired: set[int] = set()
    for start in range(1, counting.points + 1):
        tracer = Burst(start)
        out = run(kind, name, how, tracer)
        where = (start, tracer.fired, tracer.discarded, out)
        # Released at once: not left held (and renewed by the watchdog for the process's life).
        assert not lock(f"burst:{name}").locked(), where
        if tracer.landed:
            assert out == "TimeLimit", where
        fired.add(tracer.landed)
    assert COUNT in fired  # whole bursts landed
