"""An ``aacquire()`` coroutine closed while it waits (GeneratorExit: what the collector or a
torn-down event loop does to a pending task) cleans up without awaiting: it leaves the fair
queue and stops watching, and closing it raises nothing.

(A coroutine closed in the middle of redis-py's own read is redis-py's to clean up: its
async connection needs a running loop to disconnect.)
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from django_redlock import lock, locks


def close_while_waiting(coro: Coroutine[Any, Any, Any], seconds: float) -> None:
    """Run ``coro`` as a task for ``seconds``, close its loop with the task pending, then
    close the coroutine itself."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    loop.run_until_complete(asyncio.sleep(seconds))
    assert not task.done()
    task._log_destroy_pending = False  # left pending on purpose
    loop.close()
    coro.close()  # raised "generator ignored GeneratorExit" before


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("alias", ["redis", "local"])
def test_a_waiter_closed_while_waiting_leaves_cleanly(alias: str, name: str, fair: bool) -> None:
    holder = lock(name, using=alias, ttl=10, fair=fair)
    assert holder.acquire()
    close_while_waiting(lock(name, using=alias, ttl=10, fair=fair).aacquire(timeout=5), 0.3)
    holder.release()
    # A fair waiter left in the queue would keep its place (until its lease lapses) and
    # refuse a newcomer's try.
    newcomer = lock(name, using=alias, ttl=10, fair=fair)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def _pending_in_a_closed_loop(
    make: Callable[[], Coroutine[Any, Any, Any]], count: int, seconds: float
) -> list[asyncio.Task[Any]]:
    """``count`` tasks of ``make()`` run for ``seconds``, then their loop closed with them
    pending (a torn-down loop): they never run again."""
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(make()) for _ in range(count)]
    loop.run_until_complete(asyncio.sleep(seconds))
    for task in tasks:
        assert not task.done()
        task._log_destroy_pending = False  # left pending on purpose
    loop.close()
    return tasks


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("alias", ["redis", "local"])
def test_waiters_of_a_closed_loop_take_no_wake_up_from_a_live_waiter(
    alias: str, name: str, fair: bool
) -> None:
    """Review wai, 1: waiters whose loop was closed, their tasks still referenced (so never
    collected), stayed in the hub and took the release's wake-up: a live waiter of the same
    process behind them slept to its timeout (plain) or ~2 s (fair). The first wake-up that
    finds a waiter's loop closed drops it, and its wake-up goes on at once."""
    holder = lock(name, using=alias, ttl=30, fair=fair)
    assert holder.acquire()
    zombies = _pending_in_a_closed_loop(
        lambda: lock(name, using=alias, ttl=30, fair=fair).aacquire(timeout=20), 3, 0.3
    )
    got: list[float] = []

    def live() -> None:
        waiter = lock(name, using=alias, ttl=30, fair=fair)
        if waiter.acquire(timeout=6):
            got.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=live)
    thread.start()
    time.sleep(0.3)  # waiting behind them
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got, "the live waiter never got the lock"
    assert got[0] - released < 1.0  # the paused-waiter bound is 0.5 s a hand-off
    del zombies
    gc.collect()  # (their clean-up now, the server up: not at the interpreter's exit)


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("alias", ["redis", "local"])
def test_waiting_tasks_of_a_closed_loop_are_collected(
    alias: str, name: str, fair: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review wai, 1: the hub held each waiting task (through its waiter's future), so the
    tasks of a torn-down loop were never collected and their clean-up never ran. Collected
    now, their clean-up leaves the server's waiters; the collector closing their steps
    before the coroutines ("generator ignored GeneratorExit") would leave them in line."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    holder = lock(name, using=alias, ttl=30, fair=fair)
    assert holder.acquire()
    tasks = _pending_in_a_closed_loop(
        lambda: lock(name, using=alias, ttl=30, fair=fair).aacquire(timeout=20), 8, 0.3
    )
    registered = 0 if alias == "local" and not fair else 8  # (by channel there: no ids)
    assert (locks[alias].inspect(name) or pytest.fail()).waiters == registered
    refs = [weakref.ref(task) for task in tasks]
    del tasks
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == []
    assert [u.exc_value for u in unraisable] == []
    deadline = time.monotonic() + 2  # (the clean-up may run on a thread of its own)
    while (locks[alias].inspect(name) or pytest.fail()).waiters and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (locks[alias].inspect(name) or pytest.fail()).waiters == 0
    holder.release()
    newcomer = lock(name, using=alias, ttl=30, fair=fair)
    assert newcomer.acquire(blocking=False)
    newcomer.release()
