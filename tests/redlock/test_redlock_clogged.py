"""Redlock beside a clogged node (SIGSTOPped: GC, swap, a black-holed network), and releases
that need a node which just failed (issue 22, items 2 and 3).

A quorum never needs the clogged node, so no operation may wait for its socket timeout: the
tests give the nodes a long timeout (SLOW_NODE s) and check that no operation, in this
process or in processes started after the pause, took anywhere near as long. Run as
``python -m tests.redlock.test_redlock_clogged sell ...``, this module is one of those processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from django_redlock import QuorumNotReached, lock, locks
from django_redlock.backends.redlock import BREAKER_SECONDS, RedlockBackend
from django_redlock.backends.redlock_io import OWED_POLL
from django_redlock.testing import RedisServer

from ..campaign.proxy import Proxy
from .test_redlock import quorum_alias

ROOT = Path(__file__).resolve().parents[2]
#: The node socket timeout in the tests of "never waited for": far above any healthy
#: operation, even on a loaded machine, so one wait for the paused node cannot go unseen.
SLOW_NODE = 6.0


@pytest.fixture
def nodes(redis_factory: Callable[..., RedisServer]) -> Iterator[list[RedisServer]]:
    servers = [redis_factory() for _ in range(5)]
    yield servers
    for server in servers:
        server.resume()


def cycles(alias: str, count: int) -> float:
    """Take and release a lock ``count`` times; the longest acquire + release, in seconds."""
    worst = 0.0
    for i in range(count):
        started = time.monotonic()
        held = lock(f"cycle:{i % 3}", using=alias, ttl=10)
        assert held.acquire(blocking=False)
        held.release()
        worst = max(worst, time.monotonic() - started)
    return worst


def holders(servers: list[RedisServer], backend: RedlockBackend, name: str) -> list[bool]:
    return [bool(server.client().exists(backend.key(name))) for server in servers]


# -- item 2: a paused minority node costs nothing ---------------------------------------------


def test_a_paused_node_is_never_waited_for(nodes: list[RedisServer]) -> None:
    with quorum_alias("slow", nodes, socket_timeout=SLOW_NODE, socket_connect_timeout=SLOW_NODE):
        cycles("slow", 3)  # connected
        nodes[1].pause()
        worst = cycles("slow", 40)
        # A wait for the paused node would take SLOW_NODE: a majority always answered first.
        assert worst < SLOW_NODE / 3
        backend = locks["slow"]
        assert isinstance(backend, RedlockBackend)
        held = lock("p", using="slow", ttl=30)
        assert held.acquire(blocking=False)
        assert held.owned() and held.locked()
        assert held.ttl() is not None
        held.extend(30)
        held.release()
        nodes[1].resume()
        # Its recovery is noticed: it votes again (the key is there right after an acquire).
        deadline = time.monotonic() + 20
        while True:
            held = lock("back", using="slow", ttl=30)
            assert held.acquire(blocking=False)
            there = holders(nodes, backend, "back")
            held.release()
            if there[1]:
                break
            assert time.monotonic() < deadline, "the resumed node was never used again"
            time.sleep(0.1)


def test_async_operations_do_not_wait_for_a_paused_node(nodes: list[RedisServer]) -> None:
    import asyncio

    async def rounds(count: int) -> float:
        worst = 0.0
        for _ in range(count):
            started = time.monotonic()
            held = lock("a", using="slow", ttl=10)
            assert await held.aacquire(blocking=False)
            assert await held.aowned()
            await held.arelease()
            worst = max(worst, time.monotonic() - started)
        return worst

    with quorum_alias("slow", nodes, socket_timeout=SLOW_NODE, socket_connect_timeout=SLOW_NODE):

        async def main() -> float:
            await rounds(2)
            nodes[3].pause()
            return await rounds(20)

        assert asyncio.run(main()) < SLOW_NODE / 3


def test_the_breaker_lets_a_paused_node_cost_a_process_nothing(nodes: list[RedisServer]) -> None:
    """With the default node timeout, the paused node is asked (probed) about once per
    breaker period, not once per operation."""
    with quorum_alias("q", nodes):
        cycles("q", 3)
        before = nodes[2].client().info("stats")["total_connections_received"]
        nodes[2].pause()
        started = time.monotonic()
        count = 0
        while time.monotonic() - started < 3 * BREAKER_SECONDS:
            cycles("q", 5)
            count += 5
        paused_for = time.monotonic() - started
        nodes[2].resume()
        after = nodes[2].client().info("stats")["total_connections_received"]
    # Each probe opens a connection (they wait in the paused server's backlog); operations
    # open none to it. The fixture's own client adds one.
    probes = paused_for / BREAKER_SECONDS + 1
    assert count >= 20
    assert after - before <= probes + 2, (after - before, count)


# -- item 2 across processes: sellers started while a node is paused --------------------------


def sell(node_urls: list[str], store_url: str, timeout: float, wait: float) -> None:
    """One seller process: sell tickets under the lock until none is left; print JSON."""
    import django
    import redis
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DJANGO_REDLOCK={
            "default": {
                "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
                "LOCATION": node_urls,
                "OPTIONS": {"socket_timeout": timeout, "socket_connect_timeout": timeout},
            }
        },
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
        DJANGO_REDLOCK_METRICS=False,
        USE_TZ=True,
    )
    django.setup()
    from django_redlock import LockError, LockNotAcquired

    store = redis.Redis.from_url(store_url, socket_timeout=30)
    sold, unknown, gave_up, worst = 0, 0, 0, 0.0
    while True:
        started = time.monotonic()
        try:
            with lock("tickets", ttl=5, timeout=wait):
                worst = max(worst, time.monotonic() - started)
                left = int(store.get("stock") or 0)
                if left <= 0:
                    break
                time.sleep(0.0005)  # widen the race window the lock must close
                store.set("stock", left - 1)
                store.rpush("sold", left)
                sold += 1
        except LockNotAcquired:
            gave_up += 1
        except LockError:  # unknown (a node too slow on a loaded machine): try again
            unknown += 1
            time.sleep(0.05)
    print(json.dumps({"sold": sold, "unknown": unknown, "gave_up": gave_up, "worst": worst}))


def sale(
    nodes: list[RedisServer], store: RedisServer, timeout: float, wait: float, tickets: int
) -> list[dict[str, Any]]:
    store.client().set("stock", tickets)
    urls = ",".join(server.url for server in nodes)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.redlock.test_redlock_clogged", "sell", urls, store.url]
    sellers = [
        subprocess.Popen(
            [*command, str(timeout), str(wait)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(5)
    ]
    try:
        results = [json.loads(seller.communicate(timeout=240)[0]) for seller in sellers]
    finally:
        for seller in sellers:
            if seller.poll() is None:
                seller.kill()
                seller.wait()
    ledger = sorted(int(ticket) for ticket in store.client().lrange("sold", 0, -1))
    assert ledger == list(range(1, tickets + 1))  # none oversold, none lost
    return results


@pytest.mark.timeout(300)
def test_processes_started_beside_a_paused_node_never_wait_for_it(
    nodes: list[RedisServer], redis_server: RedisServer
) -> None:
    nodes[4].pause()  # before any seller connects: each meets it at its first operation
    results = sale(nodes, redis_server, SLOW_NODE, 60.0, 60)
    assert sum(r["sold"] for r in results) == 60
    assert max(r["worst"] for r in results) < SLOW_NODE / 3, results
    assert not any(r["gave_up"] for r in results)


@pytest.mark.timeout(300)
def test_waiters_beside_a_dead_and_a_paused_node_do_not_give_up(
    nodes: list[RedisServer], redis_server: RedisServer
) -> None:
    nodes[0].kill()
    nodes[1].pause()  # 3 of 5 left: every one of them is needed
    results = sale(nodes, redis_server, 0.1, 30.0, 60)
    assert sum(r["sold"] for r in results) == 60
    assert not any(r["gave_up"] for r in results), results


# -- item 3: a release waits for a node whose vote it needs ------------------------------------

#: Item 3's nodes: behind a proxy that delays every reply by LATENCY (so a reply is never
#: there "at once"), well within their socket timeout.
TIMEOUT, LATENCY = 0.6, 0.05


@pytest.fixture
def proxied(redis_factory: Callable[..., RedisServer]) -> Iterator[list[Proxy]]:
    proxies = [Proxy(redis_factory().port, f"node{i}") for i in range(5)]
    yield proxies
    for proxy in proxies:
        proxy.stop()


def fail_once(proxy: Proxy, call: Callable[[], object]) -> None:
    """``call`` gets no answer from this node (a black hole past the timeout); then the node
    answers again, though never at once."""
    proxy.black_hole(TIMEOUT + 0.4)
    with pytest.raises(QuorumNotReached):
        call()
    time.sleep(max(0.0, proxy.black_hole_until - time.monotonic()) + 0.05)
    proxy.latency = LATENCY


def test_a_release_right_after_a_node_failure_on_one_node(proxied: list[Proxy]) -> None:
    with quorum_alias("one", proxied[:1], socket_timeout=TIMEOUT):
        held = lock("r", using="one", ttl=30)
        assert held.acquire()
        fail_once(proxied[0], held.locked)  # the node now counts as down
        held.release()  # its vote is needed: it is asked, and waited for
        assert not locks["one"].is_locked("r")


def test_a_release_right_after_an_extend_failed(proxied: list[Proxy]) -> None:
    with quorum_alias("one", proxied[:1], socket_timeout=TIMEOUT):
        held = lock("e", using="one", ttl=30, auto_renew=False)
        assert held.acquire()
        fail_once(proxied[0], lambda: held.extend(30))
        held.release()
        assert not locks["one"].is_locked("e")


def test_a_release_waits_for_the_node_whose_vote_decides(proxied: list[Proxy]) -> None:
    with quorum_alias("q", proxied, socket_timeout=TIMEOUT):
        backend = locks["q"]
        assert isinstance(backend, RedlockBackend)
        for proxy in proxied[3:]:  # someone else holds it there: our hold is on 0, 1, 2
            server = redis.Redis(port=proxy.upstream_port)
            server.set(backend.key("d"), 'other|7|0|{"h":"elsewhere"}', px=30000)
        held = lock("d", using="q", ttl=30)
        # Every free node is needed: a try would give up on one that answers late on a
        # loaded machine (it did in a fresh-clone run); a blocking acquire tries again.
        assert held.acquire(timeout=10)
        fail_once(proxied[2], held.owned)  # 2 yes, 2 no, node 2 unknown: down now
        held.release()  # 2 released and 2 not: node 2 decides, so it is asked
        left = [redis.Redis(port=p.upstream_port).exists(backend.key("d")) for p in proxied]
        assert left == [0, 0, 0, 1, 1]


if __name__ == "__main__" and sys.argv[1:2] == ["sell"]:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sell(sys.argv[2].split(","), sys.argv[3], float(sys.argv[4]), float(sys.argv[5]))


def script_gets(server: RedisServer) -> int:
    """GETs run, by scripts too: every release script reads its key once."""
    return int(server.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def test_a_release_to_a_node_that_forgot_its_scripts_runs_once(nodes: list[RedisServer]) -> None:
    """NOSCRIPT: the node is taught the script and asked again, once. The release was also
    owed back as "not proven to have run", so it ran twice, and when the owed copy came first
    the release's own reply was "token gone": LockLost for a lock released cleanly (a
    fresh-clone CI failure)."""
    with quorum_alias("flushed", nodes[:1], socket_timeout=2):
        server = nodes[0]
        for i in range(4):
            held = lock(f"f{i}", using="flushed", ttl=30, auto_renew=False)
            assert held.acquire(blocking=False)
            server.client().script_flush()
            before = script_gets(server)
            held.release()
            time.sleep(3 * OWED_POLL + 0.2)  # an owed copy would have been paid by now
            assert script_gets(server) - before == 1
            assert not server.client().exists(locks["flushed"].key(f"f{i}"))
