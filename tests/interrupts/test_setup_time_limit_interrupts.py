"""A Celery soft time limit (``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises
at whatever line runs) landing in a wait's set-up: at every line of the pub/sub hub's subscribes
and unsubscribes (``_subscribe_inbox``, ``_send_subscribe``, ``_send_unsubscribe``,
``_send_first``, ``_ensure_started``) and at the entry of every function they call.

The rule checked, on a real server: the time limit comes out of the wait (or the join, the
leave), and the next wait of the process is still woken by the release. Caught as a failed
subscribe (``except Exception``), it was dropped: the wait went on past the time limit and took
the lock (review w3, 2).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType

import pytest

from django_redlock import lock, locks
from django_redlock.waiters import CompositeHub, ReleaseHub, Waiter
from django_redlock.waiting import PubSubHub

from ..support.line_interrupts import LineInterrupter, every_point


class TimeLimit(Exception):
    """What Celery's soft time limit is: an Exception, raised by a signal handler."""


class TimeLimiter(LineInterrupter):
    """Raises :class:`TimeLimit` at the ``at``-th point of the window (None: counts them)."""

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise TimeLimit(self.fired)


SUBSCRIBES: set[CodeType] = {
    PubSubHub._subscribe_inbox.__code__,
    PubSubHub._send_subscribe.__code__,
    PubSubHub._send_first.__code__,
    PubSubHub._ensure_started.__code__,
}
UNSUBSCRIBES: set[CodeType] = {PubSubHub._send_unsubscribe.__code__}


def _timed_out(call: Callable[[], object], tracer: LineInterrupter) -> TimeLimit | None:
    """``call()`` under ``tracer``: the TimeLimit it raised (None: it returned)."""
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
    except TimeLimit as exc:
        return exc
    finally:
        sys.settrace(previous)
    return None


def _later_waiter_woken(name: str) -> str | None:
    """A fair waiter of a lock released 0.1 s later: None, or what went wrong."""
    later = lock(f"{name}:later", ttl=10, auto_renew=False, fair=True)
    assert later.acquire(blocking=False)
    threading.Timer(0.1, later.release).start()
    started = time.monotonic()
    try:
        got = lock(f"{name}:later", ttl=10, fair=True).acquire(timeout=2)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    return None if got and took < 1.0 else f"later waiter: {got} after {took:.2f} s"


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("hub", ["subscribed", "fresh"])
def test_a_time_limit_in_a_wait_s_subscribe_comes_out_of_the_wait(
    driver: str, hub: str, name: str
) -> None:
    failed: list[str] = []
    runs = iter(range(1000))

    def case(tracer: LineInterrupter) -> None:
        each = f"{name}:{next(runs)}"
        if hub == "fresh":
            locks["default"].close()  # a new hub: the inbox is not subscribed yet
        else:
            assert _later_waiter_woken(f"{each}:warm") is None  # the inbox subscribed
        holder = lock(each, ttl=10, auto_renew=False)
        assert holder.acquire(blocking=False)
        # Released 0.3 s on (the wait has subscribed by then), or once the wait came out.
        timer = threading.Timer(0.3, holder.release)
        timer.start()
        waiter = lock(each, ttl=10)
        got: list[bool] = []

        def wait() -> None:
            if driver == "async":
                got.append(asyncio.run(waiter.aacquire(timeout=3)))
            else:
                got.append(waiter.acquire(timeout=3))

        raised = _timed_out(wait, tracer)
        timer.cancel()
        timer.join(5)
        if holder.token is not None:
            holder.release()
        where = tracer.fired or "no time limit"
        if tracer.fired is not None and raised is None:
            failed.append(f"{where}: the time limit was dropped, the acquire returned {got}")
        while waiter.token is not None:
            waiter.release()
        problem = _later_waiter_woken(each)
        if problem is not None:
            failed.append(f"{where}: {problem}")

    def make(at: int | None) -> LineInterrupter:
        return TimeLimiter(at, SUBSCRIBES, lambda frame: True)

    fired = every_point(case, make)
    assert len(fired) >= 3, fired
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("what", ["join", "leave"])
def test_a_time_limit_in_a_channel_subscribe_or_unsubscribe_comes_out(what: str, name: str) -> None:
    """A release channel's join and last leave (hubs that wake by channel)."""
    failed: list[str] = []
    hub = locks["default"].hub
    channel = f"{name}:{what}"

    def case(tracer: LineInterrupter) -> None:
        waiter = Waiter()
        if what == "join":
            raised = _timed_out(lambda: hub.join(channel, waiter), tracer)
        else:
            hub.join(channel, waiter)
            raised = _timed_out(lambda: hub.leave(channel, waiter), tracer)
        hub.leave(channel, waiter)  # (idempotent)
        if tracer.fired is not None and raised is None:
            failed.append(f"{what} at {tracer.fired}: the time limit was dropped")

    def make(at: int | None) -> LineInterrupter:
        return TimeLimiter(at, SUBSCRIBES if what == "join" else UNSUBSCRIBES, lambda f: True)

    assert every_point(case, make)
    assert not failed, "\n".join(failed)


def test_a_time_limit_in_a_node_s_join_comes_out_of_a_composite_join() -> None:
    """Redlock's hub joins each node's: a node that fails is skipped, a time limit is not."""

    class Struck(ReleaseHub):
        def _subscribe_inbox(self) -> None:
            raise TimeLimit("struck in the join")

    class Down(ReleaseHub):
        def _subscribe_inbox(self) -> None:
            raise ConnectionError("a node that is down")

    composite = CompositeHub([Down(), ReleaseHub()], confirm_timeout=1)
    composite.join("w.1", Waiter(), by_id=True)  # a node down: skipped
    composite = CompositeHub([ReleaseHub(), Struck()], confirm_timeout=1)
    with pytest.raises(TimeLimit):
        composite.join("w.2", Waiter(), by_id=True)
