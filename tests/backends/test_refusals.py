"""The refusal table (backends/redis.py): a server's refusal of a lock's command is a
LockError that says what the server said: BackendUnavailable for a refusal that lasts for now
(BUSY, NOREPLICAS), BackendRefused for a refusal (OOM). Never redis-py's own ResponseError,
nor a TypeError from a reply read as if it were an answer; on Redis, Sentinel and Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from django_redlock import BackendRefused, BackendUnavailable, lock, locks, semaphore
from django_redlock.testing import RedisServer

from ..support.busy import busy, configured

ALIASES = ("redis", "sentinel", "cluster")


@pytest.fixture(params=ALIASES)
def refusing(request: pytest.FixtureRequest) -> str:
    if request.param != "redis":
        request.getfixturevalue(f"_{request.param}_alias")
    return str(request.param)


def server_of(alias: str, name: str) -> redis.Redis:
    """A plain client of the server that holds lock ``name``'s keys."""
    backend = locks[alias]
    if hasattr(backend, "sharded"):  # Cluster
        node = backend.client.get_node_from_key(backend.key(name))
        return redis.Redis(host=node.host, port=node.port, socket_timeout=30)
    if hasattr(backend, "service_name"):  # Sentinel
        host, port = backend.client.connection_pool.get_master_address()
        return redis.Redis(host=host, port=port, socket_timeout=30)
    kwargs = backend.client.connection_pool.connection_kwargs
    return redis.Redis(host=kwargs["host"], port=kwargs["port"], socket_timeout=30)


def every_call(alias: str, name: str, held: Any) -> dict[str, Callable[[], Any]]:
    return {
        "acquire": lambda: lock(f"{name}:new", using=alias).acquire(blocking=False),
        "aacquire": lambda: asyncio.run(lock(f"{name}:a", using=alias).aacquire(blocking=False)),
        "semaphore": lambda: semaphore(f"{name}:sem", 2, using=alias).acquire(blocking=False),
        "owned": held.owned,
        "locked": held.locked,
        "extend": lambda: held.extend(30),
        "release": held.release,
    }


def test_a_busy_server_is_unavailable_for_every_call(refusing: str, name: str) -> None:
    """BUSY (a long script): every call of a lock raises BackendUnavailable naming BUSY."""
    name = f"{{{name}}}"  # one slot for every lock of the test: one server to make busy
    held = lock(name, using=refusing, ttl=30, auto_renew=False)
    assert held.acquire(blocking=False)
    server = server_of(refusing, name)
    try:
        with busy(server):
            for call, run in every_call(refusing, name, held).items():
                with pytest.raises(BackendUnavailable, match="BUSY") as raised:
                    run()
                assert "busy running a script" in str(raised.value), call
    finally:
        server.close()
    held.release()
    assert not held.locked()


def test_a_server_out_of_memory_refuses_an_acquire(refusing: str, name: str) -> None:
    """OOM (maxmemory, noeviction): an acquire raises BackendRefused with the server's words,
    and no call of a held lock raises anything but a LockError."""
    from django_redlock import LockError

    name = f"{{{name}}}"
    held = lock(name, using=refusing, ttl=30, auto_renew=False)
    assert held.acquire(blocking=False)
    server = server_of(refusing, name)
    try:
        with configured(server, maxmemory=1, **{"maxmemory-policy": "noeviction"}):
            with pytest.raises(BackendRefused, match="OOM") as raised:
                lock(f"{name}:new", using=refusing).acquire(blocking=False)
            assert raised.value.code == "OOM"
            for call, run in every_call(refusing, name, held).items():
                if call != "release":
                    with contextlib.suppress(LockError):  # the table's, never redis-py's
                        run()
    finally:
        server.close()
    held.release()


def test_too_few_replicas_is_unavailable(refusing: str, name: str) -> None:
    """NOREPLICAS (min-replicas-to-write above the replicas connected): BackendUnavailable
    from acquire, extend and release."""
    name = f"{{{name}}}"
    held = lock(name, using=refusing, ttl=30, auto_renew=False)
    assert held.acquire(blocking=False)
    server = server_of(refusing, name)
    try:
        with configured(server, **{"min-replicas-to-write": 5}):
            for call in ("acquire", "aacquire", "semaphore", "extend", "release"):
                with pytest.raises(BackendUnavailable, match="NOREPLICAS"):
                    every_call(refusing, name, held)[call]()
    finally:
        server.close()
    held.release()
    assert not held.locked()


@pytest.mark.usefixtures("_sentinel_alias")
def test_min_replicas_with_a_refused_write_is_not_a_type_error(
    sentinel_group: list[RedisServer], name: str
) -> None:
    """Sentinel's min_replicas pipelines [script, WAIT]: a refused script's error value was
    read as the script's reply (TypeError: 'ResponseError' object is not subscriptable)."""
    config = {**settings.DJANGO_REDLOCK["sentinel"]}
    config["OPTIONS"] = {**config["OPTIONS"], "min_replicas": 1, "min_replicas_timeout": 0.5}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "replicated": config}):
        server = server_of("replicated", name)
        try:
            with configured(server, **{"min-replicas-to-write": 5}):
                with pytest.raises(BackendUnavailable, match="NOREPLICAS"):
                    lock(name, using="replicated").acquire(blocking=False)
                with pytest.raises(BackendUnavailable, match="NOREPLICAS"):
                    semaphore(name, 2, using="replicated").acquire(blocking=False)
            oom = configured(server, maxmemory=1, **{"maxmemory-policy": "noeviction"})
            with oom, pytest.raises(BackendRefused, match="OOM"):
                lock(name, using="replicated").acquire(blocking=False)
        finally:
            server.close()
            locks["replicated"].close()


def test_a_busy_server_is_no_answer_for_the_watchdog(
    refusing: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewals refused with BUSY for half a TTL are no answer: the hold stays held and
    renewed once the script ends, and nothing is logged as the watchdog's own bug (each
    refused renewal was, with redis-py's ResponseError)."""
    import logging

    held = lock(name, using=refusing, ttl=3)
    assert held.acquire(blocking=False)
    server = server_of(refusing, name)
    caplog.set_level(logging.WARNING, logger="django_redlock")
    try:
        with busy(server):
            time.sleep(1.5)  # a renewal falls due (every second) and is refused
    finally:
        server.close()
    time.sleep(1.0)  # renewed since
    assert held.owned()
    bugs = [r for r in caplog.records if r.exc_info]
    assert not bugs, f"logged as the watchdog's bugs: {bugs[0].getMessage()}"
    held.release()


def test_a_redlock_node_refusing_is_no_answer(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """A Redlock node's refusal is that node's no answer, in the table's words: its error
    reply was parsed as an answer (bool(ResponseError) is True), so with 2 of 3 nodes BUSY
    extend() said done and locked() said held, one node answering."""
    from django_redlock import QuorumNotReached

    nodes = [redis_factory() for _ in range(3)]
    config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend",
              "LOCATION": [n.url for n in nodes], "OPTIONS": {"socket_timeout": 2.0}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "r": config}):
        held = lock(name, using="r", ttl=30, auto_renew=False)
        assert held.acquire(blocking=False)
        first, second = (redis.Redis(port=n.port, socket_timeout=30) for n in nodes[:2])
        try:
            with busy(first), busy(second):
                for call in (lambda: held.extend(20), held.locked, held.owned, held.release):
                    with pytest.raises(QuorumNotReached, match="busy running a script"):
                        call()
        finally:
            first.close()
            second.close()
        held.release()
        locks["r"].close()
