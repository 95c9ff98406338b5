"""Single Redis's (RedisBackend's) connection pool on the pool's path (a tracer, a retry
option) with max_connections: its renewals, and an interrupt in its checkout or give-back,
with the suite's redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from django_redlock import lock, locks, wire
from django_redlock.testing import RedisServer

from ..support.line_interrupts import LineInterrupter, every_point, interrupted


@contextmanager
def redis_alias(server: RedisServer, **options: Any) -> Iterator[Any]:
    """Backend "r": single Redis on ``server`` with ``options``, closed after."""
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": options,
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "r": config}):
        backend = locks["r"]
        try:
            yield backend
        finally:
            backend.close()


def _traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracer's pass-through wrapper on redis-py's commands (Sentry, ddtrace, OTel install
    one): commands go through the pool, not the thread's own connection."""
    own = redis.Redis.execute_command

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        return own(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)


def test_busy_callers_never_hold_up_the_watchdog_s_renewals(
    redis_server: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's one connection checked out by a caller while a hold's TTL runs: its
    renewals waited for it a socket timeout per try ("No connection available."), and the
    hold expired on a healthy Redis while its owner held it."""
    _traced(monkeypatch)
    with redis_alias(redis_server, socket_timeout=0.5, max_connections=1) as backend:
        held = lock(name, using="r", ttl=1.0)
        assert held.acquire(blocking=False)
        pool = backend.client.connection_pool
        busy = pool.get_connection()  # a caller mid-command, for the whole test
        try:
            lowest = 1000
            started = time.monotonic()
            while time.monotonic() - started < 2.5:  # the TTL, more than twice over
                lowest = min(lowest, redis_server.client().pttl(backend.key(name)))
                time.sleep(0.05)
        finally:
            pool.release(busy)
        assert lowest > 0, f"the held lock's key expired (PTTL {lowest})"
        assert held.owned()
        held.release()


def _outcome(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _path(where: str) -> set[Any]:
    """The pool's functions of a checkout or a give-back (redis-py's and wire's, whichever
    are there): their lines, and the entries of what they call, are the points."""
    names = ("get_connection", "get") if where == "checkout" else ("release", "put", "put_nowait")
    found = set()
    for cls in (redis.BlockingConnectionPool, wire.WaitingPool, wire._Slots):
        for each in names:
            function = vars(cls).get(each)
            while function is not None:  # redis-py's own, and its decorators' (deprecated_args)
                found.add(function.__code__)
                function = getattr(function, "__wrapped__", None)
    return found


@pytest.mark.parametrize(
    ("where", "busy"),
    [("checkout", False), ("checkout", True), ("give-back", False)],
    ids=["checkout", "checkout waiting", "give-back"],
)
def test_a_time_limit_anywhere_in_the_pool_loses_no_connection_and_hangs_nothing(
    redis_server: RedisServer,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    busy: bool,
) -> None:
    """An asynchronous exception (a soft time limit's) at each line of the pool's checkout
    (the connection free, or held by a caller that gives it back while the operation waits)
    or give-back, one at a time; then the next operation, at once. redis-py's plain blocking
    pool lost the connection to one after its queue's get() (every later operation "No
    connection available." on a healthy Redis), and its queue's Condition left the queue's
    lock held to one at its ``__exit__``'s entry (every later operation hung)."""
    _traced(monkeypatch)
    with redis_alias(redis_server, socket_timeout=1.0, max_connections=1) as backend:
        assert backend.is_locked(f"{name}:warm") is False
        pool = backend.client.connection_pool
        give_back = redis.BlockingConnectionPool.release.__code__

        def armed(frame: Any) -> bool:  # a give-back: from redis-py's own (ours recorded it)
            return where == "checkout" or frame.f_code is give_back

        def case(tracer: LineInterrupter) -> None:
            caller = None
            if busy:  # it has the connection, and gives it back while the operation waits
                taken = pool.get_connection()
                caller = threading.Timer(0.02, pool.release, (taken,))
                caller.start()
            interrupted(lambda: backend.is_locked(name), tracer)
            if caller is not None:
                caller.join(5)
            cut = tracer.fired
            assert not pool.pool.mutex.locked(), f"cut at {cut}: the pool's queue lock held"
            later: list[Any] = []
            check = threading.Thread(
                target=lambda: later.append(_outcome(backend.is_locked, name)), daemon=True
            )
            check.start()
            check.join(3)
            assert later == [False], f"cut at {cut}: the next operation: {later or 'hangs'}"
            assert len(pool.pool.queue) == 1, f"cut at {cut}: {len(pool.pool.queue)} of 1 back"

        every_point(case, lambda at: LineInterrupter(at, _path(where), armed))
