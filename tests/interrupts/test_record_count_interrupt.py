"""Outside review (reviewB): an interrupt in the last step of ``BaseLock._record`` for a
reentrant hold, the owner's count (``holds.believe``), lands after the count went up: at the
entry of ``holds._idle``, a Python function's entry, where CPython looks for a signal.
``_unrecord`` does not undo that step, so the owner believes one level it does not hold: the
hand-back settles the server to that count (the grant is kept, not given back), and from then
on every hold the owner takes and releases leaves one level behind on the server.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest

from django_redlock import lock
from django_redlock.locking import holds


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


def test_an_interrupt_in_the_count_step_of_a_record_gives_the_grant_back(name: str) -> None:
    armed = [True]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        back = frame.f_back
        if (
            armed[0]
            and event == "call"
            and frame.f_code is holds._idle.__code__
            and back is not None
            and back.f_locals.get("delta") == 1
        ):
            armed[0] = False
            raise Interrupt("entry of holds._idle, from the record's believe(+1)")
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
