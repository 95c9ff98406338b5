"""Two first subscribes of one hub at once share the hub's one connection.

redis-py's PubSub takes its connection on its first command and checks for none outside its
lock: two first commands at once (waiters of two locks joining a fresh hub) each took a
connection, and the subscription sent on the one the PubSub did not keep was read by
nobody. Its waiter never heard its confirmation or a release there, and the channel stayed
subscribed on that node for good, after every waiter left (seen as a flaky
test_unsubscribe_across_reconnect under load: the stray subscription was that one).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.testing import RedisServer

from ..redlock.test_redlock import quorum_alias


def _channels(server: RedisServer, part: str) -> list[bytes]:
    found = server.client().execute_command("PUBSUB", "CHANNELS", "*")
    return [c for c in found if part.encode() in c]


def _subscribers(server: RedisServer) -> list[str]:
    """The server's connections that have a subscription."""
    listed = server.client().execute_command("CLIENT", "LIST")
    text = listed.decode() if isinstance(listed, bytes) else listed
    return [line for line in text.splitlines() if " sub=0 " not in line]


@pytest.fixture
def both_take_at_once() -> Iterator[Callable[[Any], None]]:
    """Holds a hub's first connection checkouts until two threads are in one (at most
    1 s): the window in which each finds the PubSub without a connection."""
    restore: list[Callable[[], None]] = []

    def install(pool: Any) -> None:
        barrier = threading.Barrier(2)
        taken = pool.get_connection

        def get_connection(*args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(threading.BrokenBarrierError):  # one at a time: fine
                barrier.wait(timeout=1.0)
            return taken(*args, **kwargs)

        pool.get_connection = get_connection
        restore.append(lambda: delattr(pool, "get_connection"))

    yield install
    for undo in restore:
        undo()


def test_two_first_subscribes_at_once_keep_one_connection_and_hear_both(
    redis_factory: Callable[..., RedisServer],
    name: str,
    both_take_at_once: Callable[[Any], None],
) -> None:
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("first", servers, socket_timeout=1.0):
        backend = locks["first"]
        both_take_at_once(backend.nodes[0].client.connection_pool)  # type: ignore[attr-defined]
        holders = [lock(f"{name}:{i}", using="first", ttl=30, auto_renew=False) for i in (0, 1)]
        assert all(h.acquire(blocking=False) for h in holders)
        got: dict[int, object] = {}

        def wait(i: int) -> None:
            waiter = lock(f"{name}:{i}", using="first", ttl=5, auto_renew=False)
            got[i] = waiter.acquire(timeout=10)
            if got[i]:
                waiter.release()

        threads = [threading.Thread(target=wait, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        until = time.monotonic() + 5
        while len(_channels(servers[0], name)) < 2 and time.monotonic() < until:
            time.sleep(0.02)
        assert len(_channels(servers[0], name)) == 2  # both subscribed on node 0
        assert len(_subscribers(servers[0])) == 1, _subscribers(servers[0])
        for holder in holders:
            holder.release()
        for thread in threads:
            thread.join(15)
        assert got == {0: True, 1: True}
        until = time.monotonic() + 3
        while _subscribers(servers[0]) and time.monotonic() < until:
            time.sleep(0.02)  # every waiter left: nothing subscribed on the node
        assert not _subscribers(servers[0])
