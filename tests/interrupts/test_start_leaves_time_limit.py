"""A Celery soft time limit (``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises)
landing as the hub starts the thread that sends evicted leaves (``ReleaseHub._start_leaves``,
reached from every ``abandon``: a wait's set-up registers its leave that way before its first
try, and a wait's clean-up leaves that way a leave not sent or failed, once more than
``ABANDONED_MAX`` leaves are owed).

The rule: the time limit comes out (of the wait, of ``abandon``), and the leaves taken out
of the registry are put back (sent at a wake-up or a later eviction). Caught as "no thread to
be had" (``except Exception``), it was dropped: the wait went on past the time limit and took
the lock (review w4, 2). And ``start_thread`` lets out such a time limit as itself, not as the
``RuntimeError`` a second interrupt in ``Thread.start()``'s wait makes of it, which the
set-ups catch as a failed subscribe (review w4, suspected).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from django_redlock import lock, locks, waiters
from django_redlock.waiters import ReleaseHub


class TimeLimit(Exception):
    """What Celery's soft time limit is: an Exception, raised by a signal handler."""


@pytest.fixture
def full_registry() -> Iterator[ReleaseHub]:
    """The default backend's hub with ABANDONED_MAX old owed leaves (no-ops: evictable)."""
    hub = locks["default"].hub
    assert isinstance(hub, ReleaseHub)
    old = [f"old-waiter-{i}" for i in range(hub.ABANDONED_MAX)]
    for waiter_id in old:
        hub._keep(waiter_id, lambda: None, 0.0)
    try:
        yield hub
    finally:
        for waiter_id in old:
            hub.settle(waiter_id)


@pytest.fixture
def time_limited_start(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``waiters.start_thread`` raises TimeLimit once, in this thread (the signal landing
    in ``Thread.start()``'s wait for the thread to run); the names of the threads so cut."""
    cut: list[str] = []
    real = waiters.start_thread
    caller = threading.current_thread()

    def start_thread(thread: threading.Thread) -> None:
        if not cut and threading.current_thread() is caller:
            cut.append(thread.name)
            raise TimeLimit("soft time limit")
        real(thread)

    monkeypatch.setattr(waiters, "start_thread", start_thread)
    return cut


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_time_limit_as_a_wait_s_set_up_starts_the_leaves_comes_out_of_the_wait(
    driver: str, name: str, full_registry: ReleaseHub, time_limited_start: list[str]
) -> None:
    holder = lock(name, ttl=10)
    assert holder.acquire(blocking=False)
    waiter = lock(name, ttl=10)
    try:
        with pytest.raises(TimeLimit):
            if driver == "async":
                asyncio.run(waiter.aacquire(timeout=3))
            else:
                waiter.acquire(timeout=3)
        assert time_limited_start == ["redlock-leave"]
        assert waiter.token is None
        # The evicted one is back: nothing taken out of the registry was forgotten.
        assert all(f"old-waiter-{i}" in full_registry._abandoned for i in range(3))
    finally:
        holder.release()


def test_a_time_limit_as_an_abandon_starts_the_leaves_comes_out_the_leaves_kept(
    full_registry: ReleaseHub, time_limited_start: list[str]
) -> None:
    """The path of a wait's clean-up (``leave_waiters``: a leave not sent or failed)."""
    with pytest.raises(TimeLimit):
        full_registry.abandon("cut-waiter", lambda: None)
    assert time_limited_start == ["redlock-leave"]
    assert "cut-waiter" in full_registry._abandoned
    assert "old-waiter-0" in full_registry._abandoned  # (the one evicted: put back)
    full_registry.settle("cut-waiter")


def test_a_time_limit_made_a_runtime_error_by_thread_start_comes_out_as_itself() -> None:
    """A burst in ``Thread.start()``: the first interrupt in its Event's wait, the second in
    its Condition's ``finally``; the ``with`` exit then raises "release unlocked lock",
    the interrupt its context."""

    class Cut(threading.Thread):
        def start(self) -> None:
            try:
                raise TimeLimit("soft time limit")
            except TimeLimit:
                raise RuntimeError("release unlocked lock")  # noqa: B904 (its context)

    with pytest.raises(TimeLimit):
        waiters.start_thread(Cut())


def test_another_runtime_error_of_thread_start_comes_out_as_itself() -> None:
    """No thread to be had while the caller handles an error of its own: not that error."""

    class NoThread(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    try:
        raise ValueError("the caller's")
    except ValueError:
        with pytest.raises(RuntimeError, match="can't start"):
            waiters.start_thread(NoThread())
