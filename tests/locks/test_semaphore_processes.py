"""Semaphores and read-write locks across real processes on one Redis: peak concurrency,
crashed and paused holders, and waiters woken one per freed permit without polling."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import locks, read_write_lock, semaphore
from django_redlock.testing import RedisServer

from ..conftest import Child


def _calls(server: RedisServer, command: str = "evalsha") -> int:
    stats = server.client().info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0))


def _all_calls(server: RedisServer) -> dict[str, int]:
    stats = server.client().info("commandstats")
    # Not INFO (ours), nor a connection's handshake (HELLO, CLIENT SETINFO): no polling.
    skip = {"cmdstat_info", "cmdstat_hello", "cmdstat_client|setinfo", "cmdstat_client"}
    return {k: int(v.get("calls", 0)) for k, v in stats.items() if k not in skip}


def _keys_of(server: RedisServer, name: str) -> set[str]:
    """The keys of ``name`` (SCAN; the name may hold glob characters: filtered here)."""
    return {k for k in (k.decode() for k in server.client().scan_iter(count=1000))
            if f"{{{name}}}" in k}  # fmt: skip


def test_peak_is_the_limit_across_processes(
    redis_server: RedisServer, child: Callable[..., Child], redis_alias: str, name: str
) -> None:
    start = f"{name}:start"
    args = ["--name", name, "--start", start, "--limit", "3", "--rounds", "25"]
    children = [child("sem_cycles", *args, backend=redis_alias) for _ in range(8)]
    client = redis_server.client()
    client.set(start, 1)
    for each in children:
        each.expect("DONE")
    peaks = [int(p) for p in client.lrange(f"{name}:peaks", 0, -1)]
    assert len(peaks) == 8 * 25
    assert max(peaks) == 3  # reached, never exceeded
    fences = [int(f) for f in client.lrange(f"{name}:fences", 0, -1)]
    assert len(set(fences)) == len(fences) == 8 * 25 and min(fences) > 0
    assert client.lrange(f"{name}:bad", 0, -1) == []
    assert semaphore(name, 3, using=redis_alias).available() == 3
    # Nothing left but the fence counter (and this test's own bookkeeping).
    assert _keys_of(redis_server, name) == {locks[redis_alias].fence_key(name)}


def test_fences_increase_in_grant_order(redis_alias: str, name: str) -> None:
    fences = []
    for _ in range(20):
        with semaphore(name, 3, using=redis_alias) as held:
            fences.append(held.fence)
    assert fences == sorted(fences) and len(set(fences)) == 20


@pytest.fixture(params=["redis", "cache", "sentinel", "cluster"])
def remote(
    request: pytest.FixtureRequest, child: Callable[..., Child]
) -> tuple[str, Callable[..., Child]]:
    """A single-master backend shared by this process and its children, and how to start a
    child on it."""
    alias = str(request.param)
    if alias == "cluster":
        nodes = request.getfixturevalue("cluster_nodes")
        request.getfixturevalue("_cluster_alias")
        return alias, lambda *args: child(*args, url=nodes[0].url, backend="cluster")
    if alias == "sentinel":
        group = request.getfixturevalue("sentinel_group")
        request.getfixturevalue("_sentinel_alias")
        sentinels = ",".join(s.url for s in group[2:])
        return alias, lambda *args: child(*args, backend="sentinel", nodes=sentinels)
    return alias, lambda *args: child(*args, backend=alias)


def test_killed_holder_permit_returns_at_its_ttl(
    remote: tuple[str, Callable[..., Child]], name: str
) -> None:
    redis_alias, spawn = remote
    holder = spawn("lease", "--name", name, "--limit", "1", "--ttl", "1")
    holder.expect("ACQUIRED")
    sem = semaphore(name, 1, using=redis_alias)
    assert not sem.acquire(blocking=False)
    holder.signal(signal.SIGKILL)
    killed = time.monotonic()
    assert sem.acquire(timeout=5)
    waited = time.monotonic() - killed
    # At its TTL (renewed up to the kill), not at a later look: a margin for a loaded machine.
    assert waited < 1 + 1.0, waited
    sem.release()


def test_paused_holder_loses_its_permit_alone(
    remote: tuple[str, Callable[..., Child]], name: str
) -> None:
    redis_alias, spawn = remote
    other = semaphore(name, 2, using=redis_alias, ttl=30)
    other.acquire()
    paused = spawn("lease", "--name", name, "--limit", "2", "--ttl", "0.6")
    paused.expect("ACQUIRED")
    paused.signal(signal.SIGSTOP)
    sem = semaphore(name, 2, using=redis_alias, ttl=30)
    try:
        assert sem.acquire(timeout=5)  # given the paused holder's permit at its TTL
    finally:
        paused.signal(signal.SIGCONT)
    paused.send("release")
    assert paused.expect("NOT_OWNED") == "LockLost"
    assert other.owned() and sem.owned()
    assert len(sem.holders()) == 2
    other.release()
    sem.release()


def test_release_wakes_one_waiter_per_permit_without_polling(
    redis_factory: Callable[..., RedisServer], child: Callable[..., Child], name: str
) -> None:
    # A server of its own: the session's carries the Celery worker's and other tests' traffic,
    # and this test counts every command the server gets.
    own = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": own.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "own": config}):
        holders = [semaphore(name, 3, using="own") for _ in range(3)]
        for h in holders:
            h.acquire()
        waiters = []
        for _ in range(5):
            waiter = child("lease", "--name", name, "--limit", "3", url=own.url)
            waiter.expect("WAITING")
            waiters.append(waiter)
        deadline = time.monotonic() + 10
        while (info := locks["own"].inspect(name)) is None or info.waiters < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = _all_calls(own)
        time.sleep(1.0)
        after = _all_calls(own)
        during = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k)}
        # No polling: only each waiting process's hub PINGs its wait's connection, once a
        # quarter socket timeout without a message (docs/topics/waiting.md), whatever the
        # number of its waiters: 5 processes, 2 a second each with the 2 s default (+ slack).
        pings = during.pop("cmdstat_ping", 0)
        assert during == {} and pings <= 5 * 5, (during, pings)
        before = _calls(own)
        released = time.time()
        holders[0].release()
        holders[1].release()
        woken: list[float] = []
        deadline = time.monotonic() + 10
        while len(woken) < 2:  # whichever two are woken
            assert time.monotonic() < deadline, [w.seen for w in waiters]
            for waiter in waiters:
                line = waiter.poll()
                if line is not None and line.startswith("ACQUIRED"):
                    woken.append(float(line.split()[2]))
            time.sleep(0.001)
        assert len(woken) == 2
        # Woken by the release (milliseconds, or a loaded machine's latency), not by their own
        # look every WAITER_LEASE / 2 = 2.5 s.
        assert max(woken) - released < 0.5, max(woken) - released
        time.sleep(0.3)
        # Two releases and two acquires: the other three waiters never tried.
        assert _calls(own) - before == 4
        info = locks["own"].inspect(name)
        assert info is not None and info.waiters == 3 and info.hold_count == 3
        holders[2].release()


def test_dead_reader_frees_at_its_ttl(remote: tuple[str, Callable[..., Child]], name: str) -> None:
    redis_alias, spawn = remote
    reader = spawn("lease", "--name", name, "--kind", "read", "--ttl", "1")
    reader.expect("ACQUIRED")
    writer = read_write_lock(name, using=redis_alias).write()
    assert not writer.acquire(blocking=False)
    reader.signal(signal.SIGKILL)
    killed = time.monotonic()
    assert writer.acquire(timeout=5)
    assert time.monotonic() - killed < 1 + 1.0  # at its TTL (a margin for a loaded machine)
    writer.release()
