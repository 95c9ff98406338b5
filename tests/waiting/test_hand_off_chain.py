"""The bounded hand-off chains: when the first waiters in line are in several paused processes
(SIGSTOP, a long GC, a frozen container), each one costs the live waiter behind them the
hand-off delay (500 ms), not the hold's TTL.

A paused process's socket still counts as a subscriber, so every message to it says it was
heard. The release wakes the first waiter and tells the first waiter of each other process
behind it to stand by, one hand-off delay apart (lua/_wake.lua, lua/_queue.lua): a stand-by
told to a paused process never fires, and the next process's runs out half a second later.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import lock, lock_all, locks, semaphore

from ..conftest import Child

KINDS = ["plain", "fair", "semaphore"]


def _wait_for_waiters(name: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        info = locks["redis"].inspect(name)
        if info is not None and info.waiters == count:
            return
        assert time.monotonic() < deadline, f"never {count} waiters: {info}"
        time.sleep(0.005)


def _one(name: str, kind: str) -> Any:
    if kind == "semaphore":
        return semaphore(name, 1, ttl=20, using="redis")
    return lock(name, using="redis", ttl=20, fair=kind == "fair")


def _waiting_child(child: Callable[..., Child], name: str, kind: str) -> Child:
    if kind == "semaphore":
        args = ["lease", "--name", name, "--kind", "sem", "--limit", "1", "--ttl", "20"]
    else:
        fair = ["--fair"] if kind == "fair" else []
        args = ["queue", "--name", name, "--order", f"{name}:order", "--tag", "0", *fair]
    waiter = child(*args)
    waiter.expect("WAITING")
    return waiter


@pytest.mark.parametrize("kind", KINDS)
def test_two_paused_processes_first_in_line_cost_the_live_third_a_hand_off_each(
    child: Callable[..., Child], name: str, kind: str
) -> None:
    """P1 and P2 wait first and second, each in its own process, both SIGSTOPped; a live
    waiter of this process waits third. The release wakes P1 (heard, never taken) and tells
    P2 to stand by (heard, never fires): the live waiter, told to stand by one hand-off
    later, gets the lock about 1 s after the release, not at its hint (the hold's TTL, 20 s)."""
    holder = _one(name, kind)
    assert holder.acquire(blocking=False)
    paused = []
    for count in (1, 2):
        paused.append(_waiting_child(child, name, kind))
        _wait_for_waiters(name, count)
    got: list[float] = []
    live = _one(name, kind)

    def third() -> None:
        if live.acquire(timeout=4):
            got.append(time.monotonic())

    thread = threading.Thread(target=third)
    thread.start()
    try:
        _wait_for_waiters(name, 3)
        for waiter in paused:
            waiter.process.send_signal(signal.SIGSTOP)
        time.sleep(0.2)  # all three asleep on the holder's TTL
        released = time.monotonic()
        holder.release()
        thread.join(6)
    finally:
        for waiter in paused:
            waiter.process.send_signal(signal.SIGCONT)
    assert got, "the live waiter never got the free lock (it slept to its hint)"
    lag = got[0] - released
    assert 0.8 < lag < 2.0, lag  # two hand-off delays (one per paused process) and a margin
    live.release()


@pytest.mark.parametrize("kind", KINDS)
def test_each_paused_process_in_line_costs_one_hand_off_delay(name: str, kind: str) -> None:
    """Three paused processes first in line, one waiter each (here: subscribers to their
    inboxes that never read, as a SIGSTOPped process's socket), a live waiter fourth: it gets
    the lock about 1.5 s after the release, 500 ms per paused process. A fair queue's missed
    turns are dropped by the live waiter's try, one hand-off after the other."""
    backend = locks["redis"]
    client = backend.client  # type: ignore[attr-defined]
    processes = [f"pausedchain{i}" for i in range(3)]
    pubsub = client.pubsub()
    pubsub.subscribe(*(f"{backend.inbox_prefix}{process}" for process in processes))
    confirmed = 0
    until = time.monotonic() + 5
    while confirmed < len(processes):  # the confirmations; nothing read after
        assert time.monotonic() < until, "never subscribed"
        confirmed += pubsub.get_message(timeout=0.1) is not None
    holder = _one(name, kind)
    assert holder.acquire(blocking=False)
    paused = [f"{process}.1" for process in processes]
    if kind == "fair":
        client.rpush(backend.queue_key(name), *paused)
        until_ms = int(time.time() * 1000) + 20_000
        client.zadd(backend.deadlines_key(name), dict.fromkeys(paused, until_ms))
    else:
        client.zadd(backend.waiting_key(name), {waiter: i for i, waiter in enumerate(paused)})
    got: list[float] = []
    live = _one(name, kind)

    def fourth() -> None:
        if live.acquire(timeout=5):
            got.append(time.monotonic())

    thread = threading.Thread(target=fourth)
    thread.start()
    lag = _lag_after_release(holder, thread, got, name, 4, 7, pubsub)
    assert 1.3 < lag < 2.5, lag  # three hand-off delays and a margin; the TTL was 20 s
    live.release()


def _lag_after_release(
    holder: Any,
    thread: Any,
    got: list[float],
    name: str,
    waiters: int,
    join: float,
    pubsub: Any = None,
) -> float:
    """Once ``waiters`` wait on ``name`` and sleep, release ``holder``: how long after it the
    live waiter (``thread``, which appends its take's time to ``got``) took the lock."""
    try:
        _wait_for_waiters(name, waiters)
        time.sleep(0.1)  # asleep on the holder's TTL (or the head's deadline)
        released = time.monotonic()
        holder.release()
        thread.join(join)
    finally:
        if pubsub is not None:
            pubsub.close()
    assert got, "the live waiter never got the free lock (it slept to its hint)"
    return got[0] - released


def _paused_processes(*processes: str) -> Any:
    """Subscribers to these processes' inboxes that never read: SIGSTOPped processes' sockets
    (every message to them counts as heard)."""
    backend = locks["redis"]
    pubsub = backend.client.pubsub()  # type: ignore[attr-defined]
    pubsub.subscribe(*(f"{backend.inbox_prefix}{process}" for process in processes))
    confirmed = 0
    until = time.monotonic() + 5
    while confirmed < len(processes):  # the confirmations; nothing read after
        assert time.monotonic() < until, "never subscribed"
        confirmed += pubsub.get_message(timeout=0.1) is not None
    return pubsub


def _queue_up(name: str, kind: str, ids: list[str]) -> None:
    """Put ``ids`` in line behind whoever waits already, as their tries would have."""
    backend = locks["redis"]
    client = backend.client  # type: ignore[attr-defined]
    if kind == "fair":
        client.rpush(backend.queue_key(name), *ids)
        until_ms = int(time.time() * 1000) + 20_000
        client.zadd(backend.deadlines_key(name), dict.fromkeys(ids, until_ms))
        return
    waiting = backend.waiting_key(name)
    last = client.zrange(waiting, -1, -1, withscores=True)
    start = last[0][1] if last else time.time() * 1000
    client.zadd(waiting, {waiter: start + 0.001 * (i + 1) for i, waiter in enumerate(ids)})


def _evalsha_calls() -> int:
    stats = locks["redis"].client.info("commandstats")  # type: ignore[attr-defined]
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _live_waiter(name: str, kind: str, timeout: float, got: list[float]) -> tuple[Any, Any]:
    live = _one(name, kind)

    def wait() -> None:
        if live.acquire(timeout=timeout):
            got.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    return live, thread


def _taken_hand_off_stands_down(name: str, kind: str, first: Any, tag: str) -> None:
    """Line: ``first`` (A, this process), B and C (two other processes), D (a lock() of this
    process). The release wakes A and tells B, C and D to stand by; A takes at once, and its
    take stands all three down: no try runs after it (D's timer used to fire at 500 ms)."""
    pubsub = _paused_processes(f"{tag}B", f"{tag}C")
    holder = _one(name, kind)
    for _ in range(2):  # the release script loaded: its first call counts its NOSCRIPT too
        assert holder.acquire(blocking=False)
        holder.release()
    assert holder.acquire(blocking=False)
    got: list[float] = []

    def wait() -> None:
        if first.acquire(timeout=5):
            got.append(time.monotonic())

    first_thread = threading.Thread(target=wait)
    first_thread.start()
    _wait_for_waiters(name, 1)
    _queue_up(name, kind, [f"{tag}B.1", f"{tag}C.1"])
    last, last_thread = _live_waiter(name, kind, 3, [])
    try:
        _wait_for_waiters(name, 4)
        time.sleep(0.1)  # all asleep on the holder's TTL
        before = _evalsha_calls()
        released = time.monotonic()
        holder.release()
        first_thread.join(3)
        assert got, "A never took the lock"
        time.sleep(1.2)  # past D's stand-by (500 ms) and C's (1 s)
        scripts = _evalsha_calls() - before
        # A take later than D's stand-by (a loaded machine) leaves D the try it is promised.
        late = got[0] - released > 0.4
        assert scripts == 2 or (late and scripts == 3), (
            f"{scripts} scripts: the release, A's take, and spurious tries"
            f" (A took {got[0] - released:.3f} s after the release)"
        )
    finally:
        if got:
            first.release()
        first_thread.join(5)
        last_thread.join(5)
        if last.owned():
            last.release()
        pubsub.close()


@pytest.mark.parametrize("kind", ["plain", "fair"])
@pytest.mark.usefixtures("redis_alone")
def test_a_taken_hand_off_stands_down_the_takers_own_next_waiter(name: str, kind: str) -> None:
    """A is a lock() of this process, D its process's next waiter."""
    _taken_hand_off_stands_down(name, kind, _one(name, kind), "standdown")


@pytest.mark.usefixtures("redis_alone")
def test_a_taken_lock_all_hand_off_stands_down_the_next_waiters(name: str) -> None:
    """A is a lock_all() registered on the held name: its take (lua/acquire_all.lua) left
    only its own place, and D's timer fired a try 500 ms later that could not succeed."""
    first = lock_all(name, f"{name}:other", ttl=20, using="redis")
    _taken_hand_off_stands_down(name, "plain", first, "allstand")


def test_a_plain_waiter_behind_a_paused_fair_head_waits_one_hand_off(name: str) -> None:
    """A name with a fair queue: its head (a paused process) and a live plain waiter. The
    release wakes both; the plain one, refused behind the head, sleeps to the head's turn: it
    comes down to 500 ms after the release (the bound holds for plain waiters registered on
    the name too), not the head's whole lease (20 s)."""
    pubsub = _paused_processes("fairhead")
    holder = _one(name, "fair")
    assert holder.acquire(blocking=False)
    _queue_up(name, "fair", ["fairhead.1"])
    got: list[float] = []
    live, thread = _live_waiter(name, "plain", 4, got)
    lag = _lag_after_release(holder, thread, got, name, 2, 6, pubsub)
    assert 0.3 < lag < 1.5, lag  # one hand-off delay and a margin
    live.release()


def test_a_fair_waiter_behind_more_dead_waiters_than_a_call_prunes_gets_the_lock(
    name: str,
) -> None:
    """120 waiters of a killed process (no subscriber: each wake-up counts 0) queue ahead of a
    live one. The release drops 100 (a call's cap) and still hands off past the rest: the
    live waiter takes within a hand-off, not at its hint (the dead head's deadline, 20 s)."""
    holder = _one(name, "fair")
    assert holder.acquire(blocking=False)
    _queue_up(name, "fair", [f"deadcrowd.{i}" for i in range(120)])
    got: list[float] = []
    live, thread = _live_waiter(name, "fair", 3, got)
    lag = _lag_after_release(holder, thread, got, name, 121, 5)  # (asleep on the dead head's
    assert lag < 0.4, lag  # deadline) at once, not a hand-off later
    live.release()


@pytest.mark.parametrize("kind", KINDS)
def test_a_paused_process_with_many_waiters_first_costs_one_hand_off(name: str, kind: str) -> None:
    """150 waiters of one paused process first in line (more than the 32 a release looks at
    past the first, more than the 100 a fair queue's try drops), a live waiter behind them:
    the release passes the paused process's own waiters over when it looks for the next
    process to tell, and a fair try stopped at its cap hints 0 (it goes on at once), so the
    live one gets the lock one hand-off after the release, not at its hint (20 s)."""
    pubsub = _paused_processes("pausedcrowd")
    holder = _one(name, kind)
    assert holder.acquire(blocking=False)
    _queue_up(name, kind, [f"pausedcrowd.{i}" for i in range(150)])
    got: list[float] = []
    live, thread = _live_waiter(name, kind, 4, got)
    lag = _lag_after_release(holder, thread, got, name, 151, 6, pubsub)
    assert 0.3 < lag < 1.5, lag  # one hand-off delay and a margin
    live.release()
