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
from django_redlock.backends.redlock_io import OWED_POLL, Fan
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


def test_a_release_left_behind_by_a_plainly_closed_loop_lands_with_no_next_request(
    redis_factory: Callable[..., RedisServer], name: str, no_collection: Any
) -> None:
    """Node 0 holds every request back (CLIENT PAUSE 300 ms): the acquire is granted by nodes
    1 and 2, node 0's straggles, and the release's write to node 0 goes on behind it in the
    background. The caller closes its loop without cancelling its tasks (the plain
    ``run_until_complete(); close()``, not asyncio.run): the write was owed only by this
    process's next Redlock request, and an idle process makes none: the released hold
    stayed on node 0 to its TTL (30 s). The debt collector owes it, and sends it once the
    node answers again."""
    timeout, held_back_ms = 0.5, 300
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("plainclose", servers, socket_timeout=timeout):
        io = backend_of("plainclose").io
        key = io.nodes[0].key(name)
        mine = lock(name, using="plainclose", ttl=30, auto_renew=False)

        async def main() -> float:
            # Every node connected, its scripts loaded (a NOSCRIPT reply read after the loop
            # closed would leave the acquire itself unsent).
            for n in range(3):
                warm = lock(f"{name}:warm{n}", using="plainclose", auto_renew=False)
                assert await warm.aacquire(blocking=False)
                await warm.arelease()
            await asyncio.sleep(0.1)
            servers[0].client().execute_command("CLIENT", "PAUSE", held_back_ms, "ALL")
            paused = time.monotonic()
            assert await mine.aacquire(blocking=False)  # nodes 1 and 2; node 0's straggles
            await mine.arelease()  # node 0's release goes on behind it
            assert io._open, "node 0's release is under way"
            return paused

        loop = asyncio.new_event_loop()
        try:
            paused = loop.run_until_complete(main())
        finally:
            loop.close()  # its tasks pending: never run again
        unpaused = paused + held_back_ms / 1000
        # No Redlock request from here on. The acquire runs on node 0 once it answers again;
        # waited for up to 5 s (the hold's TTL is 30 s).
        deadline = time.monotonic() + 5
        while (value := servers[0].client().get(key)) is not None:
            assert time.monotonic() < deadline, f"the release never reached node 0: {value!r}"
            time.sleep(0.005)
        landed = time.monotonic() - unpaused
        assert landed < 2 * OWED_POLL + timeout, landed
        assert not any(s.client().exists(key) for s in servers[1:])


@pytest.mark.parametrize("mode", ["kept", "dropped"])
def test_a_release_left_behind_by_an_idle_loop_lands_with_no_next_request(
    redis_factory: Callable[..., RedisServer], name: str, no_collection: Any, mode: str
) -> None:
    """As above, but the caller keeps its loop between jobs (``run_until_complete()`` each,
    never closed), or drops it without ``close()``: node 0's release, queued behind the
    straggling acquire, was sent only when that loop ran again, if ever, and the released
    hold stayed on node 0 to its TTL, the collector polling on (review rr, 2). The
    collector now owes what an idle loop held for longer than a node timeout, and sends it
    once the node answers."""
    timeout, held_back_ms = 0.5, 300
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("idleloop", servers, socket_timeout=timeout):
        io = backend_of("idleloop").io
        key = io.nodes[0].key(name)
        mine = lock(name, using="idleloop", ttl=30, auto_renew=False)

        async def main() -> float:
            for n in range(3):  # every node connected, its scripts loaded
                warm = lock(f"{name}:warm{n}", using="idleloop", auto_renew=False)
                assert await warm.aacquire(blocking=False)
                await warm.arelease()
            await asyncio.sleep(0.1)
            servers[0].client().execute_command("CLIENT", "PAUSE", held_back_ms, "ALL")
            paused = time.monotonic()
            assert await mine.aacquire(blocking=False)  # nodes 1 and 2; node 0's straggles
            await mine.arelease()  # node 0's release goes on behind it
            assert io._open, "node 0's release is under way"
            return paused

        loop: asyncio.AbstractEventLoop | None = asyncio.new_event_loop()
        assert loop is not None
        try:
            paused = loop.run_until_complete(main())
            if mode == "dropped":
                loop = None  # never closed
            unpaused = paused + held_back_ms / 1000
            deadline = time.monotonic() + 5
            while (value := servers[0].client().get(key)) is not None:
                assert time.monotonic() < deadline, f"the release never reached node 0: {value!r}"
                time.sleep(0.005)
            landed = time.monotonic() - unpaused
            assert landed < 1.0 + timeout, landed  # within about a second of answering
            assert not any(s.client().exists(key) for s in servers[1:])
            deadline = time.monotonic() + 2
            while io.debts._collector is not None:  # paid: it stops
                assert time.monotonic() < deadline, "the collector runs on"
                time.sleep(0.02)
            assert not io._open
            if loop is not None:  # it runs again: the task finds its write owed, sent
                loop.run_until_complete(asyncio.sleep(0.05))
                assert not servers[0].client().exists(key)
        finally:
            if loop is not None:
                loop.close()
