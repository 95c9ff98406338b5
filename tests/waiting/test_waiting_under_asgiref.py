"""A blocking wait in asgiref's thread-sensitive thread (docs/topics/waiting.md, "Waiting for
yourself"): the self-wait guard knows only the caller's owner, and each ``sync_to_async``
call is an owner of its own, so a wait there for a lock another call there holds is not
refused; it blocks the one thread that call's release would run in, until its timeout."""

from __future__ import annotations

import asyncio
import time

from asgiref.sync import sync_to_async

from django_redlock import lock


def test_a_wait_in_the_thread_sensitive_thread_blocks_it_until_its_timeout(name: str) -> None:
    first = lock(name, using="redis", ttl=3)  # renewed by the watchdog: never lapses
    second = lock(name, using="redis", ttl=3)
    events: list[tuple[str, float]] = []

    async def take_and_release() -> None:
        assert await sync_to_async(first.acquire)()
        await asyncio.sleep(0.2)  # the other task's wait starts meanwhile
        await sync_to_async(first.release)()  # has to wait for the thread
        events.append(("released", time.monotonic()))

    async def wait_for_it() -> None:
        await asyncio.sleep(0.1)
        started = time.monotonic()
        # Not refused at once (another call's hold), and no deadlock with a timeout: the
        # thread is blocked until it runs out, then the release runs.
        got = await sync_to_async(second.acquire)(timeout=1.0)
        events.append(("waited", time.monotonic() - started))
        assert got is False

    async def both() -> None:
        await asyncio.gather(take_and_release(), wait_for_it())

    asyncio.run(both())
    waited = dict(events)["waited"]
    assert 0.9 <= waited < 2.0, events
    assert [e for e, _ in events] == ["waited", "released"]  # the release waited for it
    assert not first.locked()
