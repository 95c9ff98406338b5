"""Faults with real processes: paused and killed holders, flushed scripts, restarted servers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.test import override_settings

from django_redlock import BackendUnavailable, LockNotOwned, lock, lock_all, locks
from django_redlock.backends.base import Renewal
from django_redlock.testing import RedisServer

from ..conftest import Child
from ..support.settings import redlock_settings

pytestmark = pytest.mark.django_db(transaction=False)


def test_ticket_sale_never_oversells(
    redis_alias: str, redis_server: RedisServer, child: Callable[..., Child]
) -> None:
    client = redis_server.client()
    sellers = [
        child(
            "sell", "--name", "tickets", "--stock", "stock", "--ledger", "sold", backend=redis_alias
        )
        for _ in range(6)
    ]
    for seller in sellers:  # a seller that started late on a busy box found nothing left
        seller.expect("READY")
    client.set("stock", 200)
    sold = [int(seller.expect("SOLD").split()[0]) for seller in sellers]
    ledger = [int(ticket) for ticket in client.lrange("sold", 0, -1)]
    assert sum(sold) == 200
    assert sorted(ledger) == list(range(1, 201))  # every ticket exactly once
    assert int(client.get("stock")) == 0
    assert sum(1 for n in sold if n) >= 2  # the processes really competed


def test_paused_holder_loses_the_lock_safely(
    redis_alias: str, child: Callable[..., Child], name: str
) -> None:
    holder = child("hold", "--name", name, "--ttl", "0.6", backend=redis_alias)
    old_fence = int(holder.expect("ACQUIRED"))
    holder.signal(signal.SIGSTOP)  # a GC pause, a VM migration: longer than the TTL
    try:
        time.sleep(1.0)
        new = lock(name, using=redis_alias, ttl=30)
        assert new.acquire(blocking=False)
        assert new.fence is not None and new.fence > old_fence
    finally:
        holder.signal(signal.SIGCONT)
    assert "released by someone else" in holder.expect("LOST")  # the watchdog noticed
    holder.send("release")
    assert holder.expect("NOT_OWNED") in ("LockNotOwned", "LockLost")
    assert new.owned()  # the stale release left the new hold intact
    new.release()


def test_paused_holder_without_watchdog_cannot_release_the_new_hold(
    redis_alias: str, child: Callable[..., Child], name: str
) -> None:
    holder = child("hold", "--name", name, "--ttl", "0.5", "--no-renew", backend=redis_alias)
    old_fence = int(holder.expect("ACQUIRED"))
    holder.signal(signal.SIGSTOP)
    time.sleep(0.7)
    new = lock(name, using=redis_alias)
    assert new.acquire(blocking=False) and new.fence is not None and new.fence > old_fence
    holder.signal(signal.SIGCONT)
    holder.send("release")
    assert holder.expect("NOT_OWNED") == "LockLost"
    assert new.owned()
    new.release()


def test_killed_holder_frees_the_lock_after_its_ttl(
    redis_alias: str, child: Callable[..., Child], name: str
) -> None:
    holder = child("hold", "--name", name, "--ttl", "1.0", backend=redis_alias)
    holder.expect("ACQUIRED")
    time.sleep(0.5)  # let the watchdog renew once
    holder.signal(signal.SIGKILL)
    killed = time.monotonic()
    waiter = lock(name, using=redis_alias)
    assert waiter.acquire(timeout=5)
    assert time.monotonic() - killed < 1.0 + 0.3
    waiter.release()


# What the measuring client itself sends (connection handshake, INFO, stats reset).
OBSERVER_COMMANDS = {"cmdstat_info", "cmdstat_hello", "cmdstat_client", "cmdstat_config"}


def _command_calls(server: RedisServer) -> dict[str, int]:
    stats = server.client().info("commandstats")
    return {
        k[len("cmdstat_") :]: v["calls"] for k, v in stats.items() if k not in OBSERVER_COMMANDS
    }


def _commands(server: RedisServer) -> int:
    return sum(_command_calls(server).values())


@pytest.mark.parametrize("wait", [0.5, 2.0])
def test_waiting_sends_no_commands_and_hands_off_in_milliseconds(
    redis_alias: str, redis_factory: Callable[..., RedisServer], name: str, wait: float
) -> None:
    # A server of its own: only this test's commands are counted (the suite's server also
    # serves renewals of other tests' holds, in this process or beside it).
    redis_server = redis_factory()
    with override_settings(**redlock_settings(redis_server.url)):
        _waiting_sends_nothing(redis_alias, redis_server, name, wait)


def _waiting_sends_nothing(
    redis_alias: str, redis_server: RedisServer, name: str, wait: float
) -> None:
    holder, waiter = lock(name, using=redis_alias), lock(name, using=redis_alias)
    holder.acquire()
    redis_server.client().config_resetstat()
    got: list[float] = []

    def wait_for_it() -> None:
        assert waiter.acquire(timeout=30)
        got.append(time.monotonic())

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    time.sleep(0.2)
    calls = _command_calls(redis_server)
    time.sleep(wait)
    after = _command_calls(redis_server)
    during = {k: n - calls.get(k, 0) for k, n in after.items() if n != calls.get(k, 0)}
    released = time.monotonic()
    holder.release()
    thread.join(5)
    # No polling, however long the wait: only the hub's PINGs on the wait's connection (one
    # per quarter socket timeout without a message, for every waiter of the process).
    timeout = locks[redis_alias].hub.confirm_timeout
    assert set(during) <= {"ping"}, during
    assert during.get("ping", 0) <= wait / (timeout / 4) + 1, during
    # Try, subscribe (only a process's first wait subscribes to its inbox), try again; then
    # silence. (Commands inside scripts count too.)
    assert calls["evalsha"] == 2 and calls.get("subscribe", 0) <= 1
    assert got and got[0] - released < 1.0  # woken by the release, long before the 30 s TTL
    waiter.release()


def test_script_flush_mid_hold(redis_alias: str, redis_server: RedisServer, name: str) -> None:
    held = lock(name, using=redis_alias, ttl=5)
    held.acquire()
    redis_server.client().script_flush()
    held.extend(10)
    ttl = held.ttl()
    assert ttl is not None and ttl > 9
    redis_server.client().script_flush()
    # The watchdog's pipelined path reloads too.
    assert locks[redis_alias].renew_many([Renewal(name, held._holds[""].token, 5000)]) == [True]
    redis_server.client().script_flush()
    held.release()
    assert not held.locked()


def test_restart_with_data_mid_hold(redis_factory: Callable[..., RedisServer], name: str) -> None:
    server = redis_factory(persist=True)
    backend_settings = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
    }
    with _alias("restarted", backend_settings):
        held = lock(name, using="restarted", ttl=30)
        held.acquire()
        server.restart()  # the key survives (AOF); the script cache does not
        held.extend(20)
        held.release()
        assert not held.locked()


def test_restart_empty_mid_hold_reports_the_loss(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    backend_settings = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
    }
    with _alias("restarted", backend_settings):
        held = lock(name, using="restarted", ttl=30)
        held.acquire()
        server.restart()
        with pytest.raises(LockNotOwned):
            held.extend()
        again = lock(name, using="restarted")
        assert again.acquire(blocking=False)
        again.release()


def test_paused_server_gives_backend_unavailable_within_the_socket_timeout(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    backend_settings = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 0.5},
    }
    with _alias("paused", backend_settings):
        held = lock(name, using="paused")
        held.acquire()
        server.pause()
        try:
            lock_all_take = lock_all(name + "3", name + "4", using="paused").acquire
            for call in (lock(name + "2", using="paused").acquire, held.release, held.locked,
                         lock_all_take):  # fmt: skip
                started = time.monotonic()
                with pytest.raises(BackendUnavailable, match="paused"):
                    call()
                assert time.monotonic() - started < 0.5 + 0.3
        finally:
            server.resume()


def held_and_waiting(alias: str, name: str, kind: str) -> tuple[Any, Any]:
    """A hold of ``name`` (30 s, not renewed), and a waiter for it of that kind: a lock, a
    fair lock, or a lock_all of it and another name."""
    holder = lock(name, using=alias, ttl=30, auto_renew=False, fair=kind == "fair")
    holder.acquire()
    if kind == "lock_all":
        return holder, lock_all(name, name + ":other", using=alias)
    return holder, lock(name, using=alias, fair=kind == "fair")


@pytest.mark.parametrize("kind", ["lock_all", "lock", "fair", "async"])
def test_a_wait_on_a_server_paused_meanwhile_ends_within_one_socket_timeout(
    redis_factory: Callable[..., RedisServer], name: str, kind: str
) -> None:
    # A waiter whose try after its sleep times out raises at once: its leave would wait
    # another socket timeout (and a paused server could run it before the try it undoes).
    # Its registration then lapses on its own (the waiter sets and the fair queue expire).
    server = redis_factory()
    socket_timeout, timeout = 1.0, 1.5
    backend_settings = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": socket_timeout},
    }
    with _alias("paused", backend_settings):
        holder, waiter = held_and_waiting("paused", name, kind)
        backend = locks["paused"]
        registered = backend.deadlines_key(name) if kind == "fair" else backend.waiting_key(name)
        client = server.client()
        outcome: list[BaseException | float] = []

        def wait() -> None:
            started = time.monotonic()
            try:
                if kind == "async":
                    asyncio.run(waiter.aacquire(timeout=timeout))
                else:
                    waiter.acquire(timeout=timeout)
            except BaseException as exc:
                outcome.append(exc)
            outcome.append(time.monotonic() - started)

        thread = threading.Thread(target=wait)
        thread.start()
        try:
            until = time.monotonic() + 10
            while not client.exists(registered) and time.monotonic() < until:
                time.sleep(0.01)
            assert client.exists(registered), "the waiter never registered"
            server.pause()  # while it sleeps: its next try gets no answer
            thread.join(timeout + 4 * socket_timeout + 10)
        finally:
            server.resume()
        assert not thread.is_alive()
        error, elapsed = outcome
        assert isinstance(error, BackendUnavailable) and error.timed_out
        # Its sleep ends at the timeout, then one socket timeout for the try (a leave
        # after it made two: 2.0 s).
        assert elapsed - timeout < 1.6 * socket_timeout, elapsed
        assert not waiter.held() if kind == "lock_all" else waiter.fence is None
        time.sleep(0.2)  # the server runs what it was sent while paused
        assert client.pttl(registered) > 0  # what is left of the waiter lapses on its own
        assert not lock(name + ":other", using="paused").locked()
        # What is left of it may stand first in line, and get the release's wake-up: this
        # process, which still hears its id, leaves for it then. The next waiter is woken at
        # the release, not at the hold's expiry (28 s on).
        after = lock(name, using="paused", fair=kind == "fair")
        took: list[float] = []
        thread = threading.Thread(
            target=lambda: after.acquire(timeout=15) and took.append(time.monotonic())
        )
        thread.start()
        until = time.monotonic() + 10
        while client.zcard(registered) < 2 and time.monotonic() < until:
            time.sleep(0.01)
        released = time.monotonic()
        holder.release()
        thread.join(30)
        assert took and took[0] - released < 5, "the next waiter was not woken at the release"
        after.release()


@pytest.mark.parametrize("kind", ["lock_all", "lock", "fair"])
def test_a_wait_whose_connection_is_cut_still_leaves_the_waiters(
    redis_server: RedisServer, name: str, kind: str
) -> None:
    # Not a time-out: the server answered the try (its reply was lost with the connection),
    # so the leave is tried, and takes the waiter out at once.
    from ..support.proxy import LossyProxy

    proxy = LossyProxy(redis_server.port)
    # A socket timeout long enough that the wait's hub sends no PING (a quarter of it without
    # a message) before the try whose reply is lost: the PING's would be the one lost.
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": proxy.url,
        "OPTIONS": {"socket_timeout": 10},
    }
    try:
        with _alias("cut", config):
            holder, waiter = held_and_waiting("cut", name, kind)
            backend = locks["cut"]
            keys = [backend.waiting_key(name), backend.queue_key(name),
                    backend.deadlines_key(name)]  # fmt: skip
            client = redis_server.client()
            errors: list[BaseException] = []

            def wait() -> None:
                try:
                    waiter.acquire(timeout=1.0)
                except BaseException as exc:
                    errors.append(exc)

            thread = threading.Thread(target=wait)
            thread.start()
            until = time.monotonic() + 10
            while not client.exists(*keys) and time.monotonic() < until:
                time.sleep(0.01)
            proxy.lose_replies(1)  # the next try's, after the sleep
            thread.join(30)
            assert not thread.is_alive() and proxy.lost == 1
            [error] = errors
            assert isinstance(error, BackendUnavailable) and not error.timed_out
            assert client.exists(*keys) == 0  # left at once, not at a lease's end
            holder.release()
    finally:
        proxy.close()


def test_down_server_gives_backend_unavailable_at_once(name: str) -> None:
    from django_redlock.testing import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with _alias("down", {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url}):
        held = lock(name, using="down")
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match=r"'down'"):
            held.acquire()
        assert time.monotonic() - started < 1.0
        assert held.fence is None and not held.owned()  # never reported held


def _alias(alias: str, config: dict[str, object]):  # type: ignore[no-untyped-def]
    from django.conf import settings
    from django.test import override_settings

    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config})


def test_temporary_aliases_are_gone_after_the_override() -> None:
    assert "paused" not in locks.settings


def test_a_reply_that_comes_too_late_is_never_read_as_another_answer(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    _late_reply(server, config, name)


def test_a_late_reply_through_sentinel_is_never_read_as_another_answer(name: str) -> None:
    # A Sentinel connection does not drop itself on a time-out (redis-py leaves that to its
    # command wrapper): the lock's own path must, or the late reply answers the next command.
    from ..conftest import start_sentinel_group

    group = start_sentinel_group(replicas=0)
    try:
        config = {
            "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
            "LOCATION": [s.url for s in group[1:]],
            "OPTIONS": {"service_name": "mymaster"},
        }
        _late_reply(group[0], config, name)  # paused for less than the sentinels' 1 s
    finally:
        for each in group:
            each.stop()


def _late_reply(server: RedisServer, config: dict[str, object], name: str) -> None:
    # One connection in the pool: an acquire whose reply is late must not leave it behind for
    # the next command to read as its own (the connection is dropped at the time-out).
    options = {**config.get("OPTIONS", {}), "socket_timeout": 0.3, "max_connections": 1}  # type: ignore[dict-item]
    with _alias("late", {**config, "OPTIONS": options}):
        held = lock(name, using="late", auto_renew=False)
        held.acquire()  # the one connection is made, and the server knows the scripts
        held.release()
        server.pause()
        try:
            with pytest.raises(BackendUnavailable, match="late"):
                held.acquire(blocking=False)
        finally:
            server.resume()
        time.sleep(0.2)  # the server runs the acquire now, and answers a closed socket
        assert lock(name + ":free", using="late").locked() is False
        assert lock(name, using="late").locked() is True  # the lost try did take it
        assert held.acquire(blocking=False)  # the same token: it finds its hold
        held.release()
        assert lock(name, using="late").locked() is False


@pytest.mark.parametrize("kind", ["lock", "fair", "async"])
def test_a_server_that_stops_answering_during_a_wait_s_set_up_costs_one_socket_timeout(
    redis_factory: Callable[..., RedisServer],
    name: str,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first try says "busy", then the server stops answering as the wait subscribes:
    the set-up waited a socket timeout for the confirmation, then the try another (2.0 s with
    1.0 s). They share one deadline: BackendUnavailable within one socket timeout."""
    from django_redlock.waiting import PubSubHub

    server = redis_factory()
    socket_timeout = 1.0
    backend_settings = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": socket_timeout},
    }
    for method in ("_subscribe", "_subscribe_inbox"):  # the server stops as the wait sets up
        original = getattr(PubSubHub, method)

        def pausing(hub: Any, *args: Any, _original: Any = original) -> Any:
            server.pause()
            return _original(hub, *args)

        monkeypatch.setattr(PubSubHub, method, pausing)
    with _alias("stops", backend_settings):
        holder = lock(name, using="stops", ttl=30, auto_renew=False, fair=kind == "fair")
        holder.acquire()
        waiter = lock(name, using="stops", fair=kind == "fair")
        started = time.monotonic()
        try:
            with pytest.raises(BackendUnavailable) as raised:
                if kind == "async":
                    asyncio.run(waiter.aacquire(timeout=10))
                else:
                    waiter.acquire(timeout=10)
            elapsed = time.monotonic() - started
        finally:
            server.resume()
        assert raised.value.timed_out
        assert elapsed < 1.5 * socket_timeout, elapsed
        monkeypatch.undo()
        holder.release()
        assert waiter.acquire(timeout=5)  # nothing was left in the way
        waiter.release()


def test_a_reentrant_release_whose_settle_gets_no_answer_leaves_nothing_held(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """A reentrant release begins with a settle (the count was unsure); no answer to it is a
    release of unknown outcome, as one to the release itself: the level leaves the object,
    and the owner's next operation settles the server. (Kept in the object, the level made
    the owner's next take a re-entry of that hold, and its release left the hold held, as the
    fault campaign saw with lost replies.)"""
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 0.3},
    }
    with _alias("paused", config):
        held = lock(name, using="paused", reentrant=True, ttl=10)
        held.acquire()
        server.pause()
        try:
            with pytest.raises(BackendUnavailable):  # run once resumed: a level more
                lock(name, using="paused", reentrant=True, ttl=10).acquire(blocking=False)
            with pytest.raises(BackendUnavailable):  # its settle gets no answer
                held.release()
        finally:
            server.resume()
        time.sleep(0.2)  # the server runs what it was sent while paused
        with lock(name, using="paused", reentrant=True, ttl=10):
            pass
        assert not server.client().exists(locks["paused"].key(name)), "left held"


@pytest.mark.parametrize("then", ["busy", "flushed"])
def test_a_try_of_several_round_trips_raises_within_one_socket_timeout(
    redis_factory: Callable[..., RedisServer], name: str, then: str
) -> None:
    """Every round trip of one call shares its deadline: a reconnect's handshake, then BUSY
    (the fault campaign's seed 1711: 0.755 s with a 0.3 s timeout), or then NOSCRIPT, SCRIPT
    LOAD and the call again, each under the socket timeout through a slow link (0.4 s of
    0.5), once added up: 1.2 s (BUSY), and a success after about 2 s."""
    from ..support.busy import busy
    from ..support.proxy import LossyProxy

    server = redis_factory()
    proxy = LossyProxy(server.port)
    socket_timeout = 0.5
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": proxy.url,
        "OPTIONS": {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout},
    }
    try:
        with _alias("slow", config):
            held = lock(name, using="slow", ttl=10, auto_renew=False)
            assert held.acquire(blocking=False)  # this thread's connection is made
            held.release()
            proxy.cut()  # closed under it: the next command reconnects first
            proxy.latency = 0.2  # each chunk, each way: a round trip takes 0.4 s
            if then == "flushed":
                server.client().script_flush()
            with busy(server.client()) if then == "busy" else contextlib.nullcontext():
                started = time.monotonic()
                with pytest.raises(BackendUnavailable):
                    held.acquire(blocking=False)
                elapsed = time.monotonic() - started
            proxy.latency = 0.0
            assert elapsed < socket_timeout + 0.3, elapsed  # (a loaded machine's lag)
            time.sleep(0.5)  # what the server was sent meanwhile has run
            assert held.acquire(blocking=False)  # free, or its own hold (the same token)
            held.release()
            assert not held.locked()
    finally:
        proxy.close()
