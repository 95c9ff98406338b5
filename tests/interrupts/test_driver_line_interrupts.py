"""An interrupt (a signal handler's exception: any BaseException) at every line of a step driver
once a waiter's release came (``_adrive`` and ``_Cancels.lost`` for ``aacquire``, ``_drive``
for ``acquire``, and the functions that run them), and at the entry of every function those
lines call: the loop's head and its lines between two steps included.

The rule checked after each one, on a real server: an acquire that raised holds nothing, one
that returned holds, and the next taker gets the name at once. Between two steps, the async
driver left the steps suspended: a granting reply never reached them, so their hand-back never
ran, and the name stayed held by nobody until its TTL (review w3, 1; the sync driver throws
such an interrupt into the steps: ``_drive_all``).
"""

from __future__ import annotations

import asyncio
import dis
import functools
import threading
import time
from types import CodeType, FrameType
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.locking import steps

from ..support.line_interrupts import LineInterrupter, every_point, interrupted

TTL = 8.0  # a grant nobody hands back holds the name this long


def _codes(*functions: object) -> set[CodeType]:
    return {f.__code__ for f in functions}  # type: ignore[attr-defined]


WATCHED = {
    "async": _codes(
        steps.adrive,
        *(f for n, f in vars(steps).items() if n.startswith("_adrive")),
        steps._Cancels.lost,
    ),
    "sync": _codes(steps.drive, steps._drive_all, steps._drive),
}


@functools.cache
def _resumes(code: CodeType) -> dict[int, int]:
    return {i.offset: i.arg or 0 for i in dis.get_instructions(code) if i.opname == "RESUME"}


class DriverInterrupter(LineInterrupter):
    """No point at the resumption of a generator or coroutine suspended in a ``yield from`` or
    an ``await`` (the steps' outer generators, an awaited coroutine): CPython looks for no
    signal there (RESUME's oparg 2 and 3), so a tracer raising there would do what no signal
    can (the outer generator raising, its inner one left suspended)."""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code not in self.watched and _resumes(frame.f_code).get(frame.f_lasti, 0) >= 2:
            return None
        return super().__call__(frame, event, arg)


def _waiters_on(name: str) -> int:
    backend = locks["default"]
    client = backend.client  # type: ignore[attr-defined]
    return int(client.zcard(backend.waiting_key(name)) + client.llen(backend.queue_key(name)))


def _case(name: str, driver: str, fair: bool, tracer: LineInterrupter, failed: list[str]) -> None:
    """A holder; a waiter interrupted at the tracer's point once the holder releases (armed
    just before: the waiter sleeps until then); then a check of what the waiter holds, and
    the next taker's wait."""
    holder = lock(name, ttl=TTL, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    waiter = lock(name, ttl=TTL, auto_renew=False, fair=fair)
    released = threading.Event()

    def release() -> None:
        until = time.monotonic() + 5
        while _waiters_on(name) < 1 and time.monotonic() < until:
            time.sleep(0.005)
        time.sleep(0.02)
        released.set()
        holder.release()

    tracer.armed_when = lambda frame: released.is_set()
    releaser = threading.Thread(target=release)
    releaser.start()
    got: list[bool] = []

    def wait() -> None:
        if driver == "async":
            got.append(asyncio.run(waiter.aacquire(timeout=5)))
        else:
            got.append(waiter.acquire(timeout=5))

    raised = interrupted(wait, tracer)
    releaser.join(10)
    where = f"{tracer.fired or 'no interrupt'}"
    if raised is not None and waiter.token is not None:
        failed.append(f"{where}: the acquire raised, its object holds")
    if raised is None and not (got == [True] and waiter.owned()):
        failed.append(f"{where}: the acquire returned {got}, the name is not its")
    while waiter.token is not None:
        waiter.release()
    after = lock(name, ttl=TTL, fair=fair)
    started = time.monotonic()
    took = after.acquire(timeout=2)
    waited = time.monotonic() - started
    if took:
        after.release()
    if not took or waited > 1.0:
        failed.append(f"{where}: the next taker waited {waited:.2f} s (took it: {took})")


@pytest.mark.parametrize("driver", ["async", "sync"])
@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_an_interrupt_at_any_line_of_the_driver_after_a_release_leaves_nothing_held(
    driver: str, fair: bool, name: str
) -> None:
    failed: list[str] = []
    runs = iter(range(1000))

    def make(at: int | None) -> LineInterrupter:
        return DriverInterrupter(at, WATCHED[driver], lambda frame: False)

    def case(tracer: LineInterrupter) -> None:
        _case(f"{name}:{next(runs)}", driver, fair, tracer, failed)

    fired = every_point(case, make, limit=400)
    assert len(fired) > 20, fired  # the driver's lines were seen
    hub = locks["default"].hub
    left = [c for c, group in hub._waiters.items() if group]
    assert not failed, "\n".join(failed)
    assert not left, f"waiters left in the hub: {left}"
