"""The watchdog: renews every held lock that asked for it, at about a third of its TTL.

Sync holds are renewed by one daemon thread per process; asyncio holds by one task per event
loop. Holds that fall due close together are renewed together in one pipelined round trip
per backend (up to :data:`BATCH` holds), so 1,000 held locks cost a few round trips per
period, not 1,000. A hold whose renewal finds it gone, or that cannot be renewed before its
TTL runs out, is reported lost to every Lock object that holds it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .backends.base import BaseLockBackend, Renewal
from .waiting import AsyncWaiter

if TYPE_CHECKING:
    from .locking import Lock

logger = logging.getLogger("django_redlock")
BATCH = 500
IDLE_WAKE = 1.0

HoldKey = tuple[int, str, str]  # (id of the backend, lock name, token)


@dataclass
class _Entry:
    backend: BaseLockBackend
    renewal: Renewal
    interval: float  # seconds between renewals
    due: float  # monotonic time of the next renewal
    confirmed_until: float  # the hold is certainly ours until then
    stop_at: float | None  # the cap on renewing, if any
    locks: weakref.WeakSet[Lock] = field(default_factory=weakref.WeakSet)


class Renewer:
    """The schedule of held locks; subclasses run it on a thread or an event loop."""

    def __init__(self) -> None:
        self._entries: dict[HoldKey, _Entry] = {}
        self._mutex = threading.RLock()
        # (due, serial, key): the next renewals in order. An item whose entry is gone or has
        # a new due time is stale and skipped, so rescheduling is just another push.
        self._schedule: list[tuple[float, int, HoldKey]] = []
        self._serial = itertools.count()

    def _plan(self, key: HoldKey, entry: _Entry) -> None:
        heapq.heappush(self._schedule, (entry.due, next(self._serial), key))

    def add(self, lock: Lock, renewal: Renewal, max_hold: float | None) -> None:
        now = time.monotonic()
        ttl = renewal.ttl_ms / 1000
        key = (id(lock.backend), renewal.name, renewal.token)
        with self._mutex:
            entry = self._entries.get(key)
            if entry is None or entry.renewal.ttl_ms != renewal.ttl_ms:
                previous = entry
                entry = self._entries[key] = _Entry(
                    backend=lock.backend,
                    renewal=renewal,
                    interval=ttl / 3,
                    due=now + ttl / 3,
                    confirmed_until=now + ttl,
                    stop_at=None if max_hold is None else now + max_hold,
                )
                if previous is not None:
                    entry.locks.update(previous.locks)
                self._plan(key, entry)
            entry.locks.add(lock)
        self._wake(entry.due)

    def remove(self, lock: Lock, token: str) -> None:
        key = (id(lock.backend), lock.name, token)
        with self._mutex:
            entry = self._entries.get(key)
            if entry is not None:
                entry.locks.discard(lock)
                if not entry.locks:
                    del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def _wake(self, due: float) -> None:
        """A hold falls due at ``due``: make sure the runner looks at it in time."""

    def _next(self) -> list[list[tuple[HoldKey, _Entry]]] | float:
        """Groups of due holds (one per backend), or how long to sleep until one is due.

        Only the holds that are due are looked at (a heap), so 10,000 held locks cost little
        more than 10.
        """
        now = time.monotonic()
        groups: dict[int, list[tuple[HoldKey, _Entry]]] = defaultdict(list)
        with self._mutex:
            schedule = self._schedule
            while schedule:
                due, _, key = schedule[0]
                entry = self._entries.get(key)
                if entry is None or entry.due != due:
                    heapq.heappop(schedule)  # stale: released, or rescheduled since
                    continue
                if groups:  # taking more: those due within half an interval line up
                    if due > now + entry.interval / 2:
                        break
                elif due > now:
                    return due - now
                heapq.heappop(schedule)
                if not entry.locks:
                    del self._entries[key]  # every Lock object holding it was collected
                elif entry.stop_at is not None and entry.stop_at <= now:
                    del self._entries[key]  # capped: the hold now runs out at its TTL
                else:
                    groups[id(entry.backend)].append((key, entry))
            if not groups:
                # Idle: look again in a second, so that a new hold (due in TTL/3) rarely
                # needs to wake the thread early (see ThreadRenewer._wake).
                return IDLE_WAKE
        return [g[i : i + BATCH] for g in groups.values() for i in range(0, len(g), BATCH)]

    def _settle(
        self, group: list[tuple[HoldKey, _Entry]], results: list[bool] | Exception, started: float
    ) -> None:
        """Apply one batch's outcome; report lost holds."""
        lost: list[tuple[list[Lock], str, str]] = []
        now = time.monotonic()
        with self._mutex:
            for i, (key, entry) in enumerate(group):
                if self._entries.get(key) is not entry:
                    continue  # released meanwhile
                result = results if isinstance(results, Exception) else results[i]
                if result is True:
                    entry.due = started + entry.interval
                    entry.confirmed_until = started + entry.renewal.ttl_ms / 1000
                    self._plan(key, entry)
                    continue
                if result is False:
                    reason = "it expired or was released by someone else"
                elif now >= entry.confirmed_until:
                    reason = f"renewals failed until the TTL ran out ({result})"
                else:  # try again soon; the hold is still ours for a while
                    entry.due = now + min(entry.interval / 4, 1.0)
                    self._plan(key, entry)
                    continue
                del self._entries[key]
                lost.append((list(entry.locks), entry.renewal.token, reason))
        for locks, token, reason in lost:
            for lock in locks:
                lock._mark_lost(token, reason)

    def _failed(self, group: list[tuple[HoldKey, _Entry]], exc: Exception) -> Exception:
        from .exceptions import BackendUnavailable

        if not isinstance(exc, BackendUnavailable):  # a bug must not kill the watchdog
            logger.exception("redlock: renewing on %s failed", group[0][1].backend.describe())
        return exc


class ThreadRenewer(Renewer):
    """Renews sync holds from one daemon thread (it never keeps the interpreter alive)."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(self._mutex)
        self._thread: threading.Thread | None = None
        self._wakes_at = 0.0  # when the sleeping thread wakes by itself; 0: it is busy

    def _wake(self, due: float) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="redlock-renewer", daemon=True
                )
                self._thread.start()
            elif due < self._wakes_at:
                # Only then: waking the thread on every acquire would cost each one a
                # thread switch (and the GIL) for nothing.
                self._cond.notify()

    def _batches(self) -> list[list[tuple[HoldKey, _Entry]]]:
        with self._cond:  # deciding to sleep and sleeping are one step: no wake-up is lost
            while True:
                batches = self._next()
                if not isinstance(batches, float):
                    self._wakes_at = 0.0
                    return batches
                self._wakes_at = time.monotonic() + batches
                self._cond.wait(batches)

    def _run(self) -> None:
        while True:
            for group in self._batches():
                started = time.monotonic()
                try:
                    results: list[bool] | Exception = group[0][1].backend.renew_many(
                        [entry.renewal for _, entry in group]
                    )
                except Exception as exc:
                    results = self._failed(group, exc)
                self._settle(group, results, started)

    def _forget_after_fork(self) -> None:
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._entries = {}
        self._schedule = []
        self._thread = None
        self._wakes_at = 0.0


class LoopRenewer(Renewer):
    """Renews asyncio holds from one task in their event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self._task: asyncio.Task[None] | None = None
        self._waiter: AsyncWaiter | None = None

    def _wake(self, due: float) -> None:
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._run(), name="redlock-renewer")
        elif self._waiter is not None:
            self._waiter.wake()

    async def _run(self) -> None:
        self._waiter = AsyncWaiter()
        while True:
            batches = self._next()
            if isinstance(batches, float):
                if not self._entries:
                    return  # idle: nothing keeps the loop busy; add() starts a new task
                await self._waiter.wait(batches)
                continue
            for group in batches:
                started = time.monotonic()
                backend = group[0][1].backend
                try:
                    results: list[bool] | Exception = await backend.aexecute(
                        backend.op_renew([entry.renewal for _, entry in group])
                    )
                except Exception as exc:
                    results = self._failed(group, exc)
                self._settle(group, results, started)


thread_renewer = ThreadRenewer()
_loop_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopRenewer] = (
    weakref.WeakKeyDictionary()
)


def loop_renewer() -> LoopRenewer:
    """The renewer of the running event loop."""
    loop = asyncio.get_running_loop()
    renewer = _loop_renewers.get(loop)
    if renewer is None:
        renewer = _loop_renewers[loop] = LoopRenewer(loop)
    return renewer


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=thread_renewer._forget_after_fork)
