"""The asyncio API: the same Lock, awaited through its a-methods; waiting by pub/sub."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from django.test import AsyncClient, Client, override_settings

from django_redlock import LockLost, LockNotAcquired, LockNotOwned, lock, lock_all, locks
from django_redlock.testing import RedisServer


def test_await_acquire_release_and_queries(alias: str, name: str) -> None:
    async def scenario() -> None:
        held = lock(name, using=alias, ttl=10)
        assert await held.aacquire()
        assert await held.aowned() and await held.alocked()
        ttl = await held.attl()
        assert ttl is not None and 9 < ttl <= 10
        assert not await lock(name, using=alias).aacquire(blocking=False)
        await held.aextend(20)
        await held.arelease()
        assert not await held.alocked()
        with pytest.raises(LockNotOwned):
            await held.arelease()

    asyncio.run(scenario())


def test_async_with_and_fencing(alias: str, name: str) -> None:
    async def scenario() -> list[int | None]:
        fences = []
        for _ in range(3):
            async with lock(name, using=alias) as held:
                fences.append(held.fence)
        async with lock(name, using=alias):
            with pytest.raises(LockNotAcquired):
                async with lock(name, using=alias, timeout=0.1):
                    pass
        return fences

    fences = asyncio.run(scenario())
    assert fences == sorted(set(fences)) and len(fences) == 3


@pytest.mark.parametrize("fair", [False, True])
def test_two_hundred_tasks_never_overlap(alias: str, name: str, fair: bool) -> None:
    async def scenario() -> tuple[int, int]:
        inside = peak = done = 0

        async def worker() -> None:
            nonlocal inside, peak, done
            async with lock(name, using=alias, ttl=10, fair=fair):
                inside += 1
                peak = max(peak, inside)
                await asyncio.sleep(0)
                inside -= 1
                done += 1

        await asyncio.gather(*(worker() for _ in range(200)))
        return peak, done

    assert asyncio.run(scenario()) == (1, 200)


def _keys(server: RedisServer) -> set[bytes]:
    return set(server.client().keys("*"))


@pytest.mark.parametrize("fair", [False, True])
def test_cancelling_a_waiting_task_leaves_nothing_behind(
    redis_alias: str, redis_server: RedisServer, name: str, fair: bool
) -> None:
    async def scenario() -> None:
        holder = lock(name, using=redis_alias, fair=fair)
        await holder.aacquire()
        before = _keys(redis_server)
        waiter = asyncio.create_task(lock(name, using=redis_alias, fair=fair).aacquire())
        await asyncio.sleep(0.2)
        if fair:
            assert (locks[redis_alias].inspect(name) or pytest.fail()).waiters == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert _keys(redis_server) == before  # no queue entry, no stray hold
        info = locks[redis_alias].inspect(name)
        assert info is not None and info.waiters == 0
        await holder.arelease()

    asyncio.run(scenario())


def test_a_cancelled_waiter_never_releases_a_hold_another_task_took_with_its_object(
    redis_alias: str, name: str
) -> None:
    """Task A waits with object L (module-level: a plain lock's owner is the object) and is
    cancelled as the lock frees; task B takes it with L at once. A's undo looked at L's hold
    after its clean-up's round trips: B's, which it released under B, and another object
    took the lock (review wai2, 2: two holders). The undo knows the hold its own take
    recorded: none."""

    async def scenario() -> None:
        mine = lock(name, using=redis_alias, ttl=30)
        holder = lock(name, using=redis_alias, ttl=30)
        assert await holder.aacquire()
        a = asyncio.ensure_future(mine.aacquire(timeout=25))
        await asyncio.sleep(0.3)
        await holder.arelease()
        a.cancel()
        assert await mine.aacquire(blocking=False)  # task B, the same object
        await asyncio.sleep(0.3)  # A's clean-up is over
        assert a.cancelled()
        other = lock(name, using=redis_alias, ttl=30)
        assert not await other.aacquire(blocking=False), "two holders"
        await mine.arelease()

    asyncio.run(scenario())


def test_cancelling_a_holding_task_releases_the_lock(alias: str, name: str) -> None:
    async def scenario() -> bool:
        started = asyncio.Event()

        async def body() -> None:
            async with lock(name, using=alias):
                started.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(body())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return bool(await lock(name, using=alias).alocked())

    assert asyncio.run(scenario()) is False


def test_a_loop_per_request_leaves_no_event_loop_behind(alias: str, name: str) -> None:
    """asyncio.md: a loop per request (``asyncio.run``, asgiref's ``async_to_sync``) leaves
    nothing behind: each finished loop is collected (review wai, 5: every loop that ran a
    lock command was kept for the life of the process). The last one's closed client is let
    go by the next loop's first command (``aclient``): one loop at most per backend."""
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def request() -> None:
        held = lock(name, using=alias, ttl=5)
        assert await held.aacquire(timeout=1)
        await held.arelease()
        loops.append(weakref.ref(asyncio.get_running_loop()))

    for _ in range(4):
        asyncio.run(request())
    gc.collect()
    assert [ref for ref in loops[:-1] if ref() is not None] == []


def test_async_waiter_wakes_on_release(alias: str, name: str) -> None:
    async def scenario() -> float:
        holder = lock(name, using=alias)
        await holder.aacquire()
        woke: list[float] = []

        async def wait() -> None:
            assert await lock(name, using=alias).aacquire(timeout=10)
            woke.append(time.monotonic())

        task = asyncio.create_task(wait())
        await asyncio.sleep(0.3)
        released = time.monotonic()
        await holder.arelease()
        await task
        return woke[0] - released

    assert asyncio.run(scenario()) < 1.0  # woken by the release, not the TTL


def test_async_watchdog_renews_and_reports_loss(alias: str, name: str) -> None:
    async def scenario() -> None:
        # Renewed past its TTL (1.5 of 1 s); a 0.3 s TTL missed a renewal under load.
        held = lock(name, using=alias, ttl=1.0)
        await held.aacquire()
        await asyncio.sleep(1.5)
        assert await held.aowned()
        assert locks[alias].force_release(name)
        deadline = time.monotonic() + 5
        while held.lost is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert held.lost is not None
        with pytest.raises(LockLost):
            await held.arelease()

    asyncio.run(scenario())


def test_async_decorator(alias: str, name: str) -> None:
    @lock(name + ":{user_id}", using=alias, timeout=0)
    async def report(user_id: int) -> bool:
        return bool(await lock(f"{name}:{user_id}", using=alias).alocked())

    assert asyncio.run(report(3)) is True
    assert not locks[alias].is_locked(f"{name}:3")


@pytest.mark.django_db
def test_inside_django_views_sync_and_async() -> None:
    assert Client().get("/locked-sync/").content == b"held 1"
    response = asyncio.run(AsyncClient().get("/locked-async/"))
    assert response.content == b"held 1"


@pytest.mark.parametrize("kind", ["plain", "reentrant", "lock_all"])
def test_a_second_cancellation_during_async_withs_release_still_releases(
    redis_factory: Callable[..., RedisServer], name: str, kind: str
) -> None:
    """The body is cancelled; then, while the release waits for the pool's only connection
    (busy with a command to a paused server), the task is cancelled again. The release is
    finished anyway, not left to the lock's TTL while the next waiter waits."""
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"max_connections": 1, "socket_timeout": 3},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "one": config}):

        async def scenario() -> float:
            entered = asyncio.Event()

            async def holder() -> None:
                held = (
                    lock_all(name, f"{name}:b", using="one", ttl=20)
                    if kind == "lock_all"
                    else lock(name, using="one", ttl=20, reentrant=kind == "reentrant")
                )
                async with held:
                    entered.set()
                    await asyncio.sleep(100)

            task = asyncio.create_task(holder())
            await entered.wait()
            server.pause()
            busy = asyncio.create_task(lock(f"{name}:other", using="one").alocked())
            await asyncio.sleep(0.2)  # it has the only connection, waiting for an answer
            task.cancel()  # the body ends: the release waits for the connection
            await asyncio.sleep(0.2)
            task.cancel()  # and again, during the release
            with contextlib.suppress(asyncio.CancelledError):
                await task
            server.resume()
            with contextlib.suppress(Exception):
                await busy
            started = time.monotonic()
            assert await lock(name, using="one").aacquire(timeout=15)
            return time.monotonic() - started

        waited = asyncio.run(scenario())
        locks["one"].close()
    assert waited < 2, f"the next holder waited {waited:.1f} s"


def _send_done(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is suspended in asyncio.wait_for (redis-py sends each command under
    it) whose inner send has finished: a cancellation landing now is swallowed by wait_for
    before Python 3.12, which returns the send's result instead of raising."""
    coro: object = task.get_coro()  # (not task.get_stack(): it stops at a Future)
    while coro is not None:
        frame = getattr(coro, "cr_frame", None)
        code = None if frame is None else frame.f_code
        if code is not None and code.co_name == "wait_for" and "asyncio" in code.co_filename:
            inner = frame.f_locals.get("fut")  # type: ignore[union-attr]
            return isinstance(inner, asyncio.Future) and inner.done()
        coro = getattr(coro, "cr_await", None)
    return False


async def _at_a_finished_send(task: asyncio.Task[Any]) -> None:
    """Step the loop until ``task``, or a task it awaits (each command's, on Python 3.10),
    is in the window of :func:`_send_done`: the first command's (nothing else sends yet)."""
    for _ in range(100_000):
        await asyncio.sleep(0)
        others = asyncio.all_tasks() - {task, asyncio.current_task()}
        if any(_send_done(each) for each in (task, *others)):
            return
    if sys.version_info >= (3, 12):
        pytest.skip("wait_for no longer swallows a cancellation (Python 3.12+)")
    pytest.fail("never caught a command's send finished inside wait_for")


@pytest.mark.parametrize("busy", [True, False], ids=["waiting", "granted"])
@pytest.mark.parametrize("fair", [False, True])
def test_a_cancellation_swallowed_by_redis_pys_send_still_cancels_the_acquire(
    redis_alias: str, redis_server: RedisServer, name: str, fair: bool, busy: bool
) -> None:
    """The task is cancelled as its try's send finishes inside redis-py's wait_for, which
    (before Python 3.12) drops the cancellation. The acquire still raises CancelledError, at
    once: it neither waits on to take the lock at the next release (``busy``) nor keeps a
    hold granted in that moment (else); nothing but the fence counter is left on the server."""

    async def scenario() -> None:
        holder = lock(name, using=redis_alias, ttl=30, fair=fair)
        if busy:
            assert await holder.aacquire(blocking=False)
        waiter = lock(name, using=redis_alias, ttl=30, fair=fair)
        task = asyncio.ensure_future(waiter.aacquire(timeout=None))
        await _at_a_finished_send(task)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        if busy:
            await holder.arelease()  # never taken by the cancelled waiter
        if not done:
            await asyncio.wait([task], timeout=5)
        assert task.cancelled(), f"the cancelled acquire returned {task.result()!r}"
        assert not await waiter.aowned()
        assert not await waiter.alocked()  # a hold granted in that moment was handed back
        left = {key for key in _keys(redis_server) if name.encode() in key}
        # The fence stays, and the hand-back's marker of a try that may be on the wire
        # (refusing it if it lands after the hand-back) expires on its own.
        marker = locks[redis_alias].handed_back_key(name, "").encode()
        assert all(redis_server.client().pttl(key) > 0 for key in left if marker in key)
        assert {key for key in left if not key.endswith(b":f") and marker not in key} == set()

    asyncio.run(scenario())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout: Python 3.11+")
def test_an_asyncio_timeout_expiring_as_a_send_finishes_ends_the_wait(
    redis_alias: str, name: str
) -> None:
    """``async with asyncio.timeout(T)`` around a waiting aacquire(): its expiry lands as a
    send finishes inside redis-py's wait_for. The wait still ends then, with TimeoutError,
    not when the lock frees."""

    async def scenario() -> None:
        holder = lock(name, using=redis_alias, ttl=30)
        assert await holder.aacquire(blocking=False)
        waiter = lock(name, using=redis_alias, ttl=30)
        scope: list[asyncio.Timeout] = []

        async def user() -> bool:
            async with asyncio.timeout(30) as cm:
                scope.append(cm)
                return await waiter.aacquire()

        task = asyncio.ensure_future(user())
        while not scope:
            await asyncio.sleep(0)
        await _at_a_finished_send(task)
        scope[0].reschedule(asyncio.get_running_loop().time())  # it expires now
        done, _ = await asyncio.wait([task], timeout=2)
        await holder.arelease()
        if not done:
            await asyncio.wait([task], timeout=5)
        assert done, "the wait outlived its asyncio.timeout"
        with pytest.raises(TimeoutError):
            task.result()
        assert not await waiter.aowned()

    asyncio.run(scenario())
