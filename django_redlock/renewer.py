"""The watchdog: renews every held lock that asked for it, at about a third of its TTL.

Every hold, sync or asyncio, is renewed from threads of this process: a thread outlives the
event loops (``asyncio.run`` per request), which a task per loop would not. Holds of one
backend and TTL taken close together form a batch (a bucket, up to :data:`BATCH` holds)
renewed in one round trip, so 1,000 held locks cost a few round trips per period, and the
schedule is kept per bucket, so its Python work does not grow with the holds.

The rules (each is tested in tests/watchdog/test_watchdog.py; the per-backend ones in
tests/backends/):

* **One entry per hold**, keyed by (backend, name, token), with the Lock objects that hold
  it (weakly), each object's TTL and cap, and the hold's. Several objects may share a token
  (a reentrant lock taken through two objects, two reads of one thread, ``adopt()``): each
  :meth:`add` adds its object to the entry. An object leaves the entry by
  :meth:`Renewer.remove` (its release) or by being collected; the entry is dropped when no
  object is left, when its cap passes, or when a renewal finds the hold gone. Nothing else
  adds or removes entries.
* **A shared hold follows the objects holding it now**: it is renewed with the TTL set last
  by one of them, until the latest of their caps (none if one has none), and both are
  worked out again whenever an object joins, sets a TTL, lets go or is collected: never
  kept from an object that let go (its shorter TTL would cut the others' margin against a
  stall, its lack of a cap would renew a capped hold for good). A TTL that comes back from
  an object that held on is renewed at once (the server may still have the shorter one).
  Every command that sets the TTL tells the renewer: a take, an ``extend()``, a re-entry
  (it sets its object's TTL again), an adoption.
* **News is not ordered by its arrival**: two commands setting one hold's TTL that overlap
  (each sent before the other's answer came: two threads extending one object, two
  objects of one token) may have run in either order, whatever order their news comes
  in. So, until the extends (re-entries, adoptions) settle, the hold is renewed on the
  shortest TTL one on its way may set (:meth:`sending`: Redis may run it any time before
  its answer, which may come after another's); and when news overlaps the news that came
  before it, the hold is renewed at once with the TTL followed, after both ran (a renewal
  never shortens, so the server then has at least that TTL). Never on a longer schedule
  than Redis may hold. News of an object that let go before it was taken (a nested
  re-entry that left at once) renews the hold's entry at once if its TTL is shorter.
* **A hold counts from its command's send**: Redis sets the TTL when it runs the command,
  before its answer comes. A new hold (the winning try's send), and an extend's or a
  re-entry's new TTL, is dated from when its command was sent, and joins only a batch
  due no later than a third of its TTL after that: an answer that came late (within the
  socket timeout) is renewed at once, never after the key ran out (leaders do the same).
* **An adopted hold is on the adopter's schedule before adopt() returns**: ``adopt()``
  sets the hold's TTL to the adopter's (the server had the one its last renewal, by another
  object or process, set at a time unknown here), then makes its :meth:`add` with the time
  that command was sent (not left pending: the old object may be collected next, and its
  entry dropped). A batch of the old object's that lands after it is renewed again at once
  (the TTL-change rule below). The old holder may be another process, renewing the token
  with its own, shorter TTL until it lets go: a renewal never shortens a hold (renew.lua
  keeps the longer time left), so its renewals never cut the adopter's TTL.
* **Pending news is taken before a sweep**: news of a hold (:meth:`ThreadRenewer.soon`) is
  appended without the mutex, so it may come after the scheduler took the pending news and
  before another object of its token is collected; the sweep of collected objects takes
  it up first, so the entry it joins is not dropped.
* **The cap** (``max_hold``) is a monotonic deadline fixed at the acquisition and passed in
  by the lock: ``extend()`` never moves it, and an ``add`` after it renews nothing for its
  object. But the TTL it set (an extend or a re-entry after the cap) is on the server all
  the same: a hold other objects keep renewed follows it as any TTL set last (it ran out
  under them on a longer schedule). Once the last object without a cap, or with a later
  one, lets go of a shared hold, the caps left hold again (one passed already: renewing
  stops at once).
* **A TTL change** (``extend(ttl=...)``) moves the entry to a bucket of its new TTL. A batch
  taken before may still be on its way with the old TTL and land after the extend (a
  shorter one changes nothing there: a renewal never shortens); so when a batch settles
  with members that moved meanwhile, or an extend sent before a batch settled tells the
  renewer after it, the moved holds' bucket is renewed again at once: an old TTL stands for
  one round trip at most, never until the next period.
* **A renewal keeps every key the hold lives by**: a lease's renewal (``LeaseRenewal``)
  declares its details hash (the read-write lock's writer mark) beside the leases, so a
  Cluster slot moved key by key answers ASK or TRYAGAIN (no answer: tried again) instead
  of running half the script: the leases renewed, the mark left to run out, and a reader
  admitted beside the writer. Renewals never queue behind the backend's callers: a Redis
  backend's come from a pool of their own, made like the client's (any ``ConnectionPool``
  subclass but Sentinel's), and a loss found there is declared as any.
* **One backend never delays another**: one scheduler thread (``redlock-renewer``) decides
  what is due and hands each batch to its backend's worker thread, which alone waits for
  that backend; a paused Redis holds up its own worker and nobody else's. **A shard is a
  backend here**: a backend whose holds live on separate servers (a Cluster's masters)
  names each hold's shard when it joins (``renewal_shard``), and holds of one shard are
  batched and renewed by a worker of their own, which sends to that shard only: a paused
  master holds up only its holds. Nothing is logged and no user code runs (signals,
  receivers, metrics) under the renewer's one mutex, which the scheduler, every worker and
  every release take: a slow log handler would hold them all up. A hold whose keys moved
  (the backend's ``renewal_epoch`` changed: a slot moved, a failover) is asked its shard
  again before its batch's next renewal or as that batch settles, and moves to its new
  shard's batches, renewed at once.
  Idle workers end, and a closed backend's workers (:meth:`ThreadRenewer.retire`, from
  ``close()``) end as soon as they renew no hold of that backend.
* **A loss is declared** only when a backend answered that a token no longer holds its
  lock, by the worker that got the answer, to each Lock object in the entry, after dropping
  it (under the renewer's mutex, so once). The object declares it (``lock_lost``, warning)
  only if it still had the hold: whoever takes a hold out of the object under its mutex (a
  renewal's loss, a release that found it gone, ``owned()``, ``extend()``) declares it, and
  only they, so one loss fires once per object. Objects sharing the hold (one token) each
  get theirs: each reported it held, each would learn it from its own ``owned()``, and a
  receiver tells them apart by its ``lock`` argument.
* **A loss dropped is a loss declared**: the entry is queued as lost before it is dropped
  and leaves the queue once its objects were told, so an exception in between (the worker
  heals) leaves it to the heal or the next settle, never forgotten.
* **A loss is decided on the renewal path, announced off it**: the worker takes the hold out
  of the object (``owned()`` is False, ``lost`` set, ``LockLost`` raised from then on) and
  hands the notification (``lock_lost`` receivers, the warning, metrics) to the notifier
  thread (``redlock-notify``, one per process, started by the first loss, ended when idle),
  which runs them in order: a receiver that blocks delays other notifications, never a
  renewal. Receivers should be quick all the same.
* **No answer is not a loss**: the bucket is tried again soon, for as long as it takes.
* **Healing**: an exception in a renewer thread (a bug, or an asynchronous exception) is
  caught and logged; the thread goes on after putting every bucket it had taken back into
  the schedule (a batch interrupted mid-flight settles as "no answer"); a hold's pending
  news leaves the pending deque only once it is added, so an interrupted take loses none. A
  scheduler that
  died anyway is started again by the next ``add``/``soon`` or by a worker (idle workers
  look every second); the scheduler starts dead workers, and a worker that ends hands its
  queued batches back. The notifier logs a failed notification and goes on (not running it
  again: part of it may have run); one that died is started by the next loss, or at once if
  notifications are left. After a fork the child starts empty.
* **A batch in flight after a release** may still renew the released hold once (harmless:
  the release deleted the key or the token no longer matches) and its answer is ignored
  for holds no longer in its bucket: only members still there can be declared lost.
* **The tables shrink**: an empty bucket leaves the joinable table; stale schedule and cap
  items are compacted once they outnumber the live ones.

* **An orphan is let go**: a reentrant hold belongs to its owner, a thread or an asyncio
  task; once that has ended without releasing it, nobody may release it, so it is no longer
  renewed (looked for every :data:`OWNER_SWEEP` seconds) and runs out at its TTL. Every
  ``add`` of a reentrant hold (the acquire's, an ``extend()``'s) names its owner, and the
  entry keeps it whichever of them made it: the acquire's news may reach the renewer after
  the extend's.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import observe
from .backends.base import BaseLockBackend, Renewal, on_close, on_moved
from .forks import after_fork_in_child
from .waiters import start_thread


class Lock(Protocol):
    """What the watchdog needs of a lock object (:class:`~.locks.base.BaseLock` is one)."""

    backend: BaseLockBackend
    name: str

    def renewed_by(self, renewer: Renewer, token: str) -> bool:
        """Whether a hold with ``token`` is held and meant to be renewed by ``renewer``:
        asked before a hold's first renewal (it may have been released meanwhile)."""

    def mark_lost(
        self,
        token: str,
        reason: str,
        later: Callable[[Callable[[], None]], None] | None = None,
        found: float | None = None,
    ) -> None:
        """The backend answered that ``token`` holds nothing: the object drops the hold and
        is lost from now on; its notification runs in ``later`` (the notifier thread).
        ``found``: when that answer came (monotonic; None: now)."""


logger = logging.getLogger("django_redlock")
BATCH = 500
IDLE_WAKE = 1.0
WORKER_IDLE = 60.0  # a backend's worker ends after this long without a batch (its connection
# is made again by the next one: a cluster client takes a while)
COMPACT = 64  # stale schedule and cap items tolerated beyond twice the live ones
OWNER_SWEEP = 2.0  # seconds between looks for reentrant holds whose owner has ended
LOST = "it expired or was released by someone else"

HoldKey = tuple[int, str, str]  # (id of the backend, lock name, token)
Batch = tuple["_Bucket", list["_Entry"], list[Renewal]]


@dataclass(eq=False)
class _Ask:
    """What one Lock object asked of a hold it shares: the hold follows the objects still
    holding it, never one that let go (see :meth:`Renewer._follow`)."""

    renewal: Renewal  # its TTL
    set_at: float  # when that TTL was set: older news of the object does not replace it
    stop_at: float | None  # its cap (monotonic), if any


@dataclass(eq=False)
class _Entry:
    """One hold, and the Lock objects that hold it (renewing stops when they are collected)."""

    key: HoldKey
    backend: BaseLockBackend
    renewal: Renewal
    stop_at: float | None  # the cap on renewing (monotonic), if any
    bucket: _Bucket | None = None
    shard: Hashable = None  # the backend's part its hold was on when taken (see _join)
    locks: weakref.WeakSet[Lock] = field(default_factory=weakref.WeakSet)
    # Weak references whose callbacks tell the renewer that a holding Lock was collected, by
    # the object's id: one per object holding now (remove() and the sweep drop the others),
    # so a long hold joined by many objects in turn keeps no trail of dead references.
    watches: dict[int, weakref.ref[Lock]] = field(default_factory=dict)
    asks: dict[int, _Ask] = field(default_factory=dict)  # by the object's id, as watches
    found_lost: float = 0.0  # when a renewal's answer said it is gone (monotonic)
    # The TTL news that reached the renewer last: when it came and when its command was sent
    # (news of two commands that overlapped may come in another order than Redis ran them).
    news_at: float = -math.inf
    news_sent: float = -math.inf
    # Extends sent and not answered yet (see sending()): their TTL and when they were sent.
    flights: dict[int, tuple[Renewal, float]] = field(default_factory=dict)


@dataclass(eq=False)
class _Bucket:
    """Holds of one backend and TTL, acquired close together, renewed as one batch.

    The schedule works on buckets, not holds: a renewal period costs a heap push per bucket
    and no Python work per hold unless one fails (10,000 holds are 20 buckets).
    """

    backend: BaseLockBackend
    ttl_ms: int
    shard: Hashable  # the backend's part (a Cluster's master): its own batches and worker
    epoch: int  # the backend's renewal_epoch its members' shards were found at (at least)
    interval: float  # seconds between renewals: a third of the TTL
    closes: float  # new holds may join until then
    due: float  # monotonic time of the next renewal (inf while a batch is in flight)
    confirmed_until: float  # every member is certainly ours until then
    overdue: bool = False  # past confirmed_until without an answer (warned once)
    flying: threading.Thread | None = None  # the thread that has its batch, if any
    settled_at: float = -math.inf  # when its last batch settled
    moved: bool = False  # a member moved to another bucket while a batch was in flight
    again: bool = False  # renew again as soon as the batch in flight settles
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
    """The schedule of held locks; :class:`ThreadRenewer` runs it (tests drive it by hand)."""

    def __init__(self) -> None:
        self._entries: dict[HoldKey, _Entry] = {}
        self._mutex = threading.RLock()
        # (backend id, ttl ms, shard): joinable
        self._open: dict[tuple[int, int, Hashable], _Bucket] = {}
        # (due, serial, bucket): the next renewals in order. An item whose bucket has a new
        # due time or no members is stale and skipped, so rescheduling is just another push.
        self._schedule: list[tuple[float, int, _Bucket]] = []
        self._caps: list[tuple[float, int, HoldKey]] = []  # (stop_at, serial, key)
        self._capped = 0  # entries with a cap: live items of _caps
        # Reentrant holds' owners (thread or task), weakly: renewed while their owner lives.
        self._owners: dict[HoldKey, weakref.ref[Any]] = {}
        self._owners_swept = 0.0
        self._serial = itertools.count()
        self._collected = False  # a holding Lock object was garbage-collected: sweep
        self._losses: deque[_Entry] = deque()  # dropped as lost, objects not all told yet

    def _on_collected(self, _: weakref.ref[Lock]) -> None:
        self._collected = True  # only a flag: this runs wherever the collector runs

    def _plan(self, bucket: _Bucket) -> None:
        heapq.heappush(self._schedule, (bucket.due, next(self._serial), bucket))

    def _due_now(self, bucket: _Bucket, now: float) -> None:
        """Renew ``bucket`` at once (or right after its batch in flight settles)."""
        if bucket.flying is not None:
            bucket.again = True  # a member joined after its batch left: once more, at once
        elif bucket.due > now:
            bucket.due = now
            self._plan(bucket)

    def _join(self, entry: _Entry, backend: BaseLockBackend, now: float, epoch: int = -1) -> None:
        """Put a hold taken at ``now`` (when the command that set its TTL was sent: Redis
        counts the TTL from about then) into a batch: the open one, or a new one. ``epoch``:
        the backend's :attr:`~.BaseLockBackend.renewal_epoch` read before ``entry.shard``
        was found (-1: unknown, its shard is asked again at the batch's next renewal)."""
        ttl_ms, shard = entry.renewal.ttl_ms, entry.shard
        bucket = self._open.get((id(backend), ttl_ms, shard))
        if (
            bucket is None
            or now > bucket.closes
            or len(bucket.members) >= BATCH
            or bucket.due > now + bucket.interval  # dated from its send: due sooner
        ):
            interval = ttl_ms / 3000
            bucket = self._open[id(backend), ttl_ms, shard] = _Bucket(
                backend=backend,
                ttl_ms=ttl_ms,
                shard=shard,
                epoch=epoch,
                interval=interval,
                closes=now + interval / 2,  # first renewal: a sixth to a third of the TTL in
                due=now + interval,
                confirmed_until=now + ttl_ms / 1000,
            )
            self._plan(bucket)
        elif not bucket.members and bucket.flying is None:
            self._plan(bucket)  # its schedule item may have been dropped while it was empty
        bucket.epoch = min(bucket.epoch, epoch)
        bucket.members[entry.key] = entry
        bucket.changed()
        entry.bucket = bucket

    def _reshard(self, bucket: _Bucket, now: float) -> None:
        """A hold whose keys moved to another part of the backend since it joined (a
        Cluster's slot moved, its master failed over: the backend's renewal_epoch changed)
        leaves ``bucket`` for a batch of the part it is on now, renewed there at once by
        that part's worker: a worker never waits for another part. Per hold work only after
        such a change (called locked)."""
        backend = bucket.backend
        epoch = backend.renewal_epoch
        if bucket.epoch == epoch:
            return
        bucket.epoch = epoch
        for entry in list(bucket.members.values()):
            shard = backend.renewal_shard(entry.renewal.name)
            if shard != entry.shard:
                self._leave(entry)
                entry.shard = shard
                self._join(entry, backend, now, epoch)
                self._due_now(entry.bucket, now)  # type: ignore[arg-type]

    def _leave(self, entry: _Entry) -> _Bucket | None:
        """Take an entry out of its bucket; an emptied bucket is not joinable any more."""
        bucket, entry.bucket = entry.bucket, None
        if bucket is not None:
            bucket.members.pop(entry.key, None)
            bucket.changed()
            if not bucket.members:
                key = (id(bucket.backend), bucket.ttl_ms, bucket.shard)
                if self._open.get(key) is bucket:
                    del self._open[key]
        return bucket

    def _drop(self, key: HoldKey) -> _Entry:
        entry = self._entries.pop(key)
        self._owners.pop(key, None)
        self._leave(entry)
        if entry.stop_at is not None:
            self._capped -= 1
        self._compact()
        return entry

    def _compact(self) -> None:
        """Drop stale schedule and cap items once they outnumber the live ones."""
        if len(self._caps) > COMPACT + 2 * self._capped:
            self._caps = [c for c in self._caps if self._cap_is_live(c)]
            heapq.heapify(self._caps)
        if len(self._schedule) > COMPACT + 2 * len(self._entries):
            self._schedule = [
                item for item in self._schedule if item[0] == item[2].due and item[2].members
            ]
            heapq.heapify(self._schedule)

    def _cap_is_live(self, item: tuple[float, int, HoldKey]) -> bool:
        entry = self._entries.get(item[2])
        return entry is not None and entry.stop_at == item[0]

    def _set_cap(self, entry: _Entry, stop_at: float | None) -> None:
        if entry.stop_at is not None:
            self._capped -= 1
        entry.stop_at = stop_at
        if stop_at is not None:
            self._capped += 1
            heapq.heappush(self._caps, (stop_at, next(self._serial), entry.key))

    def add(
        self,
        lock: Lock,
        renewal: Renewal,
        stop_at: float | None,
        since: float | None = None,
        owner: Any = None,
        flight: int | None = None,
    ) -> None:
        """Renew a hold from now on, until ``stop_at`` (monotonic; None: no cap).

        A new TTL replaces this object's old one (the hold follows its objects: see
        :meth:`_follow`). ``since``: when the command that set it (an
        extend) was sent, to tell whether a batch may have landed after it (see the rules).
        ``owner``: a reentrant hold's thread or task (renewed while it lives). ``flight``:
        the extend's number from :meth:`sending`.
        """
        now = time.monotonic()
        with self._mutex:
            due = self._add(lock, renewal, stop_at, now, since, owner, flight)
        if due is not None:
            self._wake(due)

    def soon(
        self,
        lock: Lock,
        renewal: Renewal,
        stop_at: float | None,
        owner: Any = None,
        sent: float | None = None,
    ) -> None:
        """Renew a hold just taken, unless it is released before its first renewal.
        ``sent``: when the take was sent (its TTL counts from about then)."""
        self.add(lock, renewal, stop_at, sent, owner)

    def unsure(
        self,
        lock: Lock,
        renewal: Renewal,
        stop_at: float | None,
        owner: Any = None,
        flight: int | None = None,
    ) -> None:
        """A command that may have set ``renewal``'s TTL on the server had no answer (a lost
        reply): if that TTL is shorter than the one renewed, the hold goes on its schedule
        and is renewed at once (the server may have only that TTL left). A renewal never
        shortens, so this costs nothing if the command did not run."""
        now = time.monotonic()
        key = (id(lock.backend), renewal.name, renewal.token)
        with self._mutex:
            entry = self._entries.get(key)
            if entry is not None and flight is not None:
                entry.flights.pop(flight, None)  # its TTL kept below if shorter
                if renewal.ttl_ms >= self._kept(entry):
                    return  # at least the TTL kept either way: its schedule holds
            elif entry is not None and renewal.ttl_ms >= entry.renewal.ttl_ms:
                return  # at least the old TTL left either way: its schedule holds
            self._add(lock, renewal, stop_at, now, None, owner)
            entry = self._entries.get(key)
            if entry is None or entry.bucket is None:
                return
            self._due_now(entry.bucket, now)
        self._wake(now)

    def _kept(self, entry: _Entry) -> int:
        """The TTL ``entry`` follows once a flight is popped: the one set last by an object
        holding it, or a shorter one still on its way (called locked)."""
        asks = [a for i, a in entry.asks.items()
                if (w := entry.watches.get(i)) and w() is not None]  # fmt: skip
        if not asks:
            return entry.renewal.ttl_ms
        return self._target(entry, max(asks, key=lambda a: a.set_at))[0].ttl_ms

    def unsure_hold(
        self, backend: BaseLockBackend, renewal: Renewal, flight: int | None = None
    ) -> None:
        """As :meth:`unsure`, from an object that does not hold the token (a re-entry or an
        adopt() that raised): the hold, if renewed here, goes on the shorter TTL's schedule
        (until its objects set a TTL again) and is renewed at once. ``flight``: the
        command's number from :meth:`sending` (its :meth:`landed` is then a no-op)."""
        now = time.monotonic()
        with self._mutex:
            self._take_pending()  # a hold just taken may not be in the entries yet
            entry = self._entries.get((id(backend), renewal.name, renewal.token))
            if entry is None:
                return
            if flight is not None and entry.flights.pop(flight, None) is not None:
                kept = self._kept(entry)  # on the flight's schedule maybe: not kept
            else:
                kept = entry.renewal.ttl_ms
            if renewal.ttl_ms >= kept:
                return
            old = self._leave(entry)
            if old is not None and old.flying is not None:
                old.moved = True
            entry.renewal = renewal
            self._join(entry, backend, now, old.epoch if old is not None else -1)
            self._due_now(entry.bucket, now)  # type: ignore[arg-type]
        self._wake(now)

    def _add(
        self,
        lock: Lock,
        renewal: Renewal,
        stop_at: float | None,
        now: float,
        since: float | None = None,
        owner: Any = None,
        flight: int | None = None,
    ) -> float | None:
        """``lock``'s news that ``renewal``'s TTL was set: answered at ``now``, its command
        sent at ``since`` (None: unknown, taken as ``now``; ``flight``: its number from
        :meth:`sending`). Called locked."""
        key = (id(lock.backend), renewal.name, renewal.token)
        entry = self._entries.get(key)
        if entry is not None and flight is not None:
            entry.flights.pop(flight, None)  # answered: its news replaces it
        if stop_at is not None and stop_at <= time.monotonic() and entry is None:
            return None  # past its cap (an extend after it), alone: it runs out at its TTL
        # Past its cap with others holding on: its TTL is on the server all the same, so the
        # entry follows it (the cap is still its own: no renewals for it once they let go).
        sent = now if since is None else min(since, now)
        if entry is None:
            entry = self._entries[key] = _Entry(key, lock.backend, renewal, None)
            epoch = lock.backend.renewal_epoch  # first: a change while it is asked is seen
            entry.shard = lock.backend.renewal_shard(renewal.name)
            if owner is not None:
                self._owners[key] = weakref.ref(owner)
            self._set_cap(entry, stop_at)
            self._join(entry, lock.backend, sent, epoch)  # dated from the send (review wdc3, 3)
            joined = raced = False
        else:
            joined = True
            if owner is not None and key not in self._owners:
                # Made by a call without the owner that came first (a pending hold is taken
                # up to IDLE_WAKE late): the owner is kept, whichever call brings it.
                self._owners[key] = weakref.ref(owner)
            # Overlapped the news that came last (each sent before the other's answer):
            # Redis may have run them in either order, whatever order their news came in.
            raced = sent < entry.news_at and entry.news_sent < now
        if now >= entry.news_at:
            entry.news_at, entry.news_sent = now, sent
        ask = _Ask(renewal, now, stop_at)
        if lock not in entry.locks:
            # Its ask and watch before it joins: this runs in callers' threads too (landed,
            # unsure_hold), where an interrupt between two lines must not leave an object in
            # ``locks`` without them (the scheduler then failed on it at every turn).
            entry.asks[id(lock)] = ask
            entry.watches[id(lock)] = weakref.ref(lock, self._on_collected)
            entry.locks.add(lock)
        else:
            known = entry.asks.get(id(lock))
            if known is None or now >= known.set_at:
                entry.asks[id(lock)] = ask
            if id(lock) not in entry.watches:
                entry.watches[id(lock)] = weakref.ref(lock, self._on_collected)
        if joined:
            if not self._follow(entry, now, ask, since, sent):
                self._drop(key)  # every cap has passed (this object's too): let it run out
                return None
            if raced and entry.bucket is not None:
                # The server may hold the other's TTL, shorter maybe: renewed at once with
                # the one followed, after both ran (review wdc3, 1).
                self._due_now(entry.bucket, now)
        return entry.bucket.due if entry.bucket is not None else None

    def _follow(
        self,
        entry: _Entry,
        now: float,
        added: _Ask | None = None,
        since: float | None = None,
        sent: float | None = None,
    ) -> bool:
        """Give a shared hold the TTL and cap of the objects holding it now (called locked,
        after one joined, set a TTL, released or was collected): the TTL set last by one
        of them, and the latest of their caps (none if one has none). A hold never keeps
        the TTL or cap of an object that let go. False: every cap has passed (drop it).
        ``sent``: when the command of ``added`` was sent (its new TTL is dated from then)."""
        asks = [a for i, a in entry.asks.items() if (w := entry.watches.get(i)) and w() is not None]
        if not asks:
            return True  # no object left: the caller drops the entry
        latest = max(asks, key=lambda a: a.set_at)
        target, flown = self._target(entry, latest)
        if target.ttl_ms != entry.renewal.ttl_ms:
            old = self._leave(entry)
            if old is not None and old.flying is not None:
                old.moved = True  # its batch may land after this TTL: settle renews
            entry.renewal = target
            if flown is not None:
                dated = flown  # an extend on its way: counted from its send
            else:
                dated = sent if latest is added and sent is not None else now
            self._join(entry, entry.backend, dated, old.epoch if old is not None else -1)
            if flown is None and (
                latest is not added
                or (old is not None and since is not None and old.settled_at >= since)
            ):
                # Either the TTL came back from an object that held on (the server still
                # has the one that let go's, maybe shorter: its new bucket would be due too
                # late), or the old TTL's batch settled after this extend was sent and may
                # have landed after it. Renew with the TTL now in force at once.
                self._due_now(entry.bucket, now)  # type: ignore[arg-type]
        caps = [a.stop_at for a in asks]
        cap = None if None in caps else max(c for c in caps if c is not None)
        if cap != entry.stop_at:
            self._set_cap(entry, cap)  # renewed as long as any object holding it asks
        return cap is None or cap > now

    @staticmethod
    def _target(entry: _Entry, latest: _Ask) -> tuple[Renewal, float | None]:
        """The TTL to renew ``entry`` with: the one set last (``latest``), or a shorter one an
        extend on its way may set (with its send time; None: not one of those)."""
        target, flown = latest.renewal, None
        for renewal, sent in entry.flights.values():
            if renewal.ttl_ms < target.ttl_ms:
                target, flown = renewal, sent
        return target, flown

    def sending(self, lock: Lock, renewal: Renewal) -> int | None:
        """An extend, a re-entry or an adopt() that sets ``renewal``'s TTL is about to be
        sent: until its answer (or its lack) is told (:meth:`add`, :meth:`soon`,
        :meth:`unsure`, :meth:`unsure_hold`, then :meth:`landed`), the hold is
        renewed on that TTL's schedule if it is shorter (Redis may run it any time before
        the answer comes). The flight's number, or None if the hold is not renewed here."""
        now = time.monotonic()
        key = (id(lock.backend), renewal.name, renewal.token)
        with self._mutex:
            self._take_pending()  # the hold's news may still be pending
            entry = self._entries.get(key)
            if entry is None:
                return None
            flight = next(self._serial)
            entry.flights[flight] = (renewal, now)
            if renewal.ttl_ms >= entry.renewal.ttl_ms:
                return flight
            self._follow(entry, now)
            due = entry.bucket.due if entry.bucket is not None else None
        if due is not None:
            self._wake(due)
        return flight

    def landed(self, lock: Lock, renewal: Renewal, flight: int | None) -> None:
        """The command of :meth:`sending` is over, its news told (or it was never sent)."""
        if flight is None:
            return
        now = time.monotonic()
        key = (id(lock.backend), renewal.name, renewal.token)
        with self._mutex:
            self._take_pending()  # a re-entry's news (soon): in the entry before it lands
            entry = self._entries.get(key)
            if entry is None or entry.flights.pop(flight, None) is None:
                return  # told already (add, unsure)
            if not self._follow(entry, now):
                self._drop(key)
                return
            due = entry.bucket.due if entry.bucket is not None else None
        if due is not None:
            self._wake(due)

    def remove(self, lock: Lock, token: str) -> None:
        key = (id(lock.backend), lock.name, token)
        with self._mutex:
            entry = self._entries.get(key)
            if entry is not None:
                entry.locks.discard(lock)
                watch = entry.watches.get(id(lock))
                if watch is not None and watch() is lock:
                    del entry.watches[id(lock)]
                    entry.asks.pop(id(lock), None)
                if not entry.locks or not self._follow(entry, time.monotonic()):
                    self._drop(key)  # nobody holds it, or the caps left have passed

    def renew_now(self, backend: BaseLockBackend) -> None:
        """Renew every hold of ``backend`` at once (its server moved: a Sentinel failover;
        a renewal sent before may have reached only the old master)."""
        now = time.monotonic()
        with self._mutex:
            buckets = {id(e.bucket): e.bucket for e in self._entries.values()
                       if e.backend is backend and e.bucket is not None}  # fmt: skip
            for bucket in buckets.values():
                self._due_now(bucket, now)
        self._wake(now)

    def __len__(self) -> int:
        return len(self._entries)

    def tables(self) -> dict[str, int]:
        """The sizes of the renewer's tables (tests, diagnostics)."""
        with self._mutex:
            return {"entries": len(self._entries), "open": len(self._open),
                    "schedule": len(self._schedule), "caps": len(self._caps),
                    "watches": sum(len(e.watches) for e in self._entries.values())}  # fmt: skip

    def _wake(self, due: float) -> None:
        """A hold falls due at ``due``: make sure the runner looks at it in time."""

    def _take_pending(self) -> None:
        """Start renewing the holds of :meth:`soon` that are still held (called locked)."""

    def _sweep_collected(self) -> None:
        """Drop the entries no Lock object holds any more (their holds run out); called
        locked, after a holding object was collected.

        An object's news (:meth:`ThreadRenewer.soon`) is appended without the mutex: it may
        have come after the scheduler took the pending news and before the collection of
        the token's other object. It is taken up first, so the entry it joins is kept.
        """
        self._collected = False
        self._take_pending()
        now = time.monotonic()
        for key, entry in list(self._entries.items()):
            if not entry.locks:
                self._drop(key)  # no Lock object holds it any more: let it run out
            else:
                dead = [i for i, watch in entry.watches.items() if watch() is None]
                for each in dead:
                    del entry.watches[each]
                    entry.asks.pop(each, None)
                if dead and not self._follow(entry, now):
                    self._drop(key)  # the caps of the objects left have passed

    def _next(self) -> list[Batch] | float:
        """The buckets due now (marked in flight), or how long to sleep until one is due."""
        now = time.monotonic()
        with self._mutex:
            self._take_pending()
            while self._caps and self._caps[0][0] <= now:
                item = heapq.heappop(self._caps)
                if self._cap_is_live(item):
                    self._drop(item[2])  # capped: the hold now runs out at its TTL
            if self._owners and now >= self._owners_swept + OWNER_SWEEP:
                self._owners_swept = now
                for key in [k for k, ref in self._owners.items() if _ended(ref())]:
                    self._drop(key)  # its owner ended unreleased: nobody may release it
            if self._collected:
                self._sweep_collected()
            due: list[Batch] = []
            schedule = self._schedule
            me = threading.current_thread()
            while schedule:
                at, _, bucket = schedule[0]
                if at != bucket.due or not bucket.members or bucket.flying is not None:
                    heapq.heappop(schedule)  # stale, or every hold in it is gone
                    continue
                if at > now:
                    if due:
                        break
                    return min(at - now, IDLE_WAKE)  # a second at most: see soon()
                heapq.heappop(schedule)
                self._reshard(bucket, now)  # holds moved to another part go to its batches
                if not bucket.members:
                    continue
                bucket.due = math.inf  # in flight: any other item of it is stale
                bucket.flying = me
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
        results: list[bool | None] | BaseException,
        started: float,
    ) -> None:
        """Apply one batch's outcome; report lost holds."""
        observe.renewed(bucket.backend, len(entries), results)
        lost: list[_Entry] = []
        overdue = 0  # holds to warn about, after the mutex (see below)
        now = time.monotonic()
        with self._mutex:
            bucket.flying = None
            bucket.settled_at = now
            self._reshard(bucket, now)  # first: a hold found elsewhere got None here
            if isinstance(results, BaseException) or (
                None in results
                and any(
                    r is None and e.bucket is bucket for e, r in zip(entries, results, strict=True)
                )
            ):
                # No answer (for some): unknown is not lost. Try again soon, for as long as
                # it takes: only an answer that the token is gone makes a loss. Past the TTL
                # the hold may have run out (fencing is what protects the work then): say so.
                if isinstance(results, BaseException):
                    results = [None] * len(entries)
                bucket.due = now + min(bucket.interval / 4, 1.0)
                if now >= bucket.confirmed_until and not bucket.overdue:
                    bucket.overdue = True
                    overdue = results.count(None)
                lost = [e for e, ok in zip(entries, results, strict=True) if ok is False]
            else:
                bucket.due = started + bucket.interval
                bucket.confirmed_until = started + bucket.ttl_ms / 1000
                bucket.overdue = False
                if not all(results):  # the common case costs no loop over the holds
                    lost = [e for e, ok in zip(entries, results, strict=True) if not ok]
            if bucket.again:
                bucket.again = False
                bucket.due = now
            self._plan(bucket)
            if bucket.moved:
                # Members moved to another TTL while this batch flew: it may have landed
                # after their extend, with the old TTL. Renew them with the new one now.
                bucket.moved = False
                for entry in entries:
                    if entry.bucket is not bucket and entry.bucket is not None:
                        self._due_now(entry.bucket, now)
            lost = [entry for entry in lost if entry.bucket is bucket]
            for entry in lost:
                entry.found_lost = now  # a release begun after this did not cause it
            self._losses.extend(lost)  # first: a loss dropped is a loss to declare
            for entry in lost:
                self._drop(entry.key)
            wake = min(bucket.due, self._schedule[0][0]) if self._schedule else bucket.due
        self._wake(wake)  # the scheduler may sleep past the new due time: settled elsewhere
        if overdue:
            # Logged out of the mutex: a slow handler (a network one) holds up this worker
            # only, never the scheduler, other backends' workers or a release.
            logger.warning(
                "redlock: %d holds on %s could not be renewed before their TTL ran out"
                " (no answer); they may have expired: still trying",
                overdue,
                bucket.backend.describe(),
            )
        self._declare_losses()

    def _declare_losses(self) -> None:
        """Tell each Lock object of every entry dropped as lost that its hold is gone
        (``mark_lost``: decided there, the object lets go now; declared by ``_notify``).

        Called without the mutex (``mark_lost`` takes the object's, which may be held by
        a caller waiting for this one). A loss is queued, under the mutex, before its entry
        is dropped, and leaves the queue only once each of its objects was told: an
        exception in between (an asynchronous one) leaves it to the next settle or heal,
        which tells them again (an object told twice declares once: it has let go)."""
        while True:
            with self._mutex:
                if not self._losses:
                    return
                entry = self._losses[0]
            for lock in list(entry.locks):
                lock.mark_lost(entry.renewal.token, LOST, self._notify, entry.found_lost)
            with self._mutex:
                if self._losses and self._losses[0] is entry:  # not by another thread
                    self._losses.popleft()

    def _notify(self, declare: Callable[[], None]) -> None:
        """Run a loss's declaration (signal, warning, metrics); here at once, but the
        :class:`ThreadRenewer` hands it to its notifier thread, off the renewal path."""
        declare()

    def _renew(self, batches: list[Batch]) -> None:
        """Send batches of one worker in one round trip and settle each with its replies,
        whatever happens (an exception: no answer). One settle cut short leaves the others
        in flight for the heal."""
        bucket = batches[0][0]
        renewals = [renewal for batch in batches for renewal in batch[2]]
        started = time.monotonic()
        results: list[bool | None] | BaseException = RuntimeError("renewal interrupted")
        try:
            if bucket.shard is None:
                results = bucket.backend.renew_many(renewals)
            else:  # this part's holds only: a worker never waits for another part
                results = bucket.backend.renew_many(renewals, shard=bucket.shard)
        except Exception as exc:
            results = self._failed(bucket, exc)
        finally:
            at = 0
            for each, entries, sent in batches:
                if isinstance(results, BaseException):
                    self._settle(each, entries, results, started)
                else:
                    self._settle(each, entries, results[at : at + len(sent)], started)
                at += len(sent)

    def _heal(self, thread: threading.Thread, queued: deque[Batch] | None = None) -> None:
        """After an exception in ``thread``: whatever it had taken (but still has ``queued``)
        is scheduled again, and every entry is back in a bucket and every bucket in the
        schedule. An exception here leaves things no worse: the next heal finishes."""
        now = time.monotonic()
        with self._mutex:
            waiting = {id(batch[0]) for batch in queued or ()}
            buckets: dict[int, _Bucket] = {}
            for entry in self._entries.values():
                bucket = entry.bucket
                if bucket is None or bucket.members.get(entry.key) is not entry:
                    self._leave(entry)
                    self._join(entry, entry.backend, now)
                    bucket = entry.bucket
                assert bucket is not None
                buckets[id(bucket)] = bucket
            for bucket in buckets.values():
                if (bucket.flying is thread and id(bucket) not in waiting) or (
                    bucket.flying is not None and not bucket.flying.is_alive()
                ):
                    bucket.flying = None
                if bucket.flying is None:
                    bucket.due = min(bucket.due, now)
                    self._plan(bucket)
        self._wake(now)
        self._declare_losses()  # a loss the exception cut short

    def _failed(self, bucket: _Bucket, exc: Exception) -> Exception:
        from .exceptions import BackendRefused, BackendUnavailable, QuorumNotReached

        if isinstance(exc, (BackendUnavailable, QuorumNotReached, BackendRefused)):
            observe.backend_error(bucket.backend)
        if isinstance(exc, BackendRefused):  # the server's refusal, in its words: no answer
            logger.warning("redlock: renewing on %s: %s", bucket.backend.describe(), exc)
        elif not isinstance(exc, BackendUnavailable):  # a bug must not kill the watchdog
            logger.exception("redlock: renewing on %s failed", bucket.backend.describe())
        return exc


def _ended(actor: Any) -> bool:
    """Whether a reentrant owner (a thread, or an asyncio task) is gone or has finished."""
    if actor is None:
        return True
    done = getattr(actor, "done", None)
    return bool(done()) if done is not None else not actor.is_alive()


@dataclass(eq=False)
class _Worker:
    """The thread that alone waits for one backend's renewals, and its queue of batches."""

    backend: BaseLockBackend
    shard: Hashable
    cond: threading.Condition
    queue: deque[Batch] = field(default_factory=deque)
    thread: threading.Thread | None = None
    retired: bool = False  # its backend was closed: end once it renews no hold


class ThreadRenewer(Renewer):
    """Renews sync and asyncio holds from daemon threads (they never keep the interpreter
    alive): a scheduler, and a worker per backend (per shard of a backend that has shards:
    a Cluster's masters) that has batches due."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(self._mutex)
        self._thread: threading.Thread | None = None
        self._workers: dict[tuple[int, Hashable], _Worker] = {}  # by backend id and shard
        self._wakes_at = 0.0  # when the sleeping thread wakes by itself; 0: it is busy
        # Holds just taken. Most holds are released long before their first renewal
        # (TTL/3): those never cost more than this append.
        self._pending: deque[
            tuple[float, float, weakref.ref[Lock], Renewal, float | None, Any, HoldKey]
        ] = deque()  # (came, sent, Lock, renewal, stop_at, owner, hold key)
        # Losses to declare, in order, by the notifier thread: its own lock, so that a slow
        # receiver never holds up the renewer's mutex, nor any worker.
        self._notes_cond = threading.Condition(threading.Lock())
        self._notes: deque[Callable[[], None]] = deque()
        self._notifier: threading.Thread | None = None

    def _notify(self, declare: Callable[[], None]) -> None:
        with self._notes_cond:
            self._notes.append(declare)
            if self._notifier is None or not self._notifier.is_alive():
                self._start_notifier()
            else:
                self._notes_cond.notify()

    def _start_notifier(self) -> None:
        self._notifier = threading.Thread(target=self._declare, name="redlock-notify", daemon=True)
        self._notifier.start()

    def _declare(self) -> None:
        """The notifier thread: declare each loss handed over, in order; end when idle."""
        me, cond = threading.current_thread(), self._notes_cond
        try:
            while True:
                try:
                    with cond:
                        idle = time.monotonic()
                        while not self._notes:
                            if self._notifier is not me or time.monotonic() - idle >= WORKER_IDLE:
                                return  # idle: the next loss starts a new notifier
                            cond.wait(IDLE_WAKE)
                        declare = self._notes.popleft()
                    declare()
                except BaseException:  # a bug, or an asynchronous exception: carry on
                    # Not run again: part of it may have run, and a loss is declared once.
                    logger.exception("redlock: declaring a lost lock failed; going on")
        finally:
            with cond:
                if self._notifier is me:
                    self._notifier = None
                    if self._notes:  # left by an exception that got out of the loop
                        self._start_notifier()

    def retire(self, backend: BaseLockBackend) -> None:
        """``backend`` was closed: its worker ends as soon as no hold of it is renewed
        (at once if none is), instead of after :data:`WORKER_IDLE`."""
        with self._mutex:
            for worker in list(self._workers.values()):
                if worker.backend is backend:
                    worker.retired = True
                    worker.cond.notify()

    def _renews_on(self, backend: BaseLockBackend) -> bool:
        return any(entry.backend is backend for entry in self._entries.values())

    def soon(
        self,
        lock: Lock,
        renewal: Renewal,
        stop_at: float | None,
        owner: Any = None,
        sent: float | None = None,
    ) -> None:
        now = time.monotonic()
        # Dated from the take's send, not its answer: a reply slow by 2/3 of the TTL put
        # the first renewal after the key's expiry (review wdc3, 3).
        taken = now if sent is None else min(sent, now)
        key = (id(lock.backend), renewal.name, renewal.token)  # the object may be collected
        self._pending.append((now, taken, weakref.ref(lock), renewal, stop_at, owner, key))
        due = taken + renewal.ttl_ms / 3000
        if due < now + IDLE_WAKE or self._thread is None:
            # The thread may sleep up to IDLE_WAKE before it looks at the pending holds:
            # fine for TTLs of 3 s and more, a shorter one (or a late answer) is due sooner.
            self._wake(due)

    def _take_pending(self) -> None:
        pending = self._pending
        while pending:
            # Left in the deque until it is added: an exception (an asynchronous one) on the
            # way leaves it for the next take (taking one twice adds nothing).
            came, taken, ref, renewal, stop_at, owner, key = pending[0]
            lock = ref()
            if lock is not None and lock.renewed_by(self, renewal.token):
                # Joins the hold's entry if it has one (another object of the token, or an
                # extend that added it): a TTL set later is kept.
                self._add(lock, renewal, stop_at, came, taken, owner)
            else:
                # Released (or its Lock collected) before its first renewal: its TTL is on
                # the server all the same. Another object holding the token (a nested
                # re-entry that left at once) is renewed at once: a renewal restores its
                # TTL, never shortens (review wdc4, 2).
                entry = self._entries.get(key)
                if (
                    entry is not None
                    and entry.bucket is not None
                    and renewal.ttl_ms < entry.renewal.ttl_ms
                ):
                    now = time.monotonic()
                    self._due_now(entry.bucket, now)
                    self._wake(now)
            del lock
            pending.popleft()

    def _wake(self, due: float) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="redlock-renewer", daemon=True
                )
                start_thread(self._thread)
            elif due < self._wakes_at:
                # Only then: waking the thread on every acquire would cost each one a
                # thread switch (and the GIL) for nothing.
                self._cond.notify()

    def _batches(self) -> list[Batch]:
        with self._cond:  # deciding to sleep and sleeping are one step: no wake-up is lost
            while True:
                batches = self._next()
                if not isinstance(batches, float):
                    self._wakes_at = 0.0
                    return batches
                self._wakes_at = time.monotonic() + batches
                self._cond.wait(batches)

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            while self._thread is me:
                try:
                    for batch in self._batches():
                        self._hand(batch)
                except BaseException:  # a bug, or an asynchronous exception: carry on
                    logger.exception("redlock: the watchdog's scheduler failed; going on")
                    self._heal(me)
        finally:
            with self._cond:
                if self._thread is me:
                    self._thread = None

    def _hand(self, batch: Batch) -> None:
        """Give a batch to its backend's (shard's) worker (started if it has none)."""
        bucket = batch[0]
        key = (id(bucket.backend), bucket.shard)
        with self._mutex:
            worker = self._workers.get(key)
            if worker is None:
                worker = _Worker(bucket.backend, bucket.shard, threading.Condition(self._mutex))
                self._workers[key] = worker
            worker.queue.append(batch)
            if worker.thread is None or not worker.thread.is_alive():
                worker.thread = threading.Thread(
                    target=self._work,
                    args=(worker,),
                    name=f"redlock-renew {bucket.backend.alias}"
                    + ("" if bucket.shard is None else f" {bucket.shard}"),
                    daemon=True,
                )
                start_thread(worker.thread)
            bucket.flying = worker.thread
            worker.cond.notify()

    def _work(self, worker: _Worker) -> None:
        me = threading.current_thread()
        try:
            while True:
                try:
                    with self._mutex:
                        idle = time.monotonic()
                        while not worker.queue:
                            # Awake every second: a dead scheduler is started again.
                            worker.cond.wait(IDLE_WAKE)
                            if self._thread is None or not self._thread.is_alive():
                                self._wake(time.monotonic())
                            if worker.queue or worker.thread is not me:
                                continue
                            if time.monotonic() - idle >= WORKER_IDLE or (
                                worker.retired and not self._renews_on(worker.backend)
                            ):
                                return  # idle: the next batch starts a new worker
                        # Those queued behind it go in the same round trip: holds taken
                        # slowly (a loaded machine) spread over many small batches, and one
                        # trip each fell behind their TTL. In flight (``flying``) from here.
                        batches = [worker.queue.popleft()]
                        size = len(batches[0][2])
                        while worker.queue and size + len(worker.queue[0][2]) <= BATCH:
                            size += len(worker.queue[0][2])
                            batches.append(worker.queue.popleft())
                    self._renew(batches)
                except BaseException:  # a bug, or an asynchronous exception: carry on
                    logger.exception("redlock: a watchdog worker failed; going on")
                    self._heal(me, worker.queue)
        finally:
            with self._mutex:
                if worker.thread is me:
                    worker.thread = None
                    key = (id(worker.backend), worker.shard)
                    if self._workers.get(key) is worker:
                        del self._workers[key]
                    now = time.monotonic()
                    while worker.queue:  # not sent: due again, for the next worker
                        bucket = worker.queue.popleft()[0]
                        bucket.flying = None
                        bucket.due = now
                        self._plan(bucket)
                    self._cond.notify()

    def _forget_after_fork(self) -> None:
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._entries = {}
        self._pending = deque()
        self._open = {}
        self._schedule = []
        self._caps = []
        self._capped = 0
        self._owners = {}
        self._losses = deque()  # the parent declares its own losses
        self._workers = {}
        self._thread = None
        self._wakes_at = 0.0
        self._notes_cond = threading.Condition(threading.Lock())
        self._notes = deque()  # the parent declares its own losses
        self._notifier = None


thread_renewer = ThreadRenewer()
on_close(thread_renewer.retire)  # a closed backend's watchdog worker ends
on_moved(thread_renewer.renew_now)  # a Sentinel failover: renewed on the new master now


after_fork_in_child(thread_renewer._forget_after_fork)
