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

import asyncio
import contextlib
import os
import random
import signal
import sys
import threading
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

    def active(self) -> bool:
        """Whether the nemesis' client_interrupt is on (its flag file exists)."""
        return bool(self.flag) and os.path.exists(self.flag)

    def _delay(self, horizon: float) -> float:
        if self.rng.random() < 0.5:
            return self.rng.uniform(0.0002, 0.005)
        return self.rng.uniform(0.0002, max(0.001, horizon))

    @contextlib.contextmanager
    def armed(self, horizon: float) -> Iterator[None]:
        """A call that may be interrupted at a random moment within ``horizon`` s."""
        if not self.active() or self.rng.random() >= ARMED:
            yield
            return
        # Only the main thread runs the handlers (and a call in another thread, asgiref's,
        # is not where they would land): nothing to arm there.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        with self._timer(horizon):
            yield

    @contextlib.contextmanager
    def _timer(self, horizon: float) -> Iterator[None]:
        delay = self._delay(horizon)
        burst = self.rng.random() < 0.5
        interval = self.rng.uniform(0.000005, 0.0001) if burst else 0.0
        window = delay + (self.rng.uniform(0.0005, 0.005) if burst else 0.01)
        _state["until"] = time.monotonic() + window
        signal.setitimer(signal.ITIMER_REAL, delay, interval)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    @contextlib.contextmanager
    def cancels(self, horizon: float) -> Iterator[None]:
        """An asyncio client's call (in its task): armed as :meth:`armed` is, half of the
        armed calls with the signal, half with ``task.cancel()`` at a random moment within
        ``horizon`` s (a client gone, a ``asyncio.timeout()`` expiring); half of those a
        burst of 2-4 cancels 0.1-2 ms apart (cancelled again while the first unwinds: a
        hand-back, a release in ``__aexit__``)."""
        if not self.active() or self.rng.random() >= ARMED:
            yield
            return
        if self.rng.random() < 0.5 and threading.current_thread() is threading.main_thread():
            with self._timer(horizon):
                yield
            return
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        at = self._delay(horizon)
        count = self.rng.randint(2, 4) if self.rng.random() < 0.5 else 1
        handles = []
        for _ in range(count):
            handles.append(loop.call_later(at, task.cancel))
            at += self.rng.uniform(0.0001, 0.002)
        try:
            yield
        finally:
            for handle in handles:
                handle.cancel()


#: Until when (monotonic) the timer's signals raise; how many :func:`deferred` calls are
#: under way, and whether an interrupt came meanwhile.
_state = {"until": 0.0, "deferred": 0, "pending": 0}


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While the main thread waits for a call run in another thread (asgiref's
    ``sync_to_async`` / ``async_to_sync``): an interrupt that comes meanwhile is raised once
    the call is over, as it would be in C code. Raised in the middle, it would leave the call
    running on in its thread while the client cleans up behind it: its own misuse."""
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
        if not _state["deferred"] and _state["pending"]:
            _state["pending"] = 0
            raise KeyboardInterrupt("deferred signal")


def _raise(signum: int, frame: Any) -> None:
    if _state["deferred"]:
        _state["pending"] = 1
        return
    raise KeyboardInterrupt(f"signal {signum}")


def _time_limit(signum: int, frame: Any) -> None:
    raise TimeLimit("soft time limit (campaign)")


def _timer(signum: int, frame: Any) -> None:
    if time.monotonic() < _state["until"]:
        if _state["deferred"]:
            _state["pending"] = 1
            return
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


def caught(
    log: Any, hold: int, current: Any, error: type[Exception], place: str = "", how: str = ""
) -> None:
    """The loop's top caught an interrupt: log it, release what it held (if it can).
    ``place`` and ``how``: an asyncio client's loop closed under its call (aclient.py)."""
    place = place or where()
    while True:  # a burst may still be landing (for its few ms at most)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            break
        except RAISED:
            continue
    log("intr", h=hold, where=place, **({"how": how} if how else {}))
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
