"""The finisher is one thread for the process: the clean-ups of closed waiters of a server that
went silent must not hold up another backend's (asyncio.md: "it runs shortly after"; faq.md:
"a backend that does not answer delays only its own"). Real servers, SIGSTOP/SIGCONT."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.test import override_settings

from django_redlock import lock
from django_redlock.locking import finisher
from django_redlock.testing import RedisServer

WAITERS = 6


def _alias(alias: str, server: RedisServer) -> Any:
    """``alias`` a Redis backend on ``server`` with a 1 s socket timeout."""
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 1.0},
    }
    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config})


def test_closed_waiters_of_a_silent_server_do_not_hold_up_another_backend_s_hand_back(
    redis_factory: Callable[..., RedisServer], redis_server: RedisServer, name: str
) -> None:
    """Six waiters of a server then paused are closed (their loop torn down): each clean-up's
    leave and hand-back cost a socket timeout (1 s) there. Then a waiter of the healthy
    backend is closed while its wake-up try waits in its server: granted, held by nobody until
    the finisher hands it back. Before: behind the silent server's twelve timeouts (about 12 s
    held by nobody); now the finisher stops sending to a backend that just did not answer
    (what is left there runs out at its TTL, or its waiter's lease), as a loop's shutdown
    does (steps.finish_now)."""
    silent = redis_factory()
    with _alias("silent", silent):
        holder = lock(f"{name}:silent", using="silent", ttl=60)
        assert holder.acquire()
        loop = asyncio.new_event_loop()
        waiters = [
            lock(f"{name}:silent", using="silent", ttl=60).aacquire(timeout=30)
            for _ in range(WAITERS)
        ]
        for waiter in waiters:
            loop.create_task(waiter)._log_destroy_pending = False  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0.5))  # all waiting
        loop.close()
        silent.pause()
        try:
            for waiter in waiters:
                waiter.close()  # as the collector does: handed to the finisher
            client = redis_server.client()
            held = lock(name, using="redis", ttl=30)
            assert held.acquire()
            loop = asyncio.new_event_loop()
            coroutine = lock(name, using="redis", ttl=30).aacquire(timeout=10)
            task = loop.create_task(coroutine)

            def release_then_pause() -> None:
                held.release()  # wakes the waiter: its try follows ...
                client.execute_command("CLIENT", "PAUSE", 800, "WRITE")  # ... and waits there

            loop.call_later(0.3, release_then_pause)
            loop.run_until_complete(asyncio.sleep(0.5))
            task._log_destroy_pending = False  # type: ignore[attr-defined]
            loop.close()
            coroutine.close()
            closed = time.monotonic()
            newcomer = lock(name, using="redis", ttl=5)
            while not newcomer.acquire(blocking=False):
                waited = time.monotonic() - closed
                assert waited < 4.0, "the healthy hand-back waited behind the silent server"
                time.sleep(0.05)
            newcomer.release()
        finally:
            silent.resume()
        assert finisher.wait_finished(10)


def test_closed_holds_the_finisher_could_not_release_are_no_longer_renewed(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """Two tasks inside ``async with`` of long-lived lock objects; the server pauses, their
    loop is closed and the tasks collected. The finisher's first release times out; the
    second is not sent (the server just did not answer). Before: that second hold stayed
    recorded in its object, renewed by the watchdog for as long as the object lived, once the
    server answered again (review asy3 3). Now an unsent or unanswered closed release lets the
    hold go: it runs out at its TTL."""
    server = redis_factory()
    with _alias("paused", server):
        objects = [lock(f"{name}:{i}", using="paused", ttl=2) for i in range(2)]

        inside = [0]

        async def body(held: Any) -> None:
            async with held:
                inside[0] += 1
                await asyncio.sleep(100)

        async def both_inside() -> None:
            while inside[0] < len(objects):  # (a loaded machine's takes may need long)
                await asyncio.sleep(0.01)

        loop = asyncio.new_event_loop()
        tasks = [loop.create_task(body(held)) for held in objects]
        loop.run_until_complete(asyncio.wait_for(both_inside(), 10))
        assert all(held.locked() for held in objects)
        for task in tasks:
            task._log_destroy_pending = False  # type: ignore[attr-defined]
        server.pause()
        try:
            loop.close()
            del tasks, task, loop
            gc.collect()  # both closes handed to the finisher
            time.sleep(1.4)
        finally:
            server.resume()
        assert finisher.wait_finished(5)
        deadline = time.monotonic() + 2 * 2 + 1  # two TTLs: renewed, it never ends
        while any(lock(held.name, using="paused").locked() for held in objects):
            assert time.monotonic() < deadline, [repr(held) for held in objects]
            time.sleep(0.1)
        assert all(held.token is None for held in objects), [repr(held) for held in objects]
