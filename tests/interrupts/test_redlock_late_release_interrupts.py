"""An interrupt (KeyboardInterrupt, a signal handler's exception) at every line of a Redlock
release's late ask (the node skipped as down, asked once the nodes asked cannot make a quorum),
or as its second phase starts: that node is still sent the release or owed it.

An interrupt while the release waited for that node's connect (or just before) left it neither
sent nor owed: the released hold stayed there for its whole TTL (issue 42, item 3).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import LockError, lock
from django_redlock.backends import redlock_io
from django_redlock.testing import RedisServer

from ..campaign.proxy import Proxy
from ..redlock.test_redlock import quorum_alias
from ..redlock.test_redlock_io import IO_FILES, alias_at, backend_of, check_replies


class LateInject:
    """Raise KeyboardInterrupt at the ``at``-th line this thread runs in the Redlock I/O
    once ``NodeIO._ask_late`` has been entered, until node 2's op is in a Flight or owed
    (not at ``with``/``try:`` lines: see
    tests/redlock/test_redlock_io.py's Inject)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen, self.armed, self.fired = at, 0, False, False
        self.entered = False
        self.where = ""

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.endswith(IO_FILES):
            return None
        if event == "call" and frame.f_code.co_name == "_ask_late" and not self.entered:
            self.armed = self.entered = True
        done = event == "return" and frame.f_code.co_name in ("_send", "_unsent")
        if done and frame.f_locals.get("i") == 2:  # node 2's op in a Flight, or owed
            self.armed = False
        if event == "line" and self.armed and not self.fired:
            import linecache

            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            if not code.startswith(("with ", "try:")):
                self.seen += 1
                if self.seen == self.at:
                    self.fired = True
                    self.where = f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_lineno}"
                    raise KeyboardInterrupt(f"injected at {self.where}")
        return self


def _tick(name: str, alias: str = "late") -> None:
    with contextlib.suppress(LockError):
        lock(f"{name}:tick", using=alias).locked()  # requests carry what is owed
    time.sleep(0.01)


def _quiet(backend: Any, name: str) -> None:
    """Nothing owed, no node down, every node warm: the next release asks nodes 0 and 1."""
    io, until = backend.io, time.monotonic() + 5
    while (
        io.debts.any
        or io.health.down()
        or io.slow(time.monotonic(), io.slow_after)
        or not all(io.health.warm(i) for i in range(3))
    ):
        assert time.monotonic() < until, "the nodes never settled"
        _tick(name)


@pytest.fixture
def slow_node(
    redis_factory: Callable[..., RedisServer],
) -> Iterator[tuple[list[RedisServer], Proxy]]:
    servers = [redis_factory() for _ in range(3)]
    proxy = Proxy(servers[1].port, "slow")
    try:
        yield servers, proxy
    finally:
        proxy.stop()


def test_an_interrupt_in_a_release_s_late_ask_leaves_no_node_neither_sent_nor_owed(
    slow_node: tuple[list[RedisServer], Proxy], name: str
) -> None:
    """Node 1 answers late (a proxy: slow, not down), node 2 counts as down (its breaker's
    second not up): the release asks 0 and 1, finds node 1 slow and asks node 2 late, on a
    connect made in a thread (node 2 has no connection it knows to work). A KeyboardInterrupt
    at each line in turn from there: every node's hold is still deleted, at once."""
    servers, proxy = slow_node
    with alias_at("late", [servers[0].url, proxy.url, servers[2].url], socket_timeout=0.5):
        backend = backend_of("late")
        key = backend.nodes[0].key(name)
        check_replies(backend, "warm")
        backend.io.health.breaker = 0.2  # a node counted down is probed again soon
        fired, at, misses = 0, 1, 0
        while True:
            proxy.latency = 0.0
            _quiet(backend, name)
            held = lock(name, using="late", ttl=30, auto_renew=False)
            assert held.acquire(blocking=False)
            assert servers[2].client().exists(key)
            backend.io.health.failed(2)  # down: skipped, and not warm (connected in a thread)
            proxy.latency = 0.1  # node 1 slow (past slow_after), never overdue (0.5 s)
            inject = LateInject(at)
            sys.settrace(inject)
            try:
                held.release()
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
                proxy.latency = 0.0
            if not inject.entered:  # (the release asked no node late: a setup that went wrong)
                misses += 1
                assert misses < 5, "the release never asked node 2 late"
                continue
            if not inject.fired:
                break  # past the last line of the late ask's release
            fired += 1
            # Each node got the release: written, or owed (paid by the next requests, or by
            # node 2's probe).
            until = time.monotonic() + 3
            while (left := [i for i, s in enumerate(servers) if s.client().exists(key)]) and (
                time.monotonic() < until
            ):
                _tick(name)
            assert not left, f"interrupt at {inject.where}: nodes {left} kept the released hold"
            at += 1
        assert fired > 20, fired  # the late ask's lines were each hit once
        proxy.latency = 0.0
        check_replies(backend, "end")


def test_an_interrupt_as_a_release_s_second_phase_starts_leaves_the_node_owed(
    redis_factory: Callable[..., RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 2 counts as down, node 1 lost the hold: the first phase (nodes 0 and 1) cannot
    decide, so the second asks node 2. An interrupt as that phase starts left node 2's
    release PENDING, neither sent nor owed (fan_out owed only the nodes still skipped)."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("phase2", servers, socket_timeout=0.5):
        backend = backend_of("phase2")
        backend.io.health.breaker = 0.2  # a node counted down is probed again soon
        key = backend.nodes[0].key(name)
        held = lock(name, using="phase2", ttl=30, auto_renew=False)
        assert held.acquire(blocking=False)
        servers[1].client().delete(key)  # node 1 restarted empty
        backend.io.health.failed(2)
        ask = redlock_io.NodeIO._ask
        asked: list[list[int]] = []

        def interrupted_second(self: Any, fan: Any, indexes: list[int], replies: Any) -> None:
            asked.append(list(indexes))
            if len(asked) == 2:
                raise KeyboardInterrupt("as the second phase starts")
            ask(self, fan, indexes, replies)

        monkeypatch.setattr(redlock_io.NodeIO, "_ask", interrupted_second)
        with pytest.raises(KeyboardInterrupt):
            held.release()
        monkeypatch.undo()
        assert asked == [[0, 1], [2]]
        until = time.monotonic() + 3
        while servers[2].client().exists(key) and time.monotonic() < until:
            _tick(name, "phase2")
        assert not servers[2].client().exists(key), "node 2 kept the released hold"
