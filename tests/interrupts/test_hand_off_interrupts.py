"""The bounded hand-off (lua/_wake.lua's HAND_OFF_MS) under an interrupt at every line of a
wait's clean-up (see test_wait_interrupts.py).

The first waiter is paused: a subscriber to its process's inbox that never reads (as a
SIGSTOPped process's socket: the release's PUBLISH counts it heard). The second waiter times
out and is interrupted at point ``at`` of its clean-up: left, abandoned (its leave left to the
hub) or still in the hub's registry. The release wakes the paused one and tells the second to
stand by. Whatever state the interrupt left it in, the hand-off goes on through the hub: its
timer wakes the second (gone: its leave runs, which hands off again) and the third waiter gets
the lock within two hand-off delays of the release, not at the hold's TTL (6 s).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from django_redlock import lock, locks

from .test_wait_interrupts import Interrupt, Interrupter

TTL = 6.0


@pytest.fixture
def paused() -> Iterator[str]:
    """The id of a waiter whose process never acts on its inbox (its socket stays open)."""
    backend = locks["default"]
    pubsub = backend.client.pubsub()  # type: ignore[attr-defined]
    pubsub.subscribe(f"{backend.inbox_prefix}pausedprocess")
    deadline = time.monotonic() + 5
    while pubsub.get_message(timeout=0.1) is None:  # the confirmation; nothing read after
        assert time.monotonic() < deadline, "never subscribed"
    yield "pausedprocess.1"
    pubsub.close()


def _put_first(name: str, fair: bool, waiter: str) -> None:
    backend = locks["default"]
    client: Any = backend.client  # type: ignore[attr-defined]
    if fair:
        client.lpush(backend.queue_key(name), waiter)
        client.zadd(backend.deadlines_key(name), {waiter: int(time.time() * 1000) + 20_000})
    else:
        client.zadd(backend.waiting_key(name), {waiter: 0})  # the earliest arrival


def _joined(hub: Any) -> set[int]:
    """The waiters in the hub's registry (ids: an earlier one may leave it meanwhile)."""
    return {id(waiter) for group in list(hub._waiters.values()) for waiter in list(group)}


def _case(name: str, fair: bool, paused: str, at: int | None) -> tuple[Interrupter, float | None]:
    holder = lock(name, ttl=TTL, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    _put_first(name, fair, paused)
    second = lock(name, ttl=TTL, fair=fair)
    tracer = Interrupter(at, "clean-up")
    sys.settrace(tracer)
    try:
        second.acquire(timeout=0.2)
    except Interrupt:
        pass
    finally:
        sys.settrace(None)
    hub = locks["default"].hub
    joined = _joined(hub)  # (the second's, if the interrupt left it in the registry)
    third = lock(name, ttl=TTL, fair=fair)
    took: list[float] = []
    thread = threading.Thread(
        target=lambda: third.acquire(timeout=2 * TTL) and took.append(time.monotonic())
    )
    thread.start()
    backend = locks["default"]
    client: Any = backend.client  # type: ignore[attr-defined]
    until = time.monotonic() + 5
    while time.monotonic() < until and (
        (client.zcard(backend.waiting_key(name)) + client.llen(backend.queue_key(name))) < 2
        or not _joined(hub) - joined
    ):  # the paused one and the third (and the second, if its leave was not sent) in line,
        # and the third in the hub's registry (a release wakes it from there on)
        time.sleep(0.01)
    released = time.monotonic()
    holder.release()
    thread.join(3 * TTL)
    if took:
        third.release()
    return tracer, (took[0] - released) if took else None


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_an_interrupt_at_any_line_of_a_wait_leaves_the_hand_off_bounded(
    fair: bool, name: str, paused: str
) -> None:
    counting, waited = _case(f"{name}:count", fair, paused, None)
    points = counting.points
    assert points > 3, points
    assert waited is not None and waited < 1.0, waited  # one hand-off delay
    failed = []
    for at in range(1, points + 1):
        tracer, waited = _case(f"{name}:{at}", fair, paused, at)
        where = f"interrupted at {tracer.fired or 'nothing'} (point {at})"
        if waited is None or waited > 2.0:
            failed.append(f"{where}: the third waiter got the lock {waited} s after the release")
    hub = locks["default"].hub
    assert not failed, "\n".join(failed)
    assert not [c for c, group in hub._waiters.items() if group], "waiters left in the hub"
    assert not hub._standing_by.pending(), hub._standing_by.pending()
