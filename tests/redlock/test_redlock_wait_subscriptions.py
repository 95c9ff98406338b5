"""A Redlock waiter's subscriptions end with its wait on every node, a paused one too."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias


def _channels(server: RedisServer) -> list[bytes]:
    return list(server.client().execute_command("PUBSUB", "CHANNELS", "*"))


def test_a_wait_that_ends_while_a_node_is_paused_leaves_no_subscription_there(
    redis_factory: Callable[..., RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 pauses once the waiter subscribed. Its hub finds it silent, drops the
    connection, and the reader connects again at once (a paused server's kernel accepts),
    redis-py queueing its re-SUBSCRIBE there. The waiter's leave meanwhile only forgot the
    channel ("no subscription left on the server"): the queued SUBSCRIBE ran once the node
    resumed, and the channel stayed subscribed there for good (the hub's record: none)."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("subs", servers, socket_timeout=0.2):
        backend = locks["subs"]
        holder = lock(name, using="subs", ttl=30, auto_renew=False)
        assert holder.acquire(blocking=False)
        assert not lock(name, using="subs").acquire(timeout=0.1)  # the hubs are connected
        hub = backend.hub.hubs[1]
        join = backend.hub.join

        def pausing_join(*args: Any, **kwargs: Any) -> Any:
            out = join(*args, **kwargs)
            until = time.monotonic() + 2
            while not all(_channels(server) for server in servers):  # subscribed
                assert time.monotonic() < until
                time.sleep(0.005)
            servers[1].pause()
            return out

        monkeypatch.setattr(backend.hub, "join", pausing_join)
        silent: list[bool] = []
        try:
            waiter = lock(name, using="subs", ttl=30)
            assert not waiter.acquire(timeout=1.0)  # node 1 found silent meanwhile
            silent.append(hub._silent)
        finally:
            servers[1].resume()
        monkeypatch.undo()
        assert silent == [True]
        time.sleep(0.5)  # what was queued on node 1 has run
        key = backend.nodes[1].key(name)
        left = [c for c in _channels(servers[1]) if key.encode() in c]
        assert not left, f"still subscribed on node 1: {left}"
        assert not hub._forgotten
        holder.release()
