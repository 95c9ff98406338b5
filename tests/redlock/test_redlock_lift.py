"""The acquire's second round trip, the lift of the lagging nodes to the holder's fence
(review rio4): a node that pauses after its grant costs the lift nothing while a quorum is
at the fence (its lift is written, its reply read later); a lift that cannot reach a quorum
raises QuorumNotReached within one node timeout, not False ("held") after two or three; and
a lifted node keeps the name's counter as long as the hold, as the acquire does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import QuorumNotReached, lock, locks
from django_redlock.backends.redis import RedisBackend
from django_redlock.backends.redlock import RedlockBackend
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias, running_long_since
from .test_redlock_one_fence_per_hold import lifted_hold, restarted_empty, stored_fence

TIMEOUT = 0.5
SLOW = {"socket_timeout": TIMEOUT, "socket_connect_timeout": TIMEOUT}


@pytest.fixture
def pause_at_lift(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """``armed["server"] = s``: node 1's next lift pauses ``s`` (SIGSTOP) just as it is
    built, after node 1's grant was read; ``armed["at"]``: when. Resumed after the test."""
    armed: dict[str, Any] = {}
    original = RedisBackend.op_raise_fence

    def lift(self: RedisBackend, name: str, fence: int, token: str) -> Any:
        server = armed.pop("server", None)
        if server is not None and self.alias.endswith("[1]"):
            server.pause()
            armed["paused"], armed["at"] = server, time.monotonic()
        elif server is not None:
            armed["server"] = server
        return original(self, name, fence, token)

    monkeypatch.setattr(RedisBackend, "op_raise_fence", lift)
    yield armed
    if "paused" in armed:
        armed["paused"].resume()


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("driver", ["threads", "asyncio"])
def test_a_node_paused_before_its_lift_costs_the_acquire_nothing(
    redis_factory: Callable[..., RedisServer],
    name: str,
    pause_at_lift: dict[str, Any],
    driver: str,
) -> None:
    """Node 0 grants a larger fence, nodes 1 and 2 are lifted; node 1 pauses before its
    lift. Nodes 0 and 2 are at the fence: a quorum. Before: True after the node timeout
    (502 ms of 500); now within a fraction of it, and node 1 gets its lift once it resumes."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("lift", servers, **SLOW):
        backend = locks["lift"]
        assert isinstance(backend, RedlockBackend)
        backend.prepare()  # the scripts loaded, as at startup: a lane drops a NOSCRIPT
        lock(f"{name}:warm", using="lift", ttl=5).acquire(blocking=False)  # connections
        restarted_empty(servers[0])
        held = lock(name, using="lift", ttl=60, auto_renew=False)

        async def warm_then_acquire() -> tuple[bool, float]:
            # This loop's connections first: a connect is not what is measured.
            await lock(f"{name}:awarm", using="lift", ttl=5).aacquire(blocking=False)
            pause_at_lift["server"] = servers[1]
            started = time.monotonic()
            return await held.aacquire(blocking=False), time.monotonic() - started

        if driver == "asyncio":
            got, took = asyncio.run(warm_then_acquire())
        else:
            pause_at_lift["server"] = servers[1]
            started = time.monotonic()
            got = held.acquire(blocking=False)
            took = time.monotonic() - started
        assert "paused" in pause_at_lift, "no lift (node 0's grant came late)"
        assert got and held.fence is not None
        assert took < TIMEOUT / 2, f"{took * 1000:.0f} ms"
        assert stored_fence(servers[2], backend, name) == held.fence
        servers[1].resume()
        del pause_at_lift["paused"]
        # Written, not waited for: node 1 runs its lift once it resumes.
        _until(lambda: stored_fence(servers[1], backend, name) == held.fence)


def test_a_node_paused_before_its_re_fence_lift_costs_nothing(
    redis_factory: Callable[..., RedisServer], name: str, pause_at_lift: dict[str, Any]
) -> None:
    """A re-fence whose largest fence came from node 0 (its counter 1.5 s ahead) lifts nodes
    1 and 2; node 1 pauses before its lift. Before: 505 ms (the node timeout); now not
    waited for."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("refence", servers, **SLOW):
        backend = locks["refence"]
        assert isinstance(backend, RedlockBackend)
        held = lock(name, using="refence", ttl=60, auto_renew=False)
        assert held.acquire(blocking=False) and held.fence is not None and held.token
        ahead = held.fence + 1_500_000
        servers[0].client().set(backend.fence_key(name), f"{ahead}|other", px=60000)
        pause_at_lift["server"] = servers[1]
        started = time.monotonic()
        fence = backend.execute(backend.op_refence(name, held.token, held.fence))
        took = time.monotonic() - started
        assert "paused" in pause_at_lift
        assert fence > ahead
        assert took < TIMEOUT / 2, f"{took * 1000:.0f} ms"
        assert stored_fence(servers[2], backend, name) == fence


@pytest.mark.parametrize("driver", ["threads", "asyncio", "blocking"])
def test_a_quorum_lost_at_the_lift_is_unknown_within_one_node_timeout(
    redis_factory: Callable[..., RedisServer],
    name: str,
    pause_at_lift: dict[str, Any],
    driver: str,
) -> None:
    """Node 2 is down; nodes 0 and 1 grant a free lock with different fences and node 1
    stops answering as it is lifted. Before: False ("held by someone else") after two node
    timeouts (the undo waited for node 1 too); a blocking acquire raised only on its next
    try, three timeouts after. Now QuorumNotReached within about one node timeout."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("lost", servers, **SLOW):
        lock(f"{name}:warm", using="lost", ttl=5).acquire(blocking=False)  # connections
        servers[2].kill()
        restarted_empty(servers[0])
        held = lock(name, using="lost", ttl=60, auto_renew=False)

        raised: list[float] = []  # when the acquire raised (the loop's shutdown after it
        # may still read a straggler's reply: not the caller's wait)

        async def acquire() -> bool:
            pause_at_lift["server"] = servers[1]
            try:
                return await held.aacquire(blocking=False)
            finally:
                raised.append(time.monotonic())

        with pytest.raises(QuorumNotReached):
            if driver == "asyncio":
                asyncio.run(acquire())
            else:
                pause_at_lift["server"] = servers[1]
                if driver == "blocking":
                    held.acquire(timeout=10)
                else:
                    held.acquire(blocking=False)
        took = (raised[0] if raised else time.monotonic()) - pause_at_lift["at"]
        assert took < TIMEOUT * 1.5, f"{took * 1000:.0f} ms after node 1 stopped"


def test_a_lifted_node_keeps_the_counter_as_long_as_the_hold(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """A 1-hour hold whose nodes 1 and 2 were lifted: their counter (the last hold's token
    in it) lived 60 s; now at least the hold's TTL, as on the node that granted the fence."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("long", servers, socket_timeout=0.1, socket_connect_timeout=0.1):
        backend = locks["long"]
        assert isinstance(backend, RedlockBackend)
        held = lifted_hold(servers, "long", name)
        for server in servers:
            client = server.client()
            hold = client.pttl(backend.key(held.name))
            counter = client.pttl(backend.fence_key(held.name))
            # (set from the hold's PTTL as the lift ran: the same end, give or take a ms)
            assert hold > 3_500_000 and counter >= hold - 50
