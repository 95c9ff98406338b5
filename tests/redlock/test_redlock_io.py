"""The Redlock I/O (backends/redlock_io.py) on real redis-servers: its connection ownership
under exceptions at every line, cold nodes in a fresh process, a lock's validity when it
returns, the drainer beside a paused node, and one script call per node per acquire (issue 30).

Run as ``python -m tests.redlock.test_redlock_io cold URL,URL,...``, this module is a fresh process
whose threads acquire at once.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import linecache
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.backends import owners, redlock_io
from django_redlock.backends.base import Released
from django_redlock.backends.owners import Owner
from django_redlock.backends.redlock import RedlockBackend
from django_redlock.backends.redlock_io import Fan
from django_redlock.testing import RedisServer

from ..campaign.proxy import Proxy
from .test_redlock import quorum_alias, running_long_since

ROOT = Path(__file__).resolve().parents[2]
IO_FILES = ("redlock_io.py", "owners.py", "node_stream.py")


@pytest.fixture
def three(redis_factory: Callable[..., RedisServer]) -> list[RedisServer]:
    return [redis_factory() for _ in range(3)]


def backend_of(alias: str) -> RedlockBackend:
    backend = locks[alias]
    assert isinstance(backend, RedlockBackend)
    return backend


def alias_at(alias: str, urls: list[str], **options: Any) -> Any:
    """A Redlock alias on these URLs (proxies among them)."""
    config = quorum_alias(alias, [], **options)
    config.options["DJANGO_REDLOCK"][alias]["LOCATION"] = urls
    return config


def in_use(pool: Any) -> list[Any]:
    """The connections a redis-py BlockingConnectionPool has handed out and not got back
    (it has no public list of them)."""
    idle = {id(c) for c in list(pool.pool.queue) if c is not None}
    return [c for c in list(pool._connections) if id(c) not in idle]


def stray_connections(backend: RedlockBackend) -> list[Any]:
    """The owners of connections handed out by the nodes' pools that are neither kept nor
    in a lane (a request's, or the pool's own: leaked)."""
    return [
        owners.owner(c)
        for node in backend.nodes
        for c in in_use(node.client.connection_pool)
        if owners.owner(c) is owners.POOL or isinstance(owners.owner(c), Owner)
    ]


def clients(server: RedisServer) -> int:
    """Connections the server has from others than this admin client."""
    return len(server.client().client_list()) - 1


def check_replies(backend: RedlockBackend, tag: str) -> None:
    """Every reply goes to the request it answers: a missing key reads as unlocked, a lock
    taken reads as locked, with our own token (a mixed-up reply would say otherwise)."""
    assert not backend.is_locked(f"missing:{tag}")
    held = lock(f"check:{tag}", using=backend.alias, ttl=10)
    assert held.acquire(blocking=False)
    assert held.locked() and held.owned()
    held.release()
    assert not backend.is_locked(f"check:{tag}")


# -- item 1 of the rule: exceptions at every line where a connection changes owner -------------


class Inject:
    """Raise KeyboardInterrupt at the ``at``-th line this thread runs in the Redlock I/O."""

    def __init__(self, at: int) -> None:
        self.at, self.seen, self.fired = at, 0, False

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.endswith(IO_FILES):
            return None
        # Not at a ``with`` line (leaving the block runs __exit__ there, and an exception a
        # tracer raises before that call skips it: a lock never released) nor at a ``try:``
        # (its no-op may lie outside the enclosing handler's range). An asynchronous
        # exception lands at neither: it is checked at calls and loops' back edges.
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and not self.fired and not code.startswith(("with ", "try:")):
            self.seen += 1
            if self.seen == self.at:
                self.fired = True
                self.where = f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_lineno}"
                raise KeyboardInterrupt(f"injected at {self.where}")
        return self


def test_an_exception_at_any_line_leaves_each_connection_one_owner(
    three: list[RedisServer], redis_factory: Callable[..., RedisServer]
) -> None:
    """Node 2 answers late (behind a proxy), so fan-outs leave it in a lane that the
    drainer or the next fan-out reads: every move of the I/O happens. A KeyboardInterrupt
    at each line in turn: no connection is handed to two owners (the suite checks every move,
    owners.CHECK), every reply then read goes to its request, and no connection leaks."""
    assert owners.CHECK
    slow = Proxy(three[2].port, "slow")
    slow.latency = 0.004
    nodes = [three[0].url, three[1].url, slow.url]
    try:
        with alias_at("inj", nodes, socket_timeout=0.5):
            backend = backend_of("inj")
            check_replies(backend, "warm")
            fired, at = 0, 1
            while True:
                inject = Inject(at)
                sys.settrace(inject)
                try:
                    held = lock(f"n{at % 7}", using="inj", ttl=10)
                    if held.acquire(blocking=False):
                        held.release()
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)
                if not inject.fired:
                    break  # past the last line of a cycle
                fired += 1
                at += 1
                if at % 25 == 0:
                    check_replies(backend, str(at))
            assert fired > 100  # every line of a cycle was hit once
            time.sleep(0.1)  # the lanes drained
            check_replies(backend, "end")
            # No connection leaked: each one the pools count as in use is kept or in a lane
            # (redis-py's pool has no public list of them).
            assert stray_connections(backend) == []
    finally:
        slow.stop()


# -- cold nodes: a fresh process's threads ---------------------------------------------------


def cold(urls: list[str], threads: int) -> None:
    """A fresh process: ``threads`` threads acquire distinct names at once; print outcomes."""
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DJANGO_REDLOCK={
            "default": {
                "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
                "LOCATION": urls,
                "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2},
            }
        },
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
        DJANGO_REDLOCK_METRICS=False,
        USE_TZ=True,
    )
    django.setup()
    outcomes: list[str] = []
    start = threading.Barrier(threads)

    def take(n: int) -> None:
        start.wait()
        try:
            held = lock(f"cold:{os.getpid()}:{n}", ttl=10)
            outcomes.append("acquired" if held.acquire(blocking=False) else "refused")
            held.release()
        except Exception as exc:
            outcomes.append(type(exc).__name__)

    workers = [threading.Thread(target=take, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(json.dumps(outcomes))


def test_a_fresh_process_acquires_on_every_thread(three: list[RedisServer]) -> None:
    """Nodes not connected yet: every thread waits for the connect under way (or connects
    too), none counts a node it did not ask. Healthy nodes: every first acquire succeeds."""
    urls = ",".join(server.url for server in three)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.redlock.test_redlock_io", "cold", urls, "8"]
    outcomes: list[str] = []
    for _ in range(4):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        outcomes += json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes == ["acquired"] * 32


# -- validity when acquire() returns ---------------------------------------------------------


@pytest.fixture
def proxies(three: list[RedisServer]) -> Iterator[list[Proxy]]:
    started = [Proxy(server.port, f"node{i}") for i, server in enumerate(three)]
    yield started
    for proxy in started:
        proxy.stop()


def test_acquire_is_valid_when_it_returns_true(
    three: list[RedisServer], proxies: list[Proxy]
) -> None:
    """Node 0's fence counter is far ahead, so nodes 1 and 2 lag and are raised in a second
    round trip; both answer late (60 ms each way). Each trip alone fits the 200 ms TTL, both
    together do not: acquire() must not return True with the hold expired."""
    urls = [p.url for p in proxies]
    with alias_at("late", urls, socket_timeout=1.0, socket_connect_timeout=1.0):
        backend = backend_of("late")
        check_replies(backend, "warm")
        for attempt in range(3):
            name = f"late{attempt}"
            three[0].client().set(backend.fence_key(name), 10**16, px=60000)
            for proxy in proxies[1:]:
                proxy.latency = 0.06
            held = lock(name, using="late", ttl=0.2)
            started = time.monotonic()
            acquired = held.acquire(blocking=False)
            elapsed = time.monotonic() - started
            for proxy in proxies[1:]:
                proxy.latency = 0.0
            assert not (acquired and elapsed >= 0.2), (attempt, elapsed)


# -- the drainer beside a paused node --------------------------------------------------------


def test_a_late_reply_from_a_healthy_node_is_read_while_another_node_is_paused(
    redis_factory: Callable[..., RedisServer],
) -> None:
    """Node 4 is paused with a lane the drainer waits on; node 3 answers 10 ms late, after
    each fan-out decided. Its lanes are read within a few ms all the same: node 3 never counts
    as slow (it did when the drainer waited only on the lanes it saw when it started)."""
    servers = [redis_factory() for _ in range(5)]
    late = Proxy(servers[3].port, "late")
    try:
        urls = [s.url for s in servers]
        urls[3] = late.url
        with alias_at("drain", urls, socket_timeout=2.0, socket_connect_timeout=2.0):
            backend = backend_of("drain")
            check_replies(backend, "warm")
            servers[4].pause()
            try:
                backend.is_locked("x")  # leaves a lane on node 4: the drainer waits on it
                late.latency = 0.005
                slow_seen = 0
                for n in range(10):
                    backend.is_locked(f"y{n}")  # node 3's reply comes after the decision
                    time.sleep(0.06)  # its lane is read by the drainer, in 10 ms or so
                    slow_seen += 3 in backend.io.slow(time.monotonic(), backend.io.slow_after)
                assert slow_seen == 0
            finally:
                servers[4].resume()
    finally:
        late.stop()


# -- the suspected items ---------------------------------------------------------------------


def test_a_non_connection_error_in_a_send_leaks_no_connection(three: list[RedisServer]) -> None:
    """A request that cannot be packed (TypeError) raises; the connection it took is closed
    and returned, not leaked (the pool would run out after max_connections)."""
    with quorum_alias("bad", three, max_connections=4):
        backend = backend_of("bad")
        check_replies(backend, "warm")
        node = backend.nodes[0]
        for _ in range(12):
            fan = Fan([node.op_pttl("k") for _ in backend.nodes])
            fan[0] = type(fan[0])("k", ("GET", object()), lambda r: r)  # cannot be packed
            with pytest.raises((TypeError, Exception)):
                backend.io.fan_out(fan)
        check_replies(backend, "after")


def test_close_closes_the_kept_connections(three: list[RedisServer]) -> None:
    """The connections kept between fan-outs are closed by close(), not left open."""
    with quorum_alias("kept", three):
        backend = backend_of("kept")
        check_replies(backend, "warm")
        time.sleep(0.05)
        before = [clients(s) for s in three]
        backend.io.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            after = [clients(s) for s in three]
            if all(a < b for a, b in zip(after, before, strict=True)):
                break
            time.sleep(0.02)
        assert all(a < b for a, b in zip(after, before, strict=True)), (before, after)
        check_replies(backend, "again")


def test_a_task_of_a_closed_loop_does_not_make_a_node_slow(three: list[RedisServer]) -> None:
    """An asyncio fan-out leaves node 1 (paused) behind in a task; its event loop is then
    closed without cancelling it, so the task never finishes. The node is not slow for ever
    because of it (the loop is gone: its task says nothing about the node)."""
    with quorum_alias("loop", three, socket_timeout=5.0, socket_connect_timeout=5.0):
        backend = backend_of("loop")
        loop = asyncio.new_event_loop()
        loop.run_until_complete(backend.aexecute(backend.op_locked("warm")))
        three[1].pause()
        try:
            assert not loop.run_until_complete(backend.aexecute(backend.op_locked("x")))
            loop.close()  # node 1's task is left pending
            time.sleep(backend.io.slow_after * 2)
            assert 1 not in backend.io.slow(time.monotonic(), backend.io.slow_after)
        finally:
            three[1].resume()


def test_a_socket_closed_meanwhile_counts_as_ready() -> None:
    import socket

    from django_redlock.backends.redlock_io import readable

    class Conn:
        def __init__(self) -> None:
            self._sock = socket.socket()
            self._sock.close()  # fileno() is -1 now

    assert readable({"a": Conn(), "b": Conn()}, time.monotonic() + 1) == {"a", "b"}


def test_a_move_by_a_non_owner_fails_loudly() -> None:
    class Conn:
        pass

    connection, a, b = Conn(), Owner("a"), Owner("b")
    assert owners.move(connection, owners.POOL, a)
    with pytest.raises(owners.OwnershipError):
        owners.move(connection, b, owners.POOL)  # b never had it
    assert owners.move(connection, a, owners.POOL)
    with pytest.raises(owners.OwnershipError):
        owners.move(connection, a, owners.POOL)  # released twice
    with pytest.raises(owners.OwnershipError):
        owners.using(connection, a)


# -- one round trip per acquire --------------------------------------------------------------


def test_one_script_call_per_node_per_acquire_and_release(
    redis_factory: Callable[..., RedisServer],
) -> None:
    """A healthy cluster: each acquire + release costs one script call per node each (the
    fences agree: no second trip to raise a lagging counter), fences still increasing."""
    servers = [redis_factory() for _ in range(5)]
    running_long_since(servers)
    with quorum_alias("trips", servers):
        check_replies(backend_of("trips"), "warm")
        time.sleep(0.05)  # the warm-up's stragglers are read
        before = [s.script_calls() for s in servers]
        fences = []
        for n in range(50):
            held = lock(f"t{n % 3}", using="trips", ttl=10)
            assert held.acquire(blocking=False)
            fences.append((n % 3, held.fence or 0))
            held.release()
        time.sleep(0.05)
        calls = [s.script_calls() - b for s, b in zip(servers, before, strict=True)]
        assert calls == [100] * 5
        for name in range(3):
            mine = [f for n, f in fences if n == name]
            assert mine == sorted(set(mine))


def test_one_script_call_per_node_per_acquire_of_a_held_name(
    three: list[RedisServer], name: str
) -> None:
    """A name held on every node: the acquire's undo went to every node too, though each
    answered "refused" (it holds nothing of this token), and waited for their replies: two
    script calls per node. Only nodes that granted, or did not answer, are undone."""
    with quorum_alias("busy", three):
        backend = backend_of("busy")
        check_replies(backend, "warm")
        for server in three:
            server.client().set(backend.nodes[0].key(name), "other|1|0|", px=30_000)
        before = three[0].settled_script_calls(*three[1:])
        assert not lock(name, using="busy").acquire(blocking=False)
        after = three[0].settled_script_calls(*three[1:])
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]


def test_a_node_that_forgot_its_scripts_is_taught_before_it_is_asked_again(
    redis_factory: Callable[..., RedisServer],
) -> None:
    """NOSCRIPT (a restart, SCRIPT FLUSH): the node is taught the op's script, then asked
    again: one script call more. Asked again first, it answered NOSCRIPT a second time (3
    calls for an acquire; under libfaketime a node whose warm-up reply came late cost the
    skewed-clock test 42 calls instead of 40)."""
    server = redis_factory()
    with quorum_alias("forgot", [server]):
        check_replies(backend_of("forgot"), "warm")
        for n in range(3):
            server.client().script_flush()
            before = server.script_calls()
            held = lock(f"f{n}", using="forgot", ttl=10)
            assert held.acquire(blocking=False)
            assert server.script_calls() - before == 2  # NOSCRIPT, then the script's run
            server.client().script_flush()
            before = server.script_calls()
            held.release()
            assert server.script_calls() - before == 2
            assert not held.locked()


def test_an_acquirer_whose_clock_runs_ahead_does_not_lift_fences_above_the_nodes_clocks(
    redis_factory: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fences outlive their counter only through the nodes' clocks: a proposal from a client
    whose clock is 120 s ahead, counted in full, made the next fence after the counter was
    forgotten (60 s idle) smaller than this one. Capped at the node's clock + 2 s, the fence
    is below what that node's clock reaches before its counter is forgotten (a minute)."""
    from django_redlock.backends import redlock

    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("ahead", servers):
        monkeypatch.setattr(redlock, "FENCE_LEAD_US", 120_000_000)  # the clock 120 s ahead
        ahead = lock("skew", using="ahead", ttl=10)
        assert ahead.acquire(blocking=False)
        first = ahead.fence
        ahead.release()
        monkeypatch.undo()
        clocks = [s.client().time() for s in servers]
        now_us = max(sec * 1_000_000 + usec for sec, usec in clocks)
        assert first is not None and first <= now_us + 2_000_000
        counters = 0
        for server in servers:  # the name idle until its counter is forgotten
            for key in server.client().keys("*skew*:f"):  # (a node too slow to ask has none)
                assert server.client().pttl(key) > 55_000  # it outlives the cap by far
                counters += 1
            if server.client().keys("*skew*"):
                server.client().delete(*server.client().keys("*skew*"))
        assert counters >= 2  # a majority granted it
        # A minute later, each node's clock alone is above `first`: the next fence is too.
        assert first < min(sec * 1_000_000 + usec for sec, usec in clocks) + 55_000_000


if __name__ == "__main__" and sys.argv[1:2] == ["cold"]:
    cold(sys.argv[2].split(","), int(sys.argv[3]))


# -- a write decided without a node still reaches it -----------------------------------------


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_node_skipped_as_down_is_asked_when_the_others_cannot_make_a_quorum(
    three: list[RedisServer], name: str, driver: str
) -> None:
    """Node 0 counts as down (it answers again, and its breaker's second is not up), then
    node 1 pauses: the acquire asked nodes 1 and 2 only, and when node 1 did not answer
    raised QuorumNotReached while nodes 0 and 2 made a majority. The skipped node is asked
    too once the nodes asked cannot make a quorum, within the same node timeout (1 s here:
    the default 0.1 s is outlasted by a loaded machine's scheduling alone, 0.110 s seen at
    load 13; asking node 0 only after node 1's timeout would take more than one)."""
    with quorum_alias("skipped", three, socket_timeout=1.0, socket_connect_timeout=1.0):
        backend = backend_of("skipped")
        check_replies(backend, "warm")
        backend.io.health.failed(0)
        three[1].pause()
        try:
            held = lock(name, using="skipped", ttl=10, auto_renew=False)
            started = time.monotonic()
            if driver == "sync":
                assert held.acquire(blocking=False)
            else:
                assert asyncio.run(held.aacquire(blocking=False))
            took = time.monotonic() - started
            assert took < backend.io.timeout, f"{took:.3f} s"
        finally:
            three[1].resume()
        held.release()


def _held_on(servers: list[RedisServer], key: str) -> list[RedisServer]:
    return [s for s in servers if s.client().exists(key)]


def test_a_release_decided_without_a_down_node_still_reaches_it(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """5 nodes, holds of 30 s: each of three rounds takes the lock, pauses one node (a
    different one each round) until it counts as down, releases, and resumes it. The release
    was never written to the node skipped as down: three of five nodes kept released holds,
    and a contender was refused the free lock on a healthy cluster for the holds' whole TTL.
    The node is owed the write, sent when it answers again (before it counts as up)."""
    servers = [redis_factory() for _ in range(5)]
    with quorum_alias("owed", servers), quorum_alias("other", servers):
        backend = backend_of("owed")
        key = backend.nodes[0].key(name)
        for paused in range(3):
            deadline = time.monotonic() + 10
            while backend.io.health.down():  # the last round's node is back (its probe)
                assert time.monotonic() < deadline, "a resumed node never came back"
                lock(f"{name}:probe", using="owed").locked()
                time.sleep(0.05)
            holder = lock(name, using="owed", ttl=30, auto_renew=False)
            assert holder.acquire(blocking=False)
            servers[paused].pause()
            try:
                deadline = time.monotonic() + 10
                while not backend.io.health.is_down(paused):  # noticed: skipped from now on
                    assert time.monotonic() < deadline, "the paused node never counted as down"
                    lock(f"{name}:probe", using="owed").locked()
                    time.sleep(0.05)
                holder.release()
            finally:
                servers[paused].resume()
        # Every node healthy again: its debt is paid once it answers (its probe: a second).
        until = time.monotonic() + 5
        while _held_on(servers, key) and time.monotonic() < until:
            time.sleep(0.05)
        assert not _held_on(servers, key), "nodes still hold released holds"
        contender = lock(name, using="other", ttl=30)
        assert contender.acquire(blocking=False)  # at once: nothing left in the way
        contender.release()


def test_a_force_release_decided_without_a_down_node_still_reaches_it(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """An operator's force-release of a stuck hold (its token, as the admin lists it) while
    one node counts as down answered RELEASED and was never written there (not owed, as a
    release is): the hold stayed on that node for its TTL; two such, and the free lock was
    refused to everyone for the hour (review rio, 5). Owed: written when it answers again."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("owed", servers):
        backend = backend_of("owed")
        key = backend.nodes[0].key(name)
        stuck = lock(name, using="owed", ttl=3600, auto_renew=False)
        assert stuck.acquire(blocking=False)
        servers[2].pause()
        try:
            deadline = time.monotonic() + 10
            while not backend.io.health.is_down(2):  # noticed: skipped from now on
                assert time.monotonic() < deadline, "the paused node never counted as down"
                lock(f"{name}:probe", using="owed").locked()
                time.sleep(0.05)
            assert backend.force_release(name, token=stuck.token) is Released.RELEASED
        finally:
            servers[2].resume()
        # Node 2 healthy again: its debt is paid once it answers (its probe: a second).
        until = time.monotonic() + 5
        while _held_on(servers, key) and time.monotonic() < until:
            time.sleep(0.05)
        assert not _held_on(servers, key), "node 2 still holds the force-released hold"


def test_an_acquire_s_undo_reaches_a_node_that_turned_slow_meanwhile(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """An acquire whose votes split beside a paused node leaves its request there (not
    waited for), and its undo found that node slow: skipped, never written, so the grant the
    node made once it ran on stayed for the hold's TTL. The undo is written behind it."""
    servers = [redis_factory() for _ in range(5)]
    with quorum_alias("owed", servers):
        backend = backend_of("owed")
        key = backend.nodes[0].key(name)
        for server in servers[3:]:  # someone holds it on two nodes: ours cannot win
            server.client().set(key, "someone|1|0|", px=30_000)
        check_replies(backend, "warm")
        time.sleep(0.05)
        servers[0].pause()
        try:
            mine = lock(name, using="owed", ttl=30, auto_renew=False)
            assert not mine.acquire(blocking=False)
            time.sleep(0.05)
        finally:
            servers[0].resume()
        until = time.monotonic() + 3
        while _held_on(servers[:3], key) and time.monotonic() < until:
            time.sleep(0.05)
        assert not _held_on(servers[:3], key), "the undo did not reach every node"


def _until_gone(servers: list[RedisServer], key: str, name: str, alias: str) -> None:
    until = time.monotonic() + 15  # a loaded machine: the probe that pays it may come late
    while _held_on(servers, key) and time.monotonic() < until:
        lock(f"{name}:tick", using=alias).locked()  # requests that carry what is owed
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["ALL", "WRITE"])
def test_a_release_written_to_a_node_in_client_pause_still_reaches_it(
    three: list[RedisServer], name: str, mode: str
) -> None:
    """CLIENT PAUSE (what Redis's FAILOVER uses): the paused node reads the release into its
    query buffer and frees it when its connection, overdue, is closed. The release, written
    and never answered, was not owed: the hold stayed on that node for its whole TTL."""
    with quorum_alias("owed", three):
        backend = backend_of("owed")
        key = backend.nodes[0].key(name)
        holder = lock(name, using="owed", ttl=60, auto_renew=False)
        assert holder.acquire(blocking=False)
        three[2].client().execute_command("CLIENT", "PAUSE", 700, mode)
        holder.release()
        time.sleep(0.8)
        _until_gone(three, key, name, "owed")
        assert not _held_on(three, key), "the paused node kept the released hold"


def test_an_async_release_to_a_node_in_client_pause_still_reaches_it(
    three: list[RedisServer], name: str
) -> None:
    with quorum_alias("owed", three):
        backend = backend_of("owed")
        key = backend.nodes[0].key(name)
        holder = lock(name, using="owed", ttl=60, auto_renew=False)

        async def hold_and_release() -> None:
            assert await holder.aacquire(blocking=False)
            three[2].client().execute_command("CLIENT", "PAUSE", 700, "ALL")
            await holder.arelease()
            await asyncio.sleep(0.8)  # the request to the paused node ends meanwhile

        asyncio.run(hold_and_release())
        _until_gone(three, key, name, "owed")
        assert not _held_on(three, key), "the paused node kept the released hold"


def test_an_async_release_to_a_paused_node_is_owed_when_its_event_loop_ends(
    three: list[RedisServer], name: str
) -> None:
    """asyncio.run() returned with the release's request to the paused node pending: the
    loop cancelled it (redis-py dropped its connection, the node freed the unrun command) and
    nothing owed it: the hold stayed on that node for its whole TTL."""
    with quorum_alias("owed", three):
        key = backend_of("owed").nodes[0].key(name)
        holder = lock(name, using="owed", ttl=60, auto_renew=False)
        assert asyncio.run(holder.aacquire(blocking=False))
        three[2].client().execute_command("CLIENT", "PAUSE", 600, "ALL")
        asyncio.run(holder.arelease())  # decided by nodes 0 and 1: returns, cancels the rest
        time.sleep(0.7)
        _until_gone(three, key, name, "owed")
        assert not _held_on(three, key), "the paused node kept the released hold"


def test_a_release_a_busy_node_refused_still_reaches_it(
    three: list[RedisServer], name: str
) -> None:
    """A node busy with a long script answers the release BUSY (it did not run): read
    later by the drainer, that reply was dropped, and the hold stayed for its TTL."""
    with quorum_alias("owed", three):
        backend = backend_of("owed")
        key = backend.nodes[0].key(name)
        holder = lock(name, using="owed", ttl=60, auto_renew=False)
        assert holder.acquire(blocking=False)
        admin = three[2].client(socket_timeout=5)
        admin.config_set("busy-reply-threshold", 50)
        spin = (
            "local t = redis.call('TIME') local s = t[1] + t[2] / 1e6 while true do"
            " local n = redis.call('TIME') if n[1] + n[2] / 1e6 - s > 1 then break end end"
        )
        busy = threading.Thread(target=admin.eval, args=(spin, 0))
        busy.start()
        try:
            time.sleep(0.2)  # past the threshold: the node answers BUSY
            holder.release()
        finally:
            busy.join()
        _until_gone(three, key, name, "owed")
        assert not _held_on(three, key), "the busy node kept the released hold"


def test_a_release_owed_before_a_thousand_more_still_reaches_the_node(
    three: list[RedisServer], name: str
) -> None:
    """Past OWED_MAX writes owed to a down node, the oldest were dropped: the releases of
    holds it took before it stopped answering (those after are of holds taken without it)."""
    with quorum_alias("owed", three):
        backend = backend_of("owed")
        key = backend.nodes[0].key(name)
        holder = lock(name, using="owed", ttl=60, auto_renew=False)
        assert holder.acquire(blocking=False)
        three[2].pause()
        try:
            deadline = time.monotonic() + 10
            while not backend.io.health.is_down(2):
                assert time.monotonic() < deadline, "the paused node never counted as down"
                lock(f"{name}:probe", using="owed").locked()
                time.sleep(0.05)
            holder.release()
            for n in range(1100):
                other = lock(f"{name}:{n % 7}", using="owed", ttl=60, auto_renew=False)
                assert other.acquire(blocking=False)
                other.release()
        finally:
            three[2].resume()
        _until_gone(three, key, name, "owed")
        assert not _held_on(three, key), "the release owed first was dropped"


def test_a_new_connection_to_a_node_paused_since_it_answered_delays_no_other_node(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """A node that answered lately (warm) but has no connection kept was connected in the
    request thread, before the later nodes were sent theirs: paused meanwhile, its handshake
    held the whole fan-out for the node timeout (1 s here). Made in a thread, it costs the
    others nothing."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("sync", servers, socket_timeout=1, socket_connect_timeout=1):
        backend = backend_of("sync")
        check_replies(backend, "warm")
        time.sleep(0.05)
        servers[0].pause()
        try:
            backend.io.close()  # no connection kept; the nodes still count as answering
            assert backend.io.health.warm(0)
            started = time.monotonic()
            held = lock(name, using="sync", ttl=10)
            assert held.acquire(blocking=False)
            assert time.monotonic() - started < 0.5
        finally:
            servers[0].resume()
        held.release()


# -- asyncio: a request behind a node's stragglers waits one node timeout at most -----------


def test_an_async_call_after_a_failed_acquire_beside_a_paused_node_takes_one_timeout(
    three: list[RedisServer], name: str
) -> None:
    """A node paused: an ``aacquire`` whose votes split leaves its request there, and its
    undo is written behind it. The next call that needs that node waited for both (the undo
    sent only once the acquire timed out, then waiting a timeout of its own), then for its
    own request: 3 s for a 1 s socket timeout. It waits for them one timeout at most, and
    the undo, still owed, reaches the node once it answers again."""
    from django_redlock.exceptions import BackendUnavailable, QuorumNotReached

    with quorum_alias("astall", three, socket_timeout=1, socket_connect_timeout=1):
        backend = backend_of("astall")
        key = backend.nodes[0].key(name)
        three[2].client().set(key, "someone|1|0|", px=30_000)  # ours cannot take node 2

        async def run() -> float:
            assert not await lock(f"{name}:warm", using="astall").alocked()
            three[0].pause()
            mine = lock(name, using="astall", ttl=30, auto_renew=False)
            assert not await mine.aacquire(blocking=False)  # node 1 yes, node 2 no, node 0?
            started = time.monotonic()
            with pytest.raises((QuorumNotReached, BackendUnavailable)):
                await lock(name, using="astall").alocked()  # needs node 0's vote
            return time.monotonic() - started

        try:
            elapsed = asyncio.run(run())
        finally:
            three[0].resume()
        assert elapsed < 1.4, f"took {elapsed:.2f} s for a 1 s socket timeout"
        until = time.monotonic() + 10
        while three[0].client().get(key) is not None and time.monotonic() < until:
            lock(f"{name}:tick", using="astall").locked()
            time.sleep(0.05)
        assert three[0].client().get(key) is None, "the undo never reached the paused node"


def test_an_async_try_with_every_node_paused_takes_one_timeout(
    three: list[RedisServer], name: str
) -> None:
    """Every node stopped answering: the acquire waits one node timeout, then its undo (not
    waited for: too few answered) is decided before any reply. The asyncio fan-out waited
    for a first reply all the same, a second node timeout (1.0 s for a 0.5 s timeout; sync
    0.5 s): it asks whether it is decided before its first wait too."""
    from django_redlock.exceptions import LockError

    with quorum_alias("apaused", three, socket_timeout=0.5, socket_connect_timeout=0.5):

        async def run() -> float:
            warm = lock(f"{name}:warm", using="apaused", ttl=10)
            assert await warm.aacquire(blocking=False)
            await warm.arelease()
            for server in three:
                server.pause()
            started = time.monotonic()
            with pytest.raises(LockError):
                await lock(name, using="apaused", ttl=10).aacquire(blocking=False)
            return time.monotonic() - started

        try:
            elapsed = asyncio.run(run())
        finally:
            for server in three:
                server.resume()
        assert elapsed < 0.8, f"took {elapsed:.2f} s for a 0.5 s socket timeout"


# -- time this process did not run is not counted against a node (issue 42) ------------------


def hold_the_gil(seconds: float) -> None:
    """A pause of this whole process (a full garbage collection, CPU starvation): no other
    thread of it runs meanwhile (a PyDLL call keeps the GIL)."""
    ctypes.PyDLL(None).usleep(int(seconds * 1_000_000))


def test_a_connect_whose_thread_could_not_run_is_not_late(
    three: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh process (a node not warm is connected in a thread). This process stalls
    0.3 s while the acquire waits for that connect, past its deadline (0.2 s): the connect's
    thread could not run, yet the connect "did not finish in time", the healthy node was
    marked down (all cold: QuorumNotReached on healthy nodes). A connect found late by as
    long as this process stalled gets as long again."""
    wait = redlock_io.Watch.wait
    stalls: list[float] = []

    def stalling_wait(self: Any, waiting: Any, timeout: float) -> Any:
        io = backend_of("fresh").io
        if io._connectors and not stalls and threading.current_thread() is threading.main_thread():
            stalls.append(time.monotonic())
            hold_the_gil(0.3)
            return set()
        return wait(self, waiting, timeout)

    with quorum_alias("fresh", three, socket_timeout=0.1):
        backend = backend_of("fresh")
        monkeypatch.setattr(redlock_io.Watch, "wait", stalling_wait)
        held = lock(name, using="fresh", ttl=10, auto_renew=False)
        assert held.acquire(blocking=False)
        monkeypatch.undo()
        assert stalls, "no connect was waited for"
        assert backend.io.health.down() == set()
        held.release()


def test_a_connect_whose_thread_started_late_is_not_late(
    three: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A starved process (a fresh one's 250 threads on two cores) runs a connect's thread
    0.3 s after it was started, past the connect's deadline (0.2 s) counted from then: the
    connect "did not finish in time" though it never ran, and the acquire raised
    QuorumNotReached on healthy nodes. The deadline counts from when the thread runs."""

    def late_start(self: redlock_io.Connector) -> None:
        def run() -> None:
            time.sleep(0.3)  # not scheduled yet
            self._run()

        with self._mutex:
            if self._started:
                return
            self._started = True
        threading.Thread(target=run, daemon=True).start()

    with quorum_alias("starved", three, socket_timeout=0.1):
        backend = backend_of("starved")
        monkeypatch.setattr(redlock_io.Connector, "start", late_start)
        held = lock(name, using="starved", ttl=10, auto_renew=False)
        assert held.acquire(blocking=False)
        monkeypatch.undo()
        assert backend.io.health.down() == set()
        held.release()


def test_a_request_sent_after_a_stall_is_not_overdue_at_once(
    three: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's Flight was stamped before its write: this thread stalled 0.3 s between
    (past the 0.1 s timeout), and the reply asked for just then was counted overdue at once:
    "no answer within 0.1 s", a healthy node marked down. Its timeout counts from the write."""
    with quorum_alias("stamp", three, socket_timeout=0.1):
        backend = backend_of("stamp")
        check_replies(backend, "warm")
        pack = redlock_io.pack_many
        sent: list[int] = []

        def stalling_pack(connection: Any, commands: Any) -> Any:
            sent.append(1)
            if len(sent) == 3:  # the last node's write of the acquire
                time.sleep(0.3)
            return pack(connection, commands)

        monkeypatch.setattr(redlock_io, "pack_many", stalling_pack)
        held = lock(name, using="stamp", ttl=10, auto_renew=False)
        assert held.acquire(blocking=False)
        monkeypatch.undo()
        assert len(sent) >= 3
        assert backend.io.health.down() == set()
        held.release()
