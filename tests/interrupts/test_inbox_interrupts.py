"""An interrupt (KeyboardInterrupt, a signal handler's exception, Celery's soft time limit)
during a process's first wait, while its hub subscribes the process's inbox: at the entry of every
function called from ``PubSubHub._subscribe_inbox`` and ``_ensure_started``, and inside
redis-py's ``PubSub.subscribe`` (before and after the SUBSCRIBE is written).

The rule checked after each one, on a real server: the next wait of the process is still
woken by the release. The inbox left marked subscribed with no subscription (no reader, or
no SUBSCRIBE sent) made every later waiter of the process deaf: a fair waiter slept until
its timeout, or every blocking acquire raised BackendUnavailable on a healthy server.
"""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType
from typing import Any

from redis.client import PubSub

from django_redlock import lock, locks
from django_redlock.waiting import PubSubHub

SUBSCRIBE_INBOX = PubSubHub._subscribe_inbox.__code__
ENSURE_STARTED = PubSubHub._ensure_started.__code__
PUBSUB_SUBSCRIBE = PubSub.subscribe.__code__


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


class Interrupter:
    """Raises :class:`Interrupt` at the ``at``-th point (None: counts them): each entry of a
    function that ``_subscribe_inbox``, ``_ensure_started`` or ``PubSub.subscribe`` calls,
    where CPython runs pending signal handlers. (Not at its lines: a tracer raising at a
    ``with`` line's exit skips the lock's release, which no signal can do.)"""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.points = 0
        self.fired: str | None = None

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise Interrupt(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        caller = frame.f_back.f_code if frame.f_back is not None else None
        if caller in (SUBSCRIBE_INBOX, ENSURE_STARTED, PUBSUB_SUBSCRIBE):
            self._point(frame)
        return None


def _case(name: str, at: int | None) -> tuple[Interrupter, float | str]:
    """A fresh hub (this process's first wait), its first wait interrupted at point ``at``;
    then a fair waiter of a lock released 0.1 s later: how long it took, or its error."""
    backend = locks["default"]
    backend.close()  # a new hub: the inbox is not subscribed yet
    holder = lock(name, ttl=10, auto_renew=False)
    assert holder.acquire(blocking=False)
    tracer = Interrupter(at)
    sys.settrace(tracer)
    try:
        lock(name, ttl=10).acquire(timeout=0.2)
    except Interrupt:
        pass
    finally:
        sys.settrace(None)
    holder.release()
    later = lock(f"{name}:later", ttl=10, auto_renew=False, fair=True)
    assert later.acquire(blocking=False)
    threading.Timer(0.1, later.release).start()
    started = time.monotonic()
    try:
        got = lock(f"{name}:later", ttl=10, fair=True).acquire(timeout=2)
    except Exception as exc:
        return tracer, f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    return tracer, took if got else f"not acquired after {took:.2f} s"


def test_an_interrupt_while_the_first_wait_subscribes_the_inbox_leaves_it_heard(
    name: str,
) -> None:
    counting, took = _case(f"{name}:count", None)
    assert isinstance(took, float) and took < 1.0, took
    points = counting.points
    assert points > 5, points  # the lines and the callees were seen
    failed = []
    for at in range(1, points + 1):
        tracer, took = _case(f"{name}:{at}", at)
        if not isinstance(took, float) or took > 1.0:
            failed.append(f"interrupted at {tracer.fired} (point {at}): later waiter {took}")
    assert not failed, "\n".join(failed)
