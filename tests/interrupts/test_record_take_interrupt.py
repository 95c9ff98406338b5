"""Outside review (reviewB): an interrupt at the entry of ``holds._count`` (a Python
function's entry, where CPython looks for a signal) inside ``holds.take()``, while a granted
hold is recorded. ``_record`` undoes its steps, but ``take()`` had already registered the
object's handle without counting it: once that object is collected, the handle uncounts a hold
of the same thread through another object, and a blocking acquire of a name the thread holds
waits for itself instead of raising ``LockError``.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from types import FrameType
from typing import Any

from django_redlock import lock
from django_redlock.locking import holds


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


def test_an_interrupt_in_take_leaves_no_handle_that_uncounts_a_later_hold(name: str) -> None:
    """At the entry of each Python function ``take()`` calls in turn (where a signal lands)."""
    at = 0
    while True:
        at += 1
        if not _interrupted_at(at, f"{name}:{at}"):
            break
    assert at > 1  # take() called something: it was interrupted there


def _interrupted_at(at: int, name: str) -> bool:
    """Interrupt the ``at``-th call out of ``take()``; False when there is none."""
    seen = [0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        back = frame.f_back
        if event == "call" and back is not None and back.f_code is holds.take.__code__:
            seen[0] += 1
            if seen[0] == at:
                raise Interrupt(f"entry of {frame.f_code.co_name}, in take()")
        return None

    dropped = lock(f"{name}:dropped", ttl=5)  # a hold whose Lock is collected unreleased:
    assert dropped.acquire(blocking=False)  # take() sweeps it first (a call out of take())
    del dropped
    gc.collect()
    first = lock(name, ttl=5)
    sys.settrace(tracer)
    try:
        with contextlib.suppress(Interrupt):
            first.acquire(blocking=False)
    finally:
        sys.settrace(None)
    if seen[0] < at:
        first.release()
        return False
    assert first.token is None
    before = holds.taken_count()
    second = lock(name, ttl=5)
    assert second.acquire(blocking=False)
    assert holds.taken_count() == before + 1
    del first
    gc.collect()
    try:
        # The thread still holds it through ``second``: still counted as taken.
        assert holds.taken_count() == before + 1
    finally:
        second.release()
    return True
