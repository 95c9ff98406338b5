"""Reentrant locks: one owner per thread or asyncio task, holds counted in a Redis hash."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from django_redlock import LockLost, LockNotOwned, lock, locks


def test_counts_up_and_down_and_frees_at_zero(alias: str, name: str) -> None:
    held = lock(name, using=alias, reentrant=True)
    fences = []
    for expected in (1, 2, 3):
        assert held.acquire(blocking=False)
        fences.append(held.fence)
        assert held.hold_count() == expected
    assert len(set(fences)) == 1  # a re-entry continues the same hold: same fence
    held.release()
    held.release()
    assert held.hold_count() == 1 and held.locked()
    held.release()
    assert held.hold_count() == 0 and not held.locked()
    with pytest.raises(LockNotOwned):
        held.release()


def test_nested_lock_objects_of_one_owner_share_the_hold(alias: str, name: str) -> None:
    with lock(name, using=alias, reentrant=True) as outer:
        with lock(name, using=alias, reentrant=True, timeout=0) as inner:
            assert inner.hold_count() == 2 and inner.fence == outer.fence
        assert outer.hold_count() == 1 and outer.owned()
    assert not outer.locked()


def test_another_thread_can_neither_acquire_nor_release(alias: str, name: str) -> None:
    held = lock(name, using=alias, reentrant=True)
    held.acquire()
    outcome: dict[str, object] = {}

    def other() -> None:
        outcome["acquired"] = held.acquire(blocking=False)
        outcome["owned"] = held.owned()
        try:
            held.release()
        except LockNotOwned as exc:
            outcome["release"] = exc

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(5)
    assert outcome["acquired"] is False and outcome["owned"] is False
    assert isinstance(outcome["release"], LockNotOwned)
    assert held.hold_count() == 1
    held.release()


def test_another_asyncio_task_is_another_owner(alias: str, name: str) -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        held = lock(name, using=alias, reentrant=True)
        assert await held.aacquire()
        again = await held.aacquire(blocking=False)  # same task: re-entry

        async def other() -> bool:
            return bool(await lock(name, using=alias, reentrant=True).aacquire(blocking=False))

        others = await asyncio.gather(other(), other())
        await held.arelease()
        await held.arelease()
        return again, others[0], others[1]

    assert asyncio.run(scenario()) == (True, False, False)


def test_release_at_zero_wakes_a_waiter(alias: str, name: str) -> None:
    held = lock(name, using=alias, reentrant=True)
    held.acquire()
    held.acquire()
    woke: list[float] = []

    def wait() -> None:
        waiter = lock(name, using=alias, reentrant=True)
        assert waiter.acquire(timeout=5)
        woke.append(time.monotonic())
        waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    held.release()
    time.sleep(0.3)
    assert not woke  # one hold left: still ours
    released = time.monotonic()
    held.release()
    thread.join(5)
    assert woke and woke[0] - released < 1.0  # woken by the release, not the TTL


def test_watchdog_and_loss_work_for_reentrant_holds(alias: str, name: str) -> None:
    held = lock(name, using=alias, reentrant=True, ttl=0.3)
    held.acquire()
    held.acquire()
    time.sleep(1.0)
    assert held.hold_count() == 2  # renewed past three TTLs
    info = locks[alias].inspect(name)
    assert info is not None and info.kind == "reentrant" and info.hold_count == 2
    assert locks[alias].force_release(name)
    deadline = time.monotonic() + 2
    while held.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.lost is not None and not held.owned()
    with pytest.raises(LockLost):
        held.release()
    # The second level is gone too: no acquire nests in it (none reaches Redis) until it is
    # released as well, and then the name is free to take anew.
    with pytest.raises(LockLost, match="nest in a hold that is gone"):
        held.acquire(blocking=False)
    with pytest.raises(LockLost):
        held.release()
    assert held.acquire(blocking=False)
    held.release()


def test_a_re_entry_after_an_unnoticed_loss_is_lost_and_takes_nothing(
    alias: str, name: str
) -> None:
    """The hold vanished (expired while paused, force-released) before the watchdog saw it:
    the server grants a fresh hold with a new fence, which a re-entry must not pass off as
    the old one (the campaign's reentry-fence finding). It is handed back; LockLost."""
    held = lock(name, using=alias, reentrant=True, auto_renew=False, ttl=10)
    held.acquire()
    assert locks[alias].force_release(name)
    with pytest.raises(LockLost, match="before this re-entry"):
        held.acquire(blocking=False)
    assert held.fence is None and locks[alias].inspect(name) is None  # handed back
    with pytest.raises(LockLost):
        held.release()  # the outer level
    assert held.acquire(blocking=False)  # free: a new hold
    held.release()
    assert locks[alias].inspect(name) is None


def test_another_object_of_the_owner_does_not_nest_in_a_lost_hold(alias: str, name: str) -> None:
    outer = lock(name, using=alias, reentrant=True, auto_renew=False, ttl=10)
    outer.acquire()
    assert locks[alias].force_release(name)
    with pytest.raises(LockLost, match="before this re-entry"):
        lock(name, using=alias, reentrant=True).acquire(blocking=False)
    assert locks[alias].inspect(name) is None
    with pytest.raises(LockLost):
        outer.release()
    with lock(name, using=alias, reentrant=True, timeout=0) as again:  # all settled
        assert again.hold_count() == 1


def test_plain_and_reentrant_locks_on_one_name_exclude_each_other(alias: str, name: str) -> None:
    with lock(name, using=alias, reentrant=True):
        assert not lock(name, using=alias).acquire(blocking=False)
    with lock(name, using=alias):
        assert not lock(name, using=alias, reentrant=True).acquire(blocking=False)
