"""Outside review (reviewB): renewer.py's rule "a loss dropped is a loss declared" queues a lost
entry until each of its objects was told (``mark_lost``), and tells them again after an
exception ("an object told twice declares once"). But ``mark_lost`` takes the hold out of the
object (``_forget``) before it declares: an exception (an asynchronous one in the watchdog's
worker) at the entry of a function ``_forget`` calls leaves the object holding nothing, and
the second telling finds no hold, so ``lock_lost`` never fires and ``lost`` stays None.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest

from django_redlock import lock
from django_redlock.locking.base import BaseLock
from django_redlock.signals import lock_lost


class Interrupt(Exception):
    """What PyThreadState_SetAsyncExc may raise in the watchdog's worker."""


def test_a_loss_told_again_after_an_exception_in_mark_lost_is_declared_once(name: str) -> None:
    lk = lock(name, ttl=5)
    assert lk.acquire(blocking=False)
    token = lk.token
    assert token is not None
    declared: list[str] = []

    def receiver(sender: Any, lock: Any, reason: str, **kwargs: Any) -> None:
        if lock is lk:
            declared.append(reason)

    lock_lost.connect(receiver, weak=False)
    armed = [True]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if armed[0] and event == "call" and frame.f_code is BaseLock._stop_renewing.__code__:
            armed[0] = False
            raise Interrupt("entry of _stop_renewing, called by mark_lost's _forget")
        return None

    try:
        sys.settrace(tracer)
        try:
            with pytest.raises(Interrupt):
                lk.mark_lost(token, "it expired or was released by someone else")
        finally:
            sys.settrace(None)
        assert not armed[0]
        # What _declare_losses does after the exception: tell the object again.
        lk.mark_lost(token, "it expired or was released by someone else")
        assert lk.token is None
        assert declared == ["it expired or was released by someone else"]
        assert lk.lost is not None
    finally:
        lock_lost.disconnect(receiver)
