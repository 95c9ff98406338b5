"""A server busy running a long script (BUSY) when the process's pub/sub connection subscribes
its inbox: the first SUBSCRIBE, or redis-py's re-SUBSCRIBE after a reconnect. Once the
script ends, the inbox is subscribed again: later waiters are woken by the release, and none
waits for a confirmation the BUSY reply left pending for the life of the process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import lock, locks, wire
from django_redlock.testing import RedisServer

from ..support.busy import busy

SOCKET_TIMEOUT = 1.0


@pytest.fixture
def server(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "busy": config}):
        yield server


def _handed_over(name: str, held: Any) -> float:
    """How long after ``held``'s release a waiter (asleep on its inbox: the hold has 60 s
    left) got the lock; inf if it did not within 5 s."""
    got: list[float] = []

    def wait() -> None:
        waiter = lock(name, using="busy")
        if waiter.acquire(timeout=5):
            got.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)  # it tried, and sleeps
    released = time.monotonic()
    held.release()
    thread.join(10)
    assert held.acquire(timeout=5)
    return got[0] - released if got else float("inf")


def _inbox_subscribers(server: RedisServer) -> int:
    client = server.client()
    inbox = locks["busy"].hub._inbox
    assert inbox is not None
    return int(dict(client.pubsub_numsub(inbox))[inbox.encode()])


def test_an_inbox_whose_first_subscribe_is_refused_busy_is_subscribed_once_the_script_ends(
    server: RedisServer, name: str
) -> None:
    held = lock(name, using="busy", ttl=60, auto_renew=False)
    assert held.acquire()
    hub = locks["busy"].hub
    with busy(server.client()):
        with hub.watch("one-waiter", by_id=True) as waiter:
            assert waiter.unconfirmed  # BUSY: no confirmation within the socket timeout
        time.sleep(0.3)  # the reader read the refusal
    began = time.monotonic()
    with hub.watch("another-waiter", by_id=True) as waiter:
        assert not waiter.unconfirmed
    assert time.monotonic() - began < SOCKET_TIMEOUT / 2
    assert _inbox_subscribers(server) == 1
    assert _handed_over(name, held) < 0.5


def test_a_wait_s_set_up_refused_busy_says_so(server: RedisServer, name: str) -> None:
    """The error of a wait whose subscription was not confirmed names the server's refusal
    (BUSY), not only the silence."""
    hub = locks["busy"].hub
    with busy(server.client()), hub.watch("one-waiter", by_id=True) as waiter:
        assert waiter.unconfirmed
        message = hub.unconfirmed_error("busy", name)
    assert "did not confirm the wait's subscription" in message, message
    assert "BUSY" in message, message


def test_an_inbox_whose_resubscribe_after_a_reconnect_is_refused_busy_is_subscribed_again(
    server: RedisServer, name: str
) -> None:
    held = lock(name, using="busy", ttl=60, auto_renew=False)
    assert held.acquire()
    assert _handed_over(name, held) < 0.5  # the inbox is subscribed
    hub = locks["busy"].hub
    with busy(server.client()):
        # The reader's connection breaks: redis-py connects again and re-subscribes the
        # inbox, which the busy server refuses.
        sock = wire.socket_or_none(hub._pubsub.connection)
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)
        time.sleep(0.5)
    deadline = time.monotonic() + 2
    while _inbox_subscribers(server) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _inbox_subscribers(server) == 1
    assert _handed_over(name, held) < 0.5
