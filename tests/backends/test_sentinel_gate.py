"""Sentinel's max_connections gate (the pool's path: a tracer, a retry option) and close(),
with real servers the suite starts."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from django_redlock import lock, locks
from django_redlock.testing import RedisServer

from ..conftest import start_sentinel_group, stop_all
from ..support.line_interrupts import LineInterrupter, every_point, interrupted
from .test_sentinel import sentinel_alias


@pytest.fixture
def own_group() -> Iterator[list[RedisServer]]:
    """A master, one replica, two sentinels: ours alone (their connections are counted)."""
    servers = start_sentinel_group()
    yield servers
    stop_all(servers)


def _traced(
    monkeypatch: pytest.MonkeyPatch,
    hold: threading.Event,
    entered: threading.Event | None = None,
) -> None:
    """A tracer's wrapper on redis-py's commands (Sentry, ddtrace, OTel install one): the
    pool's path. Commands of threads named "busy*" wait for ``hold`` (a slow caller), once
    they have set ``entered``."""
    own = redis.Redis.execute_command

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("busy"):
            if entered is not None:
                entered.set()
            hold.wait(10)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)


def test_busy_callers_never_hold_up_the_watchdog_s_renewals(
    sentinel_group: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every max_connections permit taken by a caller (mid-command) while a hold's TTL runs:
    its renewals waited for a permit a socket timeout per try, and the hold expired on a
    healthy master while its owner held it."""
    hold = threading.Event()
    _traced(monkeypatch, hold)
    master = sentinel_group[0]
    with sentinel_alias(sentinel_group, socket_timeout=0.5, max_connections=1):
        backend = locks["s"]
        held = lock(name, using="s", ttl=1.0)
        assert held.acquire(blocking=False)
        busy = threading.Thread(
            target=lambda: lock(f"{name}:busy", using="s").acquire(blocking=False),
            name="busy-caller", daemon=True,
        )  # fmt: skip
        busy.start()  # it takes the one permit, and keeps it while its command waits
        try:
            lowest = 1000
            started = time.monotonic()
            while time.monotonic() - started < 2.5:  # the TTL, more than twice over
                lowest = min(lowest, master.client().pttl(backend.key(name)))
                time.sleep(0.05)
        finally:
            hold.set()
            busy.join(5)
        assert lowest > 0, f"the held lock's key expired (PTTL {lowest})"
        assert held.owned()  # (a caller: asked once the permit is free)
        held.release()
        backend.close()


def _ours_on(sentinels: list[RedisServer]) -> int:
    """Our connections on the sentinels (not theirs to each other, nor this one)."""
    return sum(
        sum(1 for c in s.client().client_list() if not c.get("name", "").startswith("sentinel-"))
        - 1
        for s in sentinels
    )


def test_a_closed_backend_leaves_no_connection_on_the_sentinels(
    own_group: list[RedisServer], name: str
) -> None:
    """close() disconnected the master's pool only: the sentinels' clients (one per sentinel,
    asked where the master is) stayed connected until the cyclic garbage collector ran."""
    sentinels = own_group[2:]

    def round_() -> None:
        with sentinel_alias(own_group, socket_timeout=0.5):
            with lock(name, using="s"):
                pass
            locks.reset()

    gc.disable()  # (a collection would close them before the count)
    try:
        round_()
        time.sleep(1.5)  # the first round's listeners end (LISTEN_POLL)
        before = _ours_on(sentinels)
        for _ in range(5):
            round_()
        deadline = time.monotonic() + 5
        while (after := _ours_on(sentinels)) > before and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        gc.enable()
    assert after <= before, f"{after - before} more connections on the sentinels"


def _gate_path(backend: Any) -> set[Any]:
    """The gated path's functions: the operation's and its gate's own (whichever it has)."""
    from django_redlock.backends.sentinel import SentinelBackend

    found = {getattr(SentinelBackend, each, None) for each in ("execute", "_run")}
    gate = type(backend._gate)
    found |= {getattr(gate, each, None) for each in ("acquire", "release", "take", "give_back")}
    return {each.__code__ for each in found if hasattr(each, "__code__")}


@pytest.mark.parametrize("busy", [False, True], ids=["free", "waiting"])
def test_a_time_limit_anywhere_in_the_gate_loses_no_permit_and_leaves_no_lock_held(
    sentinel_group: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    """An asynchronous exception at each line of the gated path, one at a time (a permit
    free, or held by a busy caller that gives it back while the operation waits). With
    threading.Semaphore, one after its permit was taken and before the ``try:`` lost it
    for good (every later operation "all 1 connections busy" on a healthy master), and one
    at the entry of its Condition's ``__exit__`` left that lock held (every later one hung)."""
    hold, entered = threading.Event(), threading.Event()
    _traced(monkeypatch, hold, entered)
    with sentinel_alias(sentinel_group, socket_timeout=1.0, max_connections=1):
        backend = locks["s"]
        assert backend.is_locked(f"{name}:warm") is False
        watched = _gate_path(backend)

        def case(tracer: LineInterrupter) -> None:
            hold.clear()
            entered.clear()
            caller = None
            if busy:  # it has the permit, and gives it back while the operation waits
                caller = threading.Thread(
                    target=backend.is_locked, args=(f"{name}:busy",), name="busy", daemon=True
                )
                caller.start()
                assert entered.wait(5)
                threading.Timer(0.02, hold.set).start()  # (within one GATE_POLL)
            interrupted(lambda: backend.is_locked(name), tracer)
            hold.set()
            if caller is not None:
                caller.join(5)
            later: list[Any] = []
            check = threading.Thread(
                target=lambda: later.append(_outcome(backend.is_locked, name)), daemon=True
            )
            check.start()
            check.join(3)
            cut = tracer.fired
            assert later == [False], f"cut at {cut}: the next operation: {later or 'hangs'}"

        every_point(case, lambda at: LineInterrupter(at, watched, lambda frame: True))
        backend.close()


def _outcome(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_closed_loop_leaves_no_connection_on_the_sentinels(
    own_group: list[RedisServer], name: str
) -> None:
    """Closing a loop's client (``asyncio.run``'s shutdown) closed the master's pool only: the
    loop's sentinels' clients (asked where the master is) stayed connected until the cyclic
    garbage collector ran, one connection per loop."""
    sentinels = own_group[2:]

    async def once() -> None:
        held = lock(name, using="s")
        assert await held.aacquire(blocking=False)
        await held.arelease()

    with sentinel_alias(own_group, socket_timeout=0.5):
        asyncio.run(once())  # the sync side's looker and listeners, and one loop's
        time.sleep(0.5)
        gc.disable()  # (a collection would close them before the count)
        try:
            before = _ours_on(sentinels)
            for _ in range(5):
                asyncio.run(once())
            deadline = time.monotonic() + 3
            while (after := _ours_on(sentinels)) > before and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            gc.enable()
        locks["s"].close()
    assert after <= before, f"{after - before} more connections on the sentinels"


def _agate_path() -> set[Any]:
    """The async gated path's functions: the operation's and its gate's own (whichever)."""
    from django_redlock.backends import sentinel

    found: set[Any] = {sentinel.SentinelBackend.aexecute}
    gate = getattr(sentinel, "_AsyncGate", asyncio.Semaphore)
    found |= {getattr(gate, each, None) for each in ("acquire", "release", "take", "give_back")}
    return {each.__code__ for each in found if hasattr(each, "__code__")}


@pytest.mark.parametrize("busy", [False, True], ids=["free", "waiting"])
def test_a_time_limit_anywhere_in_the_async_gate_loses_no_permit(
    sentinel_group: list[RedisServer], name: str, busy: bool
) -> None:
    """An asynchronous exception at each line of the async gated path on one long-lived loop,
    one at a time (a permit free, or held by a task whose command waits on a paused master
    while the operation waits for the permit). asyncio.Semaphore lost the permit to one in
    its acquire() after the release had handed it over (before aexecute's ``try:``): every
    later operation on that loop "all 1 connections busy" on a healthy master."""
    master = sentinel_group[0]
    loop = asyncio.new_event_loop()
    try:
        with sentinel_alias(sentinel_group, socket_timeout=1.0, max_connections=1):
            backend = locks["s"]

            async def op(which: str) -> Any:
                return await backend.aexecute(backend.op_locked(which))

            async def both() -> None:
                master.client().client_pause(30)  # the busy task's command waits this long
                busy_task = asyncio.ensure_future(op(f"{name}:busy"))
                await asyncio.sleep(0)  # it takes the permit, and sends
                try:
                    await op(name)
                finally:
                    with contextlib.suppress(BaseException):
                        await busy_task

            assert loop.run_until_complete(op(f"{name}:warm")) is False

            def case(tracer: LineInterrupter) -> None:
                interrupted(lambda: loop.run_until_complete(both() if busy else op(name)), tracer)
                later = loop.run_until_complete(asyncio.wait_for(_aoutcome(op, name), 3))
                cut = tracer.fired
                assert later is False, f"cut at {cut}: the next operation on the loop: {later}"

            every_point(case, lambda at: LineInterrupter(at, _agate_path(), lambda frame: True))
            backend.close()
    finally:
        loop.close()


async def _aoutcome(call: Any, *args: Any) -> Any:
    try:
        return await call(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_busy_task_never_keeps_the_async_permit_from_a_waiting_one(
    sentinel_group: list[RedisServer], name: str
) -> None:
    """max_connections=1, one task doing operations back to back (no suspending await between
    a give-back and its next take), another task making one: the gate let the busy task take
    the freed permit again ahead of the woken waiter (which then queued again at the end), so
    the other's one operation waited its whole socket timeout and failed ("all 1 connections
    busy") on a healthy master. A freed permit goes to the first waiter, as asyncio.Semaphore's
    did."""

    async def both() -> tuple[int, Any, float]:
        backend = locks["s"]
        assert await backend.aexecute(backend.op_locked(f"{name}:warm")) is False
        stop = time.monotonic() + 1.5
        done = [0]

        async def busy() -> None:
            while time.monotonic() < stop:
                await backend.aexecute(backend.op_locked(f"{name}:busy"))
                done[0] += 1

        async def one() -> tuple[Any, float]:
            await asyncio.sleep(0.05)
            started = time.monotonic()
            outcome = await _aoutcome(backend.aexecute, backend.op_locked(name))
            return outcome, time.monotonic() - started

        (outcome, took), _ = await asyncio.gather(one(), busy())
        return done[0], outcome, took

    with sentinel_alias(sentinel_group, socket_timeout=1.0, max_connections=1):
        ops, outcome, took = asyncio.run(both())
        locks["s"].close()
    assert ops > 20, ops  # (it did run back to back)
    assert outcome is False, f"after {took:.3f}s: {outcome}"
    assert took < 0.5, f"waited {took:.3f}s behind a busy task"
