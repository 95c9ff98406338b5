"""A waiter's channel is not left subscribed on a server that was paused when the waiter left.

The leave's UNSUBSCRIBE goes out to the paused server (its kernel takes the bytes) and
redis-py keeps the channel among its subscriptions until the server confirms. The hub then
finds the server silent and drops the connection; redis-py's reconnect subscribes again to
everything it still has, that channel too, and the SUBSCRIBE runs once the server resumes:
the channel stayed subscribed there for good, nobody waiting on it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.test import override_settings

from django_redlock import LockError, lock, locks
from django_redlock.testing import RedisServer

from ..redlock.test_redlock import quorum_alias


def _channels(server: RedisServer, part: str) -> list[bytes]:
    found = server.client().execute_command("PUBSUB", "CHANNELS", "*")
    return [c for c in found if part.encode() in c]


@contextmanager
def _keeper(alias: str, name: str) -> Iterator[dict[str, Any]]:
    """Another waiter waits throughout (its lock held for long): the hub has waiters, so it
    checks a silent server, finds it so and drops the connection."""
    held = lock(name, using=alias, ttl=30, auto_renew=False)
    assert held.acquire(blocking=False)
    got: dict[str, Any] = {}

    def wait() -> None:
        try:
            got["keep"] = lock(name, using=alias, ttl=5).acquire(timeout=20)
        except LockError as exc:
            got["keep"] = exc

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        held.release()
        thread.join(10)


def _wait_until(check: Callable[[], bool], within: float = 3.0) -> None:
    until = time.monotonic() + within
    while not check():
        assert time.monotonic() < until, "never"
        time.sleep(0.005)


def _leave_while_paused(
    alias: str, name: str, paused: RedisServer, watched: list[RedisServer], part: str
) -> None:
    """A waiter waits on ``name``; ``paused`` is SIGSTOPped once it subscribed; the holder
    releases and the waiter takes the lock (or, when the holder's release cannot be
    decided, times out) and leaves; ``paused`` resumes once its hub dropped the connection."""
    holder = lock(name, using=alias, ttl=30, auto_renew=False)
    assert holder.acquire(blocking=False)
    outcome: list[object] = []

    def wait() -> None:
        waiter = lock(name, using=alias, ttl=5, auto_renew=False)
        try:
            outcome.append(waiter.acquire(timeout=1.0))
            if outcome[-1]:
                waiter.release()
        except LockError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    _wait_until(lambda: all(_channels(server, part) for server in watched))  # subscribed
    time.sleep(0.1)
    paused.pause()
    try:
        time.sleep(0.02)
        with contextlib.suppress(LockError):
            holder.release()  # decided by the other nodes (Redlock); else it fails
        thread.join(10)
        assert outcome, "the waiter never came back"
        time.sleep(1.0)  # the hub found the server silent meanwhile, and dropped the connection
    finally:
        paused.resume()


def test_a_single_server_paused_as_the_waiter_leaves_has_only_the_inbox_subscribed(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The same on one server cannot leave a channel behind: its waiters are woken by id in
    their process's inbox, subscribed for the life of the process, and no channel is
    subscribed per wait. What the server has once the waiter left and it was heard again:
    the inbox alone."""
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "single": config}):
        inbox = locks["single"].inbox_prefix  # type: ignore[attr-defined]
        with _keeper("single", f"{name}:keep"):
            _leave_while_paused("single", name, server, [server], inbox)
            time.sleep(1.0)  # the re-SUBSCRIBE queued there has run, and any unsubscribe after
            subscribed = _channels(server, "")
            assert subscribed and all(c.startswith(inbox.encode()) for c in subscribed), subscribed


def test_a_redlock_node_paused_as_the_waiter_leaves_keeps_no_subscription_of_it(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("subs", servers, socket_timeout=0.3):
        backend = locks["subs"]
        key = backend.nodes[1].key(name)  # type: ignore[attr-defined]
        with _keeper("subs", f"{name}:keep"):
            _leave_while_paused("subs", name, servers[1], servers, key)
            hub = backend.hub.hubs[1]  # type: ignore[attr-defined]
            _wait_until(lambda: not hub._silent, within=5)  # heard: re-subscribed there
            until = time.monotonic() + 5
            while _channels(servers[1], key) and time.monotonic() < until:
                time.sleep(0.05)
            assert not _channels(servers[1], key), "still subscribed on node 1"
            assert key.encode() not in hub._pubsub.channels  # not to be subscribed again either
