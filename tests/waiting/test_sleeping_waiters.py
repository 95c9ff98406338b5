"""A waiter asleep between two tries notices a server that stops answering within about one
socket timeout (its hub PINGs the wait's pub/sub connection while anyone waits), and one
that only pauses for less keeps waiting and gets the lock. Real servers, SIGSTOP/SIGCONT."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import BackendUnavailable, lock, lock_all, locks, semaphore
from django_redlock.testing import RedisServer

SOCKET_TIMEOUT = 1.0
MARGIN = 0.5  # the verdict comes a socket timeout after the last message heard; + load


def _alias(alias: str, config: dict[str, object]) -> Any:
    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config})


@pytest.fixture
def one(redis_factory: Callable[..., RedisServer]) -> Iterator[list[RedisServer]]:
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    with _alias("sleepy", config):
        yield [server]


@pytest.fixture
def quorum(redis_factory: Callable[..., RedisServer]) -> Iterator[list[RedisServer]]:
    servers = [redis_factory() for _ in range(3)]
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in servers],
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    with _alias("sleepy", config):
        yield servers


def holder_and_waiter(kind: str, name: str) -> tuple[Any, Callable[[], Any]]:
    """A hold of ``name`` for 60 s (not renewed: no renewal to notice the pause), and a
    blocking take of it with a 30 s timeout, of that kind."""
    if kind == "semaphore":
        held = semaphore(name, 1, using="sleepy", ttl=60, auto_renew=False)
        assert held.acquire()
        wanted = semaphore(name, 1, using="sleepy", ttl=60)
        return held, lambda: wanted.acquire(timeout=30) and wanted
    held = lock(name, using="sleepy", ttl=60, auto_renew=False, fair=kind == "fair")
    assert held.acquire()
    if kind == "lock_all":
        many = lock_all(name, name + ":other", using="sleepy", timeout=30)
        return held, lambda: many.acquire() and many
    waiter = lock(name, using="sleepy", fair=kind == "fair")
    if kind == "async":
        return held, lambda: asyncio.run(waiter.aacquire(timeout=30)) and waiter
    return held, lambda: waiter.acquire(timeout=30) and waiter


def start(take: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(take())
        except BaseException as exc:
            outcome.append(exc)
        outcome.append(time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)  # it tried, subscribed, tried again, and sleeps (the hold has 60 s left)
    assert thread.is_alive()
    return thread, outcome


KINDS = ["lock", "fair", "lock_all", "async", "semaphore"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_sleeping_waiter_raises_within_one_socket_timeout_of_a_pause(
    one: list[RedisServer], name: str, kind: str
) -> None:
    (server,) = one
    held, take = holder_and_waiter(kind, name)
    thread, outcome = start(take)
    paused = time.monotonic()
    server.pause()
    try:
        thread.join(SOCKET_TIMEOUT + 5)
    finally:
        server.resume()
    assert not thread.is_alive(), "the waiter slept on"
    error, ended = outcome
    assert isinstance(error, BackendUnavailable) and error.timed_out, error
    assert ended - paused < SOCKET_TIMEOUT + MARGIN, ended - paused
    held.release()


@pytest.mark.parametrize("kind", ["lock", "fair", "async"])
def test_a_sleeping_waiter_raises_at_once_when_the_server_is_killed(
    one: list[RedisServer], name: str, kind: str
) -> None:
    """SIGKILL closes the connection: the hub's reader fails, every waiter tries again at
    once, and the try is refused."""
    (server,) = one
    held, take = holder_and_waiter(kind, name)
    thread, outcome = start(take)
    killed = time.monotonic()
    server.kill()
    thread.join(SOCKET_TIMEOUT + 5)
    assert not thread.is_alive(), "the waiter slept on"
    error, ended = outcome
    assert isinstance(error, BackendUnavailable), error
    assert ended - killed < SOCKET_TIMEOUT + MARGIN, ended - killed
    del held  # its server is gone: nothing to release


@pytest.mark.parametrize("kind", KINDS)
def test_a_sleeping_waiter_outlives_a_pause_shorter_than_the_socket_timeout(
    one: list[RedisServer], name: str, kind: str
) -> None:
    """Shorter than three quarters of it: the verdict comes one socket timeout after the last
    thing heard, at most a quarter of one (the PING's pace) before the pause."""
    (server,) = one
    held, take = holder_and_waiter(kind, name)
    thread, outcome = start(take)
    for _ in range(2):  # twice: a PING is due and sent while it is paused
        server.pause()
        time.sleep(SOCKET_TIMEOUT * 0.5)
        server.resume()
        time.sleep(0.3)
    assert thread.is_alive(), outcome
    released = time.monotonic()
    held.release()
    thread.join(10)
    got, ended = outcome
    assert not isinstance(got, BaseException), got
    assert ended - released < 1.0  # woken by the release
    got.release()


def test_idle_waiters_cost_one_ping_per_quarter_socket_timeout_whatever_their_number(
    one: list[RedisServer], name: str
) -> None:
    """Commands per second of N idle waiters of a healthy Redis: the PINGs are the hub's
    (one connection per process), not the waiters'; no waiter is woken by them."""
    (server,) = one
    held = lock(name, using="sleepy", ttl=60, auto_renew=False)
    assert held.acquire()

    def take_and_give_back() -> None:
        with lock(name, using="sleepy", timeout=30):
            pass

    threads = [threading.Thread(target=take_and_give_back) for _ in range(20)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    client = server.client()
    client.config_resetstat()
    time.sleep(3.0)
    stats = client.info("commandstats")
    calls = {
        k[len("cmdstat_") :]: v["calls"]
        for k, v in stats.items()
        if not k.startswith(("cmdstat_config", "cmdstat_info"))  # the measuring client's
    }
    # 3 s of silence: a PING each 0.25 s at most (12), and nothing else: no waiter tried.
    assert set(calls) <= {"ping"}, calls
    assert 6 <= calls.get("ping", 0) <= 13, calls
    held.release()
    for thread in threads:
        thread.join(30)


def test_a_sleeping_redlock_waiter_raises_once_a_quorum_stops_answering(
    quorum: list[RedisServer], name: str
) -> None:
    held, take = holder_and_waiter("lock", name)
    thread, outcome = start(take)
    quorum[0].pause()  # one node of three: the others still make a majority
    try:
        time.sleep(SOCKET_TIMEOUT + 1.0)
        assert thread.is_alive(), outcome
        paused = time.monotonic()
        quorum[1].pause()  # now no majority answers
        thread.join(SOCKET_TIMEOUT + 5)
    finally:
        quorum[1].resume()
        quorum[0].resume()
    assert not thread.is_alive(), "the waiter slept on"
    error, ended = outcome
    assert isinstance(error, BackendUnavailable) and error.timed_out, error
    assert ended - paused < SOCKET_TIMEOUT + MARGIN, ended - paused
    held.release()


def test_a_sleeping_redlock_waiter_counts_a_killed_node_as_silent(
    quorum: list[RedisServer], name: str
) -> None:
    """One node killed (its connection fails: no PING to go unanswered), then another
    paused: no majority answers any more, and the waiter raises."""
    _held, take = holder_and_waiter("lock", name)
    thread, outcome = start(take)
    quorum[0].kill()
    try:
        time.sleep(0.5)
        assert thread.is_alive(), outcome  # the other two still make a majority
        paused = time.monotonic()
        quorum[1].pause()
        thread.join(SOCKET_TIMEOUT + 5)
    finally:
        quorum[1].resume()
    assert not thread.is_alive(), "the waiter slept on"
    error, ended = outcome
    assert isinstance(error, BackendUnavailable) and error.timed_out, error
    assert ended - paused < SOCKET_TIMEOUT + MARGIN, ended - paused


def test_a_sleeping_redlock_waiter_outlives_a_node_paused_for_good(
    quorum: list[RedisServer], name: str
) -> None:
    held, take = holder_and_waiter("lock", name)
    thread, outcome = start(take)
    quorum[2].pause()
    try:
        time.sleep(SOCKET_TIMEOUT * 2.5)
        assert thread.is_alive(), outcome
        released = time.monotonic()
        held.release()
        thread.join(10)
    finally:
        quorum[2].resume()
    got, ended = outcome
    assert not isinstance(got, BaseException), got
    assert ended - released < 2.0
    got.release()
    assert locks["sleepy"] is not None


@contextlib.contextmanager
def _cluster_waited_on(name: str) -> Iterator[RedisServer]:
    """A 3-master Redis Cluster as the "sleepy" alias; yields the master of ``name``'s slot."""
    from django_redlock.testing import CLUSTER_ARGS, create_cluster

    nodes = [RedisServer(args=CLUSTER_ARGS).start() for _ in range(3)]
    try:
        create_cluster(nodes)
        config = {
            "BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
            "LOCATION": nodes[0].url,
            "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
        }
        with _alias("sleepy", config):
            client = nodes[0].client()
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", locks["sleepy"].key(name)))
            ranges = client.execute_command("CLUSTER", "SLOTS")
            port = next(int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1]))
            yield next(node for node in nodes if node.port == port)
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):  # a killed one
                node.stop()


@pytest.mark.parametrize("fair", [False, True])
def test_a_sleeping_waiter_on_a_cluster_raises_once_its_lock_s_node_stops_answering(
    name: str, fair: bool
) -> None:
    """Sharded pub/sub (Redis 7+): the waiter listens on the node of its lock's slot, whose
    connection PINGs while it waits."""
    with _cluster_waited_on(name) as owner:
        held, take = holder_and_waiter("fair" if fair else "lock", name)
        thread, outcome = start(take)
        paused = time.monotonic()
        owner.pause()
        try:
            thread.join(SOCKET_TIMEOUT + 5)
        finally:
            owner.resume()
        assert not thread.is_alive(), "the waiter slept on"
        error, ended = outcome
        assert isinstance(error, BackendUnavailable) and error.timed_out, error
        assert ended - paused < SOCKET_TIMEOUT + MARGIN, ended - paused
        held.release()


def test_a_sleeping_redlock_waiter_outlives_its_nodes_pub_sub_connections_being_killed(
    quorum: list[RedisServer], name: str
) -> None:
    """CLIENT KILL of two nodes' pub/sub connections: redis-py connects them again at once
    and the nodes answer, so no node counts as unheard and the wait goes on."""
    held, take = holder_and_waiter("lock", name)
    thread, outcome = start(take)
    for server in quorum[:2]:
        assert server.client().execute_command("CLIENT", "KILL", "TYPE", "pubsub") >= 1
    time.sleep(SOCKET_TIMEOUT * 2.5)
    assert thread.is_alive(), outcome
    held.release()
    thread.join(10)
    got, _ended = outcome
    assert not isinstance(got, BaseException), got
    got.release()


def test_waits_after_a_silent_verdict_work_once_the_connection_is_made_again(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The process's pub/sub connection goes silent (a black-holed idle flow) while Redis
    answers: the waiter of the time raises (it cannot tell), but the hub drops that
    connection, and the later waits sleep on a new one instead of failing for ever."""
    from ..support.proxy import LossyProxy

    server = redis_factory()
    proxy = LossyProxy(server.port)
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": proxy.url,
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    try:
        with _alias("sleepy", config):
            held, take = holder_and_waiter("lock", name)
            thread, outcome = start(take)
            # Its subscription went through the proxy (marked there first), not only 0.5 s
            # passed: one made after the blackhole would pass, the waiter sleeping on.
            deadline = time.monotonic() + 5
            while not server.client().pubsub_channels() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.client().pubsub_channels(), "the waiter never subscribed"
            proxy.blackhole_subscribers()
            thread.join(SOCKET_TIMEOUT + 5)
            assert not thread.is_alive(), "the waiter slept on"  # (not a ValueError below)
            error, _ended = outcome
            assert isinstance(error, BackendUnavailable), error
            for _ in range(2):
                waiter = lock(name, using="sleepy")
                began = time.monotonic()
                assert waiter.acquire(timeout=SOCKET_TIMEOUT * 2) is False
                assert time.monotonic() - began >= SOCKET_TIMEOUT * 2 - 0.1
            thread, outcome = start(lambda: lock(name, using="sleepy").acquire(timeout=10))
            held.release()
            thread.join(10)
            assert outcome[0] is True, outcome
    finally:
        proxy.close()


def test_a_silent_verdict_stands_for_a_waiter_that_looks_after_the_reconnect_is_heard(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The verdict wakes the waiter to raise; the hub drops the silent connection, and its
    reconnect (the server answers) is heard within a few ms. A waiter whose thread looks
    only after that (the GIL, a busy machine: this test looks late on purpose) still finds
    the verdict: taken back, it slept on (and the test above saw it once, a full run's
    waiter neither raising nor returning), while one that looked first raised."""
    from django_redlock.waiters import unheard

    from ..support.proxy import LossyProxy

    server = redis_factory()
    proxy = LossyProxy(server.port)
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": proxy.url,
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    try:
        with _alias("sleepy", config), locks["sleepy"].hub.watch(name) as waiter:
            proxy.blackhole_subscribers()  # watch() returned: the server confirmed it
            # Heard again after the verdict: the reader's notify_all passes the baton (only
            # then: the verdict itself does not, nor a reconnect while unheard).
            deadline = time.monotonic() + SOCKET_TIMEOUT + 5
            while not waiter.baton and time.monotonic() < deadline:
                time.sleep(0.01)
            assert waiter.baton, "no verdict, or no reconnect heard"
            # (Subscribed again by the reconnect; the old connection closed with its socket.)
            assert server.client().pubsub_numsub(name) == [(name.encode(), 1)]
            assert waiter.wait(0), "the verdict did not wake the waiter"
            assert unheard(waiter), "the verdict was taken back before the waiter looked"
    finally:
        proxy.close()


def test_a_sleeping_waiter_on_a_cluster_tries_at_once_when_its_lock_s_node_is_killed(
    name: str,
) -> None:
    """SIGKILL closes the node's sharded pub/sub connection and its reconnect is refused: no
    PING can go unanswered, so the waiters on that node are woken to try, and the try is
    refused (as for a single killed server)."""
    with _cluster_waited_on(name) as owner:
        _held, take = holder_and_waiter("lock", name)
        thread, outcome = start(take)
        killed = time.monotonic()
        owner.kill()
        thread.join(SOCKET_TIMEOUT + 5)
        assert not thread.is_alive(), "the waiter slept on"
        error, ended = outcome
        assert isinstance(error, BackendUnavailable), error
        assert ended - killed < SOCKET_TIMEOUT + MARGIN, ended - killed


@pytest.mark.parametrize("kind", ["lock", "fair"])
def test_a_sleeping_waiter_raises_within_one_socket_timeout_of_the_last_message_heard(
    one: list[RedisServer], name: str, kind: str
) -> None:
    """The bound is one socket timeout from the last thing heard (SPEC), not a quarter more:
    a message is heard (a wake-up for nobody, on the process's inbox), the server pauses at
    once, and the waiter raises within a socket timeout of that message."""
    from django_redlock.identity import process_id

    (server,) = one
    held, take = holder_and_waiter(kind, name)
    thread, outcome = start(take)
    inbox = f"{locks['sleepy'].inbox_prefix}{process_id()}"
    assert server.client().publish(inbox, "nobody.0") == 1  # the hub is subscribed: heard
    heard = time.monotonic()
    time.sleep(0.02)  # read by the hub's reader
    server.pause()
    try:
        thread.join(SOCKET_TIMEOUT + 5)
    finally:
        server.resume()
    assert not thread.is_alive(), "the waiter slept on"
    error, ended = outcome
    assert isinstance(error, BackendUnavailable) and error.timed_out, error
    assert ended - heard < SOCKET_TIMEOUT + 0.15, ended - heard  # (a quarter more: 1.25)
    held.release()


@pytest.mark.parametrize("mode", ["thread", "task", "fair_renewal"])
def test_a_waiters_try_to_a_stopped_server_raises_within_one_socket_timeout(
    one: list[RedisServer], name: str, mode: str
) -> None:
    # The server stops 0.5 s before the waiter's next try (its timer: the hold's expiry; or a
    # fair waiter's place renewal, every 2.5 s). The try, sent after the stop with a socket
    # timeout of its own, raised 1.5 socket timeouts after it; the hub's PING verdict only
    # reaches a waiter asleep. The rule: one socket timeout from the stop, whatever step.
    fair = mode == "fair_renewal"
    holder = lock(name, using="sleepy", ttl=60 if fair else 2.0, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + (2.5 if fair else 2.0)  # the next try
    ended: list[float] = []
    errors: list[BaseException] = []

    def wait() -> None:
        waiter = lock(name, using="sleepy", ttl=10, fair=fair)
        try:
            if mode == "task":
                asyncio.run(waiter.aacquire(timeout=30))
            else:
                waiter.acquire(timeout=30)
        except BackendUnavailable as exc:
            errors.append(exc)
        ended.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(max(0.0, expiry - 0.5 - time.monotonic()))
    server = one[0]
    server.pause()
    stopped = time.monotonic()
    try:
        thread.join(10)
    finally:
        server.resume()
    assert errors, ended
    assert ended[0] - stopped < SOCKET_TIMEOUT + 0.2, ended[0] - stopped


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_waiting_task_s_try_is_answered_though_its_loop_was_busy_past_the_socket_timeout(
    one: list[RedisServer], name: str, fair: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # asyncio.md: the loop's own busyness is not counted against the server. The woken
    # waiter's try goes out, then another task keeps the loop's thread for 1.5 socket
    # timeouts; the healthy server's reply came meanwhile. It raised BackendUnavailable, and
    # the grant was held by nobody to its TTL.
    backend = locks["sleepy"]
    armed: list[bool] = []
    original = backend.aexecute

    async def aexecute(op: Any) -> Any:
        if armed:  # the woken waiter's try
            armed.clear()
            asyncio.get_running_loop().call_soon(time.sleep, 1.5 * SOCKET_TIMEOUT)
        return await original(op)

    monkeypatch.setattr(backend, "aexecute", aexecute)
    holder = lock(name, using="sleepy", ttl=60, auto_renew=False, fair=fair)
    assert holder.acquire()

    async def main() -> Any:
        waiter = lock(name, using="sleepy", ttl=60, fair=fair)
        task = asyncio.create_task(waiter.aacquire(timeout=30))
        await asyncio.sleep(0.5)  # asleep on the hold's TTL
        armed.append(True)
        holder.release()
        got = await task
        if got is True:
            await waiter.arelease()
        return got

    assert asyncio.run(main()) is True


def test_a_waiting_task_s_try_answered_after_it_gave_up_hands_the_grant_back(
    one: list[RedisServer], name: str
) -> None:
    # The server stops before the waiter's try (at the hold's expiry) and resumes after the
    # hub's verdict ended that try (BackendUnavailable) but within the try's own socket
    # timeout: the script ran then and granted the lock. Nobody tries again: the grant was
    # held by nobody to its TTL (30 s), every other waiter kept out.
    (server,) = one
    backend = locks["sleepy"]
    holder = lock(name, using="sleepy", ttl=2.0, auto_renew=False)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + 2.0

    async def main() -> None:
        waiter = lock(name, using="sleepy", ttl=30)
        task = asyncio.create_task(waiter.aacquire(timeout=30))
        # The verdict comes 0.75-1 s after the stop (a PING every quarter socket timeout),
        # the try 0.65 s after it, its own read timeout 1 s after that.
        await asyncio.sleep(max(0.0, expiry - 0.65 - time.monotonic()))
        trips = backend.round_trips
        server.pause()
        try:
            await asyncio.sleep(1.3)
            assert task.done(), "the try outlived the verdict"
        finally:
            server.resume()
        assert backend.round_trips > trips, "no try went out during the stop"
        with pytest.raises(BackendUnavailable):
            await task
        await asyncio.sleep(1.0)  # this loop runs on: the late reply is read

    asyncio.run(main())
    assert backend.inspect(name) is None, "the grant was left held by nobody"
