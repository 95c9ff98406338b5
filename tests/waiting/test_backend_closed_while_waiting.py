"""A backend closed while its waiters sleep (``locks.close_all()``, a settings change) stays
in use: its next call makes a new client and a new hub. A waiter asleep on the closed hub
is woken once by the close; it must then watch on the new hub, or no release reaches it and
it sleeps until the hold's expiry (7.2 s after a release, the hold's TTL 8 s)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from django_redlock import lock, locks


@pytest.mark.parametrize("mode", ["plain", "fair", "async"])
def test_a_waiter_asleep_when_the_backend_closes_is_woken_by_the_next_release(
    name: str, mode: str
) -> None:
    fair = mode == "fair"
    backend = locks["default"]
    holder = lock(name, ttl=8, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    waiter = lock(name, ttl=8, fair=fair)
    got: list[float] = []

    def take() -> None:
        if mode == "async":
            taken = asyncio.run(waiter.aacquire(timeout=3))
        else:
            taken = waiter.acquire(timeout=3)
        if taken:
            got.append(time.monotonic())

    thread = threading.Thread(target=take)
    thread.start()
    time.sleep(0.3)  # it tried, watches, and sleeps on the hold's TTL
    old = backend.hub
    backend.close()
    time.sleep(0.3)  # woken by the close, it tried again and sleeps again
    assert backend.hub is not old
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got, "the waiter slept through the release"
    assert got[0] - released < 1.0, got[0] - released
    waiter.release()
    hub = backend.hub
    assert not any(hub._waiters.values()), hub._waiters
