"""A backend closed while its waiters sleep (``locks.close_all()``, a settings change) stays
in use: its next call makes a new client and a new hub. A waiter asleep on the closed hub
is woken once by the close; it must then watch on the new hub, or no release reaches it and
it sleeps until the hold's expiry (7.2 s after a release, the hold's TTL 8 s)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.exceptions import BackendUnavailable
from django_redlock.locking import steps
from django_redlock.testing import RedisServer
from django_redlock.waiting import PubSubHub

from ..locks.test_faults import _alias


@pytest.mark.parametrize("mode", ["plain", "fair", "async"])
def test_a_waiter_asleep_when_the_backend_closes_is_woken_by_the_next_release(
    name: str, mode: str
) -> None:
    fair = mode == "fair"
    backend = locks["default"]
    holder = lock(name, ttl=8, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    waiter = lock(name, ttl=8, fair=fair)
    got: list[float] = []

    def take() -> None:
        if mode == "async":
            taken = asyncio.run(waiter.aacquire(timeout=3))
        else:
            taken = waiter.acquire(timeout=3)
        if taken:
            got.append(time.monotonic())

    thread = threading.Thread(target=take)
    thread.start()
    time.sleep(0.3)  # it tried, watches, and sleeps on the hold's TTL
    old = backend.hub
    backend.close()
    time.sleep(0.3)  # woken by the close, it tried again and sleeps again
    assert backend.hub is not old
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got, "the waiter slept through the release"
    assert got[0] - released < 1.0, got[0] - released
    waiter.release()
    hub = backend.hub
    assert not any(hub._waiters.values()), hub._waiters


def test_close_hands_the_leaves_it_owes_to_the_next_hub(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    # A waiter whose wait ended on the hub's PING verdict (the server paused) sent no leave:
    # its hub owes it, run at the wake-up the server still sends its id. close() must hand
    # that leave to the backend's next hub: else the next release wakes the dead id, nobody
    # here takes it out, and the live waiter sleeps to the hold's TTL (7.4 s of 8 before).
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 1.0},
    }
    with _alias("owed", config):
        backend = locks["owed"]
        holder = lock(name, using="owed", ttl=8, auto_renew=False)
        assert holder.acquire(blocking=False)
        failed: list[BaseException] = []

        def first() -> None:
            try:
                lock(name, using="owed", ttl=8).acquire(timeout=20)
            except BackendUnavailable as exc:
                failed.append(exc)

        thread = threading.Thread(target=first)
        thread.start()
        time.sleep(0.3)  # registered, asleep
        server.pause()
        try:
            thread.join(5)
        finally:
            server.resume()
        assert failed, "the wait did not end on the paused server"
        client = server.client()
        assert client.zcard(backend.waiting_key(name)) == 1  # its leave was not sent
        backend.close()
        waiter = lock(name, using="owed", ttl=8)
        got: list[float] = []

        def second() -> None:
            if waiter.acquire(timeout=10):
                got.append(time.monotonic())

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        released = time.monotonic()
        holder.release()
        thread.join(12)
        assert got and got[0] - released < 1.0, [g - released for g in got]
        waiter.release()


def test_a_redlock_close_hands_each_nodes_owed_leaves_to_its_next_hub(
    redis_factory: Callable[..., RedisServer],
) -> None:
    servers = [redis_factory() for _ in range(3)]
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in servers],
    }
    with _alias("owedq", config):
        backend = locks["owedq"]
        ran = threading.Event()
        backend.hub.abandon("p.gone", ran.set)
        backend.close()
        hubs = backend.hub.hubs
        assert all("p.gone" in hub._abandoned for hub in hubs)
        hubs[1].notify("p.gone")  # the wake-up, heard on one node: its leave runs
        assert ran.wait(5)


def test_a_redlock_close_does_not_wait_for_idle_readers(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """A waiter woken and gone leaves each node's reader with no channel subscribed: it
    waits in redis-py for a subscription, not on its socket, so the close's shutdown did not
    wake it, and the close waited a read's wait (a quarter of the socket timeout, 0.5 s) per
    node: 2.5 s for five. Now the close wakes each at once."""
    servers = [redis_factory() for _ in range(5)]
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in servers],
        "OPTIONS": {"socket_timeout": 2.0},
    }
    with _alias("idleq", config):
        holder = lock(name, using="idleq", ttl=30, auto_renew=False)
        assert holder.acquire()
        threading.Timer(0.2, holder.release).start()
        waiter = lock(name, using="idleq", ttl=30, auto_renew=False)
        assert waiter.acquire(timeout=10)  # each node's reader started, then left idle
        waiter.release()
        started = time.monotonic()
        locks["idleq"].close()
        assert time.monotonic() - started < 1.5  # 2.5 s before (0.5 s a node)


def test_close_lets_an_asyncio_command_in_flight_finish(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    # A thread's command keeps its connection through close() (it closes when done); an
    # asyncio task's lost it: the dropped client's closer was finalised and disconnected
    # the connection in use, and arelease() on a healthy server raised "Connection closed
    # by server", the hold left to its TTL. Its connection is still closed once done.
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 0.5},
    }
    with _alias("inflight", config):
        backend = locks["inflight"]
        held = lock(name, using="inflight", ttl=30, auto_renew=False)
        admin = server.client()

        async def flow() -> None:
            assert await held.aacquire(blocking=False)
            admin.execute_command("CLIENT", "PAUSE", "300", "ALL")
            await asyncio.sleep(0.05)
            closing = threading.Timer(0.1, backend.close)
            closing.start()
            try:
                await held.arelease()  # answered once the pause ends
            finally:
                closing.join()
            # The loop lives on (a server's): the closed client's connection is closed
            # once no command can still be using it (2 socket timeouts and 1 s), not kept.
            until = time.monotonic() + 4
            while len(admin.client_list()) > 1 and time.monotonic() < until:
                await asyncio.sleep(0.1)
            assert len(admin.client_list()) == 1, admin.client_list()

        asyncio.run(flow())
        assert not admin.exists(backend.key(name))


def _private(
    redis_factory: Callable[..., RedisServer], alias: str, timeout: float
) -> tuple[RedisServer, Any]:
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": timeout},
    }
    return server, _alias(alias, config)


def _wait_across_a_close(name: str, alias: str, mode: str, release_after: float) -> float:
    """A waiter of ``name``: how long after the holder's release it got the lock."""
    holder = lock(name, using=alias, ttl=30, auto_renew=False)
    assert holder.acquire(blocking=False)
    waiter = lock(name, using=alias, ttl=10)
    got: list[object] = []

    def take() -> None:
        try:
            if mode == "async":
                got.append(asyncio.run(waiter.aacquire(timeout=8)))
            else:
                got.append(waiter.acquire(timeout=8))
            got.append(time.monotonic())
        except Exception as exc:
            got.append(exc)

    thread = threading.Thread(target=take)
    thread.start()
    time.sleep(release_after)
    released = time.monotonic()
    holder.release()
    thread.join(12)
    assert got and got[0] is True, got
    waiter.release()
    return float(got[1]) - released  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_wait_joining_a_hub_closed_before_its_join_moves_to_the_next_hub(
    redis_factory: Callable[..., RedisServer],
    name: str,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # close() between the watch's opening (on the backend's hub) and its join: the join
    # on the closed hub started a pub/sub connection and a reader that stopped at once,
    # nobody read the confirmation, and the wait raised "did not confirm the wait's
    # subscription" after a socket timeout, on a healthy server.
    _, settings = _private(redis_factory, "closedjoin", 1.0)
    with settings:
        backend = locks["closedjoin"]
        entering = steps._Watching.__enter__ if mode == "sync" else steps._Watching.__aenter__
        closed: list[object] = []

        def close_first(self: Any) -> Any:
            if not closed:
                closed.append(backend.hub)
                backend.close()  # a close_all() from another thread, landing here
            return entering(self)

        monkeypatch.setattr(steps._Watching, entering.__name__, close_first)
        assert _wait_across_a_close(name, "closedjoin", mode, 1.5) < 1.0
        assert closed and not closed[0]._pubsub  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_wait_whose_confirmation_is_pending_at_close_moves_to_the_next_hub(
    redis_factory: Callable[..., RedisServer],
    name: str,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The inbox's SUBSCRIBE on its way (its answer 0.3 s late: a CLIENT PAUSE) when close()
    # runs: the wait waited for the closed hub's confirmation, which never came.
    server, settings = _private(redis_factory, "closedsetup", 2.0)
    with settings:
        backend = locks["closedsetup"]
        admin = server.client()
        subscribing = PubSubHub._subscribe_inbox
        fired = threading.Event()

        def slow_subscribe(self: PubSubHub) -> Any:
            if not fired.is_set():
                fired.set()
                self._ensure_started().subscribe("warm")  # connected: the SUBSCRIBE is sent
                time.sleep(0.1)
                admin.execute_command("CLIENT", "PAUSE", "300", "ALL")
                threading.Timer(0.1, backend.close).start()
            return subscribing(self)

        monkeypatch.setattr(PubSubHub, "_subscribe_inbox", slow_subscribe)
        assert _wait_across_a_close(name, "closedsetup", mode, 2.5) < 1.0
        assert fired.is_set()
