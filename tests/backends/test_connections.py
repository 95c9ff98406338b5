"""Each thread runs its lock commands on a connection of its own (made once, not checked out
of the pool per command): what that must survive. A fork, a thread's end, a pool smaller than
the threads, a server restarted between two commands, a command that starts while the thread's
connection is mid-command (a finalizer, a signal handler)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import BackendUnavailable, fast_path, lock, locks
from django_redlock.testing import RedisServer


@contextmanager
def _alias(alias: str, server: RedisServer, **options: object) -> Iterator[None]:
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
              "OPTIONS": options}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config}):
        yield


def _names_connected(admin: Any) -> int:
    """Clients connected, counted on the test's one admin connection (a new client per count
    would add a connection of its own until collected)."""
    return len(admin.client_list())


def test_a_forked_child_never_speaks_on_its_parents_socket(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    with _alias("own", redis_factory()):
        _fork_while_held(name, "own")


def _fork_while_held(name: str, using: str) -> None:
    held = lock(name, using=using, auto_renew=False)
    held.acquire()  # this thread's connection (a Redlock's kept node connections) exists now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # Replies read on a shared socket would be the parent's (or the parent would read
            # these): each answer must be this child's own.
            for i in range(100):
                other = lock(f"{name}:child:{i}", using=using, auto_renew=False)
                assert other.acquire(blocking=False) and other.fence is not None
                other.release()
            assert not lock(name, using=using).acquire(blocking=False)
            code = 0
        finally:
            os.write(write, b"x")
            os._exit(code)
    for i in range(100):  # meanwhile, the parent goes on on its own connections
        assert held.owned(), i
    os.read(read, 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    held.release()
    assert not held.locked()


def test_more_threads_than_the_pool_has_connections(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    with _alias("small", server, max_connections=2, socket_timeout=1.0):
        errors: list[BaseException] = []
        start = threading.Barrier(12)

        def work(i: int) -> None:
            try:
                start.wait(timeout=10)
                for _ in range(30):
                    with lock(f"{name}:{i}", using="small", auto_renew=False):
                        pass
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []


def test_threads_that_end_leave_their_connections_to_new_threads(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    # A thread per request (runserver, gevent): no connection per request, and no more kept
    # than fast_path.SPARES when many threads end at once.
    server = redis_factory()
    with _alias("own", server):
        lock(name, using="own", auto_renew=False).acquire(blocking=False)
        admin = server.client()
        before = _names_connected(admin)

        def take(i: int) -> None:
            with lock(f"{name}:{i}", using="own", auto_renew=False):
                pass

        for i in range(30):  # one after another: each takes the last one's connection
            thread = threading.Thread(target=take, args=(i,))
            thread.start()
            thread.join(timeout=30)
        assert _names_connected(admin) <= before + 1
        start = threading.Barrier(40)

        def crowd(i: int) -> None:
            start.wait(timeout=10)
            take(i)

        threads = [threading.Thread(target=crowd, args=(i,)) for i in range(40)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert _names_connected(admin) <= before + fast_path.SPARES + 1


def test_a_restart_between_two_commands_costs_nothing(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory(persist=True)
    with _alias("restarted", server):
        for i in range(3):
            held = lock(f"{name}:{i}", using="restarted", auto_renew=False)
            held.acquire()
            server.restart()  # the thread's socket is closed by the time the next one is sent
            held.release()
            assert not held.locked()


def test_a_command_while_the_thread_s_connection_is_busy(
    redis_server: RedisServer, name: str
) -> None:
    # A finalizer or a signal handler may run a lock command in the middle of another one on
    # the same thread: it must not write on the connection whose reply is awaited.
    backend = locks["default"]
    pool = backend.client.connection_pool  # type: ignore[attr-defined]
    assert lock(name).acquire(blocking=False)
    bound = fast_path._bound(pool)
    assert bound.claim.acquire(False)  # as a command in flight holds it
    try:
        other = lock(f"{name}:other", auto_renew=False)
        assert other.acquire(blocking=False) and other.owned()
        other.release()
    finally:
        bound.claim.release()
    assert lock(name).locked()


def test_a_forked_child_never_speaks_on_its_parents_redlock_sockets(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend",
              "LOCATION": [redis_factory().url for _ in range(3)]}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "three": config}):
        _fork_while_held(name, "three")


def test_closing_the_backend_closes_every_thread_s_lock_connection(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    with _alias("own", server):
        admin = server.client()
        gc.collect()  # the server's readiness check's client, say: it would go during the test
        before = _names_connected(admin)
        held = lock(name, using="own", auto_renew=False)
        held.acquire()
        done, go = threading.Event(), threading.Event()

        def hold_on() -> None:  # a thread that is still alive when the backend closes
            with lock(f"{name}:other", using="own", auto_renew=False):
                done.set()
                go.wait(timeout=30)

        thread = threading.Thread(target=hold_on)
        thread.start()
        assert done.wait(timeout=30)
        assert _names_connected(admin) >= before + 2
        go.set()
        thread.join(timeout=30)
        held.release()
        locks["own"].close()
        assert _names_connected(admin) <= before


def test_closing_the_backend_leaves_no_pub_sub_socket_to_the_collector(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The pub/sub reader is mid-read when the backend closes: its failed read reconnects
    (redis-py 8's failure callback) unless close() waits for it. Nothing may be left open
    for the garbage collector, round after round (seen with redis-py 8.2: 1-4 of 8)."""
    server = redis_factory()
    with _alias("own", server, socket_timeout=2.0):
        holder = lock(f"{name}:holder", using="own", auto_renew=False)
        gc.collect()
        before = len(os.listdir("/proc/self/fd"))
        gc.disable()  # only close() may close them
        try:
            for _ in range(8):
                holder.acquire()
                waiter = lock(f"{name}:holder", using="own", auto_renew=False)
                assert not waiter.acquire(timeout=0.05)  # subscribes: the reader starts
                holder.release()
                locks["own"].close()
                left = len(os.listdir("/proc/self/fd"))
                assert left <= before, (left, before)
        finally:
            gc.enable()


def test_closing_the_backend_closes_its_pub_sub_connection(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The hub's reader thread, woken by close() taking its connection away, reconnected
    it (redis-py's failure callback) after close() had handed it back: the socket stayed
    open until the garbage collector found it (8 rounds left 1-4 open)."""
    server = redis_factory()
    with _alias("own", server):
        admin = server.client()
        gc.collect()
        before = _names_connected(admin)
        gc.disable()  # what is left open must be closed by close(), not collected
        try:
            for _ in range(8):
                holder = lock(name, using="own", auto_renew=False)
                assert holder.acquire(blocking=False)
                waiter = lock(name, using="own", auto_renew=False)
                assert not waiter.acquire(timeout=0.1)  # subscribed: the hub reads
                holder.release()
                locks["own"].close()
            time.sleep(0.5)  # a reader's reconnect would be made by now
            assert _names_connected(admin) <= before, [c["cmd"] for c in admin.client_list()]
        finally:
            gc.enable()


def _kill_lock_connections(admin: Any) -> None:
    """The server closes its clients' command connections (not admin's, not pub/sub's), and
    the event loop does not run before the next call: its EOF is not read yet (a loop busy
    meanwhile, or run once per call)."""
    assert admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") >= 1
    time.sleep(0.05)  # (on the loop: it waits)


def test_an_async_connection_the_server_closed_while_idle_costs_nothing(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    admin = server.client()

    async def scenario() -> None:
        held = lock(f"{name}:held", using="killed", ttl=30, auto_renew=False)
        assert await held.aacquire(blocking=False)
        _kill_lock_connections(admin)
        await held.arelease()  # not left held until its TTL
        assert not await held.alocked()
        _kill_lock_connections(admin)
        fresh = lock(f"{name}:fresh", using="killed", ttl=30, auto_renew=False)
        assert await fresh.aacquire(blocking=False)
        await fresh.arelease()

    with _alias("killed", server, socket_timeout=1.0):
        asyncio.run(scenario())


def test_an_async_connection_past_the_server_s_idle_timeout_costs_nothing(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    admin = server.client()

    async def scenario() -> None:
        held = lock(f"{name}:held", using="idle", ttl=30, auto_renew=False)
        assert await held.aacquire(blocking=False)
        clients = len(admin.client_list())
        admin.config_set("timeout", 1)  # (whole seconds: closed 1 to 2 s idle, and a cron's)
        try:
            give_up = time.monotonic() + 5
            while len(admin.client_list()) >= clients and time.monotonic() < give_up:
                time.sleep(0.1)  # (on the loop: it waits)
        finally:
            admin.config_set("timeout", 0)
        assert len(admin.client_list()) < clients  # the lock's idle connection was closed
        await held.arelease()
        fresh = lock(f"{name}:fresh", using="idle", ttl=30, auto_renew=False)
        assert await fresh.aacquire(blocking=False)
        await fresh.arelease()

    with _alias("idle", server, socket_timeout=1.0):
        asyncio.run(scenario())


def test_an_async_call_after_the_connections_were_cut_on_a_paused_server_takes_one_timeout(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    admin = server.client()
    timeout = 0.5

    async def scenario() -> float:
        warm = lock(f"{name}:warm", using="cut", ttl=30, auto_renew=False)
        assert await warm.aacquire(blocking=False)
        _kill_lock_connections(admin)
        server.pause()  # the reconnect's TCP connect succeeds (the kernel), its handshake waits
        try:
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await lock(name, using="cut").aacquire(blocking=False)
            return time.monotonic() - started
        finally:
            server.resume()

    with _alias("cut", server, socket_timeout=timeout, socket_connect_timeout=timeout):
        took = asyncio.run(scenario())
    assert timeout - 0.05 < took < timeout + 0.4, took


def _cut_pooled_async_connections(using: str) -> int:
    """The server closes each idle connection of ``using``'s asyncio pool (CLIENT KILL ADDR:
    only those, on a server other tests share), and the event loop does not run meanwhile."""
    import redis

    pool = locks[using].aclient.connection_pool  # type: ignore[attr-defined]
    cut = 0
    for conn in list(pool._available_connections):
        sock = conn._writer.transport.get_extra_info("socket")
        host, port = sock.getsockname()[:2]
        with redis.Redis(host=conn.host, port=conn.port, **_auth(conn)) as admin:
            admin.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}")  # (or raises)
        cut += 1
    time.sleep(0.05)  # (on the loop: it waits)
    return cut


def _auth(conn: Any) -> dict[str, Any]:
    return {"username": conn.username, "password": conn.password}


@pytest.mark.parametrize("using", ["cache", "sentinel"])
def test_an_async_connection_the_server_closed_while_idle_costs_nothing_on_each_backend(
    using: str, request: pytest.FixtureRequest, name: str
) -> None:
    if using == "sentinel":
        request.getfixturevalue("_sentinel_alias")

    async def scenario() -> None:
        held = lock(f"{name}:held", using=using, ttl=30, auto_renew=False)
        assert await held.aacquire(blocking=False)
        assert _cut_pooled_async_connections(using) >= 1
        await held.arelease()  # not left held until its TTL
        assert not await held.alocked()
        assert _cut_pooled_async_connections(using) >= 1
        fresh = lock(f"{name}:fresh", using=using, ttl=30, auto_renew=False)
        assert await fresh.aacquire(blocking=False)
        await fresh.arelease()

    asyncio.run(scenario())
