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

import _thread
import asyncio
import contextlib
import dis
import functools
import gc
import inspect
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.locking import steps

from ..support.line_interrupts import Interrupt, LineInterrupter, every_point, interrupted

TTL = 8.0  # a grant nobody hands back holds the name this long


class TimeLimit(Exception):
    """An ``Exception`` a signal handler raises: Celery's SoftTimeLimitExceeded."""


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
        try:
            if driver == "async":
                got.append(asyncio.run(waiter.aacquire(timeout=5)))
            else:
                got.append(waiter.acquire(timeout=5))
        except TimeLimit as exc:
            raise Interrupt(str(exc)) from exc  # (raised: as an Interrupt)

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


#: Where each signal's handler ran (the failure message's).
LANDED: list[str] = []


class Burst(DriverInterrupter):
    """A burst of two: the first interrupt at the point, as a signal's handler raising there;
    the second by a signal pending at that moment, whose handler CPython runs at the next
    point it looks for signals (a call, a loop's back edge): the clean-up of the first, the
    driver's handler lines included (review w4, 1). Both are made pending by one C call (no
    point between them: ``map`` of ``interrupt_main``), so the eval loop runs the first's
    handler as that call returns (here: at the traced point) and, that one raising, keeps
    the second pending. (Not ``pthread_kill``/``pthread_sigmask``: their own check of
    signals runs the first handler outside the eval loop, which then forgets the second
    until the next blocking call.)"""

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            list(map(_thread.interrupt_main, (signal.SIGUSR1, signal.SIGUSR2)))  # raises
            raise AssertionError("the first signal's handler did not run")


@contextlib.contextmanager
def _collecting_new_objects_only() -> Iterator[None]:
    """A point's ``gc.collect()`` scans only the objects made since its start (the steps it may
    abandon are among them): the whole heap took ~0.14 s a point."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _burst_case(
    name: str, driver: str, fair: bool, tracer: LineInterrupter, failed: list[str]
) -> None:
    """As _case, the interrupts a burst of two; the rule checked is the driver's own: the
    steps are never left suspended (abandoned, a grant's hand-back never ran: the collector
    closes them later, "generator ignored GeneratorExit"), and once the waiter's object
    released what it holds, the next taker gets the name at once. (Whether the acquire
    raised holding is not checked: a second landing in ``drive``'s undo cuts it, leaving
    the hold to the object, as a burst in any caller's clean-up can.)"""
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
    abandoned: list[str] = []

    def unraisable(info: Any) -> None:
        abandoned.append(f"{info.exc_value!r} in {info.object!r}")

    LANDED.clear()
    hook, sys.unraisablehook = sys.unraisablehook, unraisable
    previous = sys.gettrace()
    try:
        try:
            try:
                sys.settrace(tracer)
                if driver == "async":
                    asyncio.run(waiter.aacquire(timeout=5))
                else:
                    waiter.acquire(timeout=5)
            finally:
                sys.settrace(previous)
            for _ in range(3):  # a call: the second runs here at the latest
                time.sleep(0)
        except Interrupt:
            pass
        gc.collect()  # abandoned steps are closed now
    finally:
        sys.unraisablehook = hook
    releaser.join(10)
    where = f"{tracer.fired} (signals at {LANDED})"
    if abandoned:
        failed.append(f"{where}: steps abandoned: {abandoned}")
    with contextlib.suppress(Exception):
        while waiter.token is not None:
            waiter.release()  # (an undo the second cut: the object's, the caller's to release)
    after = lock(name, ttl=TTL, fair=fair)
    started = time.monotonic()
    took = after.acquire(timeout=2)
    waited = time.monotonic() - started
    if took:
        after.release()
    if not took or waited > 1.0:
        failed.append(f"{where}: the next taker waited {waited:.2f} s (took it: {took})")


@pytest.fixture
def signals() -> Iterator[None]:
    """SIGUSR1 and SIGUSR2 raise Interrupt (handlers run in the main thread only)."""
    assert threading.current_thread() is threading.main_thread()

    def handler(signum: int, frame: Any) -> None:
        where = f"{frame.f_code.co_name}:{frame.f_lineno}" if frame is not None else "?"
        LANDED.append(where)
        raise Interrupt(f"{signal.Signals(signum).name} at {where}")

    before = {s: signal.signal(s, handler) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.parametrize("driver", ["async", "sync"])
@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_burst_of_two_interrupts_at_any_line_of_the_driver_leaves_nothing_held(
    driver: str, fair: bool, name: str, signals: None
) -> None:
    """Review w4, 1: the second interrupt of a burst landing on the driver's handler lines
    (after a first one between two steps) left the driver with the steps suspended: a grant
    never handed back, the name held by nobody until its TTL."""
    failed: list[str] = []
    runs = iter(range(1000))

    def make(at: int | None) -> LineInterrupter:
        return Burst(at, WATCHED[driver], lambda frame: False)

    def case(tracer: LineInterrupter) -> None:
        with _collecting_new_objects_only():
            _burst_case(f"{name}:{next(runs)}", driver, fair, tracer, failed)

    fired = every_point(case, make, limit=400)
    assert len(fired) > 20, fired
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("driver", ["async", "sync"])
@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
@pytest.mark.parametrize("kind", [Interrupt, TimeLimit], ids=["base", "exception"])
def test_a_second_interrupt_in_the_drivers_state_check_leaves_nothing_held(
    driver: str,
    fair: bool,
    kind: type[BaseException],
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reviewer's case (review w4, 1; an ``Exception`` as a soft time limit is): the
    first interrupt at each line of the driver, the second raised by its next look at the
    steps' state (``inspect.getgeneratorstate``, a call: a point where signals are run)."""
    failed: list[str] = []
    runs = iter(range(1000))
    real = inspect.getgeneratorstate
    state = {"first": False, "second": False}

    def getgeneratorstate(generator: Any) -> str:
        if state["first"] and not state["second"]:
            state["second"] = True
            raise kind("second")
        return real(generator)

    monkeypatch.setattr(
        steps,
        "inspect",
        types.SimpleNamespace(
            getgeneratorstate=getgeneratorstate, GEN_SUSPENDED=inspect.GEN_SUSPENDED
        ),
    )

    class First(DriverInterrupter):
        def _point(self, frame: FrameType) -> None:
            self.points += 1
            if self.points == self.at:
                self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
                state["first"], state["second"] = True, False
                raise kind(self.fired)

    def make(at: int | None) -> LineInterrupter:
        return First(at, WATCHED[driver], lambda frame: False)

    def case(tracer: LineInterrupter) -> None:
        _case(f"{name}:{next(runs)}", driver, fair, tracer, failed)
        state["first"] = False

    fired = every_point(case, make, limit=400)
    assert len(fired) > 20, fired
    assert not failed, "\n".join(failed)
