"""The django-redis backend on a real, SIGSTOPped redis-server: a lock operation never waits
forever, whatever the cache's connection settings."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django_redis import get_redis_connection

from django_redlock import BackendUnavailable, lock, locks
from django_redlock.testing import RedisServer

CACHE = "django_redis.cache.RedisCache"
BACKEND = "django_redlock.backends.django_redis.DjangoRedisBackend"


@contextmanager
def on_cache(options: dict[str, Any], location: str) -> Iterator[None]:
    """Alias "c" locks on the django-redis cache "c" (at ``location``, with ``options``)."""
    caches = {**settings.CACHES, "c": {"BACKEND": CACHE, "LOCATION": location, "OPTIONS": options}}
    aliases = {**settings.DJANGO_REDLOCK, "c": {"BACKEND": BACKEND, "CACHE": "c"}}
    with override_settings(CACHES=caches, DJANGO_REDLOCK=aliases):
        yield


def within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """What ``call`` raised, or AssertionError if it was still running after ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds:g} s: a hang"
    return outcome[0]


# redis-py before 8 gives a connection no socket timeout unless told; django-redis tells it
# only with SOCKET_TIMEOUT. The explicit None here is that default, on any redis-py.
NO_TIMEOUT = {"CONNECTION_POOL_KWARGS": {"socket_timeout": None}}


def test_a_cache_without_socket_timeout_never_hangs_a_lock(
    redis_factory: Callable[..., RedisServer],
) -> None:
    server = redis_factory()
    with on_cache(NO_TIMEOUT, server.url):
        assert get_redis_connection("c").connection_pool.connection_kwargs["socket_timeout"] is None
        held = lock("n", using="c", auto_renew=False)
        assert held.acquire(blocking=False)
        server.pause()
        try:
            calls = [lambda: lock("m", using="c").acquire(blocking=False), held.release,
                     held.locked, lambda: asyncio.run(lock("m", using="c").aacquire())]  # fmt: skip
            for call in calls:
                started = time.monotonic()
                error = within(2.0 + 3.0, call)
                assert isinstance(error, BackendUnavailable), error
                assert time.monotonic() - started < 2.0 + 1.0  # the backend's default timeout
        finally:
            server.resume()
        held.release()  # the hold was kept (no answer): released now
        assert not lock("n", using="c").locked()


def test_a_cache_with_a_socket_timeout_shares_its_pool(redis_server: RedisServer) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # django-redis's pools are per URL
    with on_cache({"SOCKET_TIMEOUT": 1}, url):
        pool = get_redis_connection("c").connection_pool
        assert locks["c"].client.connection_pool is pool  # type: ignore[attr-defined]
        with lock("n", using="c") as held:
            assert held.owned()


def test_a_sentinel_cache_without_socket_timeout_is_refused() -> None:
    options = {**NO_TIMEOUT, "CLIENT_CLASS": "django_redis.client.SentinelClient",
               "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
               "SENTINELS": [("127.0.0.1", 9)]}  # fmt: skip
    refused = pytest.raises(ImproperlyConfigured, match=r"no socket timeout.*SOCKET_TIMEOUT")
    with on_cache(options, "redis://mymaster/0"), refused:
        lock("n", using="c").acquire(blocking=False)


class ProjectPool(redis.BlockingConnectionPool):
    """A project's own pool class (instrumentation, say): a subclass of a known one."""


def test_renewals_on_a_cache_with_a_pool_class_of_its_own_are_not_queued_behind_its_callers(
    redis_server: RedisServer,
) -> None:
    """The renewals' own pool was made for the exact known pool classes only: with a
    BlockingConnectionPool subclass, two callers busy on the cache's two connections held
    every renewal back, and the hold ran out unannounced on a healthy Redis. Renewed on a
    pool of their own now, and a loss found there is reported (review wdc3, 5)."""
    url = redis_server.url.rsplit("/", 1)[0] + "/7"  # django-redis's pools are per URL
    options = {"CONNECTION_POOL_CLASS": f"{__name__}.ProjectPool", "SOCKET_TIMEOUT": 2,
               "CONNECTION_POOL_KWARGS": {"max_connections": 2, "timeout": 20}}  # fmt: skip
    with on_cache(options, url):
        assert isinstance(get_redis_connection("c").connection_pool, ProjectPool)
        held = lock("n", using="c", ttl=1.5)
        assert held.acquire(blocking=False)
        stop = threading.Event()

        def consume() -> None:  # a queue consumer, back to back on the cache's connections
            client = get_redis_connection("c")
            while not stop.is_set():
                client.blpop(["jobs"], 1)

        consumers = [threading.Thread(target=consume, daemon=True) for _ in range(2)]
        for consumer in consumers:
            consumer.start()
        probe, key = redis_server.client(db=7), locks["c"].key("n")
        try:
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert probe.exists(key), "the hold ran out while its owner held it"
                time.sleep(0.05)
            probe.delete(key)  # gone: the next renewal finds it, and says so
            deadline = time.monotonic() + 3.0
            while held.lost is None:
                assert time.monotonic() < deadline, "a loss on the renewals' pool not reported"
                time.sleep(0.05)
        finally:
            stop.set()
            for consumer in consumers:
                consumer.join(3)
