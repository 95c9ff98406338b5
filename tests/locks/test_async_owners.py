"""Owner identity under asgiref: a lock taken inside ``sync_to_async`` / ``async_to_sync``
code never changes which task or thread owns the caller's holds."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from django_redlock import LockError, lock
from django_redlock.identity import owner_id

ALIAS = "redis"


def _audit() -> None:
    with lock("audit", using=ALIAS):  # any ordinary lock use in sync code
        pass


def test_a_tasks_own_hold_stays_its_own_after_sync_to_async(name: str) -> None:
    async def scenario() -> None:
        held = lock(name, using=ALIAS, reentrant=True, ttl=5)
        async with held:
            await sync_to_async(_audit)()
            assert await held.aowned()
            async with lock(name, using=ALIAS, reentrant=True, timeout=0):  # re-entered
                pass
        assert not await lock(name, using=ALIAS).alocked()

    asyncio.run(scenario())


def test_b_tasks_created_afterwards_are_owners_of_their_own(name: str) -> None:
    """After the caller's sync_to_async, its new tasks (and their sync halves, which run in
    asgiref's one shared thread) are each an owner of their own: one reentrant hold at once."""

    async def take(lock_name: str) -> bool:
        return await lock(lock_name, using=ALIAS, reentrant=True, ttl=5).aacquire(blocking=False)

    def take_in_thread(lock_name: str) -> bool:
        return lock(lock_name, using=ALIAS, reentrant=True, ttl=5).acquire(blocking=False)

    async def scenario() -> tuple[list[bool], list[bool]]:
        await sync_to_async(_audit)()
        direct = await asyncio.gather(take(f"{name}:a"), take(f"{name}:a"))

        async def child() -> bool:
            return await sync_to_async(take_in_thread)(f"{name}:b")

        return list(direct), list(await asyncio.gather(child(), child()))

    direct, in_threads = asyncio.run(scenario())
    assert sorted(direct) == [False, True]
    assert sorted(in_threads) == [False, True]


def test_sync_to_async_calls_of_one_task_are_owners_of_their_own(name: str) -> None:
    """Each call is its own owner (like asyncio.to_thread): a hold taken in one call is not
    the next call's, whoever created it."""

    def take() -> bool:
        return lock(name, using=ALIAS, reentrant=True, ttl=5).acquire(blocking=False)

    async def scenario() -> list[bool]:
        return [await sync_to_async(take)(), await sync_to_async(take)()]

    assert asyncio.run(scenario()) == [True, False]


def test_c_a_task_re_taking_its_own_plain_lock_is_told(name: str) -> None:
    async def scenario() -> None:
        async with lock(name, using=ALIAS, ttl=5):
            await sync_to_async(_audit)()
            this = asyncio.current_task()
            assert this is not None
            guard = asyncio.get_running_loop().call_later(3, this.cancel)  # not for ever
            with pytest.raises(LockError, match="wait for itself"):
                await lock(name, using=ALIAS).aacquire()
            guard.cancel()

    asyncio.run(scenario())


def test_async_to_sync_in_a_thread_keeps_the_threads_owner(name: str) -> None:
    async def audit() -> None:
        async with lock("audit", using=ALIAS):
            pass
        await sync_to_async(_audit)()  # back on this very thread (asgiref's nesting)

    def thread() -> None:
        with lock(name, using=ALIAS, reentrant=True, ttl=5) as held:
            async_to_sync(audit)()
            assert held.owned()
            with lock(name, using=ALIAS, reentrant=True, timeout=0):
                pass

    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _catch(thread, errors))
    worker.start()
    worker.join()
    assert not errors


def _catch(func: Callable[[], None], errors: list[BaseException]) -> None:
    try:
        func()
    except BaseException as exc:
        errors.append(exc)


def test_a_reentrant_aacquire_run_as_a_task_of_its_own_is_refused(name: str) -> None:
    """``asyncio.wait_for(lk.aacquire(), t)`` before Python 3.12 (and ``create_task``,
    ``gather``) runs the acquire as a task of its own, which would own the hold and end at
    once: True, yet no one's to release, expiring unseen. Refused before any Redis call."""

    async def scenario() -> None:
        lk = lock(name, using=ALIAS, reentrant=True, ttl=5)
        with pytest.raises(LockError, match="task of its own"):
            await asyncio.create_task(lk.aacquire())
        with pytest.raises(LockError, match="task of its own"):
            await asyncio.gather(lk.aacquire())
        if sys.version_info < (3, 12):  # wait_for wraps it in a task there
            with pytest.raises(LockError, match="task of its own"):
                await asyncio.wait_for(lk.aacquire(), 5)
        assert not await lk.alocked()
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(5):  # the way that works there
                assert await lk.aacquire()
        else:  # no asyncio.timeout on 3.10: the call's own timeout
            assert await lk.aacquire(timeout=5)
        assert await lk.aowned()
        await lk.arelease()

    asyncio.run(scenario())


def test_a_thread_keeps_its_owner_through_many_nested_calls(name: str) -> None:
    """More nested calls than the slots a Context looks through: each copies its own owner
    back over the thread's; the thread's own stays found (the oldest is kept)."""

    async def audit() -> None:
        await sync_to_async(_audit)()

    def thread() -> None:
        with lock(name, using=ALIAS, reentrant=True, ttl=5) as held:
            for _ in range(20):
                async_to_sync(audit)()
            assert held.owned()
            with lock(name, using=ALIAS, reentrant=True, timeout=0):
                pass

    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _catch(thread, errors))
    worker.start()
    worker.join()
    assert not errors, errors


@pytest.mark.parametrize("earlier", [0, 1, 30], ids=lambda n: f"{n}-earlier-calls")
@pytest.mark.parametrize("nested", [9, 40])
def test_a_reused_thread_keeps_its_owner_for_life(name: str, earlier: int, nested: int) -> None:
    """A WSGI thread that ran nested calls before its first own lock use (their owners copied
    back into it), then, under a reentrant hold, one async_to_sync call with many nested
    sync_to_async lock uses: the thread's owner never changes, and nothing is left held."""

    async def helper(n: int) -> None:
        for _ in range(n):
            await sync_to_async(_audit)()

    def thread() -> None:
        async_to_sync(helper)(earlier)  # an earlier request's code on this thread
        with lock(name, using=ALIAS, reentrant=True, ttl=5) as held:
            before = owner_id()
            async_to_sync(helper)(nested)
            assert owner_id() == before and held.owned()
            with lock(name, using=ALIAS, reentrant=True, timeout=0):  # nests: still its own
                pass
        assert not lock(name, using=ALIAS).locked()

    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _catch(thread, errors))
    worker.start()
    worker.join()
    assert not errors, errors
