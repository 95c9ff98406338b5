"""The campaign's asynchronous exceptions (``interrupts.py``): the client's clean-up after one."""

from __future__ import annotations

import signal
from typing import Any

from . import interrupts
from .interrupts import TimeLimit, caught


class Released(Exception):
    """The lock's ``LockError``: nothing more to release."""


class Lock:
    """A held lock whose first release is cut short by ``first`` (then released once)."""

    def __init__(self, first: BaseException) -> None:
        self.first: BaseException | None = first
        self.held = True

    def release(self) -> None:
        if self.first is not None:
            error, self.first = self.first, None
            raise error
        if not self.held:
            raise Released("not held")
        self.held = False


def test_a_soft_time_limit_during_the_release_after_an_interrupt_is_retried() -> None:
    """``commit_interrupted`` sends every client a soft time limit: one landing while the
    client releases after an interrupt was not retried and killed it (``client-crash``, seed
    402). Both kinds the campaign raises are retried."""
    for first in (KeyboardInterrupt("timer"), TimeLimit("soft time limit (campaign)")):
        events: list[tuple[str, dict[str, Any]]] = []
        lock = Lock(first)
        caught(lambda e, _to=events, **fields: _to.append((e, fields)), 7, lock, Released)
        assert not lock.held
        assert [e for e, _ in events] == ["intr", "intr_rel", "intr_rel"]
        assert events[-1][1]["err"] == "Released"


def test_the_timer_past_its_window_disarms_itself() -> None:
    """A burst's timer fires every 5-100 us until the loop's top disarms it: past its window
    each signal's handler now disarms it, else on a loaded machine handlers nested in handlers
    until a ``RecursionError`` killed the client (``client-crash``, seed 405)."""
    previous = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    try:
        interrupts._state["until"] = 0.0
        signal.setitimer(signal.ITIMER_REAL, 60, 60)
        interrupts._timer(signal.SIGALRM, None)
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
