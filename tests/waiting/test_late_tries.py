"""A waiter's try given up on at the wait's verdict (the server went silent) runs on to its own
socket timeout; a request that reaches the server after that (the server paused and resumed,
a request delayed on the wire) is granted to that try's token. backends.md: the same object's
next try "finds its own hold if it did". Real server, SIGSTOP/SIGCONT."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import BackendUnavailable, lock, locks
from django_redlock.testing import RedisServer

SOCKET_TIMEOUT = 1.0


@pytest.fixture
def server(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "late": config}):
        yield server


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_try_granted_after_its_own_timeout_is_found_by_the_same_object_s_next_try(
    server: RedisServer, name: str, fair: bool
) -> None:
    """Before: the late try's token was dropped when its command timed out; the grant was
    held by nobody and the same object's next tries (new tokens) were refused for its TTL."""
    backend = locks["late"]
    holder = lock(name, using="late", ttl=2.0, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + 2.0

    async def main() -> Any:
        waiter = lock(name, using="late", ttl=30, fair=fair)
        task = asyncio.create_task(waiter.aacquire(timeout=30))
        # Stopped just before the try at the hold's expiry; resumed after the try's own
        # read timeout (1 s after it went out): the request waits in the server's socket.
        await asyncio.sleep(max(0.0, expiry - 0.3 - time.monotonic()))
        trips = backend.round_trips
        server.pause()
        try:
            with pytest.raises(BackendUnavailable):
                await task
            await asyncio.sleep(SOCKET_TIMEOUT + 1.0)  # the try's own command timed out
        finally:
            server.resume()
        assert backend.round_trips > trips, "no try went out during the stop"
        deadline = time.monotonic() + 5
        while backend.inspect(name) is None or backend.inspect(name).token == holder.token:
            assert time.monotonic() < deadline, "the late try never reached the server"
            await asyncio.sleep(0.05)
        got = await waiter.aacquire(timeout=2)
        if got:
            await waiter.arelease()
        return got

    assert asyncio.run(main()) is True, "the same object's next try did not find its hold"
    assert backend.inspect(name) is None
