"""Locks inside one process, with the semantics of the Redis scripts (``lua/``) in Python:
TTL expiry, fencing, reentrant holds, fair queues with waiter deadlines, waking waiters.

For users' unit tests and single-process development. Stores are shared per LOCATION, like
Django's locmem cache, so two aliases with one LOCATION see the same locks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..exceptions import LockError
from ..validation import check_glob
from ..waiters import ReleaseHub
from .base import (
    Attempt,
    BaseLockBackend,
    Kind,
    LockInfo,
    Op,
    Order,
    Released,
    Renewal,
    glob_match,
    refence_least,
)
from .replies import CLASH_KINDS, kind_clash, lease_info, lock_info

T = TypeVar("T")


@dataclass
class _Hold:
    owners: dict[str, int]  # token -> hold count (plain: one token, count 1)
    reentrant: bool
    fence: int
    at_ms: int
    meta: str
    expires: float  # monotonic

    def ms_left(self, now: float) -> int:
        return max(0, round((self.expires - now) * 1000))

    def value(self) -> str | dict[str, str]:
        """The hold as the Redis scripts store it (for LockInfo)."""
        if not self.reentrant:
            (token,) = self.owners
            return f"{token}|{self.fence}|{self.at_ms}|{self.meta}"
        fields = {owner: str(count) for owner, count in self.owners.items()}
        return {**fields, ":fence": str(self.fence), ":at": str(self.at_ms), ":meta": self.meta}


@dataclass
class _Lease:
    """One lease of a semaphore or read-write lock (lua/_permits.lua's, in Python)."""

    expires: float  # monotonic
    fence: int
    at_ms: int
    mode: str  # "s" permit, "r" read, "w" write
    meta: str
    count: int = 1


@dataclass
class _Leases:
    leases: dict[str, _Lease] = field(default_factory=dict)  # token -> lease
    limit: int | None = None  # a semaphore's, at its last grant
    kind: str = "s"  # the last grant's: "s" a semaphore, "rw" a read-write lock
    writer: str | None = None
    writers: dict[str, float] = field(default_factory=dict)  # waiting writers' deadlines

    def prune(self, now: float) -> int:
        for token in [t for t, lease in self.leases.items() if lease.expires <= now]:
            del self.leases[token]
        if self.writer not in self.leases:
            self.writer = None
        for waiter in [w for w, deadline in self.writers.items() if deadline <= now]:
            del self.writers[waiter]
        return len(self.leases)


@dataclass
class _Store:
    mutex: threading.Lock = field(default_factory=threading.Lock)
    holds: dict[str, _Hold] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    lasts: dict[str, str] = field(default_factory=dict)  # the last exclusive hold's token
    queues: dict[str, list[str]] = field(default_factory=dict)
    deadlines: dict[str, dict[str, float]] = field(default_factory=dict)
    hub: ReleaseHub = field(default_factory=ReleaseHub)
    queued: dict[str, tuple[str, float]] = field(default_factory=dict)  # task id, expires
    leased: dict[str, _Leases] = field(default_factory=dict)  # semaphores, read-write locks

    def live(self, name: str, now: float) -> _Hold | None:
        hold = self.holds.get(name)
        if hold is not None and hold.expires <= now:
            del self.holds[name]
            return None
        return hold

    def other_kind(self, name: str, now: float) -> str | None:
        """One name is one kind at a time (as other_kind in lua/_hold.lua): the kind whose
        live leases hold ``name``, for a lock; None when none lives (then leases that are
        all expired are dropped, waiting writers kept)."""
        leased = self.leased.get(name)
        if leased is None:
            return None
        if leased.prune(now) > 0:
            return "semaphore" if leased.kind == "s" else "read-write lock"
        if not leased.writers:
            del self.leased[name]
        return None

    def take(self, name: str, token: str, ttl_ms: int, meta: str, reentrant: bool) -> Attempt:
        # As the scripts do: above the counter and at least the clock in ms x 1000.
        fence = max(self.fences.get(name, 0) + 1, time.time_ns() // 1000)
        self.fences[name] = fence
        prior, self.lasts[name] = self.lasts.get(name), token
        expires = time.monotonic() + ttl_ms / 1000
        at_ms = int(time.time() * 1000)
        self.holds[name] = _Hold({token: 1}, reentrant, fence, at_ms, meta, expires)
        return Attempt(True, fence, 1, prior)

    def prune(self, name: str, now: float) -> tuple[list[str], dict[str, float]]:
        """Drop the waiters at the head whose deadline passed (they gave up or died)."""
        queue = self.queues.setdefault(name, [])
        deadlines = self.deadlines.setdefault(name, {})
        while queue and deadlines.get(queue[0], now) <= now:
            deadlines.pop(queue.pop(0), None)
        return queue, deadlines


_stores: dict[str, _Store] = {}
_stores_mutex = threading.Lock()


class LocMemBackend(BaseLockBackend):
    """Locks inside this process, with the Redis backends' semantics (TTLs, fences, reentrant
    and fair locks, semaphores, read-write locks): for tests and single-process development.
    An optional LOCATION names the store; aliases with the same LOCATION share it. OPTIONS
    are ignored.
    """

    needs_location = False

    def __init__(self, alias: str, params: Any) -> None:
        super().__init__(alias, params)
        with _stores_mutex:
            self._store = _stores.setdefault(str(self.location or ""), _Store())

    @property
    def hub(self) -> ReleaseHub:
        return self._store.hub

    @property
    def store(self) -> Any:
        """Internal API (``contrib.beat``'s records): the in-process store this backend
        shares with every LocMem backend of its LOCATION; its ``mutex`` guards every read
        and write of it."""
        return self._store

    def execute(self, op: Op[T]) -> T:
        self.round_trips += 1
        return op.parse(op.request())

    async def aexecute(self, op: Op[T]) -> T:
        return self.execute(op)

    def _op(self, name: str, work: Callable[[_Store, float], Any]) -> Op[Any]:
        """An op that runs ``work`` under the store's mutex, then wakes whom it names."""

        def run() -> Any:
            with self._store.mutex:
                result, wake = work(self._store, time.monotonic())
            for channel in wake:
                self._store.hub.notify(channel)
            return result

        return Op(name, run)

    def _freed(self, store: _Store, name: str, now: float) -> list[str]:
        """Channels to wake when ``name`` is freed: everyone's, and the queue head's."""
        queue, _ = store.prune(name, now)
        return [self.channel(name), *queue[:1]]  # a fair waiter is woken by its id

    # -- ops ---------------------------------------------------------------------------------

    def op_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        kind: Kind,
        waiter: str | None = None,
        wait_ms: int = -1,
        order: Order | None = None,
    ) -> Op[Attempt]:
        # ``order``: as the scripts, a re-entry sets the owner's levels + 1 (nothing here runs
        # late: each op runs whole, in order).
        waiter = waiter or token

        def work(store: _Store, now: float) -> tuple[Attempt, list[str]]:
            other = store.other_kind(name, now)
            if other is not None:
                raise kind_clash(name, self.alias, f"{kind.label} lock", other)
            hold = store.live(name, now)
            if hold is not None and token in hold.owners:  # re-entry, or a retried try
                if kind.reentrant:
                    hold.owners[token] = order[1] + 1 if order else hold.owners[token] + 1
                hold.expires = now + ttl_ms / 1000
                return Attempt(True, hold.fence, hold.owners[token]), []
            queued = bool(store.queues.get(name))  # a fair queue: every kind takes turns
            if not kind.fair and not queued:
                if hold is None:
                    return store.take(name, token, ttl_ms, meta, kind.reentrant), []
                return Attempt(False, None, hold.ms_left(now)), []
            queue, deadlines = store.prune(name, now)
            head = queue[0] if queue else None
            if hold is None and (head is None or (kind.fair and head == waiter)):
                if head is not None:
                    queue.pop(0)
                    del deadlines[waiter]
                return store.take(name, token, ttl_ms, meta, kind.reentrant), []
            if kind.fair and wait_ms >= 0:
                if waiter not in deadlines:
                    queue.append(waiter)
                deadlines[waiter] = now + wait_ms / 1000
                head = head or waiter
            hint = hold.ms_left(now) if hold is not None else -1
            if head is not None and head != waiter:
                first = max(0, round((deadlines.get(head, now) - now) * 1000))
                hint = first if hint < 0 or first < hint else hint
            return Attempt(False, None, max(hint, 0)), []

        return self._op(name, work)

    def op_release(self, name: str, token: str, kind: Kind, order: Order | None = None) -> Op[int]:
        def work(store: _Store, now: float) -> tuple[int, list[str]]:
            hold = store.live(name, now)
            if hold is None or token not in hold.owners:
                return -1, []
            left = order[1] if order and kind.reentrant else hold.owners[token] - 1
            if left > 0:
                hold.owners[token] = left
                return left, []
            del store.holds[name]
            return 0, self._freed(store, name, now)

        return self._op(name, work)

    def op_refence(
        self, name: str, token: str, recorded: int, client_us: int | None = None
    ) -> Op[int]:
        least = refence_least(client_us)

        def work(store: _Store, now: float) -> tuple[int, list[str]]:
            # As refence.lua: a live hold of the token (a lock's, or a lease) only.
            hold: _Hold | _Lease | None = store.live(name, now)
            leased = store.leased.get(name)
            if not isinstance(hold, _Hold) or token not in hold.owners:
                other = hold is not None or (leased is not None and leased.prune(now) > 0)
                hold = leased.leases.get(token) if leased else None
                if hold is None:
                    return -1 if other else 0, []
            fence = max(store.fences.get(name, 0) + 1, time.time_ns() // 1000, recorded + 1)
            if recorded > hold.fence:  # the clock went back: see refence.lua
                fence = max(fence, least)
            store.fences[name] = fence
            store.lasts[name] = token  # current: the last hold granted
            hold.fence = fence
            return fence, []

        return self._op(name, work)

    def op_extend(self, name: str, token: str, ttl_ms: int) -> Op[bool]:
        renewals = [Renewal(name, token, ttl_ms)]
        return Op(name, lambda: self._extend(renewals, at_least=False).request()[0])

    def op_renew(self, renewals: Sequence[Renewal]) -> Op[list[bool | None]]:
        return self._extend(renewals, at_least=True)

    def _extend(self, renewals: Sequence[Renewal], at_least: bool) -> Op[list[bool | None]]:
        """As extend.lua (exactly ``ttl``) and renew.lua (``at_least``: never shorter)."""

        def work(store: _Store, now: float) -> tuple[list[bool], list[str]]:
            results = []
            for renewal in renewals:
                until = now + renewal.ttl_ms / 1000
                leased = store.leased.get(renewal.name)
                lease = leased.leases.get(renewal.token) if leased else None
                if lease is not None:  # a lease, as extend.lua tells them apart
                    ours = lease.expires > now
                    if ours:
                        lease.expires = max(lease.expires, until) if at_least else until
                    results.append(ours)
                    continue
                hold = store.live(renewal.name, now)
                ours = hold is not None and renewal.token in hold.owners
                if hold is not None and ours:
                    hold.expires = max(hold.expires, until) if at_least else until
                results.append(ours)
            return results, []

        return self._op(renewals[0].name if renewals else "", work)

    def op_settle(
        self, name: str, owner: str, count: int, seq: int = 0, mark: bool = True
    ) -> Op[int]:
        def work(store: _Store, now: float) -> tuple[int, list[str]]:
            hold = store.live(name, now)
            if hold is None or owner not in hold.owners:
                return 0, []
            if count > 0:
                hold.owners[owner] = count
                return count, []
            del store.holds[name]
            return 0, self._freed(store, name, now)

        return self._op(name, work)

    def op_leave(self, name: str, waiter: str) -> Op[None]:
        def work(store: _Store, now: float) -> tuple[None, list[str]]:
            queue, deadlines = store.prune(name, now)
            if waiter in deadlines:
                del deadlines[waiter]
                queue.remove(waiter)
            if store.live(name, now) is None and queue:
                return None, [queue[0]]
            return None, []

        return self._op(name, work)

    def op_hold_count(self, name: str, token: str) -> Op[int]:
        def work(store: _Store, now: float) -> tuple[int, list[str]]:
            hold = store.live(name, now)
            return (0 if hold is None else hold.owners.get(token, 0)), []

        return self._op(name, work)

    def op_locked(self, name: str) -> Op[bool]:
        """Whether the name's key exists in Redis terms: a hold, or live leases."""

        def work(store: _Store, now: float) -> tuple[bool, list[str]]:
            leased = store.leased.get(name)
            live = leased is not None and leased.prune(now) > 0
            return store.live(name, now) is not None or live, []

        return self._op(name, work)

    def op_pttl(self, name: str) -> Op[int | None]:
        def work(store: _Store, now: float) -> tuple[int | None, list[str]]:
            hold = store.live(name, now)
            leased = store.leased.get(name)
            if hold is None and leased is not None and leased.prune(now) > 0:
                last = max(lease.expires for lease in leased.leases.values())
                return round((last - now) * 1000), []
            return (None if hold is None else hold.ms_left(now)), []

        return self._op(name, work)

    def op_inspect(self, name: str) -> Op[LockInfo | None]:
        def work(store: _Store, now: float) -> tuple[LockInfo | None, list[str]]:
            hold = store.live(name, now)
            if hold is None and name in store.leased:
                return self._lease_info(store, name, now), []
            if hold is None:
                return None, []
            waiters = len(store.prune(name, now)[0])
            return lock_info(name, self.alias, hold.value(), hold.ms_left(now), waiters), []

        return self._op(name, work)

    def op_force_release(
        self, name: str, token: str | None = None, fence: int | None = None
    ) -> Op[Released]:
        def work(store: _Store, now: float) -> tuple[Released, list[str]]:
            hold = store.live(name, now)
            if hold is None and name in store.leased:
                return self._force_release_leases(store, name, token, fence, now)
            if hold is None:
                return Released.NOT_HELD, []
            # As force_release.lua: a token names a plain hold, a fence any hold.
            if token is not None and (hold.reentrant or token not in hold.owners):
                return Released.CHANGED, []
            if fence is not None and hold.fence != fence:
                return Released.CHANGED, []
            del store.holds[name]
            return Released.RELEASED, self._freed(store, name, now)

        return self._op(name, work)

    def iter_locks(self, match: str = "*") -> Iterator[LockInfo]:
        check_glob(match)
        with self._store.mutex:
            names = [n for n in [*self._store.holds, *self._store.leased] if glob_match(match, n)]
        for name in names:
            info = self.inspect(name)
            if info is not None:
                yield info

    def clear(self) -> None:
        """Forget every lock and queue of this store (fences stay: they never go backwards)."""
        with self._store.mutex:
            names = list(self._store.holds)
            self._store.holds.clear()
            self._store.queues.clear()
            self._store.deadlines.clear()
            self._store.queued.clear()
            names += list(self._store.leased)
            self._store.leased.clear()
        for name in names:
            self._store.hub.notify(self.channel(name))

    # -- queue markers (the task dedupe's: see .markers) -------------------------------------
    # The semantics of lua/mark_queued.lua, clear_marker.lua and swap_marker.lua, in this
    # process.

    def op_mark_queued(self, name: str, task_id: str, ttl_ms: int) -> Op[str | None]:
        def work(store: _Store, now: float) -> tuple[str | None, list[str]]:
            noted = store.queued.get(name)
            if noted is not None and noted[1] > now:
                return noted[0], []
            store.queued[name] = (task_id, now + ttl_ms / 1000)
            return None, []

        return self._op(name, work)

    def op_clear_queued(self, name: str, task_id: str) -> Op[bool]:
        def work(store: _Store, now: float) -> tuple[bool, list[str]]:
            noted = store.queued.get(name)
            if noted is None or noted[0] != task_id:
                return False, []
            del store.queued[name]
            return noted[1] > now, []  # an expired one was gone already

        return self._op(name, work)

    def op_swap_queued(self, name: str, expected: str, value: str, ttl_ms: int) -> Op[bool]:
        def work(store: _Store, now: float) -> tuple[bool, list[str]]:
            noted = store.queued.get(name)
            if noted is None or noted[1] <= now or noted[0] != expected:
                return False, []
            store.queued[name] = (value, now + ttl_ms / 1000)
            return True, []

        return self._op(name, work)

    def op_read_queued(self, name: str) -> Op[tuple[str, int] | None]:
        def work(store: _Store, now: float) -> tuple[tuple[str, int] | None, list[str]]:
            noted = store.queued.get(name)
            if noted is None or noted[1] <= now:
                return None, []
            return (noted[0], int((noted[1] - now) * 1000)), []

        return self._op(name, work)

    def queued_names(self, match: str = "*") -> list[str]:
        check_glob(match)
        now = time.monotonic()
        with self._store.mutex:
            noted = list(self._store.queued.items())
        return sorted(n for n, (_, until) in noted if until > now and glob_match(match, n))

    # -- leases: semaphores and read-write locks ---------------------------------------------
    # lua/permit_*.lua and lua/_permits.lua, in this process. Waiters of a lease wait on the
    # release channel (one woken per message in a process), writers and fair waiters by id.

    def _leases_wake(self, store: _Store, name: str, now: float) -> list[str]:
        """Whom to wake (see leases_wake in lua/_permits.lua): one per lease free now."""
        leased = store.leased.get(name)
        if leased is None:
            return [self.channel(name)]
        used = leased.prune(now)
        if leased.writers:
            return [min(leased.writers, key=leased.writers.__getitem__)] if used == 0 else []
        if leased.writer is not None or (leased.limit is not None and used >= leased.limit):
            return []
        queue, _ = store.prune(name, now)
        return [self.channel(name), *queue[:1]]

    def op_lease_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        mode: str,
        limit: int = 0,
        fair: bool = False,
        waiter: str | None = None,
        wait_ms: int = -1,
        reader: str = "",
    ) -> Op[Attempt]:
        waiter = waiter or token

        def work(store: _Store, now: float) -> tuple[Attempt, list[str]]:
            if store.live(name, now) is not None:
                raise kind_clash(name, self.alias, CLASH_KINDS[mode], "lock")
            leased = store.leased.setdefault(name, _Leases())
            used = leased.prune(now)
            lease = leased.leases.get(token)
            if lease is not None:  # a reentrant read, or a retried try
                if mode == "r":
                    lease.count += 1
                lease.expires = now + ttl_ms / 1000  # as lease_extend: exactly the TTL
                return Attempt(True, lease.fence, lease.count), []
            if used > 0 and (leased.kind == "s") != (mode == "s"):
                held = "semaphore" if leased.kind == "s" else "read-write lock"
                raise kind_clash(name, self.alias, CLASH_KINDS[mode], held)
            if mode == "w" and reader in leased.leases:
                raise LockError(
                    f"read-write lock {name!r} on backend {self.alias!r}: this owner holds a"
                    " read lock, and a read-to-write upgrade is refused (two readers upgrading"
                    " would wait for each other forever): release the read lock first"
                )
            queue, deadlines = store.prune(name, now)
            head = queue[0] if queue else None
            if mode == "s":
                free = used < limit and (head is None or (fair and head == waiter))
            elif mode == "r":
                free = not leased.writers and leased.writer is None
            else:
                free = used == 0
            if free:
                fence = max(store.fences.get(name, 0) + 1, time.time_ns() // 1000)
                store.fences[name] = fence
                prior = store.lasts.get(name) if mode == "w" else None
                if mode == "w":  # only a writer records fences (as permit_acquire.lua)
                    store.lasts[name] = token
                leased.leases[token] = _Lease(
                    now + ttl_ms / 1000, fence, int(time.time() * 1000), mode, meta
                )
                leased.kind = "s" if mode == "s" else "rw"
                if mode == "s":
                    leased.limit = limit  # new grants obey the latest limit
                elif mode == "w":
                    leased.writer = token
                    leased.writers.pop(waiter, None)
                if head is not None and head == waiter:
                    queue.pop(0)
                    deadlines.pop(waiter, None)
                chain = mode == "r" or head is not None  # as permit_acquire.lua says why
                wake = self._leases_wake(store, name, now) if chain else []
                return Attempt(True, fence, 1, prior), wake
            if wait_ms >= 0 and mode == "w":
                leased.writers[waiter] = now + wait_ms / 1000
            elif wait_ms >= 0 and mode == "s" and fair:
                if waiter not in deadlines:
                    queue.append(waiter)
                deadlines[waiter] = now + wait_ms / 1000
            times = [lease.expires for lease in leased.leases.values()]
            if head is not None and head != waiter:
                times.append(deadlines.get(head, now))
            elif mode == "r" and leased.writers:
                times.append(min(leased.writers.values()))
            hint = max(0, round((min(times) - now) * 1000)) if times else 0
            return Attempt(False, None, hint), []

        return self._op(name, work)

    def op_lease_release(self, name: str, token: str, mode: str = "") -> Op[int]:
        def work(store: _Store, now: float) -> tuple[int, list[str]]:
            leased = store.leased.get(name)
            if leased is None:
                return -1, []
            leased.prune(now)
            lease = leased.leases.get(token)
            if lease is None:
                return -1, []
            if lease.count > 1:
                lease.count -= 1
                return lease.count, []
            del leased.leases[token]
            if leased.writer == token:
                leased.writer = None
            wake = self._leases_wake(store, name, now)
            self._leases_keep(store, name)
            return 0, wake

        return self._op(name, work)

    def op_lease_leave(self, name: str, waiter: str) -> Op[None]:
        def work(store: _Store, now: float) -> tuple[None, list[str]]:
            queue, deadlines = store.prune(name, now)
            if waiter in deadlines:
                del deadlines[waiter]
                queue.remove(waiter)
            leased = store.leased.get(name)
            if leased is not None:
                leased.writers.pop(waiter, None)
            return None, self._leases_wake(store, name, now)

        return self._op(name, work)

    def op_leases(self, name: str) -> Op[LockInfo | None]:
        return self.op_inspect(name)

    def _leases_keep(self, store: _Store, name: str) -> None:
        leased = store.leased.get(name)
        if leased is not None and not leased.leases and not leased.writers:
            del store.leased[name]  # nothing left but the fence counter, as in Redis

    def _lease_info(self, store: _Store, name: str, now: float) -> LockInfo | None:
        leased = store.leased[name]
        leased.prune(now)
        leases = [
            (token, round((lease.expires - now) * 1000),
             f"{lease.fence}|{lease.at_ms}|{lease.count}|{lease.mode}|{lease.meta}")
            for token, lease in leased.leases.items()
        ]  # fmt: skip
        waiters = len(store.prune(name, now)[0]) + len(leased.writers)
        return lease_info(name, self.alias, leases, waiters, leased.limit)

    def _force_release_leases(
        self, store: _Store, name: str, token: str | None, fence: int | None, now: float
    ) -> tuple[Released, list[str]]:
        leased = store.leased[name]
        leased.prune(now)
        if token or fence is not None:  # one lease: by its token, or by its fence
            found = [
                t
                for t, lease in leased.leases.items()
                if (not token or t == token) and (fence is None or lease.fence == fence)
            ]
            if not found:
                return Released.CHANGED, []
            gone = found[:1]
        else:
            gone = list(leased.leases)
            if not gone:
                return Released.NOT_HELD, []
        for each in gone:
            del leased.leases[each]
        if leased.writer in gone:
            leased.writer = None
        wake = self._leases_wake(store, name, now)
        self._leases_keep(store, name)
        return Released.RELEASED, wake
