"""The watchdog: renews every held lock that asked for it, at about a third of its TTL.

Every hold, sync or asyncio, is renewed by one daemon thread per process: a thread outlives
the event loops (``asyncio.run`` per request), which a task per loop would not. Holds of one
backend and TTL taken close together form a batch (up to :data:`BATCH`
holds) that is renewed in one round trip, so 1,000 held locks cost a few round trips per
period, not 1,000; and the schedule is kept per batch, so its Python work does not grow with
the holds. A hold whose renewal finds it gone, or that cannot be renewed before its TTL runs
out, is reported lost to every Lock object that holds it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from . import observe
from .backends.base import BaseLockBackend, Renewal


class Lock(Protocol):
    """What the watchdog needs of a lock object (:class:`~.locks.base.BaseLock` is one)."""

    backend: BaseLockBackend
    name: str

    def _renewed_by(self, renewer: Renewer, token: str) -> bool: ...

    def _mark_lost(self, token: str, reason: str) -> None: ...


logger = logging.getLogger("django_redlock")
BATCH = 500
IDLE_WAKE = 1.0

HoldKey = tuple[int, str, str]  # (id of the backend, lock name, token)


@dataclass(eq=False)
class _Entry:
    """One hold, and the Lock objects that hold it (renewing stops when they are collected)."""

    renewal: Renewal
    stop_at: float | None  # the cap on renewing, if any
    bucket: _Bucket | None = None
    locks: weakref.WeakSet[Lock] = field(default_factory=weakref.WeakSet)
    # Weak references whose callbacks tell the renewer that a holding Lock was collected.
    watches: list[weakref.ref[Lock]] = field(default_factory=list)


@dataclass(eq=False)
class _Bucket:
    """Holds of one backend and TTL, acquired close together, renewed as one batch.

    The schedule works on buckets, not holds: a renewal period costs a heap push per bucket
    and no Python work per hold unless one fails (10,000 holds are 20 buckets).
    """

    backend: BaseLockBackend
    ttl_ms: int
    interval: float  # seconds between renewals: a third of the TTL
    closes: float  # new holds may join until then
    due: float  # monotonic time of the next renewal
    confirmed_until: float  # every member is certainly ours until then
    overdue: bool = False  # past confirmed_until without an answer (warned once)
    members: dict[HoldKey, _Entry] = field(default_factory=dict)
    _snapshot: tuple[list[_Entry], list[Renewal]] | None = None

    def snapshot(self) -> tuple[list[_Entry], list[Renewal]]:
        """The members and their renewals, in one order; kept until the members change."""
        if self._snapshot is None:
            entries = list(self.members.values())
            self._snapshot = (entries, [entry.renewal for entry in entries])
        return self._snapshot

    def changed(self) -> None:
        self._snapshot = None


class Renewer:
    """The schedule of held locks; subclasses run it on a thread or an event loop."""

    def __init__(self) -> None:
        self._entries: dict[HoldKey, _Entry] = {}
        self._mutex = threading.RLock()
        self._open: dict[tuple[int, int], _Bucket] = {}  # (backend id, ttl ms): joinable
        # (due, serial, bucket): the next renewals in order. An item whose bucket has a new
        # due time or no members is stale and skipped, so rescheduling is just another push.
        self._schedule: list[tuple[float, int, _Bucket]] = []
        self._caps: list[tuple[float, int, HoldKey]] = []  # (stop_at, serial, key)
        self._serial = itertools.count()
        self._collected = False  # a holding Lock object was garbage-collected: sweep

    def _on_collected(self, _: weakref.ref[Lock]) -> None:
        self._collected = True  # only a flag: this runs wherever the collector runs

    def _plan(self, bucket: _Bucket) -> None:
        heapq.heappush(self._schedule, (bucket.due, next(self._serial), bucket))

    def _join(self, key: HoldKey, entry: _Entry, backend: BaseLockBackend, now: float) -> None:
        """Put a hold taken at ``now`` into a batch: the open one, or a new one."""
        ttl_ms = entry.renewal.ttl_ms
        bucket = self._open.get((id(backend), ttl_ms))
        if bucket is None or now > bucket.closes or len(bucket.members) >= BATCH:
            interval = ttl_ms / 3000
            bucket = self._open[id(backend), ttl_ms] = _Bucket(
                backend=backend,
                ttl_ms=ttl_ms,
                interval=interval,
                closes=now + interval / 2,  # first renewal: a sixth to a third of the TTL in
                due=now + interval,
                confirmed_until=now + ttl_ms / 1000,
            )
            self._plan(bucket)
        elif not bucket.members:
            self._plan(bucket)  # its schedule item may have been dropped while it was empty
        bucket.members[key] = entry
        bucket.changed()
        entry.bucket = bucket

    def _drop(self, key: HoldKey) -> _Entry:
        entry = self._entries.pop(key)
        if entry.bucket is not None:
            del entry.bucket.members[key]
            entry.bucket.changed()
            entry.bucket = None
        return entry

    def add(self, lock: Lock, renewal: Renewal, max_hold: float | None) -> None:
        """Renew a hold from now on (a new TTL replaces the hold's old one)."""
        with self._mutex:
            due = self._add(lock, renewal, max_hold, time.monotonic())
        self._wake(due)

    def soon(self, lock: Lock, renewal: Renewal, max_hold: float | None) -> None:
        """Renew a hold just taken, unless it is released before its first renewal."""
        self.add(lock, renewal, max_hold)

    def _add(self, lock: Lock, renewal: Renewal, max_hold: float | None, now: float) -> float:
        key = (id(lock.backend), renewal.name, renewal.token)
        entry = self._entries.get(key)
        if entry is None or entry.renewal.ttl_ms != renewal.ttl_ms:
            previous = self._drop(key) if entry is not None else None
            stop_at = None if max_hold is None else now + max_hold
            entry = self._entries[key] = _Entry(renewal, stop_at)
            if previous is not None:
                entry.locks.update(previous.locks)
            self._join(key, entry, lock.backend, now)
            if stop_at is not None:
                heapq.heappush(self._caps, (stop_at, next(self._serial), key))
        if lock not in entry.locks:
            entry.locks.add(lock)
            entry.watches.append(weakref.ref(lock, self._on_collected))
        return entry.bucket.due if entry.bucket is not None else now

    def remove(self, lock: Lock, token: str) -> None:
        key = (id(lock.backend), lock.name, token)
        with self._mutex:
            entry = self._entries.get(key)
            if entry is not None:
                entry.locks.discard(lock)
                if not entry.locks:
                    self._drop(key)

    def __len__(self) -> int:
        return len(self._entries)

    def _wake(self, due: float) -> None:
        """A hold falls due at ``due``: make sure the runner looks at it in time."""

    def _take_pending(self) -> None:
        """Start renewing the holds of :meth:`soon` that are still held (called locked)."""

    def _next(self) -> list[tuple[_Bucket, list[_Entry], list[Renewal]]] | float:
        """The buckets due now, or how long to sleep until one is due."""
        now = time.monotonic()
        with self._mutex:
            self._take_pending()
            while self._caps and self._caps[0][0] <= now:
                stop_at, _, key = heapq.heappop(self._caps)
                entry = self._entries.get(key)
                if entry is not None and entry.stop_at == stop_at:
                    self._drop(key)  # capped: the hold now runs out at its TTL
            if self._collected:
                self._collected = False
                for key in [k for k, entry in self._entries.items() if not entry.locks]:
                    self._drop(key)  # no Lock object holds it any more: let it run out
            due: list[tuple[_Bucket, list[_Entry], list[Renewal]]] = []
            schedule = self._schedule
            while schedule:
                at, _, bucket = schedule[0]
                if at != bucket.due or not bucket.members:
                    heapq.heappop(schedule)  # stale, or every hold in it is gone
                    continue
                if at > now:
                    if due:
                        break
                    return min(at - now, IDLE_WAKE)  # a second at most: see soon()
                heapq.heappop(schedule)
                bucket.due = math.inf  # in flight: any other item of it is stale
                due.append((bucket, *bucket.snapshot()))
            if not due:
                # Idle: look again in a second, so that a new hold (due in TTL/3) rarely
                # needs to wake the thread early (see ThreadRenewer._wake).
                return IDLE_WAKE
        return due

    def _settle(
        self,
        bucket: _Bucket,
        entries: list[_Entry],
        results: list[bool | None] | Exception,
        started: float,
    ) -> None:
        """Apply one batch's outcome; report lost holds."""
        observe.renewed(bucket.backend, len(entries), results)
        lost: list[tuple[_Entry, str]] = []
        now = time.monotonic()
        with self._mutex:
            if isinstance(results, Exception) or None in results:
                # No answer (for some): unknown is not lost. Try again soon, for as long as
                # it takes: only an answer that the token is gone makes a loss. Past the TTL
                # the hold may have run out (fencing is what protects the work then): say so.
                if isinstance(results, Exception):
                    results = [None] * len(entries)
                bucket.due = now + min(bucket.interval / 4, 1.0)
                if now >= bucket.confirmed_until and not bucket.overdue:
                    bucket.overdue = True
                    logger.warning(
                        "redlock: %d holds on %s could not be renewed before their TTL ran out"
                        " (no answer); they may have expired: still trying",
                        results.count(None),
                        bucket.backend.describe(),
                    )
                self._plan(bucket)
                reason = "it expired or was released by someone else"
                lost = [(e, reason) for e, ok in zip(entries, results, strict=True) if ok is False]
            else:
                bucket.due = started + bucket.interval
                bucket.confirmed_until = started + bucket.ttl_ms / 1000
                bucket.overdue = False
                self._plan(bucket)
                if not all(results):  # the common case costs no loop over the holds
                    reason = "it expired or was released by someone else"
                    lost = [(e, reason) for e, ok in zip(entries, results, strict=True) if not ok]
            lost = [(entry, reason) for entry, reason in lost if entry.bucket is bucket]
            for entry, _ in lost:
                renewal = entry.renewal
                self._drop((id(bucket.backend), renewal.name, renewal.token))
        for entry, reason in lost:
            for lock in list(entry.locks):
                lock._mark_lost(entry.renewal.token, reason)

    def _failed(self, bucket: _Bucket, exc: Exception) -> Exception:
        from .exceptions import BackendUnavailable, QuorumNotReached

        if isinstance(exc, (BackendUnavailable, QuorumNotReached)):
            observe.backend_error(bucket.backend)
        if not isinstance(exc, BackendUnavailable):  # a bug must not kill the watchdog
            logger.exception("redlock: renewing on %s failed", bucket.backend.describe())
        return exc


class ThreadRenewer(Renewer):
    """Renews sync holds from one daemon thread (it never keeps the interpreter alive)."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(self._mutex)
        self._thread: threading.Thread | None = None
        self._wakes_at = 0.0  # when the sleeping thread wakes by itself; 0: it is busy
        # Holds just taken, as (taken at, Lock, renewal, max_hold). Most holds are released
        # long before their first renewal (TTL/3): those never cost more than this append.
        self._pending: deque[tuple[float, weakref.ref[Lock], Renewal, float | None]] = deque()

    def soon(self, lock: Lock, renewal: Renewal, max_hold: float | None) -> None:
        taken = time.monotonic()
        self._pending.append((taken, weakref.ref(lock), renewal, max_hold))
        interval = renewal.ttl_ms / 3000
        if interval < IDLE_WAKE or self._thread is None:
            # The thread may sleep up to IDLE_WAKE before it looks at the pending holds:
            # fine for TTLs of 3 s and more, a shorter one is due sooner.
            self._wake(taken + interval)

    def _take_pending(self) -> None:
        pending = self._pending
        while pending:
            taken, ref, renewal, max_hold = pending.popleft()
            lock = ref()
            if lock is None or not lock._renewed_by(self, renewal.token):
                continue  # released (or its Lock collected) before its first renewal
            if (id(lock.backend), renewal.name, renewal.token) not in self._entries:
                self._add(lock, renewal, max_hold, taken)  # (an extend may have added it)

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

    def _batches(self) -> list[tuple[_Bucket, list[_Entry], list[Renewal]]]:
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
            for bucket, entries, renewals in self._batches():
                started = time.monotonic()
                try:
                    results: list[bool | None] | Exception = bucket.backend.renew_many(renewals)
                except Exception as exc:
                    results = self._failed(bucket, exc)
                self._settle(bucket, entries, results, started)

    def _forget_after_fork(self) -> None:
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._entries = {}
        self._pending = deque()
        self._open = {}
        self._schedule = []
        self._caps = []
        self._thread = None
        self._wakes_at = 0.0


thread_renewer = ThreadRenewer()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=thread_renewer._forget_after_fork)
