"""django_redlock.compat.RedisPyLock behaves as redis-py documents its Lock (redis/lock.py),
on real servers, with our locks underneath."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.core.cache import caches
from django.test import override_settings
from redis.backoff import NoBackoff
from redis.exceptions import LockError, LockNotOwnedError
from redis.retry import Retry

from django_redlock import BackendUnavailable, MissingPermission
from django_redlock import LockError as OurLockError
from django_redlock.compat import Redis, RedisPyLock
from django_redlock.locking import finisher
from django_redlock.testing import RedisServer


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Any]:
    made = redis.Redis(port=redis_server.port, socket_timeout=2)
    yield made
    made.close()


def test_acquire_release_and_the_key(client: Any, name: str) -> None:
    lk = client.lock(name, lock_class=RedisPyLock)
    assert lk.acquire(blocking=False)
    assert lk.locked() and lk.owned()
    assert isinstance(lk.local.token, bytes)
    assert lk.fence is not None  # ours: a fencing token too
    assert client.exists(f"redlock:{{{name}}}")  # our key layout, not redis-py's
    other = client.lock(name, lock_class=RedisPyLock)
    assert not other.acquire(blocking=False)
    assert not other.owned()
    lk.release()
    assert not lk.locked() and not lk.owned()
    with pytest.raises(LockError, match="not owned or is already unlocked"):
        lk.release()


def test_timeout_expires_the_hold(client: Any, name: str) -> None:
    lk = client.lock(name, timeout=0.3, lock_class=RedisPyLock)
    assert lk.acquire()
    time.sleep(0.5)  # no watchdog with a timeout: it expired
    assert not lk.locked()
    with pytest.raises(LockNotOwnedError):
        lk.release()


def test_no_timeout_is_renewed_while_held(client: Any, redis_server: RedisServer) -> None:
    # redis-py's timeout=None is an immortal key; ours is a hold renewed while held.
    lk = client.lock("renewed", lock_class=RedisPyLock)
    lk.acquire()
    ttl = client.pttl("redlock:{renewed}")
    assert 0 < ttl <= 30_000
    lk.release()


def test_blocking_timeout_and_context_manager(client: Any, name: str) -> None:
    holder = client.lock(name, lock_class=RedisPyLock)
    holder.acquire()
    waiter = client.lock(name, blocking_timeout=0.2, lock_class=RedisPyLock)
    started = time.monotonic()
    assert not waiter.acquire()
    assert 0.15 < time.monotonic() - started < 1.5
    with pytest.raises(LockError, match="Unable to acquire lock"), waiter:
        pass
    assert not client.lock(name, blocking=False, lock_class=RedisPyLock).acquire()
    holder.release()
    with client.lock(name, lock_class=RedisPyLock) as lk:
        assert lk.owned()
    assert not lk.locked()


def test_a_waiter_is_woken_by_the_release_not_by_sleep(client: Any, name: str) -> None:
    holder = client.lock(name, lock_class=RedisPyLock)
    holder.acquire()
    waiter = client.lock(name, sleep=10, lock_class=RedisPyLock)  # redis-py would nap 10 s
    got: list[float] = []

    def wait() -> None:
        if waiter.acquire():
            got.append(time.monotonic())
            waiter.release()  # thread-local token: released by the thread that took it

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    released = time.monotonic()
    holder.release()
    thread.join(5)
    assert got and got[0] - released < 0.5


def test_thread_local_tokens(client: Any, name: str) -> None:
    lk = client.lock(name, lock_class=RedisPyLock)
    lk.acquire()
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(lk.local.token))
    thread.start()
    thread.join()
    assert seen == [None]  # another thread does not see this thread's token
    shared = client.lock(name + ":shared", thread_local=False, lock_class=RedisPyLock)
    shared.acquire()
    thread = threading.Thread(target=shared.release)  # handed to another thread
    thread.start()
    thread.join()
    assert not shared.locked()
    lk.release()


def test_token_of_ones_own(client: Any, name: str) -> None:
    lk = client.lock(name, lock_class=RedisPyLock)
    assert lk.acquire(token="my-token")
    assert lk.local.token == b"my-token"
    value = client.get(f"redlock:{{{name}}}")
    assert value.startswith(b"my-token|")
    lk.release()
    with pytest.raises(ValueError, match="token"):
        lk.acquire(token="a|b")


def test_extend_and_reacquire(client: Any, name: str) -> None:
    lk = client.lock(name, timeout=10, lock_class=RedisPyLock)
    with pytest.raises(LockError, match="unlocked"):
        lk.extend(5)
    lk.acquire()
    assert lk.extend(10)  # adds to the TTL
    assert 19_000 < client.pttl(f"redlock:{{{name}}}") <= 20_000
    assert lk.extend(5, replace_ttl=True)
    assert 4_000 < client.pttl(f"redlock:{{{name}}}") <= 5_000
    assert lk.reacquire()
    assert 9_000 < client.pttl(f"redlock:{{{name}}}") <= 10_000
    client.delete(f"redlock:{{{name}}}")  # someone else freed it
    with pytest.raises(LockNotOwnedError):
        lk.extend(5)
    forever = client.lock(name + ":f", lock_class=RedisPyLock)
    forever.acquire()
    with pytest.raises(LockError, match="no timeout"):
        forever.extend(5)
    with pytest.raises(LockError, match="no timeout"):
        forever.reacquire()
    forever.release()


def test_raise_on_release_error(client: Any, name: str) -> None:
    quiet = client.lock(name, timeout=0.2, raise_on_release_error=False, lock_class=RedisPyLock)
    with quiet:
        time.sleep(0.4)  # expired inside the block: only a warning
    loud = client.lock(name, timeout=0.2, lock_class=RedisPyLock)
    with pytest.raises(LockNotOwnedError), loud:
        time.sleep(0.4)


def test_the_client_class_makes_every_lock_ours(redis_server: RedisServer, name: str) -> None:
    client = Redis(port=redis_server.port)
    assert isinstance(client.lock(name), RedisPyLock)
    caches_setting = {
        "locky": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": redis_server.url,
            "OPTIONS": {"REDIS_CLIENT_CLASS": "django_redlock.compat.Redis"},
        }
    }
    with override_settings(CACHES=caches_setting):
        lk = caches["locky"].lock(name, timeout=5)
        assert isinstance(lk, RedisPyLock)
        with lk:
            assert lk.owned() and lk.fence is not None
        assert not lk.locked()


def test_a_dropped_client_is_freed_with_its_connections(
    redis_server: RedisServer, name: str
) -> None:
    # A client made per call and dropped (redis.Redis(...).lock(..., lock_class=...) in a
    # request) must go with its pool and connections, as with redis-py's Lock. The backend
    # kept per client held it strongly, as the value of a dict weakly keyed by it: every
    # client stayed, with its connection (and its waiter's pub/sub), for the process's life.
    tag = "compat-dropped"  # CLIENT SETNAME of these clients' connections only
    observer = redis.Redis(port=redis_server.port)

    def connections() -> int:
        return sum(1 for each in observer.client_list() if each.get("name") == tag)

    clients: list[weakref.ref[Any]] = []
    for _ in range(10):
        holder = redis.Redis(port=redis_server.port, client_name=tag)
        waiter = redis.Redis(port=redis_server.port, client_name=tag)
        held = holder.lock(name, timeout=5, lock_class=RedisPyLock, thread_local=False)
        assert held.acquire()
        releaser = threading.Timer(0.05, held.release)
        releaser.start()
        # A waiter (its pub/sub hub), then a hold with no timeout (renewed by the watchdog).
        with waiter.lock(name, blocking_timeout=5, lock_class=RedisPyLock):
            assert connections() > 0
        releaser.join()
        clients += [weakref.ref(holder), weakref.ref(waiter)]
        del holder, waiter, held, releaser
    gc.collect()
    assert sum(1 for each in clients if each() is not None) == 0, "clients kept"
    # Their backends are closed on the finisher thread (not where the collector ran): the
    # count could reach 0 while a reader being stopped there reconnected meanwhile.
    assert finisher.wait_finished(10)
    deadline = time.monotonic() + 5  # the server sees each close a moment later
    while connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connections() == 0
    observer.close()


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("outage", ["killed", "paused"])
def test_an_unreachable_server_raises_what_redis_pys_lock_raises(
    redis_factory: Callable[..., RedisServer], name: str, outage: str
) -> None:
    """Beside redis-py's own Lock: each call raises an instance of the class redis-py's
    raises (ConnectionError, or TimeoutError for a server that stopped answering), which is
    also our BackendUnavailable."""
    server = redis_factory()
    client = redis.Redis(  # no retries: one socket timeout per call, for both
        port=server.port,
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
        retry=Retry(NoBackoff(), 0),
    )
    theirs = client.lock(f"{name}:theirs")
    ours = client.lock(name, lock_class=RedisPyLock)
    assert theirs.acquire() and ours.acquire()
    server.kill() if outage == "killed" else server.pause()
    try:
        for call in ("acquire", "locked", "release"):
            if call == "release":
                expected, got = _raised(theirs.release), _raised(ours.release)
            else:  # a lock on another name, each (ours would see it waits for itself)
                expected = _raised(getattr(client.lock(f"{name}:b:theirs"), call))
                got = _raised(getattr(client.lock(f"{name}:b", lock_class=RedisPyLock), call))
            assert isinstance(expected, redis.RedisError), (call, expected)
            assert isinstance(got, type(expected)), (call, outage, expected, got)
            assert isinstance(got, BackendUnavailable), (call, got)
    finally:
        if outage == "paused":
            server.resume()
        client.close()


def test_a_self_wait_raises_redis_pys_lock_error(client: Any, name: str) -> None:
    """Two drop-in locks on one name in one thread, the second waiting with no timeout: ours
    says so at once (redis-py's would wait forever), as a redis-py LockError, and ours."""
    held = client.lock(name, lock_class=RedisPyLock)
    assert held.acquire()
    with pytest.raises(LockError, match="itself") as caught:
        client.lock(name, lock_class=RedisPyLock).acquire()
    assert isinstance(caught.value, OurLockError)
    held.release()


def test_a_lost_hold_names_the_clients_own_backend(client: Any, name: str) -> None:
    lk = client.lock(name, timeout=0.2, lock_class=RedisPyLock)
    assert lk.acquire()
    time.sleep(0.4)
    with pytest.raises(LockNotOwnedError) as caught:
        lk.release()
    cause = caught.value.__cause__
    assert cause is not None and "'default'" not in str(cause), str(cause)
    assert f"{client.connection_pool.connection_kwargs['port']}" in str(cause)


def test_a_user_without_the_permission_gets_redis_pys_no_permission_error(
    redis_server: RedisServer, name: str
) -> None:
    """Beside redis-py's own Lock, for a Redis user that may not SET."""
    from tests.conftest import restrict

    restrict(redis_server, "noset", "pw", "~* &* +@all -set")
    client = redis.Redis(port=redis_server.port, username="noset", password="pw")
    try:
        theirs = _raised(client.lock(f"{name}:theirs").acquire)
        ours = _raised(client.lock(name, lock_class=RedisPyLock).acquire)
    finally:
        client.close()
        redis_server.client().execute_command("ACL", "DELUSER", "noset")
    assert isinstance(theirs, redis.exceptions.NoPermissionError), theirs
    assert isinstance(ours, redis.exceptions.NoPermissionError), ours
    assert isinstance(ours, MissingPermission)


@pytest.mark.parametrize("where", ["taken", "returned"])
def test_an_interrupt_as_the_hold_is_taken_hands_it_back(
    client: Any, name: str, where: str
) -> None:
    # An interrupt (Ctrl-C, a soft time limit, a SIGALRM handler that raises) as the hold is
    # taken: in acquire(), before the hold is noted ("taken"), or as acquire() returns into
    # __enter__ ("returned"). The caller holds nothing, so nothing may stay held (it stayed:
    # until its TTL, or renewed for as long as the lock object lived).
    import sys

    from django_redlock.locking.base import BaseLock

    code, caller = {
        "taken": (BaseLock.acquire.__code__, "acquire"),
        "returned": (RedisPyLock.acquire.__code__, "__enter__"),
    }[where]
    strikes = [1]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code or frame.f_back.f_code.co_name != caller:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "return" and arg is True and strikes:
                strikes.pop()
                raise KeyboardInterrupt("as the hold was taken")
            return local

        return local

    lk = client.lock(name, lock_class=RedisPyLock)
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt), lk:
            pytest.fail("the block ran")
    finally:
        sys.settrace(previous)
    assert not strikes
    assert not lk.owned() and lk.local.token is None
    other = client.lock(name, lock_class=RedisPyLock)
    assert other.acquire(blocking=False), "the interrupted hold is still held"
    other.release()


def test_a_dropped_client_s_close_waits_for_no_server_where_it_is_collected(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The collector frees a dropped client at any allocation, in any thread (perhaps one
    holding a lock its backend's close needs): the close (its pub/sub reader stopped and
    awaited, its pools disconnected) runs on the finisher thread, not there. Before: the
    collection waited a socket timeout for the reader's reconnect to the paused server."""
    # The process's older objects out of the collections timed here: a full collection of a
    # test process's heap alone took over a second on a loaded machine.
    gc.collect()
    gc.freeze()
    try:
        _collect_a_dropped_client(redis_factory, name)
    finally:
        gc.unfreeze()


def _collect_a_dropped_client(redis_factory: Callable[..., RedisServer], name: str) -> None:
    server = redis_factory()
    holder = redis.Redis(port=server.port)
    waiter = redis.Redis(port=server.port, socket_timeout=1.0)
    held = holder.lock(name, timeout=5, lock_class=RedisPyLock, thread_local=False)
    assert held.acquire()
    releaser = threading.Timer(0.05, held.release)
    releaser.start()
    with waiter.lock(name, blocking_timeout=5, lock_class=RedisPyLock):  # its hub's reader
        pass
    releaser.join()
    gone = weakref.ref(waiter)
    server.client().execute_command("CLIENT", "PAUSE", 1500, "ALL")
    began = time.monotonic()
    del waiter
    gc.collect()
    took = time.monotonic() - began
    assert gone() is None
    assert took < 0.9, f"the collection took {took:.2f} s"
    assert finisher.wait_finished(5)  # closed once the server answers
