"""An event loop closed while an asyncio release's fan-out is under way: its tasks never run
again (asyncio.run's shutdown cut short by a second Ctrl-C, one a task re-raises as it is
cancelled, or a loop closed with tasks pending). Their clean-up runs only once the collector
closes them, and they sit in a reference cycle with the closed loop until a full collection.

Before (issue 42, outside review round 5): their writes waited for that collection (the
hold stayed on the nodes meanwhile, for its TTL in a process that makes little garbage), and
the collector running their clean-up while this thread held one of the I/O's plain locks
waited for it for ever. Now what they held is owed by the next Redlock request
(``NodeIO._owe_orphans``), and a clean-up run by the collector takes no lock (deferred to
the next fan-out).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import LockError, lock
from django_redlock.backends.base import Kind
from django_redlock.backends.redlock_io import Fan
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias
from .test_redlock_io import backend_of


@pytest.fixture
def no_collection() -> Iterator[None]:
    """No collection but the test's own (one would close the stuck tasks at any time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stuck_release(name: str, alias: str) -> None:
    """Holds ``name``, starts its release's fan-out on a loop, runs two steps of it (the
    tasks made and started, their requests under way), then closes the loop."""
    backend = backend_of(alias)
    held = lock(name, using=alias, ttl=30, auto_renew=False)
    assert held.acquire(blocking=False) and held.token is not None
    fan = Fan(
        [node.op_release(name, held.token, Kind()) for node in backend.nodes],
        lambda replies: False,  # every reply waited for
        owed="release",
    )
    loop = asyncio.new_event_loop()
    fan_out = loop.create_task(backend.io.afan_out(fan))
    for _ in range(2):
        loop.call_soon(loop.stop)
        loop.run_forever()
    assert not fan_out.done()
    loop.close()  # (asyncio allows it: the tasks stay pending, never run again)


def _held_until(servers: list[RedisServer], key: str, name: str, alias: str) -> list[int]:
    """The nodes still holding ``key`` after up to 2 s of requests (which carry debts)."""
    until = time.monotonic() + 2
    while (left := [i for i, s in enumerate(servers) if s.client().exists(key)]) and (
        time.monotonic() < until
    ):
        with contextlib.suppress(LockError):
            lock(f"{name}:tick", using=alias).locked()
        time.sleep(0.01)
    return left


def test_a_loop_closed_with_a_release_under_way_leaves_it_owed_to_the_next_request(
    redis_factory: Callable[..., RedisServer], name: str, no_collection: Any
) -> None:
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("closedloop", servers, socket_timeout=0.5):
        key = backend_of("closedloop").nodes[0].key(name)
        _stuck_release(name, "closedloop")
        assert [s.client().exists(key) for s in servers] == [1, 1, 1]  # nothing ran
        assert _held_until(servers, key, name, "closedloop") == []


def test_the_collector_closing_a_stuck_fan_out_takes_no_lock_of_the_io(
    redis_factory: Callable[..., RedisServer], name: str, no_collection: Any
) -> None:
    """The collector runs the clean-up of the stuck coroutines in whatever thread allocates,
    here one holding the I/O's locks: it returns, and the release is still owed."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("closedgc", servers, socket_timeout=0.5):
        io = backend_of("closedgc").io
        key = io.nodes[0].key(name)
        _stuck_release(name, "closedgc")

        def collect() -> None:
            with io._mutex, io.debts._lock:
                gc.collect()

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        collector.join(5)
        if collector.is_alive():  # let it go (a plain lock: any thread may), then fail
            for held in (io.debts._lock, io._mutex):
                with contextlib.suppress(RuntimeError):
                    held.release()
            pytest.fail("the collector's clean-up waited for a lock its thread held")
        assert _held_until(servers, key, name, "closedgc") == []
