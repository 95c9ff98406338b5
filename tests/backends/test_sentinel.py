"""Sentinel (failover, min_replicas) with real servers the suite starts."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from redis.exceptions import ResponseError

from django_redlock import BackendUnavailable, LockError, QuorumNotReached, lock, locks
from django_redlock.backends import sentinel as sentinel_backend
from django_redlock.testing import RedisServer

from ..conftest import start_sentinel_group, stop_all
from ..support.proxy import LossyProxy


@pytest.fixture
def own_group() -> Iterator[list[RedisServer]]:
    """A master, one replica, two sentinels: the test's alone, so it may fail over."""
    servers = start_sentinel_group()
    yield servers
    stop_all(servers)


@pytest.fixture(scope="module")
def _quiet_group() -> Iterator[list[list[RedisServer]]]:
    made: list[list[RedisServer]] = []
    yield made
    while made:
        stop_all(made.pop())


@pytest.fixture
def group(_quiet_group: list[list[RedisServer]]) -> Iterator[list[RedisServer]]:
    """A master, one replica, two sentinels, apart from the session's, never failed over:
    shared by this file's tests that only pause one of them (about 1.3 s each to make),
    emptied before each, resumed and checked whole after (one left otherwise is replaced).
    The failover tests make groups of their own."""
    if not _quiet_group:
        _quiet_group.append(start_sentinel_group())
    servers = _quiet_group[0]
    servers[0].client().flushall()
    yield servers
    if not _whole(servers):
        stop_all(_quiet_group.pop())


def _whole(servers: list[RedisServer]) -> bool:
    """Every server resumed, the replica synced with the master, every sentinel naming it."""
    master, replica, sentinels = servers[0], servers[1], servers[2:]
    deadline = time.monotonic() + 10
    try:
        for server in servers:
            server.resume()
        while (
            replica.client().info("replication").get("master_link_status") != "up"
            or master.client().info("replication").get("connected_slaves") != 1
            or any(master_port(sentinel) != master.port for sentinel in sentinels)
        ):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    except Exception:  # (a server gone: a group made afresh for the next test)
        return False
    return True


def _demote(old: RedisServer, new: RedisServer) -> None:
    """What the sentinels do to the master a failover left behind, once it has reported its
    role for 8 s (10-15 s after the switch here): made a replica of ``new``, its clients
    disconnected (SKIPME: not this one). Done at once where that wait is no test's subject;
    returns once it follows ``new``."""
    pipe = old.client().pipeline(transaction=True)
    pipe.execute_command("REPLICAOF", "127.0.0.1", new.port)
    pipe.execute_command("CLIENT", "KILL", "TYPE", "normal")
    pipe.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    pipe.execute()
    deadline = time.monotonic() + 30
    while _replication(old).get("master_link_status") != "up":
        assert time.monotonic() < deadline, f"{old.port} never followed {new.port}"
        time.sleep(0.05)


def sentinel_alias(servers: list[RedisServer], **options: Any) -> Any:
    config = {
        "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
        "LOCATION": [s.url for s in servers[2:]],
        "OPTIONS": {"service_name": "mymaster", **options},
    }
    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "s": config})


def master_port(sentinel: RedisServer) -> int:
    _host, port = sentinel.client().execute_command(
        "SENTINEL", "get-master-addr-by-name", "mymaster"
    )
    return int(port)


def test_locks_survive_a_sentinel_failover(own_group: list[RedisServer]) -> None:
    group = own_group
    master, replica, sentinel = group[0], group[1], group[2]
    with sentinel_alias(group):
        with lock("after", using="s") as held:
            before = held.fence
            assert before is not None
        _fail_over(sentinel, replica)
        deadline = time.monotonic() + 30
        # Until the old master is demoted it still takes writes on open connections: the
        # window in which an asynchronous failover can lose a lock (see the docs). Demoted
        # here as the sentinels would, without their 10-15 s wait.
        _demote(master, replica)
        while master.client().info("replication")["role"] != "slave":
            assert time.monotonic() < deadline, "the old master was never demoted"
            time.sleep(0.1)
        while True:  # the client finds the new master by itself
            try:
                after = lock("after", using="s")
                assert after.acquire(blocking=False)
                break
            except BackendUnavailable:
                assert time.monotonic() < deadline, "the client never found the new master"
                time.sleep(0.1)
        assert replica.client().exists(locks["s"].key("after"))  # on the promoted replica
        assert after.fence is not None and after.fence > before  # the fence went on growing
        after.release()


@pytest.mark.redis_py
def test_min_replicas_waits_for_the_replica(group: list[RedisServer]) -> None:
    master, replica = group[0], group[1]
    with sentinel_alias(group, min_replicas=1, min_replicas_timeout=1.0):
        with lock("r", using="s") as held:  # the replica confirms: held
            assert held.fence is not None
            assert replica.client().exists(locks["s"].key("r"))  # WAIT made sure of it
        replica.pause()
        try:
            started = time.monotonic()
            with pytest.raises(QuorumNotReached, match="only 0 of the 1 replicas"):
                lock("r", using="s").acquire(blocking=False)
            assert time.monotonic() - started < 1.0 + 0.8
            assert not master.client().exists(locks["s"].key("r"))  # released again
        finally:
            replica.resume()


def test_min_replicas_confirms_a_permit(group: list[RedisServer]) -> None:
    from django_redlock import semaphore

    master, replica = group[0], group[1]
    with sentinel_alias(group, min_replicas=1, min_replicas_timeout=1.0):
        with semaphore("p", 2, using="s") as held:
            assert held.fence is not None
            assert replica.client().exists(locks["s"].key("p"))  # WAIT made sure of it
        replica.pause()
        try:
            with pytest.raises(QuorumNotReached, match="only 0 of the 1 replicas"):
                semaphore("p", 2, using="s").acquire(blocking=False)
            assert not master.client().exists(locks["s"].key("p"))  # handed back
        finally:
            replica.resume()


def test_min_replicas_undoes_a_re_entry_and_keeps_the_outer_level(
    group: list[RedisServer], name: str
) -> None:
    """A re-entry too few replicas confirmed is undone: its owner's count goes back to the
    levels it holds (an ordered write, after the re-entry's), and the outer level's release
    frees the name."""
    master, replica = group[0], group[1]
    with sentinel_alias(group, min_replicas=1, min_replicas_timeout=0.5):
        outer = lock(name, using="s", reentrant=True)
        outer.acquire()
        replica.pause()
        try:
            with pytest.raises(QuorumNotReached, match="re-entry was undone"):
                lock(name, using="s", reentrant=True).acquire(blocking=False)
        finally:
            replica.resume()
        assert outer.hold_count() == 1
        outer.release()
        assert not master.client().exists(locks["s"].key(name))


def test_min_replicas_counts_the_replicas_that_have_the_acquire(group: list[RedisServer]) -> None:
    """A master that does not know the scripts yet (just started, restarted, promoted by a
    failover) answers the acquire NOSCRIPT: the WAIT sent with it then counted the replicas
    that had this connection's earlier writes (none: any replica), not the acquire's. Here
    the only replica is paused: nothing may be confirmed."""
    from django_redlock import semaphore

    master, replica = group[0], group[1]
    tries = [lambda: lock("n", using="s").acquire(blocking=False),
             lambda: semaphore("n", 2, using="s").acquire(blocking=False),
             lambda: asyncio.run(lock("n", using="s").aacquire(blocking=False))]  # fmt: skip
    replica.pause()
    try:
        for attempt in tries:
            master.client().script_flush()
            with sentinel_alias(group, min_replicas=1, min_replicas_timeout=0.5):  # new pool
                with pytest.raises(QuorumNotReached, match="only 0 of the 1 replicas"):
                    attempt()
                assert not master.client().exists(locks["s"].key("n"))  # released again
    finally:
        replica.resume()


@pytest.mark.redis_py
def test_min_replicas_timeout_longer_than_the_socket_s_is_refused() -> None:
    """WAIT answers after min_replicas_timeout: a socket that gives up first would call every
    slow replica "unavailable". Refused when the backend is built, before any Redis call."""
    config = {
        "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
        "LOCATION": ["redis://127.0.0.1:9"],  # nothing listens: no call is made
        "OPTIONS": {"service_name": "m", "min_replicas": 1, "min_replicas_timeout": 2.0,
                    "socket_timeout": 1.5},
    }  # fmt: skip
    refused = pytest.raises(ImproperlyConfigured, match=r"min_replicas_timeout.*2 s.*1\.5 s")
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "bad": config}), refused:
        locks["bad"]


def test_a_thread_connected_before_a_sentinel_failover_uses_the_new_master(name: str) -> None:
    """A thread's connection made before SENTINEL FAILOVER still reaches the old master until
    the sentinels demote it (seconds). With two replicas and min_replicas=1, its take right
    after the sentinels named the new master is granted on the old master, confirmed by the
    replica that then follows the new master and drops it: a grant the failover loses. (With
    one replica the takes raise QuorumNotReached until the old master is demoted and has
    synced from the new one, about 15 s here, on the new master too: nothing to gain there.)
    Each thread's connection moved only at the backend's next look at the sentinels (once a
    second, and SENTINEL MASTERS, which it asks, names the old master until the failover
    ends): they now move when a sentinel announces it (+promoted-slave, +switch-master)."""
    group = start_sentinel_group(replicas=2)
    master, new, sentinel = group[0], group[1], group[3]
    try:
        # (sentinel_alias's LOCATION is servers[2:]: the sentinels only, not the 2nd replica,
        # which redis-py before 8 does not skip when it refuses SENTINEL MASTERS)
        with sentinel_alias(group[:2] + group[3:], min_replicas=1, min_replicas_timeout=0.5):
            with lock(name, using="s"):
                pass  # this thread's connection, to the old master
            _fail_over(sentinel, (new, group[2]))
            deadline = time.monotonic() + 30
            began = time.monotonic()
            while True:
                try:
                    held = lock(name, using="s")
                    if held.acquire(blocking=False):
                        break
                except (QuorumNotReached, BackendUnavailable):
                    pass
                assert time.monotonic() < deadline, "never acquired on the new master"
                time.sleep(0.05)
            took = time.monotonic() - began
            port = master_port(sentinel)
            promoted = next(s for s in group[1:3] if s.port == port)
            assert promoted.client().exists(locks["s"].key(name))  # on the new master
            held.release()
            assert master.client().info("replication")["role"] == "master" or took < 8
            assert took < 8.0, f"acquired {took:.1f} s after the sentinels named the new master"
    finally:
        stop_all(group)


def test_an_event_loop_connected_before_a_sentinel_failover_uses_the_new_master(
    name: str,
) -> None:
    """As above for an event loop's pooled connection: its take right after the sentinels
    named the new master went to the old one until the backend's next look (up to a second,
    more while SENTINEL MASTERS named the old master); the announcement moves it now."""
    group = start_sentinel_group(replicas=2)
    master, sentinel = group[0], group[3]
    try:
        with sentinel_alias(group[:2] + group[3:], min_replicas=1, min_replicas_timeout=0.5):

            def switched() -> None:
                _fail_over(sentinel, (group[1], group[2]))

            async def main() -> Any:
                warm = lock(f"{name}:warm", using="s")
                assert await warm.aacquire(blocking=False)  # the loop's connection, to old
                await warm.arelease()
                await asyncio.to_thread(switched)
                deadline = time.monotonic() + 30
                while True:
                    try:
                        held = lock(name, using="s")
                        if await held.aacquire(blocking=False):
                            return held
                    except (QuorumNotReached, BackendUnavailable):
                        pass
                    assert time.monotonic() < deadline, "never acquired"
                    await asyncio.sleep(0.05)

            held = asyncio.run(main())
            key = locks["s"].key(name)
            promoted = next(s for s in group[1:3] if s.port == master_port(sentinel))
            assert (promoted.client().exists(key), master.client().exists(key)) == (1, 0)
            held.release()
            locks["s"].close()
    finally:
        stop_all(group)


def test_after_a_planned_sentinel_failover_the_watchdog_renews_on_the_new_master(name: str) -> None:
    """SENTINEL FAILOVER: the old master takes writes until the sentinels demote it (about
    10 s here). The watchdog's connection stayed on it: its renewals kept the old copy alive
    while the promoted master's ran out at its TTL, another client took the name there, and
    the first holder's owned() said True: two holders at once. Each thread's connection now
    moves to the new master at the backend's next look at the sentinels (once a second)."""
    import threading

    group = start_sentinel_group()
    replica, sentinel = group[1], group[2]
    try:
        with sentinel_alias(group, socket_timeout=1.0):
            first = lock(name, using="s", ttl=2)
            assert first.acquire(blocking=False)
            key = locks["s"].key(name)
            time.sleep(1.0)  # renewed once, and replicated
            _fail_over(sentinel, replica)
            assert replica.client().exists(key)
            ends = time.monotonic() + 5.5  # past the old master's copy's TTL, twice over
            while time.monotonic() < ends:
                took: list[Any] = []

                def take(took: list[Any] = took) -> None:  # its own thread: a new connection
                    other = lock(name, using="s", ttl=30)
                    try:
                        took.append(other.acquire(blocking=False) and other)
                    except LockError:
                        took.append(False)

                thread = threading.Thread(target=take)
                thread.start()
                thread.join(10)
                if took and took[0]:
                    took[0].release()
                    raise AssertionError(
                        f"another client took the name on the new master; first.owned() ="
                        f" {first.owned()}"
                    )
                time.sleep(0.2)
            assert replica.client().pttl(key) > 0  # renewed there
            assert first.owned()
            first.release()
            locks["s"].close()
    finally:
        stop_all(group)


def _fail_over(
    sentinel: RedisServer, new: RedisServer | tuple[RedisServer, ...], *others: RedisServer
) -> None:
    """SENTINEL FAILOVER (a planned one), returned once ``sentinel`` (and ``others``, the
    other sentinels, which a client may ask instead) name ``new`` (or one of them)."""
    ports = {each.port for each in (new if isinstance(new, tuple) else (new,))}
    deadline = time.monotonic() + 30
    while True:  # refused (NOGOODSLAVE) until the sentinel has fresh news of the replica
        try:
            sentinel.client().execute_command("SENTINEL", "FAILOVER", "mymaster")
            break
        except ResponseError:
            assert time.monotonic() < deadline, "the sentinel never accepted the failover"
            time.sleep(0.2)
    while any(master_port(each) not in ports for each in (sentinel, *others)):
        assert time.monotonic() < deadline, "no failover"
        time.sleep(0.05)


def test_after_a_planned_sentinel_failover_an_asyncio_take_lands_on_the_new_master(
    name: str,
) -> None:
    """An event loop's pooled connection stayed on the old master, which takes writes until
    the sentinels demote it (seconds): an asyncio take 1.5 s after the switch was granted
    there while a thread took the same name on the new master (two holders). The backend's
    look at the sentinels (once a second) now moves every loop's connections too."""
    group = start_sentinel_group()
    old, new, sentinel = group[0], group[1], group[2]
    try:
        with sentinel_alias(group, socket_timeout=1.0):
            key = locks["s"].key(name)

            async def main() -> None:
                warm = lock(f"{name}:warm", using="s")
                assert await warm.aacquire(blocking=False)  # the loop's connection, to old
                await warm.arelease()
                _fail_over(sentinel, new, group[3])
                await asyncio.sleep(1.5)  # past the backend's next look
                assert old.client().info("replication")["role"] == "master"  # still writable
                held = lock(name, using="s", ttl=10)
                assert await held.aacquire(blocking=False)
                on_new, on_old = new.client().exists(key), old.client().exists(key)
                await held.arelease()
                assert (on_new, on_old) == (1, 0)

            asyncio.run(main())
            locks["s"].close()
    finally:
        stop_all(group)


def test_after_a_planned_sentinel_failover_an_asyncio_release_reaches_the_new_master(
    name: str,
) -> None:
    """As above for a hold taken before the switch: its arelease() 1.5 s after it deleted
    the old master's copy, while the new master's, renewed there by the watchdog, blocked
    the name for its TTL."""
    group = start_sentinel_group()
    old, new, sentinel = group[0], group[1], group[2]
    try:
        with sentinel_alias(group, socket_timeout=1.0):
            key = locks["s"].key(name)

            async def main() -> None:
                held = lock(name, using="s", ttl=15)
                assert await held.aacquire(blocking=False)
                _fail_over(sentinel, new, group[3])  # (a planned one waits for the replica)
                await asyncio.sleep(1.5)
                assert old.client().info("replication")["role"] == "master"
                assert await held.aowned()
                await held.arelease()
                assert new.client().pttl(key) == -2  # released where the hold is

            asyncio.run(main())
            locks["s"].close()
    finally:
        stop_all(group)


@pytest.mark.parametrize("how", ["sync", "asyncio"])
def test_a_take_after_an_idle_spell_and_a_failover_lands_on_the_new_master(
    name: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The looker ends after LOOKER_IDLE without an operation; the next one restarted it but
    ran at once on its old connection: after a failover during the idle spell, a take was
    granted on the old master (still writable) while others took the name on the new one.
    The operation that restarts the looker now waits for its first look."""
    monkeypatch.setattr(sentinel_backend, "LOOKER_IDLE", 0.2)  # (60 s by default)
    group = start_sentinel_group()
    old, new, sentinel = group[0], group[1], group[2]
    try:
        with sentinel_alias(group, socket_timeout=1.0):
            backend, key = locks["s"], locks["s"].key(name)

            def idle_then_fail_over() -> None:
                deadline = time.monotonic() + 10
                while backend._looker is not None:  # the looker ended: idle
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                _fail_over(sentinel, new)
                while master_port(group[3]) != new.port:  # each sentinel knows
                    assert time.monotonic() < deadline + 20
                    time.sleep(0.05)
                assert old.client().info("replication")["role"] == "master"  # writable

            if how == "sync":
                warm = lock(f"{name}:warm", using="s")
                assert warm.acquire(blocking=False)  # this thread's connection, to old
                warm.release()
                idle_then_fail_over()
                held = lock(name, using="s", ttl=10)
                assert held.acquire(blocking=False)
            else:

                async def main() -> Any:
                    warm = lock(f"{name}:warm", using="s")
                    assert await warm.aacquire(blocking=False)  # the loop's, to old
                    await warm.arelease()
                    await asyncio.to_thread(idle_then_fail_over)
                    held = lock(name, using="s", ttl=10)
                    assert await held.aacquire(blocking=False)

                asyncio.run(main())
            assert (new.client().exists(key), old.client().exists(key)) == (1, 0)
            backend.close()
    finally:
        stop_all(group)


def test_a_child_forked_while_the_looker_was_being_started_starts_its_own(
    group: list[RedisServer], name: str
) -> None:
    """The lock that lets one thread start the looker was copied held into a child forked
    while another thread held it (starting the looker: its window): the child's operations
    then never started one, nor listened to the sentinels, and went on to whatever master
    its connections had for as long as the child lived."""
    with sentinel_alias(group, socket_timeout=1.0):
        backend = locks["s"]
        with lock(f"{name}:parent", using="s"):
            pass
        holding, forked = threading.Event(), threading.Event()

        def starting_the_looker() -> None:
            with backend._looking:
                holding.set()
                forked.wait(10)

        thread = threading.Thread(target=starting_the_looker)
        thread.start()
        assert holding.wait(10)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with lock(f"{name}:child", using="s"):
                    pass
                looker = backend._looker
                code = 0 if looker is not None and looker.is_alive() else 2
            finally:
                os.write(write, b"x")
                os._exit(code)
        forked.set()
        thread.join()
        os.read(read, 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child started no looker"
        backend.close()


def test_the_listeners_come_back_after_a_lost_connection_and_end_with_close(
    group: list[RedisServer], name: str
) -> None:
    """The backend listens to each sentinel for announced switches (see the failover tests
    above): a listener whose connection is lost connects again, a paused sentinel delays no
    operation, and close() ends them all."""
    sentinels = group[2:]

    def listeners() -> list[int]:
        return [
            len(s.client().execute_command("CLIENT", "LIST", "TYPE", "pubsub").splitlines())
            for s in sentinels
        ]

    def until(wanted: list[int]) -> None:
        deadline = time.monotonic() + 5
        while listeners() != wanted:
            assert time.monotonic() < deadline, f"{listeners()} listeners, not {wanted}"
            time.sleep(0.05)

    with sentinel_alias(group, socket_timeout=1.0):
        backend = locks["s"]
        with lock(name, using="s"):
            pass
        until([1, 1])
        for sentinel in sentinels:
            sentinel.client().execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        until([1, 1])  # back (a second later)
        sentinels[0].pause()
        try:
            began = time.monotonic()
            for i in range(5):
                with lock(f"{name}:{i}", using="s"):
                    pass
            assert time.monotonic() - began < 0.5
        finally:
            sentinels[0].resume()
        backend.close()
        until([0, 0])


@pytest.mark.redis_py
def test_asyncio_calls_queued_for_a_paused_sentinel_master_are_unavailable_in_time(
    group: list[RedisServer],
) -> None:
    """Asyncio calls wait for one of max_connections permits of their event loop: that wait
    had no bound, so with the master paused 30 calls over 5 permits came out in rounds of a
    socket timeout (6 s for 1 s). It is bounded by the socket timeout, as a thread's is.
    On redis-py before 7.2 the pool also connected under its lock, so the calls holding a
    permit connected one after the other (4 s for the fifth): it lets the lock go first."""
    master = group[0]
    with sentinel_alias(group, socket_timeout=1.0, max_connections=5):
        outcomes: list[tuple[str, float]] = []

        async def one(i: int, began: float) -> None:
            try:
                await lock(f"gate{i}", using="s").aacquire(blocking=False)
                outcome = "granted"
            except BackendUnavailable:
                outcome = "unavailable"
            outcomes.append((outcome, time.monotonic() - began))

        async def main() -> None:
            warm = lock("gate-warm", using="s")
            assert await warm.aacquire(blocking=False)
            await warm.arelease()
            master.pause()
            try:
                began = time.monotonic()
                await asyncio.gather(*(one(i, began) for i in range(30)))
            finally:
                master.resume()

        asyncio.run(main())
        assert {outcome for outcome, _ in outcomes} == {"unavailable"}
        assert max(took for _, took in outcomes) < 2.0 + 0.5  # a socket timeout queued, one sent
        locks["s"].close()


@pytest.mark.redis_py
@pytest.mark.parametrize("path", ["tracer", "retry"])
def test_a_pooled_take_right_after_an_announced_switch_lands_on_the_new_master(
    name: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With redis.Redis.execute_command wrapped (a tracer) or a ``retry`` option, commands go
    through the Sentinel pool, not the fast path. An announced switch moved only the fast
    path's connections: the pool's idle one was left to the looker's next look, and a take
    made as soon as the announcement was applied was granted on the old master (still
    writable) while the new master was free: two holders. The sentinel asked first is
    paused as the announcement arrives, so no look comes to the rescue in time."""
    import redis.backoff
    import redis.retry

    options: dict[str, Any] = {"socket_timeout": 1.0}
    if path == "tracer":
        own = redis.Redis.execute_command

        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            return own(self, *args, **kwargs)

        monkeypatch.setattr(redis.Redis, "execute_command", traced)
    else:
        options["retry"] = redis.retry.Retry(redis.backoff.NoBackoff(), 1)
    applied = threading.Event()
    heard_switch = sentinel_backend.SentinelBackend._heard_switch
    group = start_sentinel_group()
    old, new, first, second = group

    def heard(self: Any, channel: Any, message: Any) -> None:
        if not applied.is_set():
            first.pause()
        heard_switch(self, channel, message)
        applied.set()

    monkeypatch.setattr(sentinel_backend.SentinelBackend, "_heard_switch", heard)
    try:
        with sentinel_alias(group, **options):
            warm = lock(f"{name}:warm", using="s")
            assert warm.acquire(blocking=False)  # a pooled connection, to the old master
            warm.release()
            _found_while_listening(locks["s"])  # the listeners are listening
            failing_over = threading.Thread(target=_fail_over, args=(second, new), daemon=True)
            failing_over.start()
            assert applied.wait(30), "no switch announced"
            held = lock(name, using="s", ttl=30)
            assert held.acquire(blocking=False)
            key = locks["s"].key(name)
            assert (new.client().exists(key), old.client().exists(key)) == (1, 0)
            locks["s"].close()
            failing_over.join(30)  # (its last look at the sentinel, before they stop)
    finally:
        first.resume()
        stop_all(group)


@pytest.mark.redis_py
def test_a_child_forked_while_threads_held_connection_permits_gets_them_all(
    sentinel_group: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the pool (a tracer here), an operation holds one of max_connections permits
    while it runs. A child forked while the parent's threads held them all inherited them
    taken for good (those threads are not in the child): every operation there failed with
    "all 2 connections busy" on an idle master."""

    own = redis.Redis.execute_command

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        return own(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)
    with sentinel_alias(sentinel_group, socket_timeout=1.0, max_connections=2):
        backend = locks["s"]
        with lock(f"{name}:warm", using="s"):
            pass
        tickets = [sentinel_backend._Ticket() for _ in range(2)]
        for ticket in tickets:  # as two threads mid-operation do
            assert backend._gate.take(ticket, 1)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                held = lock(name, using="s")
                code = 0 if held.acquire(blocking=False) else 2
                held.release()
            finally:
                os.write(write, b"x")
                os._exit(code)
        try:
            os.read(read, 1)
            _, status = os.waitpid(pid, 0)
        finally:
            for ticket in tickets:
                backend._gate.give_back(ticket)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's take failed"
        backend.close()


def test_a_waiter_hears_a_release_on_the_new_master_after_a_switch(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter subscribed (the backend's one pub/sub connection) on the old master, which
    stays a master for seconds after a planned failover: a release on the new master,
    once the switch was announced, published to nobody there, and the waiter slept until
    its next try (about 10 s) while the name was free. The announced switch moves the
    pub/sub connection too, and the waiters look again once it is subscribed there."""
    applied = threading.Event()
    heard_switch = sentinel_backend.SentinelBackend._heard_switch

    def heard(self: Any, channel: Any, message: Any) -> None:
        heard_switch(self, channel, message)
        applied.set()

    monkeypatch.setattr(sentinel_backend.SentinelBackend, "_heard_switch", heard)
    group = start_sentinel_group()
    old, new, first, second = group
    try:
        with sentinel_alias(group, socket_timeout=1.0):
            holder = lock(name, using="s", ttl=20)
            assert holder.acquire(blocking=False)
            got: dict[str, Any] = {}

            def wait() -> None:
                waiter = lock(name, using="s", ttl=20)
                got["took"] = waiter.acquire(timeout=20)
                got["at"] = time.monotonic()
                waiter.release()

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(1.0)  # subscribed, on the old master
            _fail_over(first, new, second)
            assert applied.wait(10), "no switch announced"
            time.sleep(0.2)
            assert old.client().info("replication")["role"] == "master"  # still (for seconds)
            released = time.monotonic()
            holder.release()
            thread.join(25)
            assert got["took"] is True
            assert got["at"] - released < 2.0, f"woken {got['at'] - released:.1f} s after"
            locks["s"].close()
    finally:
        stop_all(group)


def test_no_take_is_unavailable_once_an_unplanned_failover_s_promotion_is_heard(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master killed: after the leader announced the promotion (+promoted-slave), a
    connection made again asked the sentinels, whose SENTINEL MASTERS still named the old
    master flagged down until the failover's end: redis-py said "No master found", and
    takes were unavailable for tens of milliseconds although the new master was known."""
    from django_redlock.testing import SentinelServer

    heard_at: list[float] = []
    heard_switch = sentinel_backend.SentinelBackend._heard_switch

    def heard(self: Any, channel: Any, message: Any) -> None:
        heard_switch(self, channel, message)
        heard_at.append(time.monotonic())

    monkeypatch.setattr(sentinel_backend.SentinelBackend, "_heard_switch", heard)
    master = RedisServer(args=["--repl-diskless-sync-delay", "0"]).start()
    replicas = [
        RedisServer(args=["--replicaof", "127.0.0.1", str(master.port)]).start() for _ in range(2)
    ]
    sentinels = [SentinelServer(master, down_after=1).start() for _ in range(2)]
    group = [master, *replicas, *sentinels]
    try:
        deadline = time.monotonic() + 30
        for replica in replicas:
            while replica.client().info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for sentinel in sentinels:
            while len(sentinel.client().execute_command("SENTINEL", "REPLICAS", "mymaster")) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with sentinel_alias([*group[:2], *sentinels], socket_timeout=1.0):
            with lock(f"{name}:warm", using="s"):
                pass
            _found_while_listening(locks["s"])  # the listeners are listening
            master.kill()
            while not heard_at:
                assert time.monotonic() < deadline + 30, "no switch announced"
                time.sleep(0.005)
            failures = []
            while True:
                try:
                    held = lock(name, using="s")
                    assert held.acquire(blocking=False)
                    held.release()
                    break
                except BackendUnavailable as exc:
                    failures.append(str(exc))
                assert time.monotonic() < heard_at[0] + 10
                time.sleep(0.01)
            assert not failures, failures[0]
            locks["s"].close()
    finally:
        stop_all(group)


@pytest.mark.parametrize(
    ("min_replicas", "how"),
    # (the lowest-redis-py pass: each branch once, each of redis-py's two clients once)
    [pytest.param(1, "thread", marks=pytest.mark.redis_py), (1, "asyncio"), (0, "thread"),
     pytest.param(0, "asyncio", marks=pytest.mark.redis_py)],
    ids=["1-thread", "1-asyncio", "0-thread", "0-asyncio"],
)  # fmt: skip
def test_with_every_sentinel_silent_a_new_thread_uses_the_master_found(
    group: list[RedisServer], name: str, how: str, min_replicas: int
) -> None:
    """A new thread (or event loop) connects through the sentinels: with both paused, each
    cost it a whole socket timeout, and then "No master found" (BackendUnavailable) though
    the master, found a moment before, was healthy. With min_replicas it uses that master,
    the sentinels asked for one socket timeout in all (a take there is granted only once a
    replica confirms it). Without, nothing proves that master is not stale (see
    test_cut_off_from_the_sentinels_...): BackendUnavailable, every sentinel asked once."""
    sentinels = group[2:]
    timeouts = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
    with sentinel_alias(group, min_replicas=min_replicas, **timeouts):
        with lock(name, using="s"):
            pass  # the master found
        _found_while_listening(locks["s"])
        for sentinel in sentinels:
            sentinel.pause()
        try:
            outcome: list[Any] = []

            def take() -> None:
                began = time.monotonic()
                try:
                    if how == "asyncio":

                        async def atake() -> bool:
                            async with lock(f"{name}:new", using="s", timeout=0) as held:
                                return held.fence is not None

                        acquired = asyncio.run(atake())
                    else:
                        with lock(f"{name}:new", using="s", timeout=0) as held:
                            acquired = held.fence is not None
                    outcome.append(acquired)
                except LockError as exc:
                    outcome.append(exc)
                outcome.append(time.monotonic() - began)

            thread = threading.Thread(target=take)
            thread.start()
            thread.join(10)
        finally:
            for sentinel in sentinels:
                sentinel.resume()
        if min_replicas:
            assert outcome[0] is True, outcome
            assert outcome[1] < 1.6, f"{outcome[1]:.2f} s: more than one socket timeout"
        else:
            assert isinstance(outcome[0], BackendUnavailable), outcome
            assert outcome[1] < 2.6, f"{outcome[1]:.2f} s: more than a socket timeout each"


def _found_while_listening(backend: Any) -> None:
    """Returns once a sentinel named the master after the listeners subscribed: the only
    case the master found is used when no sentinel answers (FOUND_TRUSTED after it). Every
    sentinel's listener is connected (one that connects later, or fails to, resets it)."""
    deadline = time.monotonic() + 10
    listening, sentinels = backend._listening, len(backend.location)
    while (
        len(listening._state[1]) < sentinels
        or (since := listening.since) is None
        or backend._heard.found_at < since
    ):
        assert time.monotonic() < deadline, "no look at the sentinels after they listened"
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["sync", "asyncio"])
def test_after_an_idle_spell_silent_sentinels_never_send_a_take_to_the_master_found_before(
    name: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every sentinel silent, "the master found last" was used whatever its age: after
    an idle spell (looker and listeners ended), a failover, and the old master back on its
    address, empty and a master (ROLE proves nothing), a take was granted there while the
    new master was the sentinels' (two holders). That master is used only while a sentinel
    named it within FOUND_TRUSTED and the listeners were subscribed throughout since."""
    monkeypatch.setattr(sentinel_backend, "LOOKER_IDLE", 0.2)  # (60 s by default)
    group = start_sentinel_group()
    old, new, sentinels = group[0], group[1], group[2:]
    try:
        with sentinel_alias(group, socket_timeout=1.0, socket_connect_timeout=1.0):
            backend, key = locks["s"], locks["s"].key(name)

            def idle_fail_over_and_back_empty() -> None:
                deadline = time.monotonic() + 10
                while any(t.name.startswith("redlock-sentinel s") for t in threading.enumerate()):
                    assert time.monotonic() < deadline, "the looker and listeners never ended"
                    time.sleep(0.05)
                _fail_over(sentinels[0], new, sentinels[1])
                for sentinel in sentinels:
                    sentinel.pause()
                old.kill()
                old.start()  # back on its address, empty, a master
                assert old.client().info("replication")["role"] == "master"

            if how == "sync":
                warm = lock(f"{name}:warm", using="s")
                assert warm.acquire(blocking=False)  # the master found, this thread connected
                warm.release()
                idle_fail_over_and_back_empty()
                began = time.monotonic()
                with pytest.raises(BackendUnavailable):
                    lock(name, using="s", ttl=10).acquire(blocking=False)
            else:

                async def main() -> float:
                    warm = lock(f"{name}:warm", using="s")
                    assert await warm.aacquire(blocking=False)  # the loop's connection
                    await warm.arelease()
                    await asyncio.to_thread(idle_fail_over_and_back_empty)
                    began = time.monotonic()
                    with pytest.raises(BackendUnavailable):
                        await lock(name, using="s", ttl=10).aacquire(blocking=False)
                    return began

                began = asyncio.run(main())
            assert time.monotonic() - began < 5.0  # first look (1 s), then 2 sentinels x 1 s
            assert not old.client().exists(key)
            backend.close()
    finally:
        for sentinel in group[2:]:
            sentinel.resume()
        stop_all(group)


def _cut_off_alias(sentinels: list[RedisServer], proxies: list[LossyProxy], **options: Any) -> Any:
    """Two aliases of one group: "p" reaches the sentinels through ``proxies`` (which can
    cut it off from them), "q" directly; the masters are reached directly by both."""

    def config(urls: list[str]) -> dict[str, Any]:
        return {
            "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
            "LOCATION": urls,
            "OPTIONS": {
                "service_name": "mymaster", "socket_timeout": 1.0,
                "socket_connect_timeout": 1.0, **options,
            },
        }  # fmt: skip

    aliases = {
        "p": config([proxy.url for proxy in proxies]),
        "q": config([sentinel.url for sentinel in sentinels]),
    }
    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, **aliases})


def _take_in_a_new_thread(name: str, how: str, using: str = "p") -> Any:
    """A take by a new thread (or a new event loop): its first connection asks the sentinels.
    True, False or the LockError raised."""
    outcome: list[Any] = []

    def take() -> None:
        try:
            held = lock(name, using=using, ttl=30)
            if how == "asyncio":
                outcome.append(asyncio.run(held.aacquire(blocking=False)))
            else:
                outcome.append(held.acquire(blocking=False))
        except LockError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(15)
    assert outcome, "the take never returned"
    return outcome[0]


@pytest.mark.parametrize("how", ["sync", "asyncio"])
@pytest.mark.parametrize("min_replicas", [0, 1])
def test_cut_off_from_the_sentinels_a_new_thread_never_takes_on_the_old_master_back_empty(
    name: str, how: str, min_replicas: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no sentinel answering, the master a sentinel named within FOUND_TRUSTED was used
    ("the listeners were subscribed since: a switch would have been heard"). Cut off from
    the sentinels, the listeners stay subscribed and hear nothing: a failover, the old
    master back empty on its address (a master), and a new thread's take was granted there
    while Q held the name on the promoted master (two holders). Without min_replicas that
    master is never used when no sentinel answers: BackendUnavailable. With min_replicas it
    still is, and the take there is QuorumNotReached (no replica), released."""
    monkeypatch.setattr(sentinel_backend, "FOUND_TRUSTED", 30.0)  # (no race with the window)
    group = start_sentinel_group()
    old, new, sentinels = group[0], group[1], group[2:]
    proxies = [LossyProxy(sentinel.port) for sentinel in sentinels]
    try:
        with _cut_off_alias(sentinels, proxies, min_replicas=min_replicas):
            q = lock(name, using="q", ttl=30)
            assert q.acquire(blocking=False)
            pipe = old.client().pipeline(transaction=False)  # Q's hold is on the replica
            pipe.publish("__synced__", "").execute_command("WAIT", 1, 5000)
            assert pipe.execute()[1] == 1
            with lock(f"{name}:warm", using="p"):
                pass
            _found_while_listening(locks["p"])
            for proxy in proxies:
                proxy.blackhole()  # P cut off from the sentinels, its listeners subscribed
            _fail_over(sentinels[0], new, sentinels[1])
            old.kill()
            old.start()  # back on its address, empty, a master
            assert old.client().info("replication")["role"] == "master"
            outcome = _take_in_a_new_thread(name, how)
            expected = QuorumNotReached if min_replicas else BackendUnavailable
            assert isinstance(outcome, expected), str(outcome)
            assert not old.client().exists(locks["p"].key(name))
            assert new.client().exists(locks["q"].key(name))  # Q's hold, on the master
            for alias in ("p", "q"):
                locks[alias].close()
    finally:
        for proxy in proxies:
            proxy.close()
        stop_all(group)


def _a_b_c_group(quorum: int = 1, down_after: float = 10) -> list[RedisServer]:
    """A master A (never promoted), replicas B and C (B promoted first), two sentinels."""
    from django_redlock.testing import SentinelServer

    sync = ["--repl-diskless-sync-delay", "0"]
    a = RedisServer(args=[*sync, "--replica-priority", "0"]).start()
    b, c = (
        RedisServer(args=["--replicaof", "127.0.0.1", str(a.port), *sync, "--replica-priority",
                          str(priority)]).start()
        for priority in (10, 100)
    )  # fmt: skip
    sentinels = [SentinelServer(a, quorum=quorum, down_after=down_after).start() for _ in range(2)]
    deadline = time.monotonic() + 30
    for replica in (b, c):
        while replica.client().info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for sentinel in sentinels:
        while len(sentinel.client().execute_command("SENTINEL", "REPLICAS", "mymaster")) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    return [a, b, c, *sentinels]


def _on_switch_heard_by_p(monkeypatch: pytest.MonkeyPatch, cut: Callable[[], Any]) -> None:
    """``cut()`` runs as alias "p" hears a switch announced, before it is applied."""
    heard_switch = sentinel_backend.SentinelBackend._heard_switch

    def heard(self: Any, channel: Any, message: Any) -> None:
        if self.alias == "p":
            cut()
        heard_switch(self, channel, message)

    monkeypatch.setattr(sentinel_backend.SentinelBackend, "_heard_switch", heard)


def _switch_twice_heard_once(name: str, group: list[RedisServer]) -> Any:
    """A -> B, heard by "p" (which is cut then), then B -> C: "p"'s _Heard."""
    _a, b, c, sentinels = group[0], group[1], group[2], group[3:]
    with lock(f"{name}:warm", using="p"):
        pass
    _found_while_listening(locks["p"])
    heard_p = locks["p"]._heard
    _fail_over(sentinels[0], b, sentinels[1])
    assert heard_p.switch is not None and heard_p.switch.new == ("127.0.0.1", b.port)
    deadline = time.monotonic() + 30
    while c.client().info("replication").get("master_port") != b.port or (
        c.client().info("replication").get("master_link_status") != "up"
    ):
        assert time.monotonic() < deadline, "C never followed B"
        time.sleep(0.05)
    _fail_over(sentinels[1], c, sentinels[0])  # unheard by P
    while not all(  # (ended: a failover that times out goes back to B)
        (state := s.client().sentinel_master("mymaster"))["port"] == c.port
        and "failover_in_progress" not in state["flags"]
        for s in sentinels
    ):
        assert time.monotonic() < deadline, "the failover to C never ended"
        time.sleep(0.05)
    return heard_p


@pytest.mark.parametrize("how", ["sync", "asyncio"])
def test_cut_off_from_the_sentinels_a_new_thread_never_takes_on_a_master_announced_before(
    name: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no sentinel answering and the master found too old to use, a new connection
    went to the master a sentinel had announced, for up to SWITCH_TRUSTED (30 s): a switch
    A -> B heard, P cut off from the sentinels, a second one B -> C unheard, B back empty on
    its address (a master), and a new thread's take was granted on B while Q held the name
    on C (two holders). An announced switch is used only when a sentinel answers that the
    master it announced away from is down: else BackendUnavailable."""
    group = _a_b_c_group()
    b, c, sentinels = group[1], group[2], group[3:]
    proxies = [LossyProxy(sentinel.port) for sentinel in sentinels]
    _on_switch_heard_by_p(monkeypatch, lambda: [proxy.blackhole() for proxy in proxies])
    try:
        deadline = time.monotonic() + 30
        with _cut_off_alias(sentinels, proxies):
            heard_p = _switch_twice_heard_once(name, group)
            while not (q := lock(name, using="q", ttl=30)).acquire(blocking=False):
                assert time.monotonic() < deadline + 30
                time.sleep(0.1)
            assert c.client().exists(locks["q"].key(name))  # Q holds the name on C
            b.kill()
            b.extra_args = ["--repl-diskless-sync-delay", "0"]
            b.start()  # back on its address, empty, a master
            assert b.client().info("replication")["role"] == "master"
            while time.monotonic() - heard_p.found_at < sentinel_backend.FOUND_TRUSTED:
                time.sleep(0.05)  # the master found too old: only the announced one is left
            assert heard_p.switch is not None  # (P's looks never reached a sentinel since)
            outcome = _take_in_a_new_thread(name, how)
            assert isinstance(outcome, BackendUnavailable), outcome
            assert not b.client().exists(locks["p"].key(name))
            q.release()
            for alias in ("p", "q"):
                locks[alias].close()
    finally:
        for proxy in proxies:
            proxy.close()
        stop_all(group)


@pytest.mark.parametrize("how", ["sync", "asyncio"])
def test_a_master_announced_before_is_not_used_when_the_sentinels_say_another_is_down(
    name: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sentinel answering that the master is down (an unplanned failover under way) sent
    connections to the switch announced last, whichever master the answer named. P's pub/sub
    flows silenced (a firewall that forgot idle flows) right as it heard A -> B, a second
    switch B -> C unheard, C paused until the sentinels say it is down, B back empty on its
    address (a master): P's looker moved every connection to B and a new thread's take was
    granted there, on a master no sentinel names (C's holds come back with C). The switch
    announced is used only when the answer names the master it switched from."""
    group = _a_b_c_group(quorum=3, down_after=1)  # (C down, and no failover without quorum)
    b, c, sentinels = group[1], group[2], group[3:]
    proxies = [LossyProxy(sentinel.port) for sentinel in sentinels]
    _on_switch_heard_by_p(monkeypatch, lambda: [p.blackhole_subscribers() for p in proxies])
    try:
        with _cut_off_alias(sentinels, proxies):
            _switch_twice_heard_once(name, group)
            c.pause()
            deadline = time.monotonic() + 30
            while not all(s.client().sentinel_master("mymaster")["is_sdown"] for s in sentinels):
                assert time.monotonic() < deadline, "the sentinels never said C is down"
                time.sleep(0.05)
            b.kill()
            b.extra_args = ["--repl-diskless-sync-delay", "0"]
            b.start()  # back on its address, empty, a master
            outcome = _take_in_a_new_thread(name, how)
            assert isinstance(outcome, BackendUnavailable), str(outcome)
            assert not b.client().exists(locks["p"].key(name))
            for alias in ("p", "q"):
                locks[alias].close()
    finally:
        for proxy in proxies:
            proxy.close()
        stop_all(group)


def _replication(server: RedisServer) -> dict[str, Any]:
    """INFO replication, {} while the sentinels reconfigure it (they kill its clients)."""
    try:
        return dict(server.client().info("replication"))
    except redis.ConnectionError:
        return {}


def _failed_back_unheard(
    name: str, group: list[RedisServer], proxies: list[LossyProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> Any:  # fmt: skip
    """A -> B heard by "p", cut off from the sentinels as it hears it; B -> A unheard (ended,
    every sentinel names A). Returns "p"'s _Heard, the switch A -> B still on it."""
    a, b, sentinels = group[0], group[1], group[2:]
    cut: list[bool] = []

    def cut_once() -> None:  # (not again after the heal)
        if not cut:
            cut.append(True)
            for proxy in proxies:
                proxy.blackhole()

    _on_switch_heard_by_p(monkeypatch, cut_once)
    with lock(f"{name}:warm", using="p"):
        pass
    _found_while_listening(locks["p"])
    heard_p = locks["p"]._heard
    _fail_over(sentinels[0], b, sentinels[1])
    assert heard_p.switch is not None and heard_p.switch.new == ("127.0.0.1", b.port)
    deadline = time.monotonic() + 30
    _demote(a, b)  # A follows B (as the sentinels make it, 13-15 s later)
    _fail_over(sentinels[1], a, sentinels[0])  # unheard by P
    while not all(  # (ended: a failover that times out goes back to B)
        (state := s.client().sentinel_master("mymaster"))["port"] == a.port
        and "failover_in_progress" not in state["flags"]
        for s in sentinels
    ):
        assert time.monotonic() < deadline, "the failover back to A never ended"
        time.sleep(0.05)
    assert heard_p.switch is not None  # (P's looks never reached a sentinel since)
    return heard_p


def _heal(proxies: list[LossyProxy], heard_p: Any) -> None:
    """The cut ends; returns once P's looker had a sentinel's answer."""
    healed = time.monotonic()
    for proxy in proxies:
        proxy.heal()
    deadline = healed + 10
    while heard_p.found_at < healed:
        assert time.monotonic() < deadline, "P's looker never reached a sentinel again"
        time.sleep(0.05)


def test_a_failback_unheard_ends_an_announced_switch_s_correction(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An announced switch A -> B turned every sentinel answer naming A into B for up to
    SWITCH_TRUSTED (30 s), though a later failover B -> A, unheard (P cut off from the
    sentinels meanwhile), made A the master again: once the sentinels answered again, all
    naming A, P's new thread took the name on B (killed, back empty, a master) while Q held
    it on A (two holders). An answer naming A at a config-epoch higher than any before the
    switch, no failover under way, ends the correction. One scene, two takes: a new
    thread's and a new event loop's (each a first connection that asks the sentinels; the
    correction was ended by P's look before either)."""
    group = start_sentinel_group()
    a, b, sentinels = group[0], group[1], group[2:]
    proxies = [LossyProxy(sentinel.port) for sentinel in sentinels]
    try:
        with _cut_off_alias(sentinels, proxies):
            heard_p = _failed_back_unheard(name, group, proxies, monkeypatch)
            deadline = time.monotonic() + 30
            while not (q := lock(name, using="q", ttl=30)).acquire(blocking=False):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert a.client().exists(locks["q"].key(name))  # Q holds the name on A
            b.kill()
            b.extra_args = ["--repl-diskless-sync-delay", "0"]
            b.start()  # back on its address, empty, a master
            assert b.client().info("replication")["role"] == "master"
            _heal(proxies, heard_p)
            for how in ("sync", "asyncio"):
                assert _take_in_a_new_thread(name, how) is False, how
                assert not b.client().exists(locks["p"].key(name)), how
            q.release()
            for alias in ("p", "q"):
                locks[alias].close()
    finally:
        for proxy in proxies:
            proxy.close()
        stop_all(group)


def test_after_a_failback_unheard_takes_go_to_the_master_the_sentinels_name(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, B not killed: the sentinels make it a replica of A (here at once, as they
    do 10 s later), and until the 30 s correction ended every take of P went to B and was
    BackendUnavailable (READONLY), its connections sent back to B by each look, though
    every sentinel named A, healthy."""
    group = start_sentinel_group()
    a, b, sentinels = group[0], group[1], group[2:]
    proxies = [LossyProxy(sentinel.port) for sentinel in sentinels]
    try:
        with _cut_off_alias(sentinels, proxies):
            heard_p = _failed_back_unheard(name, group, proxies, monkeypatch)
            _demote(b, a)
            _heal(proxies, heard_p)
            time.sleep(0.2)  # (the look's move applied)
            assert lock(f"{name}:1", using="p", ttl=30).acquire(blocking=False)  # pooled
            assert _take_in_a_new_thread(f"{name}:2", "sync") is True
            for key in (f"{name}:1", f"{name}:2"):
                assert a.client().exists(locks["p"].key(key))
            for alias in ("p", "q"):
                locks[alias].close()
    finally:
        for proxy in proxies:
            proxy.close()
        stop_all(group)


def test_a_re_entry_the_replicas_do_not_confirm_is_undone_alone_and_says_so(
    group: list[RedisServer], name: str
) -> None:
    """min_replicas: a reentrant re-entry that no replica confirms is taken back, one level;
    the hold it nested in stays. The error said "it was released", as if the lock were."""
    master, replica = group[0], group[1]
    with sentinel_alias(group, min_replicas=1, min_replicas_timeout=0.5, socket_timeout=2.0):
        held = lock(name, using="s", reentrant=True, ttl=30)
        assert held.acquire(blocking=False)  # confirmed
        replica.pause()
        try:
            with pytest.raises(QuorumNotReached) as refused:
                held.acquire(blocking=False)
        finally:
            replica.resume()
        assert "it was released" not in str(refused.value)
        assert "re-entry was undone" in str(refused.value)
        assert held.owned() and master.client().exists(locks["s"].key(name))
        held.release()  # the one level left
        assert not master.client().exists(locks["s"].key(name))
