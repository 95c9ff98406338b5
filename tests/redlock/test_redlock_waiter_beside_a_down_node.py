"""A Redlock waiter whose try is refused by a holder on some nodes, granted on a node the hold
missed, and unanswered on the rest (down) sleeps: it does not poll (docs/topics/waiting.md:
"A waiter sends Redis no commands while it waits")."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from django_redlock import LockError, lock
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias
from .test_redlock_io import backend_of


def test_a_waiter_beside_a_down_node_of_the_holder_s_majority_does_not_poll(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The holder's majority: nodes 0 and 2; node 1 restarted empty, then node 2 stopped.
    The waiter's grant on node 1 looked like a split vote (only refusals that came count as
    the holder's): it backed off 5-50 ms, and its undo there published a release that woke
    it at once: about 2,000 tries a second for the whole hold."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("beside", servers, socket_timeout=0.5):
        backend = backend_of("beside")
        holder = lock(name, using="beside", ttl=30, auto_renew=False)
        assert holder.acquire(blocking=False)
        servers[1].restart()  # back empty (no restart guard: the default)
        until = time.monotonic() + 5
        while backend.io.health.down() and time.monotonic() < until:
            lock(f"{name}:tick", using="beside").locked()
            time.sleep(0.05)
        servers[2].pause()
        try:
            waiter = lock(name, using="beside", ttl=30)
            with contextlib.suppress(LockError):  # node 2 found down on the way
                assert not waiter.acquire(blocking=False)
            before = servers[1].script_calls()
            assert not waiter.acquire(timeout=1.5)
            calls = servers[1].script_calls() - before
        finally:
            servers[2].resume()
        assert calls <= 12, f"{calls} script calls on node 1 in 1.5 s: the waiter polled"
        holder.release()


def test_a_waiter_refused_by_a_grant_since_undone_beside_a_down_node_is_not_stranded(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """Node 2 down, another contender's grant on node 0 (it lost the vote): the waiter
    cannot tell it from a holder of nodes 0 and 2. The contender's undo wakes nobody; the
    waiter looks again within about a breaker period, not at the grant's TTL (30 s)."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("undone", servers, socket_timeout=0.5):
        backend = backend_of("undone")
        assert not lock(f"{name}:warm", using="undone").locked()
        key = backend.nodes[0].key(name)
        servers[0].client().set(key, "contender|1|0|", px=30_000)
        servers[2].pause()
        try:
            waiter = lock(name, using="undone", ttl=30)
            with contextlib.suppress(LockError):  # node 2 found down on the way
                assert not waiter.acquire(blocking=False)
            servers[0].client().delete(key)  # the contender's undo: no release published
            started = time.monotonic()
            assert waiter.acquire(timeout=5)
            elapsed = time.monotonic() - started
        finally:
            servers[2].resume()
        assert elapsed < 2.5, f"the waiter took {elapsed:.2f} s"
        waiter.release()
