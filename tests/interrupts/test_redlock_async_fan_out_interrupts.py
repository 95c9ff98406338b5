"""A KeyboardInterrupt (what a signal handler raises: Ctrl-C, a SIGALRM) at every line of the
Redlock I/O that an asyncio release or an acquire's undo runs, from its fan-out's entry until
``asyncio.run`` returns (its node tasks' lines, their entries and resumptions included): every
node is still sent the write or owed it, so the hold leaves every node at once.

The rule (written above ``NodeIO.afan_out``): a node stays in ``fan.unsent`` until its task's
first line takes it off, inside the task's own handler; from there the task owes the write
on any exception. Before (issue 42, outside review round 5, defect 1): ``_aask`` took the
nodes off ``fan.unsent`` as it created their tasks, and a task owed its write only when
cancelled inside ``_asend``: an interrupt just after the tasks were made (asyncio.run then
cancels tasks that never ran a step), or at a line of a task outside that handler (the await
of the node's request included), left the hold on every node for its whole TTL.

With a second interrupt (a burst: Ctrl-C twice), asyncio.run's shutdown is cut short and the
loop closed with tasks that never run again; their clean-up runs only if they are collected,
and the closed loop stays referenced (the backend's asyncio clients). What they held is owed
by the next fan-out (``NodeIO._owe_orphans``); before, the holds stayed until the next
``asyncio.run`` let the old loop go, or their TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import sys
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import pytest

from django_redlock import LockError, lock
from django_redlock.backends.base import Kind
from django_redlock.backends.redlock_io import Fan, NodeIO, Undo, answered
from django_redlock.testing import RedisServer

from ..redlock.test_redlock import quorum_alias
from ..redlock.test_redlock_io import backend_of

IO_FILE = "redlock_io.py"


class Interrupt(KeyboardInterrupt):
    """A KeyboardInterrupt: asyncio lets it out of the loop, and asyncio.run cancels the
    tasks left (the case an Exception raised in a task never reaches)."""


@functools.cache  # a sweep asks once a point: reading the source was most of a point
def _quiet(code: CodeType) -> set[int]:
    """A ``with`` statement's own lines and a ``try:`` (a comment after it too): no signal
    is looked for there."""
    lines, first = inspect.getsourcelines(code)
    return {
        first + n
        for n, line in enumerate(lines)
        if line.lstrip().startswith("with ") or line.split("#")[0].strip() == "try:"
    }


class AsyncFanOutInterrupt:
    """Raises :class:`Interrupt` at the ``at``-th point (None: counts them) from the first
    line of ``afan_out`` for a fan that owes ``kind`` (its entry is its caller's window): each
    line of the Redlock I/O run in this thread (not ``with``/``try:`` lines, where no signal
    is looked for), and each entry or resumption of one of its functions. With ``burst``, a
    second one at the next entry or resumption (a second Ctrl-C, during the clean-up or
    asyncio.run's shutdown: a profiler, as Python unsets a tracer that raised)."""

    def __init__(self, at: int | None, kind: str, burst: bool = False) -> None:
        self.at, self.kind, self.burst = at, kind, burst
        self.points, self.armed = 0, False
        self.fired: str | None = None
        self.second: str | None = None
        self.quiet: dict[CodeType, set[int]] = {}
        # The second's profiler: set before the run, quiet until the first fires
        # (tests/interrupts/test_reentrant_count_bursts.py says why not set as it fires).
        self.profiler = self._second if burst else None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.endswith(IO_FILE):
            return None
        self._point(frame, "entry")
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            code = frame.f_code
            if not self.armed and code is NodeIO.afan_out.__code__:
                self.armed = frame.f_locals["fan"].owed == self.kind
            if code not in self.quiet:
                self.quiet[code] = _quiet(code)
            if frame.f_lineno not in self.quiet[code]:
                self._point(frame, "line")
        return self._line

    def _point(self, frame: FrameType, event: str) -> None:
        if not self.armed or self.fired is not None:
            return
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}:{event}"
            raise Interrupt(self.fired)

    def _second(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.fired is None or self.second is not None:
            return  # before the first, or after the second
        code = frame.f_code
        if event == "call" and code.co_filename.endswith(IO_FILE):
            self.second = f"{code.co_name}:{frame.f_lineno}:entry"
            raise Interrupt(f"{self.fired}, then {self.second}")


def _release(name: str, alias: str, servers: list[RedisServer]) -> Callable[[], Any]:
    held = lock(name, using=alias, ttl=30, auto_renew=False)
    assert held.acquire(blocking=False)
    return lambda: asyncio.run(held.arelease())


def _undo(name: str, alias: str, servers: list[RedisServer]) -> Callable[[], Any]:
    """An acquire's undo on every node, driven through the I/O directly (through the lock,
    an acquire that raises has its hand-back release it again: not the driver's doing)."""
    backend = backend_of(alias)
    held = lock(name, using=alias, ttl=30, auto_renew=False)
    assert held.acquire(blocking=False) and held.token is not None
    ops = [node.op_release(name, held.token, Kind()) for node in backend.nodes]
    fan = Fan(
        [Undo(op.name, op.request, op.parse) for op in ops],
        lambda replies: sum(1 for r in replies if answered(r)) >= backend.quorum,
        owed="undo",
    )
    return lambda: asyncio.run(backend.io.afan_out(fan))


def _held(clients: list[Any], key: str) -> list[int]:
    return [i for i, client in enumerate(clients) if client.exists(key)]


def _tick(name: str, alias: str) -> None:
    with contextlib.suppress(LockError):
        lock(f"{name}:tick", using=alias).locked()  # requests carry what is owed
    time.sleep(0.002)  # short: the deadline, not the step, bounds the wait


def _run(
    name: str, alias: str, servers: list[RedisServer], kind: str, at: int | None, burst: bool
) -> Any:
    tracer = AsyncFanOutInterrupt(at, kind, burst)
    call = (_release if kind == "release" else _undo)(name, alias, servers)
    sys.setprofile(tracer.profiler)
    sys.settrace(tracer)
    try:
        call()
    except Interrupt:
        assert tracer.fired
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    assert tracer.armed, f"no {kind} fan-out ran"
    return tracer


# (A burst's second interrupt may land as the collector closes a coroutine of a closed loop:
# Python reports it as "ignored", which is what a signal there would do.)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    ("kind", "burst"),
    [("release", False), ("undo", False), ("release", True)],
    ids=["release", "undo", "release-burst"],
)
def test_an_interrupt_at_any_line_of_an_asyncio_release_or_undo_leaves_each_node_sent_or_owed(
    redis_factory: Callable[..., RedisServer], name: str, kind: str, burst: bool
) -> None:
    """``burst``: a second interrupt cuts asyncio.run's shutdown short: the loop is closed
    with tasks that never run again (nor their clean-up, until collected): what they held
    is owed by the next fan-out (``NodeIO._owe_orphans``)."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("afanout", servers, socket_timeout=0.5):
        key = backend_of("afanout").nodes[0].key(name)
        clients = [server.client() for server in servers]  # not a new connection per look
        counting = _run(name, "afanout", servers, kind, None, burst)
        points = counting.points
        assert points > 30, points
        failed, fired = [], 0
        for at in range(1, 2 * points):
            tracer = _run(name, "afanout", servers, kind, at, burst)
            if tracer.fired is None:  # past the last point (a run's path may be shorter)
                break
            fired += 1
            # Each node got the write: sent, or owed (paid by the next requests).
            until = time.monotonic() + 2
            while (left := _held(clients, key)) and time.monotonic() < until:
                _tick(name, "afanout")
            if left:
                where = (
                    tracer.fired if tracer.second is None else f"{tracer.fired}, {tracer.second}"
                )
                failed.append(f"{where}: nodes {left} kept the hold")
                for client in clients:
                    client.delete(key)
                if len(failed) == 5:  # enough to say what is wrong (each waited 2 s)
                    break
        assert not failed, failed
        assert fired > points // 2, (fired, points)
