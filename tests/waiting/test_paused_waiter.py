"""A waiter woken at a release that does not take the lock (its process paused: SIGSTOP, a long
GC, a frozen container) stalls the next waiter for the hand-off delay only, not for the hold's
TTL; and when the woken waiter is live, the next one neither barges nor tries once more.

A paused process's socket still counts as a subscriber, so the release's PUBLISH says it was
heard: the release also tells the next waiter to stand by (lua/_wake.lua's hand-off), and the
woken waiter's take tells it to stand down.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import lock, locks, semaphore
from django_redlock.testing import RedisServer
from django_redlock.waiters import ReleaseHub

from ..conftest import Child

KINDS = [pytest.param(False, id="plain"), pytest.param(True, id="fair")]


def _wait_for_waiters(name: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        info = locks["redis"].inspect(name)
        if info is not None and info.waiters == count:
            return
        assert time.monotonic() < deadline, f"never {count} waiters: {info}"
        time.sleep(0.005)


def _first_a_child_then_a_thread(
    name: str, child: Callable[..., Child], fair: bool, hold: float
) -> tuple[Child, threading.Thread, list[tuple[float, list[bytes]]]]:
    """A child process waits first, a thread of this process second (both asleep). The
    thread, once it holds the lock, notes when and what order the child wrote."""
    kind = ["--fair"] if fair else []
    first = child(
        "queue", "--name", name, "--order", f"{name}:order", "--tag", "0",
        "--hold", str(hold), *kind,
    )  # fmt: skip
    first.expect("WAITING")
    _wait_for_waiters(name, 1)
    got: list[tuple[float, list[bytes]]] = []
    client = locks["redis"].client  # type: ignore[attr-defined]

    def second() -> None:
        waiter = lock(name, using="redis", ttl=20, fair=fair)
        if waiter.acquire(timeout=6):
            got.append((time.monotonic(), client.lrange(f"{name}:order", 0, -1)))
            waiter.release()

    thread = threading.Thread(target=second)
    thread.start()
    _wait_for_waiters(name, 2)
    time.sleep(0.1)  # both asleep on the holder's TTL
    return first, thread, got


@pytest.mark.parametrize("fair", KINDS)
def test_a_paused_first_waiter_stalls_the_next_for_the_hand_off_delay_only(
    child: Callable[..., Child], name: str, fair: bool
) -> None:
    holder = lock(name, using="redis", ttl=20, fair=fair)
    assert holder.acquire(blocking=False)
    first, thread, got = _first_a_child_then_a_thread(name, child, fair, hold=0.02)
    first.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.1)
        released = time.monotonic()
        holder.release()  # wakes the paused child: heard (its socket is open), never taken
        thread.join(10)
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert got, "the live waiter never got the free lock"
    lag = got[0][0] - released
    assert lag < 2.0, lag  # the hand-off delay and a margin; the TTL was 20 s
    assert got[0][1] == []  # the paused one had not taken it
    first.expect("DONE")  # resumed, it takes its turn after


@pytest.mark.parametrize("fair", KINDS)
def test_a_live_first_waiter_takes_its_turn_and_the_next_stands_down(
    redis_alone: RedisServer, child: Callable[..., Child], name: str, fair: bool
) -> None:
    """The woken waiter holds longer than the hand-off delay: the next one, told to stand by
    at the release, was told to stand down by the take (no try of its own before it is
    woken by the first one's release): the hand-off costs the scripts it cost before.

    The next one is a process stopped from before the release until the first one took the
    lock, so it reads the stand-by and then the stand-down, whatever the machine's speed.
    Left running (a thread here before), it tried at its timer, 500 ms after the release,
    whenever its process had not read the stand-down by then: a take close to the delay, or
    its reader starved on a loaded machine (the CI's "6 == 5": a refused try). The hand-off
    promises that try then. A fair head that takes later than the delay misses its turn (it
    queues again, at the back): then only both turns are checked."""
    holder = lock(name, using="redis", ttl=20, fair=fair)
    assert holder.acquire(blocking=False)
    client = locks["redis"].client  # type: ignore[attr-defined]
    order = f"{name}:order"
    kind = ["--fair"] if fair else []
    waiters: list[Child] = []
    for tag, hold in (("0", "0.8"), ("1", "0.02")):
        waiter = child(
            "queue", "--name", name, "--order", order, "--tag", tag, "--hold", hold, *kind,
            url=redis_alone.url,
        )  # fmt: skip
        waiter.expect("WAITING")
        _wait_for_waiters(name, len(waiters) + 1)
        waiters.append(waiter)
    first, second = waiters
    time.sleep(0.1)  # both asleep on the holder's TTL
    head = client.lindex(locks["redis"].queue_key(name), 0) if fair else None
    second.process.send_signal(signal.SIGSTOP)
    try:
        before = redis_alone.script_calls()
        released = time.monotonic()
        holder.release()
        deadline, missed = time.monotonic() + 10, False
        while not client.lrange(order, 0, -1):
            if fair and head in client.lrange(locks["redis"].queue_key(name), 1, -1):
                missed = True  # it woke past its hand-off deadline: queued again, behind
                break
            assert time.monotonic() < deadline, "the first waiter never took its turn"
            time.sleep(0.002)
        took = time.monotonic() - released  # the first's take, seen by its body's mark
    finally:
        second.process.send_signal(signal.SIGCONT)
    first.expect("DONE")
    second.expect("DONE")
    if missed:  # the head woke past its hand-off deadline: the stand-down promised nothing
        assert sorted(client.lrange(order, 0, -1)) == [b"0", b"1"]
        return
    assert client.lrange(order, 0, -1) == [b"0", b"1"]  # in turn: the first, then the next
    # The holder's release, the first's take and release, the next one's take and release.
    time.sleep(0.05)
    scripts = redis_alone.script_calls() - before
    # A take seen later than the next one's stand-by (500 ms, a loaded machine): the next
    # one read its stand-by past its timer on waking, and its refused try is the promised one.
    assert scripts == 5 or (took > 0.4 and scripts == 6), (scripts, f"took {took:.3f} s")


def test_the_hub_wakes_a_waiter_standing_by_unless_it_stands_down() -> None:
    """In-process: '<id>|s<ms>' wakes the waiter after that many ms, through the hub (one
    thread for all, gone once nothing is pending); '<id>|d' before then cancels it. Ids not
    watched nor abandoned here, and messages of no known form, are dropped."""
    hub = ReleaseHub()
    with hub.watch("p.1", by_id=True) as one, hub.watch("p.2", by_id=True) as two:
        started = time.monotonic()
        for message in ("p.1|s100", "p.2|s100", "p.2|d", "p.1|s5000", "q.1|s10", "p.2|x", "p.2|s²"):
            hub.hear(message)
        assert one.wait(2.0)
        assert 0.09 < time.monotonic() - started < 1.0
        assert one.baton  # woken as a release wakes: a waiter gone passes it on
        assert not two.wait(0.3)
    deadline = time.monotonic() + 2
    while any(t.name == "redlock-hand-off" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the hand-off thread outlived its last stand-by"
        time.sleep(0.01)
    assert hub._standing_by.pending() == []


@pytest.mark.parametrize("paused", [True, False], ids=["paused", "live"])
def test_a_semaphore_s_next_waiter_stands_by_and_down_as_a_lock_s(
    redis_alone: RedisServer, child: Callable[..., Child], name: str, paused: bool
) -> None:
    """A semaphore's release wakes one plain waiter per permit freed (it leaves the set as it
    is woken): paused, it took the permit's only wake-up (5.8 s, the second's timeout, before
    the hand-off). The next one stands by as a lock's does; when the first is live and holds
    past the hand-off delay, the next stood down: the hand-off costs the scripts it did."""
    holder = semaphore(name, 1, ttl=20, using="redis")
    assert holder.acquire(blocking=False)
    first = child(
        "lease", "--name", name, "--kind", "sem", "--limit", "1", "--ttl", "20",
        "--timeout", "30", url=redis_alone.url,
    )  # fmt: skip
    first.expect("WAITING")
    _wait_for_waiters(name, 1)
    got: list[float] = []

    def second() -> None:
        waiter = semaphore(name, 1, ttl=20, using="redis")
        if waiter.acquire(timeout=6):
            got.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=second)
    thread.start()
    _wait_for_waiters(name, 2)
    time.sleep(0.1)
    if not paused:
        before = redis_alone.script_calls()
        released = time.monotonic()
        holder.release()
        first.expect("ACQUIRED")
        took = time.monotonic() - released
        time.sleep(0.8)  # past the hand-off delay
        first.send("release")
        first.expect("RELEASED")
        thread.join(10)
        assert got, "the second waiter never got the permit"
        time.sleep(0.05)
        # The holder's release, the child's take and release, the thread's take and release;
        # a take later than the stand-by (a loaded machine): the next one's promised try too.
        scripts = redis_alone.script_calls() - before
        assert scripts == 5 or (took > 0.4 and scripts == 6), (scripts, f"took {took:.3f} s")
        return
    first.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.1)
        released = time.monotonic()
        holder.release()
        thread.join(10)
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert got and got[0] - released < 2.0, got and got[0] - released
    first.expect("ACQUIRED")
    first.send("release")
    first.expect("RELEASED")


@pytest.mark.parametrize("kind", ["plain", "fair", "semaphore"])
def test_the_hand_off_skips_the_woken_waiter_s_process(name: str, kind: str) -> None:
    """The woken waiter's process is paused and holds the next place in line too (a worker
    with two threads waiting): the stand-by goes to the first waiter of another process, so
    a live waiter behind them gets the lock within the hand-off delay, not at its hint (the
    lock's TTL). Paused here: a subscriber to that process's inbox that never reads (as a
    SIGSTOPped process's socket: the release's PUBLISH counts it heard). A fair queue's head
    missing its turn is dropped with its process's waiters right behind it."""
    backend = locks["redis"]
    client = backend.client  # type: ignore[attr-defined]
    pubsub = client.pubsub()
    pubsub.subscribe(f"{backend.inbox_prefix}pausedtwo")
    until = time.monotonic() + 5
    while pubsub.get_message(timeout=0.1) is None:  # the confirmation; nothing read after
        assert time.monotonic() < until, "never subscribed"

    def one() -> Any:
        if kind == "semaphore":
            return semaphore(name, 1, ttl=8, using="redis")
        return lock(name, using="redis", ttl=8, fair=kind == "fair")

    holder = one()
    assert holder.acquire(blocking=False)
    paused = ["pausedtwo.1", "pausedtwo.2"]
    if kind == "fair":
        client.rpush(backend.queue_key(name), *paused)
        until_ms = int(time.time() * 1000) + 20_000
        client.zadd(backend.deadlines_key(name), dict.fromkeys(paused, until_ms))
    else:
        client.zadd(backend.waiting_key(name), {paused[0]: 0, paused[1]: 1})
    got: list[float] = []
    live = one()
    thread = threading.Thread(
        target=lambda: live.acquire(timeout=10) and got.append(time.monotonic())
    )
    thread.start()
    try:
        _wait_for_waiters(name, 3)
        time.sleep(0.1)  # asleep on the holder's TTL
        released = time.monotonic()
        holder.release()
        thread.join(12)
    finally:
        pubsub.close()
    assert got, "the live waiter never got the free lock"
    assert got[0] - released < 2.0, got[0] - released  # the hand-off delay; the TTL was 8 s
    live.release()


def test_a_later_shorter_stand_by_wins_over_an_earlier_longer_one() -> None:
    """In-process: a waiter told to stand by 3 s, then (a later release, the paused
    processes ahead of it gone) 100 ms, is woken at the 100 ms: the earlier due time wins
    whichever came first (a longer one told later changes nothing)."""
    hub = ReleaseHub()
    with hub.watch("p.1", by_id=True) as one, hub.watch("p.2", by_id=True) as two:
        started = time.monotonic()
        hub.hear("p.1|s3000")
        hub.hear("p.1|s100")
        hub.hear("p.2|s100")
        hub.hear("p.2|s3000")
        assert one.wait(2.0) and two.wait(2.0)
        assert time.monotonic() - started < 1.0
    assert hub._standing_by.pending() == []


def test_a_live_waiter_told_a_shorter_stand_by_at_a_later_release_tries_then(name: str) -> None:
    """The line: a paused process's waiter, four more paused processes' waiters, then a live
    thread's. The first release wakes the first (it never takes) and tells the live waiter to
    stand by 2.5 s (the fifth process behind). The four die; another owner takes the free lock
    and releases it: that release tells the live waiter 500 ms (one paused process ahead). It
    took the lock at the first stand-by's time before (2.3 s after the second release, the
    lock free all along; review rw, 2), and takes it about 500 ms after it now. Paused here:
    subscribers to those processes' inboxes that never read (their PUBLISH counts heard)."""
    backend = locks["redis"]
    client = backend.client  # type: ignore[attr-defined]
    paused: list[Any] = []
    for i in range(5):
        pubsub = client.pubsub()
        pubsub.subscribe(f"{backend.inbox_prefix}paused{i}")
        until = time.monotonic() + 5
        while pubsub.get_message(timeout=0.1) is None:  # the confirmation; nothing read after
            assert time.monotonic() < until, "never subscribed"
        paused.append(pubsub)
    holder = lock(name, using="redis", ttl=8)
    assert holder.acquire(blocking=False)
    client.zadd(backend.waiting_key(name), {f"paused{i}.1": i for i in range(5)})
    got: list[float] = []
    live = lock(name, using="redis", ttl=8)
    thread = threading.Thread(
        target=lambda: live.acquire(timeout=10) and got.append(time.monotonic())
    )
    thread.start()
    try:
        _wait_for_waiters(name, 6)
        time.sleep(0.1)  # asleep on the holder's TTL
        holder.release()  # the live waiter: stand by 2.5 s
        for pubsub in paused[1:]:  # four of the paused processes die
            pubsub.close()
        until = time.monotonic() + 5
        while any(
            n
            for _, n in client.pubsub_numsub(
                *(f"{backend.inbox_prefix}paused{i}" for i in range(1, 5))
            )
        ):
            assert time.monotonic() < until, "the dead processes' subscriptions stayed"
            time.sleep(0.005)
        other = lock(name, using="redis", ttl=8)
        assert other.acquire(blocking=False)  # free: the woken waiter's process is paused
        released = time.monotonic()
        other.release()  # the live waiter: stand by 500 ms
        thread.join(12)
    finally:
        for pubsub in paused:
            pubsub.close()
    assert got, "the live waiter never got the free lock"
    assert got[0] - released < 1.2, got[0] - released  # 500 ms and a margin, not 2.3 s
    live.release()


@pytest.mark.parametrize("fair", KINDS)
def test_two_paused_tasks_of_a_process_first_in_line_stall_its_live_thread_for_a_hand_off_each(
    name: str, fair: bool
) -> None:
    """Paused here: an event loop whose thread runs sync code (a loop beside threads: an ASGI
    worker's sync_to_async threads); its two waiting tasks, first in line, do not run, the
    process does. The release wakes the first and tells the second to stand by; the live
    thread of the same process behind them was passed over (its process told), and slept
    to its hint, the hold's TTL (7.6 s of an 8 s pause). Each paused waiter stalls the next
    for the hand-off delay: 1 s here."""
    holder = lock(name, using="redis", ttl=30, fair=fair)
    assert holder.acquire(blocking=False)
    blocked, done = threading.Event(), threading.Event()

    async def tasks() -> None:
        async def one() -> None:
            waiter = lock(name, using="redis", ttl=30, fair=fair)
            if await waiter.aacquire(timeout=20):
                await waiter.arelease()

        waiting = [asyncio.create_task(one()) for _ in range(2)]
        until = time.monotonic() + 10
        while (info := locks["redis"].inspect(name)) is None or info.waiters != 2:
            assert time.monotonic() < until, f"never 2 waiters: {info}"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # both asleep on the hold's TTL
        blocked.set()
        done.wait(10)  # the loop's thread busy: its tasks do not run
        await asyncio.gather(*waiting)

    loop_thread = threading.Thread(target=lambda: asyncio.run(tasks()))
    loop_thread.start()
    got: list[float] = []
    assert blocked.wait(15)
    live = lock(name, using="redis", ttl=30, fair=fair)
    thread = threading.Thread(
        target=lambda: live.acquire(timeout=15) and got.append(time.monotonic())
    )
    thread.start()
    try:
        _wait_for_waiters(name, 3)
        time.sleep(0.1)  # asleep on the holder's TTL
        released = time.monotonic()
        holder.release()
        thread.join(12)
        if got:
            live.release()
    finally:
        done.set()
        loop_thread.join(30)
    assert got, "the live waiter never got the free lock"
    assert got[0] - released < 1.5, got[0] - released  # two hand-off delays, not the pause
