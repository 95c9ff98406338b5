"""An interrupt (KeyboardInterrupt, a signal handler's exception) at any line of a wait's watch
set-up: the hub's join (``waiters.py``, ``waiting.py``, Redlock's ``redlock_health.py``) and
the step driver's ``Watch``, up to the wait's first sleep.

The rule: nothing stays registered. A waiter left in a hub kept its lock's group there and
the lock's release channel subscribed on every node for the life of the process, one more
per interrupted wait, and the hub's PINGs never stopped.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.testing import RedisServer
from django_redlock.waiters import AsyncWaiter, ReleaseHub, Waiter

from ..redlock.test_redlock import quorum_alias

FILES = ("waiters.py", "waiting.py", "redlock_health.py", "steps.py")
WATCH = {ReleaseHub.watch.__wrapped__.__code__, ReleaseHub.awatch.__wrapped__.__code__}  # type: ignore[attr-defined]
SLEEP = {Waiter.wait.__code__, AsyncWaiter.wait.__code__}


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


class Interrupter:
    """Raises at the ``at``-th line (None: counts them) run in those files from the start of
    the watch to the wait's first sleep."""

    def __init__(self, at: int | None) -> None:
        self.at, self.points, self.armed, self.done, self.fired = at, 0, False, False, ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code in WATCH and not self.done:
            self.armed = True
        elif code in SLEEP and self.armed:
            self.armed, self.done = False, True
        if Path(code.co_filename).name in FILES and "django_redlock" in code.co_filename:
            return self._line
        return None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.armed and frame.f_code.co_firstlineno != frame.f_lineno:
            line = frame.f_code.co_filename, frame.f_lineno
            text = _source(*line).strip()
            if text == "try:" or text.startswith("with "):
                # No signal is looked for at a ``try:``; a ``with`` line runs again to leave
                # its block, __exit__ called before a signal is looked for.
                return self._line
            self.points += 1
            if self.points == self.at:
                self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
                raise Interrupt(self.fired)
        return self._line


_SOURCES: dict[str, list[str]] = {}


def _source(path: str, line: int) -> str:
    if path not in _SOURCES:
        _SOURCES[path] = Path(path).read_text().splitlines()
    return _SOURCES[path][line - 1]


def _hubs(alias: str) -> list[ReleaseHub]:
    hub = locks[alias].hub
    return list(getattr(hub, "hubs", [hub]))


def _registered(alias: str) -> list[str]:
    # A Redlock node whose pub/sub connection is not open yet is joined in a thread
    # (QuorumHub.join), which leaves what it registered once it sees the waiter gone.
    for thread in threading.enumerate():
        if thread.name == "redlock-join":
            thread.join(5)
    return [c for hub in _hubs(alias) for c, group in hub._waiters.items() if group]


@pytest.fixture(params=["redis", "redlock"])
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis":
        yield "default"
        return
    factory: Callable[..., RedisServer] = request.getfixturevalue("redis_factory")
    # Node timeouts of 1 s, not the default 0.1 s: each async wait connects anew under a
    # tracer, and a loaded machine's connects outlasted 0.1 s ("only 1 of 3 nodes answered").
    nodes = [factory() for _ in range(3)]
    with quorum_alias("quorum", nodes, socket_timeout=1.0, socket_connect_timeout=1.0):
        yield "quorum"


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_an_interrupt_at_any_line_of_a_wait_s_watch_leaves_nothing_registered(
    alias: str, driver: str, name: str
) -> None:
    holder = lock(name, using=alias, ttl=30, auto_renew=False)
    assert holder.acquire(blocking=False)

    def wait(tracer: Interrupter) -> None:
        waiter = lock(name, using=alias, ttl=30)
        sys.settrace(tracer)
        try:
            if driver == "async":
                asyncio.run(waiter.aacquire(timeout=0.25))  # a new loop: new connections
            else:
                waiter.acquire(timeout=0.05)
        except Interrupt:
            pass
        finally:
            sys.settrace(None)

    counting = Interrupter(None)
    wait(counting)
    assert counting.points > 5, counting.points
    failed = []
    for at in range(1, counting.points + 1):
        tracer = Interrupter(at)
        wait(tracer)
        left = _registered(alias)
        if left:
            failed.append(f"{tracer.fired or at}: {left}")
            for hub in _hubs(alias):
                hub._waiters.clear()
    holder.release()
    assert not failed, failed
    if alias == "quorum":  # and no release channel of ours stays subscribed on a node
        channel = locks[alias].channel(name).encode()
        deadline = time.monotonic() + 2
        while any(channel in hub._pubsub.channels for hub in _hubs(alias) if hub._pubsub):
            assert time.monotonic() < deadline, "a release channel stayed subscribed"
            time.sleep(0.02)


def test_an_interrupt_in_a_wait_s_leave_still_unsubscribes_on_the_next_try(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """An interrupt in the hub's leave right after it took the lock's group out: the leave
    tried again found nobody to take out and left the release channel subscribed for the
    life of the process (one more per interrupted lock name)."""
    with quorum_alias("quorum", [redis_factory() for _ in range(3)]):
        _leave_interrupted(name)


def _leave_interrupted(name: str) -> None:
    holder = lock(name, using="quorum", ttl=30, auto_renew=False)
    assert holder.acquire(blocking=False)
    fired: list[int] = []

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not ReleaseHub._leave.__code__:
            return None
        if (
            event == "line"
            and not fired
            and "if waiter.baton" in _source(frame.f_code.co_filename, frame.f_lineno)
        ):
            fired.append(frame.f_lineno)
            raise Interrupt
        return tracer

    sys.settrace(tracer)
    try:
        waiter = lock(name, using="quorum", ttl=30)
        assert not waiter.acquire(timeout=0.2)  # the driver leaves again after the interrupt
    except Interrupt:
        pass
    finally:
        sys.settrace(None)
    holder.release()
    assert fired
    channel = locks["quorum"].channel(name)
    assert not _registered("quorum")
    assert not [h for h in _hubs("quorum") if channel in getattr(h, "_confirmed", {})]
