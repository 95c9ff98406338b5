"""Outside review (reviewB): an interrupt in the last step of ``BaseLock._record`` for a
reentrant hold, the owner's count (``holds.believe``), lands after the count went up: at the
entry of ``holds._idle``, a Python function's entry, where CPython looks for a signal.
``_unrecord`` does not undo that step, so the owner believes one level it does not hold: the
hand-back settles the server to that count (the grant is kept, not given back), and from then
on every hold the owner takes and releases leaves one level behind on the server.

The owner's count is now the sum of its objects' levels (no step of its own): the count step
of a record is the one that puts the object among those counted (``holds.holds_levels``).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest

from django_redlock import lock
from django_redlock.locking import holds
from django_redlock.locking.base import BaseLock


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


def test_an_interrupt_in_the_count_step_of_a_record_gives_the_grant_back(name: str) -> None:
    armed = [True]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        back = frame.f_back
        if (
            armed[0]
            and event == "call"
            and frame.f_code is holds.holds_levels.__code__
            and back is not None
            and back.f_code is BaseLock._record.__code__
        ):
            armed[0] = False
            raise Interrupt("entry of holds.holds_levels, from the record")
        return None

    first = lock(name, ttl=5, reentrant=True)
    sys.settrace(tracer)
    try:
        with pytest.raises(Interrupt):
            first.acquire(blocking=False)
    finally:
        sys.settrace(None)
    assert not armed[0]
    assert first.token is None  # the object holds nothing: the grant must be given back
    other = lock(name, ttl=5)
    assert other.acquire(blocking=False), "the grant was left on the server"
    other.release()
    # The same owner takes and releases it once more: nothing may be left behind.
    with lock(name, ttl=5, reentrant=True):
        pass
    assert other.acquire(blocking=False), "a released reentrant hold was left on the server"
    other.release()
