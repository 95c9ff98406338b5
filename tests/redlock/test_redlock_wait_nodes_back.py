"""A Redlock wait that began while a node was down listens on that node too once it is back:
its count of silent nodes is measured against every node it hears, so one more node pausing
while a majority answers does not end the wait as unavailable."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import lock, locks
from django_redlock.testing import RedisServer

SOCKET_TIMEOUT = 0.5


@pytest.fixture
def nodes(redis_factory: Callable[..., RedisServer]) -> Iterator[list[RedisServer]]:
    servers = [redis_factory() for _ in range(3)]
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in servers],
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "back": config}):
        yield servers


def test_a_waiter_joins_a_node_that_comes_back_while_it_waits(
    nodes: list[RedisServer], name: str
) -> None:
    backend: Any = locks["back"]
    held = lock(name, using="back", ttl=60, auto_renew=False)
    assert held.acquire()
    backend.io.health.failed(0)  # down when the wait starts: it listens on nodes 1 and 2
    outcome: list[Any] = []

    def wait() -> None:
        waiter = lock(name, using="back")
        try:
            outcome.append(waiter.acquire(timeout=20))
        except Exception as exc:
            outcome.append(exc)
        outcome.append(time.monotonic())
        if outcome[0] is True:
            waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)  # it tried, subscribed, and sleeps (the hold has 60 s left)
    assert thread.is_alive(), outcome
    backend.io.health.answered(0)  # back (a probe's or an operation's answer)
    time.sleep(0.3)
    nodes[1].pause()  # nodes 0 and 2 still make a majority
    try:
        time.sleep(SOCKET_TIMEOUT * 3)
        assert thread.is_alive(), outcome
    finally:
        nodes[1].resume()
    released = time.monotonic()
    held.release()
    thread.join(10)
    got, ended = outcome
    assert got is True, got
    assert ended - released < 2.0


def test_a_waiter_asks_a_node_skipped_as_down_when_another_falls_silent(
    nodes: list[RedisServer], name: str
) -> None:
    """The wait began while node 0 counted as down (it answers: its breaker's second was not
    up, and no operation came to probe it), so it listened on nodes 1 and 2; node 1's pause
    then ended the wait with "too few nodes answered the wait's PING", nodes 0 and 2 a
    majority. A PING slow to answer has the skipped node probed at once, within the PING's
    own deadline: the wait goes on, and ends at its timeout (False)."""
    backend: Any = locks["back"]
    held = lock(name, using="back", ttl=60, auto_renew=False)
    assert held.acquire()
    outcome: list[Any] = []

    def wait() -> None:
        waiter = lock(name, using="back")
        try:
            outcome.append(waiter.acquire(timeout=3))
        except Exception as exc:
            outcome.append(exc)

    backend.io.health.failed(0)  # down when the wait starts: it listens on nodes 1 and 2
    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)  # it tried, subscribed, and sleeps (the hold has 60 s left)
    assert thread.is_alive(), outcome
    nodes[1].pause()
    try:
        thread.join(10)
    finally:
        nodes[1].resume()
    assert outcome == [False]
    held.release()
