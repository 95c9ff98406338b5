"""An interrupt (a signal handler's exception) at every line of a Redlock release's fan-out,
from its start to the last request written, alone or followed by a second one at the entry
of the next function (the clean-up's): every node is still sent the release or owed it, and
so is the release of another lock a node was owed, carried by this one.

The rule (written above ``NodeIO.fan_out``): from the moment the fan-out exists until each
node's write is sent or owed, an exception at any line leaves every node's write either sent
or owed. Before (issue 42, outside review round 4): an interrupt in the plan (before the
``try``) left every node neither sent nor owed; one just after the books handed a node's
debts to the request, before its Flight noted them, lost them; a second interrupt during the
clean-up stopped the owe-back of the flights after the first. Each left a released hold on
its nodes for its whole TTL.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

import django_redlock
from django_redlock import LockError, lock
from django_redlock.backends.base import Kind
from django_redlock.backends.redlock_io import NodeIO, Undo
from django_redlock.testing import RedisServer

from ..redlock.test_redlock import quorum_alias
from ..redlock.test_redlock_io import IO_FILES, backend_of
from .test_record_interrupts import _quiet_lines

PACKAGE = str(Path(django_redlock.__file__).parent)
IO_FILE = "redlock_io.py"  # its lines are the points (owners.py's and the rest are not)


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


class FanOutBurst:
    """The first interrupt at the ``at``-th point (a line of the Redlock I/O, or a function's
    entry there) from a release's ``fan_out`` entry until its replies start being collected
    (None: counts the points); with ``burst``, a second at the entry of the next function
    of the package that runs after it (a profiler set before the run, quiet until the first
    fires: tests/interrupts/test_reentrant_count_bursts.py says why not set as it fires)."""

    def __init__(self, at: int | None, burst: bool) -> None:
        self.at, self.burst = at, burst
        self.points, self.armed, self.done = 0, False, False
        self.fired: list[str] = []
        self.quiet: dict[CodeType, set[int]] = {}
        self.profiler = self._second if burst else None  # one object for the whole run

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.endswith(IO_FILES):
            return None
        if event == "call" and not self.done:
            if code is NodeIO.fan_out.__code__ and frame.f_locals["fan"].owed == "release":
                self.armed = True
                return self._line  # from its first line (its entry is its caller's window)
            elif code.co_name == "_collect" and self.armed:  # every request written or owed
                self.armed, self.done = False, True
        self._point(frame, event)
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            code = frame.f_code
            if code not in self.quiet:
                self.quiet[code] = _quiet_lines(code)
            if frame.f_lineno not in self.quiet[code]:
                self._point(frame, event)
        return self._line

    def _point(self, frame: FrameType, event: str) -> None:
        if not self.armed or self.fired or not frame.f_code.co_filename.endswith(IO_FILE):
            return
        self.points += 1
        if self.points == self.at:
            self.fired.append(f"{frame.f_code.co_name}:{frame.f_lineno}:{event}")
            raise Interrupt(self.fired[-1])

    def _second(self, frame: FrameType, event: str, arg: Any) -> None:
        if len(self.fired) != 1:
            return  # before the first, or after the second
        code = frame.f_code
        if code.co_name == "__del__":  # the collector's: Python ignores what it raises
            return
        if event == "call" and code.co_filename.startswith(PACKAGE):
            self.fired.append(f"{code.co_name}:{frame.f_lineno}:entry")
            raise Interrupt("the second, in the clean-up")


def _tick(name: str, alias: str) -> None:
    with contextlib.suppress(LockError):
        lock(f"{name}:tick", using=alias).locked()  # requests carry what is owed
    time.sleep(0.002)  # short: the deadline, not the step, bounds the wait


def _steady(name: str, alias: str) -> str:
    """Every node up and warm, as in the counting run, ticking until they are (5 s at most);
    what is not, if anything. A node a loaded machine's late reply marked down is skipped
    (owed, not sent), and one whose connection an interrupt dropped connects in a thread:
    either makes the release's path in this thread shorter than the one counted."""
    health = backend_of(alias).io.health
    until = time.monotonic() + 5
    while True:
        down = health.down()
        cold = [i for i in range(3) if not health.warm(i)]
        if (not down and not cold) or time.monotonic() >= until:
            return f"down {sorted(down)}, not warm {cold}" if down or cold else ""
        _tick(name, alias)


def _run(name: str, alias: str, clients: list[Any], tracer: FanOutBurst) -> None:
    """Lock ``name``; node 0 is owed the undo of a hold of ``name:other`` left there (an
    undo: only a request to the node pays it, not the collector), and ``name``'s release
    carries that debt to it."""
    backend = backend_of(alias)
    other = lock(f"{name}:other", using=alias, ttl=30, auto_renew=False)
    held = lock(name, using=alias, ttl=30, auto_renew=False)
    assert other.acquire(blocking=False) and held.acquire(blocking=False)
    for client in clients[1:]:
        client.delete(backend.nodes[0].key(f"{name}:other"))
    assert other.token is not None
    op = backend.nodes[0].op_release(f"{name}:other", other.token, Kind())
    backend.io.debts.owe(0, Undo(op.name, op.request, op.parse), "undo")
    sys.setprofile(tracer.profiler)
    sys.settrace(tracer)
    try:
        held.release()
    except Interrupt:
        assert tracer.fired
    finally:
        sys.settrace(None)
        sys.setprofile(None)


@pytest.mark.parametrize("burst", [False, True], ids=["one-interrupt", "a-burst"])
def test_an_interrupt_at_any_line_of_a_release_s_fan_out_leaves_each_node_sent_or_owed(
    redis_factory: Callable[..., RedisServer], name: str, burst: bool
) -> None:
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("fanout", servers, socket_timeout=0.5):
        backend = backend_of("fanout")
        keys = [backend.nodes[0].key(name), backend.nodes[0].key(f"{name}:other")]
        clients = [server.client() for server in servers]  # not a new connection per look
        _run(name, "fanout", clients, FanOutBurst(None, burst))  # connections made
        assert not _steady(name, "fanout")
        counting = FanOutBurst(None, burst)
        _run(name, "fanout", clients, counting)
        points = counting.points
        assert points > 30, points
        failed = []
        for at in range(1, points + 1):
            unsteady = _steady(name, "fanout")  # the path counted, not a shorter one
            tracer = FanOutBurst(at, burst)
            _run(name, "fanout", clients, tracer)
            if not tracer.fired:  # past the last (a run may take a shorter path)
                assert at > points - 5, (at, points, unsteady)
                break
            # Each node got both releases: written, or owed (paid by the next requests).
            until = time.monotonic() + 2
            while (
                left := [(i, k) for i, c in enumerate(clients) for k in keys if c.exists(k)]
            ) and time.monotonic() < until:
                _tick(name, "fanout")
            if left:
                failed.append(f"{tracer.fired}: kept {left}")
                for c in clients:
                    c.delete(*keys)
                if len(failed) == 5:  # enough to say what is wrong (each waited 2 s)
                    break
        assert not failed, failed
