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


def test_a_signal_during_a_deferred_call_is_raised_once_it_is_over() -> None:
    """An asyncio client waiting for a call in asgiref's thread: the interrupt lands after
    it (raised in the middle, the call would run on while the client cleaned up behind it)."""
    ran = []
    try:
        with interrupts.deferred():
            interrupts._raise(signal.SIGUSR1, None)  # as the handler would, meanwhile
            ran.append("after the signal")
    except KeyboardInterrupt as exc:
        assert str(exc) == "deferred signal"
    else:
        raise AssertionError("the deferred signal was never raised")
    assert ran == ["after the signal"]
    assert interrupts._state["deferred"] == 0 and interrupts._state["pending"] == 0


def test_an_armed_async_call_is_cancelled_within_its_horizon(tmp_path: Any) -> None:
    """``Interrupts.cancels``: an armed call of an asyncio client gets ``task.cancel()``
    within its horizon (off the main thread always: the signal's timer is the main thread's),
    and nothing once it is over."""
    import asyncio
    import random
    import threading

    flag = tmp_path / "interrupt"
    flag.touch()
    handlers = {n: signal.getsignal(n) for n in (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2)}
    saved = interrupts.ARMED
    try:
        armed = interrupts.Interrupts(str(flag), random.Random(5))
        interrupts.ARMED = 1.0
        outcomes: list[str] = []

        async def call() -> None:
            try:
                with armed.cancels(0.05):
                    await asyncio.sleep(0.5)
                outcomes.append("returned")
            except asyncio.CancelledError:
                outcomes.append("cancelled")
            await asyncio.sleep(0.01)  # no cancel left over after the call

        def run() -> None:
            for _ in range(8):
                asyncio.run(call())

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(10)
        assert outcomes == ["cancelled"] * 8
    finally:
        interrupts.ARMED = saved
        for number, handler in handlers.items():
            signal.signal(number, handler)
