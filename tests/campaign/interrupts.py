"""Asynchronous exceptions in the clients: the nemesis' ``interrupt`` move.

A client's SIGUSR1 and SIGALRM handlers raise ``KeyboardInterrupt`` (as Ctrl-C, a raising
signal handler or Celery's soft time limit do) wherever the main thread is: in the lock's
acquire, its wait, a fenced block, a release, or the client's own code. The nemesis sends
SIGUSR1 once at the fault's start and, for the fault's duration, puts a flag file there:
while it exists, the client arms a timer (SIGALRM) before some of its calls, at a random
moment within the call (half of them within its first 5 ms: the set-up and the first try;
the others anywhere in the call's expected time: the wait, its wake-up and clean-up); half
the armed calls get a burst: an interrupt every 5-100 us for 0.5-5 ms from then on, so that
more land while the first unwinds (the clean-up in ``finally`` blocks, a leave not yet
sent), as a second Ctrl-C or a soft time limit followed by the hard one would. Past its
window the timer's signals raise nothing (the loop's top disarms it).

The client catches the interrupt at the top of its loop, logs it (``intr``, with the
library's innermost frame it hit), releases what it was holding if it can (``intr_rel``;
as a ``with`` block would), and goes on. Its hold then follows the documented rule:
released, or left to its TTL; and a waiter it abandoned must not strand the next one.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

try:  # what a Celery task's soft time limit raises (an Exception, not a BaseException)
    from celery.exceptions import SoftTimeLimitExceeded as TimeLimit
except ImportError:  # pragma: no cover - celery is a test dependency

    class TimeLimit(Exception):  # type: ignore[no-redef]
        pass


#: The share of calls armed while the flag exists.
ARMED = 0.7

#: What the campaign raises in a client (SIGUSR1 and the timer; SIGUSR2: commit_interrupted's
#: soft time limit, sent to every client): the loop's top catches these, and retries with them.
RAISED = (KeyboardInterrupt, TimeLimit)


class Interrupts:
    def __init__(self, flag: str, rng: random.Random) -> None:
        self.flag = flag
        self.rng = rng
        signal.signal(signal.SIGUSR1, _raise)
        signal.signal(signal.SIGUSR2, _time_limit)
        signal.signal(signal.SIGALRM, _timer)

    @contextlib.contextmanager
    def armed(self, horizon: float) -> Iterator[None]:
        """A call that may be interrupted at a random moment within ``horizon`` s."""
        if not self.flag or not os.path.exists(self.flag) or self.rng.random() >= ARMED:
            yield
            return
        if self.rng.random() < 0.5:
            delay = self.rng.uniform(0.0002, 0.005)
        else:
            delay = self.rng.uniform(0.0002, max(0.001, horizon))
        burst = self.rng.random() < 0.5
        interval = self.rng.uniform(0.000005, 0.0001) if burst else 0.0
        window = delay + (self.rng.uniform(0.0005, 0.005) if burst else 0.01)
        _state["until"] = time.monotonic() + window
        signal.setitimer(signal.ITIMER_REAL, delay, interval)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)


#: Until when (monotonic) the timer's signals raise.
_state = {"until": 0.0}


def _raise(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _time_limit(signum: int, frame: Any) -> None:
    raise TimeLimit("soft time limit (campaign)")


def _timer(signum: int, frame: Any) -> None:
    if time.monotonic() < _state["until"]:
        raise KeyboardInterrupt("timer")
    # Past its window: no more. Left firing every few us until the loop's top disarms it,
    # on a loaded machine each handler was interrupted by the next (RecursionError, seed 405).
    signal.setitimer(signal.ITIMER_REAL, 0)


def where() -> str:
    """The innermost frame of the library or Django the interrupt went through (else the
    client's)."""
    tb = sys.exc_info()[2]
    found = "client"
    for frame in traceback.extract_tb(tb):
        for package in ("django_redlock/", "django/"):
            if package in frame.filename:
                name = package + frame.filename.rsplit(package, 1)[-1]
                found = f"{name}:{frame.name}:{frame.lineno}"
    return found


def caught(log: Any, hold: int, current: Any, error: type[Exception]) -> None:
    """The loop's top caught an interrupt: log it, release what it held (if it can)."""
    place = where()
    while True:  # a burst may still be landing (for its few ms at most)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            break
        except RAISED:
            continue
    log("intr", h=hold, where=place)
    if current is None:
        return
    # Every level it took (a reentrant re-entry cut short leaves two), as each ``with``
    # block's exit would: until the object says it holds no more.
    for _ in range(6):
        try:
            current.release()
            log("intr_rel", h=hold, ok=True)
        except error as exc:
            log("intr_rel", h=hold, ok=False, err=type(exc).__name__)
            return
        except RAISED:  # the end of a burst, or a soft time limit: try again
            continue
