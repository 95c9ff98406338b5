"""Celery beat with standbys: several ``celery beat`` processes, exactly one of them sends.

``CELERY_BEAT_SCHEDULER = "django_redlock.contrib.beat.LockedScheduler"`` (on Celery's
``PersistentScheduler``) or ``"django_redlock.contrib.beat.LockedDatabaseScheduler"`` (on
django-celery-beat's ``DatabaseScheduler``), with ``DJANGO_REDLOCK_BEAT = {"using": "default",
"ttl": 30}``.

* The leader is elected by :mod:`django_redlock.leader` (the same campaign, renewal,
  loss and resignation as ``with leader(name)``) on the lock ``DJANGO_REDLOCK_BEAT["name"]``
  (default ``"celery-beat"``). Standbys wait for it (woken by its release, or at its expiry):
  when the leader dies, another leads within the TTL; when it shuts down, at once. A leader
  whose term ends (the hold gone, or no renewal confirmed for two thirds of the TTL) sends
  nothing more and campaigns again.
* Every send is decided by one script that, atomically, checks that this process still holds
  the lock and records the entry's new ``last_run_at`` (compare-and-set against the one the
  decision was based on). So a leader that was paused or cut off and lost the lock sends
  nothing when it wakes, and a new leader starts from the last recorded run of every entry:
  no due entry is decided twice and none is skipped across a takeover (runs that fell due
  while nobody led are sent once, late, as Celery does after a downtime).
* A publish that fails takes its claim back: the run stays due and is sent once the broker
  answers, under the same task id (a publish may fail after the broker stored the message: a
  lost reply; a consumer that drops a task id it saw already then runs it once). So does a
  shutdown that lands in a claim or its publish (Celery's SIGTERM handler closes the
  scheduler, then raises SystemExit there): close() takes back every claim not published
  (a publish under way in its thread is waited for, within its time, first).
* A publish the broker does not finish within half the TTL (:data:`PUBLISH_SHARE`) is
  abandoned as one that raised (its outcome unknown), and the lead resigned: a leader hung
  on its broker link would renew the lead and send nothing, forever.
* Two windows remain, inherent to any broker. A leader that decided a send and is killed (or
  paused past its TTL) before the message reaches the broker loses (or delays) that one run.
  A publish that raised although the broker stored the message is sent again: with the same
  task id by this leader, with a new one by the next leader if this one's term ends first.
  Publishing is at least once, not exactly once.
"""

from __future__ import annotations

import contextlib
import datetime
import heapq
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from celery.beat import PersistentScheduler, Scheduler, event_t
from celery.beat import logger as beat_logger
from celery.schedules import schedstate
from celery.utils.time import maybe_make_aware
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from ..backends.base import BaseLockBackend, Op
from ..backends.locmem import LocMemBackend
from ..backends.redis import RedisBackend, text
from ..exceptions import LockError, LockNotAcquired
from ..handler import DEFAULT_LOCK_ALIAS, locks
from ..leader import Term, current_leader
from ..leader import leader as campaign_for
from ..scripts import Call, script
from ..validation import MAX_TTL, check_name, to_ms
from .broker import PublishWatch

logger = logging.getLogger("django_redlock")

SETTING = "DJANGO_REDLOCK_BEAT"
DEFAULT_NAME = "celery-beat"
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

# Outcomes of a claim.
NOT_LEADER, ALREADY_SENT, CLAIMED = 0, 1, 2

# For this long after it takes the lead (plus twice the TTL), a leader reads the records again
# once a second: a beat whose term ended takes back the claims it never published as soon as
# Redis answers it, which may be just after this leader read them as sent.
RECHECK = 10.0

# An entry whose publish failed is tried again after this long, doubled at each failure in a
# row up to BACKOFF_MAX: the other due entries are sent meanwhile.
BACKOFF = 1.0
BACKOFF_MAX = 30.0

# A publish (with its connection, for a new link) is given this share of the lead's TTL.
# Celery's Redis broker has no socket timeout by default: a publish on a connection that
# stopped answering (a failover, a paused server, a NAT that dropped it) waits forever, while
# the keeper renews the lead: nobody would send. One that takes longer is abandoned, its
# claim taken back, and the lead resigned: a standby leads within the TTL of the hang.
PUBLISH_SHARE = 1 / 2


class PublishTimeout(Exception):
    """A publish the broker did not finish within its time (its outcome is unknown)."""


#: The producer Celery's tick passes on: connected in the publish's thread (connecting to a
#: Redis broker sends a PING, which waits as long as a publish).
IN_PUBLISH: Any = object()


# The leader check and the record of an entry's run, atomic with the send decision
# (lua/beat_claim.lua); a claim whose message could not be published handed back
# (lua/beat_unclaim.lua): each script's KEYS/ARGV contract is in its file.
CLAIM = script("beat_claim")
UNCLAIM = script("beat_unclaim")


@dataclass(frozen=True)
class BeatSettings:
    using: str
    ttl: float
    name: str


def beat_settings() -> BeatSettings:
    """``DJANGO_REDLOCK_BEAT``, checked (ImproperlyConfigured naming the key)."""
    raw = getattr(settings, SETTING, None)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ImproperlyConfigured(f"{SETTING} must be a dict, not {raw!r}")
    unknown = set(raw) - {"using", "ttl", "name"}
    if unknown:
        raise ImproperlyConfigured(
            f"{SETTING} has unknown keys {sorted(unknown)}; it takes 'using', 'ttl', 'name'"
        )
    using = raw.get("using", DEFAULT_LOCK_ALIAS)
    ttl = raw.get("ttl", 30.0)
    name = raw.get("name", DEFAULT_NAME)
    if not isinstance(using, str):
        raise ImproperlyConfigured(f"{SETTING}['using'] must be a backend alias, not {using!r}")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
        raise ImproperlyConfigured(f"{SETTING}['ttl'] must be a number of seconds, not {ttl!r}")
    if not 0 < ttl <= MAX_TTL:
        raise ImproperlyConfigured(f"{SETTING}['ttl'] must be > 0 and <= 30 days, not {ttl!r}")
    try:
        check_name(name)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"{SETTING}['name']: {exc}") from None
    return BeatSettings(using, float(ttl), name)


def _backend(config: BeatSettings) -> BaseLockBackend:
    try:
        backend = locks[config.using]
    except Exception as exc:  # an unknown alias
        raise ImproperlyConfigured(f"{SETTING}['using']: {exc}") from None
    if not isinstance(backend, (RedisBackend, LocMemBackend)):
        # A send decision must be atomic with the leader check, on one server.
        raise ImproperlyConfigured(
            f"{SETTING}['using'] = {config.using!r}: beat runs on a single-master backend"
            f" (Redis, django-redis, Sentinel, Cluster, LocMem), not {type(backend).__name__}:"
            " its send decisions are one atomic script beside the leader lock"
        )
    return backend


# -- the record of each entry's last run, beside the leader lock --------------------------------


def record_key(backend: BaseLockBackend, lock_name: str, entry: str) -> str:
    return f"{backend.key(lock_name)}:sent:{entry}"  # the lock's hash slot (Cluster)


#: LocMem's records, per store: (key) -> (value, expires at, monotonic).
_local_records: dict[int, dict[str, tuple[str, float]]] = {}


def _local(backend: LocMemBackend) -> tuple[Any, dict[str, tuple[str, float]]]:
    store = backend.store
    return store, _local_records.setdefault(id(store), {})


def claim_op(
    backend: BaseLockBackend, lock_name: str, token: str, entry: str, prev: int | None,
    new: int, ttl_ms: int,
) -> Op[tuple[int, int | None]]:  # fmt: skip
    """Send ``entry`` (run ``new``, decided from run ``prev``) only if ``token`` leads."""
    key = record_key(backend, lock_name, entry)
    prev_text = "" if prev is None else str(prev)
    if isinstance(backend, LocMemBackend):

        def run() -> Any:
            store, records = _local(backend)
            with store.mutex:
                now = time.monotonic()
                hold = store.live(lock_name, now)
                if hold is None or hold.reentrant or token not in hold.owners:
                    return [NOT_LEADER]
                record = records.get(key)
                if record is not None and record[1] > now:
                    at, _, by = record[0].partition("|")
                    if at == str(new) and by == token:
                        return [CLAIMED]
                    if at != prev_text:
                        return [ALREADY_SENT, record[0]]
                records[key] = (f"{new}|{token}", now + ttl_ms / 1000)
                return [CLAIMED]

        return Op(lock_name, run, _claimed)
    call = Call(CLAIM, [backend.key(lock_name), key], [token, prev_text, str(new), ttl_ms])
    return Op(lock_name, call, _claimed)


def unclaim_op(
    backend: BaseLockBackend, lock_name: str, token: str, entry: str, prev: int | None,
    new: int, ttl_ms: int,
) -> Op[bool]:  # fmt: skip
    """Take back this token's claim of run ``new`` (its message was not published)."""
    key = record_key(backend, lock_name, entry)
    prev_text = "" if prev is None else str(prev)
    if isinstance(backend, LocMemBackend):

        def run() -> Any:
            store, records = _local(backend)
            with store.mutex:
                now = time.monotonic()
                record = records.get(key)
                if record is None or record[1] <= now or record[0] != f"{new}|{token}":
                    return 0
                if prev is None:
                    del records[key]
                else:
                    records[key] = (f"{prev_text}|{token}", now + ttl_ms / 1000)
                return 1

        return Op(lock_name, run, bool)
    call = Call(UNCLAIM, [key], [token, prev_text, str(new), ttl_ms])
    return Op(lock_name, call, bool)


def read_op(backend: BaseLockBackend, lock_name: str, entry: str) -> Op[int | None]:
    """The last recorded run of ``entry`` (microseconds since the epoch), if any."""
    key = record_key(backend, lock_name, entry)
    if isinstance(backend, LocMemBackend):

        def run() -> Any:
            store, records = _local(backend)
            with store.mutex:
                record = records.get(key)
                return record[0] if record is not None and record[1] > time.monotonic() else None

        return Op(lock_name, run, _run_of)
    return Op(lock_name, ("GET", key), _run_of)


def _run_of(record: Any) -> int | None:
    if record is None:
        return None
    at = str(text(record)).partition("|")[0]
    return int(at) if at.lstrip("-").isdigit() else None


def _claimed(reply: Any) -> tuple[int, int | None]:
    outcome = int(reply[0])
    return outcome, (_run_of(reply[1]) if len(reply) > 1 else None)


#: A one-off's record lasts 30 days (it is the proof it was sent, until a leader disables it).
MAX_TTL_MS = to_ms(MAX_TTL)

#: The longest an entry's record lasts: two periods are kept, up to this (Redis takes it).
RECORD_TTL_MAX = 100 * 365 * 86400.0


def one_off_record(entry: Any) -> str | None:
    """The record name of a one-off entry's run (django-celery-beat's ``one_off``, as its
    ``clocked`` schedules are), or None. A clocked schedule ignores the last run, so a run is
    claimed only if this record does not exist: the one-off is switched off by a database
    write after the send, which a leader killed first never makes. The name carries the row's
    last change, so a one-off enabled again (saved) runs again."""
    model = getattr(entry, "model", None)
    if model is None or not getattr(model, "one_off", False):
        return None
    changed = getattr(model, "date_changed", None)
    stamp = to_micros(changed) if isinstance(changed, datetime.datetime) else ""
    return f"{entry.name}:once:{getattr(model, 'pk', '')}:{stamp}"


def to_micros(moment: datetime.datetime) -> int:
    """Exact (no float) microseconds since the epoch: what every beat compares."""
    return (maybe_make_aware(moment) - EPOCH) // datetime.timedelta(microseconds=1)


# -- the schedulers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Claimed:
    """A run this beat may send: what taking the claim back needs."""

    token: str
    prev: int | None
    new: int
    ttl_ms: int
    new_entry: Any
    record: str | None = None  # the record's entry name, when not the entry's (a one-off)
    count: int | None = None  # the row's run count before reserve(): restored if not sent
    # Set in the publish's thread as the broker took the run's message: no signal lands
    # there, so whatever line of the scheduler's a SIGTERM or exception lands on afterwards,
    # the run is known as sent (never taken back and sent again by the next leader).
    sent: threading.Event = field(default_factory=threading.Event, compare=False)


class LeaderMixin(Scheduler):
    """Lead or stand by, and claim every send (see the module's doc). Put it first:
    ``class MyScheduler(LeaderMixin, SomeScheduler)``."""

    #: How long a standby waits for the lock per tick; None (the default): until it has it.
    #: It is woken by the leader's release and at its expiry, never by polling; and a wait
    #: that times out is an ``acquire_timeout`` lock incident, which a standby would record
    #: every few seconds, forever. Signals (SIGTERM, Ctrl-C) end the wait as beat expects.
    standby_wait: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.redlock = beat_settings()  # at startup: a bad setting never reaches a tick
        self._backend = _backend(self.redlock)
        config = self.redlock
        # One campaign object for the scheduler's life: a resignation that got no answer is
        # finished by its next campaign, before it waits for the lock again.
        self._campaign = campaign_for(
            config.name, using=config.using, ttl=config.ttl, timeout=self.standby_wait
        )
        self._term: Term | None = None
        # entry name -> may the run be sent. A claim is here from before it is sent until its
        # publish is done (or it is handed back): close() takes back what is left, the claim
        # or publish a shutdown cut short (Celery's SIGTERM handler closes, then SystemExit).
        self._claims: dict[str, _Claimed | None] = {}
        # entry name -> (its publish's thread, its outcome, the monotonic time it is given up
        # at): a shutdown waits for a publish under way rather than take back a sent run.
        self._publishing: dict[str, tuple[threading.Thread, list[tuple[bool, Any]], float]] = {}
        # entry name -> a claim whose reply (or whose take-back's) was lost: nothing was
        # published. Claimed again as it was while this term lasts ...
        self._unsure: dict[str, _Claimed] = {}
        # ... and taken back after it ended (beat_unclaim.lua checks the record, not the lead),
        # at every tick until Redis answers: else the next leader reads it as sent.
        self._takeback: dict[str, _Claimed] = {}
        self._counts: dict[str, int] = {}  # entry name -> its run count before reserve()
        # entry name -> (the run before, task id) of a publish that raised: the same run is
        # sent again under the same id (the broker may have stored the first message).
        self._resend: dict[str, tuple[int | None, str]] = {}
        # entry name -> (monotonic time it may be tried again, its delay): a failed publish.
        self._backoff: dict[str, tuple[float, float]] = {}
        self._failed = False  # a publish failed in this tick
        self._pause_until = 0.0
        self._standing_by = False
        self._recheck = (0.0, 0.0)  # (monotonic time of the next reading, of the last)
        # The broker link publishes go through: (its generation, connection, producer),
        # made in a publish's thread. A publish abandoned (it hung) ends its generation: a
        # thread still hung on it never hands its link to a later publish.
        self._link: tuple[int, Any, Any] | None = None
        self._generation = 0
        self._link_mutex = threading.Lock()
        super().__init__(*args, **kwargs)

    # -- leading -------------------------------------------------------------------------------

    @property
    def leads(self) -> bool:
        """Whether this scheduler leads (its term has not ended, as far as it knows)."""
        return self._term is not None and not self._term.lost.is_set()

    def _token(self) -> str | None:
        """The leader hold's token while this scheduler leads; None once its term ended."""
        return self._campaign.lock.token if self.leads else None

    def tick(self, *args: Any, **kwargs: Any) -> Any:
        wait = self._pause_until - time.monotonic()
        if wait > 0:
            return wait
        if not self.leads and not self._elect():
            return 0.0  # waited for the lock already: try again at once
        self._failed = False
        self._recheck_records()
        wait = super().tick(*args, **kwargs)
        if self._failed:  # its entry was pushed back due: later than the others due now
            self._hold_back()
            return 0.0
        return wait

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        super().populate_heap(*args, **kwargs)
        self._hold_back()

    def is_due(self, entry: Any) -> Any:
        left = self._backoff_left(entry.name)
        if left > 0:
            return schedstate(is_due=False, next=left)
        return super().is_due(entry)

    def _backoff_left(self, name: str) -> float:
        backoff = self._backoff.get(name)
        return 0.0 if backoff is None else backoff[0] - time.monotonic()

    def _hold_back(self) -> None:
        """Put every entry backing off after a failed publish at its retry time in the heap:
        due at once, it would be tried before the others due, fail again, and starve them."""
        heap = self._heap
        if not heap or not self._backoff:
            return
        for i, event in enumerate(heap):
            left = self._backoff_left(event[2].name)
            if left > 0:
                heap[i] = event_t(self._when(event[2], left), event[1], event[2])
        heapq.heapify(heap)

    def _elect(self) -> bool:
        if self._term is not None:  # led once, ended since
            self._step_down(self._term.reason or "the lock was lost")
        if self._takeback and not self._take_back():  # before any records are read
            self._pause_until = time.monotonic() + 1.0
            return False
        config = self.redlock
        if not self._standing_by:
            logger.info("beat: standing by for the lock %r on %r", config.name, config.using)
            self._standing_by = True
        try:
            self._term = self._campaign.campaign()
        except LockNotAcquired:
            return False
        except LockError as exc:
            logger.warning("beat: could not take the lead: %s", exc)
            self._pause_until = time.monotonic() + 1.0
            return False
        try:
            self._load_records()
        except LockError as exc:
            logger.warning("beat: could not start the lead: %s", exc)
            self._step_down(str(exc))
            self._pause_until = time.monotonic() + 1.0
            return False
        self._standing_by = False
        self._heap = None  # due times from the recorded runs
        now = time.monotonic()
        self._recheck = (now + 1.0, now + RECHECK + 2 * config.ttl)
        logger.info(
            "beat: leading (lock %r on %r, fence %s)", config.name, config.using,
            self._term.fence,
        )  # fmt: skip
        return True

    def _step_down(self, why: str) -> None:
        term, self._term = self._term, None
        self._claims.clear()
        # Claims of the old token not published: taken back (first thing at the next tick),
        # so whoever leads next finds the run not sent.
        self._takeback.update(self._unsure)
        self._unsure.clear()
        self._backoff.clear()  # a delay of this term's: the next one starts afresh
        if term is not None:
            logger.warning("beat: not leading any more (%s): sending nothing", why)
            # Resigned at once; no answer: the hold runs out at its TTL, and the next
            # campaign finishes the release first.
            with contextlib.suppress(LockError):
                self._campaign.resign()

    def _take_back(self) -> bool:
        """Take back the claims of ended terms that were not published; False: Redis did not
        answer (they are tried again)."""
        for name, claimed in list(self._takeback.items()):
            op = unclaim_op(self._backend, self.redlock.name, claimed.token,
                            claimed.record or name, claimed.prev, claimed.new,
                            claimed.ttl_ms)  # fmt: skip
            try:
                self._backend.execute(op)
            except LockError as exc:
                logger.warning("beat: could not take back the claim of %r yet: %s", name, exc)
                return False
            del self._takeback[name]  # taken back, or the record moved on: nothing to undo
        return True

    def _load_records(self) -> None:
        """Start from the last run every entry has on record, whoever sent it."""
        for name, entry in list(self.schedule.items()):
            recorded = self._backend.execute(read_op(self._backend, self.redlock.name, name))
            if recorded is not None:
                self._set_last_run(entry, self._not_future(name, entry, recorded))

    def _recheck_records(self) -> None:
        """Soon after taking the lead: a record gone back to an earlier run (a claim taken
        back by the beat that made it, after this one read it) makes the run due again."""
        at, until = self._recheck
        now = time.monotonic()
        if now < at or at > until:
            return
        self._recheck = (now + 1.0, until)
        for name, entry in list(self.schedule.items()):
            try:
                recorded = self._backend.execute(read_op(self._backend, self.redlock.name, name))
            except LockError:
                return  # read again in a second; a claim meets the same Redis anyway
            last = to_micros(entry.last_run_at) if entry.last_run_at else None
            if recorded is not None and last is not None and recorded < last:
                self._set_last_run(entry, recorded)
                self._heap = None

    def _not_future(self, name: str, entry: Any, recorded: int) -> int:
        """``recorded``, or this beat's now when it is later than that: a record from the
        future was written by a leader whose clock runs ahead, and trusted it would hold every
        run back until this clock reaches it. It is rewritten as now (by this leader's token,
        only if unchanged), so the next leader starts from it too. (Beat hosts' clocks should
        agree: a run is sent by the leader's clock; this keeps a clock ahead from skipping
        runs after it is gone.)"""
        now = to_micros(entry.default_now())
        token = self._token()
        if recorded <= now or token is None:
            return recorded
        op = claim_op(self._backend, self.redlock.name, token, name, recorded, now,
                      self._record_ttl_ms(entry))  # fmt: skip
        try:
            outcome, _ = self._backend.execute(op)
        except LockError as exc:  # unknown: now here; the next claim finds the record again
            logger.warning("beat: could not rewrite %r's record from the future: %s", name, exc)
            return now
        if outcome != CLAIMED:
            return recorded  # not leading any more: the next claim steps down
        logger.warning(
            "beat: the last run of %r on record is %.3f s in this beat's future (a beat whose"
            " clock runs ahead sent it): taken as now",
            name, (recorded - now) / 1e6,
        )  # fmt: skip
        return now

    def _set_last_run(self, entry: Any, micros: int) -> None:
        """``entry``'s last run, and that of the schedule's entry of that name, which a heap
        rebuilt (``_heap = None``) starts from: they may be two objects (see :meth:`reserve`)."""
        moment = EPOCH + datetime.timedelta(microseconds=micros)
        moment = moment.astimezone(self.app.timezone)
        current = self.schedule.get(entry.name)
        for each in (entry,) if current is None or current is entry else (entry, current):
            each.last_run_at = moment
            model = getattr(each, "model", None)  # django-celery-beat's row
            if model is not None:
                model.last_run_at = moment

    # -- claiming each send --------------------------------------------------------------------

    def reserve(self, entry: Any) -> Any:
        model = getattr(entry, "model", None)  # django-celery-beat's reserve counts the run
        if model is not None:
            self._counts[entry.name] = model.total_run_count
        new_entry = super().reserve(entry)
        schedule = self.schedule
        if schedule.get(entry.name) is entry:
            # DatabaseScheduler's reserve() keeps the reserved entry in its schedule (Celery's
            # puts the next one there): a heap rebuilt from it would find the run just sent
            # due again, and its claim refused, over and over (a new leader's busy loop).
            schedule[entry.name] = new_entry
        self._claims[entry.name] = self._claim(entry, new_entry)
        return new_entry

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        claimed = self._claims.get(entry.name)
        if claimed is None:
            self._claims.pop(entry.name, None)
            return
        beat_logger.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
        again = self._resend.pop(entry.name, None)
        options = entry.options
        task_id = None
        if "task_id" not in options:  # an id of the entry's own is kept
            same = again is not None and again[0] == claimed.prev  # the run that raised
            task_id = again[1] if same and again is not None else str(uuid.uuid4())
            entry.options = {**options, "task_id": task_id}
        try:
            # Not super().apply_entry(), which logs a failed publish and moves on: the run
            # was claimed, and would be lost.
            result = self._publish(entry, producer, claimed, task_id or options.get("task_id"))
        except PublishTimeout as exc:
            beat_logger.error("Message Error: %s", exc)
            if not claimed.sent.is_set():  # (else it went through meanwhile: sent)
                if task_id is not None:
                    self._resend[entry.name] = (claimed.prev, task_id)
                self._unclaim(entry, claimed)  # at least once: the next leader sends it
            self._claims.pop(entry.name, None)  # handed back, or in _unsure
            self._forget_connection()
            self._step_down(str(exc))
            return
        except Exception as exc:
            beat_logger.error("Message Error: %s", exc, exc_info=True)
            if claimed.sent.is_set():  # raised after the broker took it: sent
                self._claims.pop(entry.name, None)
                return
            if task_id is not None:
                self._resend[entry.name] = (claimed.prev, task_id)
            self._unclaim(entry, claimed)
            self._claims.pop(entry.name, None)  # handed back, or in _unsure
            return
        finally:
            entry.options = options
        self._claims.pop(entry.name, None)  # published
        self._backoff.pop(entry.name, None)
        beat_logger.debug("%s sent. id->%s", entry.task, getattr(result, "id", None))

    def _publish(self, entry: Any, producer: Any, claimed: _Claimed, task_id: Any) -> Any:
        """``apply_async`` in a thread of its own, waited for a share of the lead's TTL
        (:data:`PUBLISH_SHARE`); ``PublishTimeout`` after that (the thread is left to end
        whenever the broker answers or drops the connection). ``claimed.sent`` is set there
        once the broker took ``task_id``'s message (or ``apply_async`` returned)."""
        limit = self.redlock.ttl * PUBLISH_SHARE
        outcome: list[tuple[bool, Any]] = []
        generation = self._generation

        def publish() -> None:
            try:
                used = self._producer(generation) if producer is IN_PUBLISH else producer
                if used is not None and isinstance(task_id, str):
                    used = PublishWatch(used, task_id, claimed.sent.set)
                result = self.apply_async(entry, producer=used, advance=False)
                claimed.sent.set()
                outcome.append((True, result))
            except BaseException as exc:  # raised in the scheduler's thread, below
                outcome.append((False, exc))
            finally:  # what a publish signal's receiver opened in this thread
                connections.close_all()

        thread = threading.Thread(target=publish, name="redlock-beat-publish", daemon=True)
        self._publishing[entry.name] = (thread, outcome, time.monotonic() + limit)
        try:
            thread.start()
            thread.join(limit)  # a SIGTERM's close() runs here: it waits for the thread
        finally:
            self._publishing.pop(entry.name, None)
        if not outcome:
            raise PublishTimeout(
                f"the broker did not take {entry.name!r} within {limit:g} s (half the lead's"
                " TTL): resigning the lead"
            )
        done, value = outcome[0]
        if done:
            return value
        raise value

    @property
    def producer(self) -> Any:
        """Not Celery's producer, connected in the scheduler's thread (a Redis broker's
        connection sends a PING, which waits as long as a publish): :data:`IN_PUBLISH`, for
        a producer of :meth:`_producer`'s, made in the publish's thread."""
        return IN_PUBLISH

    def _producer(self, generation: int) -> Any:
        """The producer of the current broker link, made on first use (in the calling
        publish's thread). ``PublishTimeout`` if ``generation`` ended meanwhile."""
        with self._link_mutex:
            link = self._link
            if link is not None and link[0] == generation:
                return link[2]
        connection = self.app.connection_for_write()
        producer = self.Producer(connection, auto_declare=False)
        with self._link_mutex:
            if generation == self._generation and self._link is None:
                self._link = (generation, connection, producer)
                return producer
        _release(connection)  # made by a publish abandoned meanwhile: nobody uses it
        raise PublishTimeout("abandoned")

    def _forget_connection(self) -> None:
        """The broker link is in use by a publish that hangs: the next publish (this
        beat's, should it lead again) makes a link of its own. The old one is released in a
        thread of its own (it may block), which also ends the hung publish where the
        transport closes its socket (redis-py shuts it down)."""
        with self._link_mutex:
            self._generation += 1
            link, self._link = self._link, None
        if link is not None:
            threading.Thread(
                target=_release, args=(link[1],), name="redlock-beat-release", daemon=True
            ).start()

    def _unclaim(self, entry: Any, claimed: _Claimed) -> None:
        """A claimed run not published: back on record as not sent, and due again here,
        after a delay of its own (the broker may need a moment; a message it will never
        take must not hold back the other entries)."""
        if claimed.prev is not None:
            self._set_last_run(claimed.new_entry, claimed.prev)
        before = self._backoff.get(entry.name)
        delay = BACKOFF if before is None else min(before[1] * 2, BACKOFF_MAX)
        self._restore_count(claimed.new_entry, entry.name, claimed.count)
        op = unclaim_op(self._backend, self.redlock.name, claimed.token,
                        claimed.record or entry.name, claimed.prev, claimed.new,
                        claimed.ttl_ms)  # fmt: skip
        try:
            self._backend.execute(op)
        except LockError as exc:
            # Unknown: the record may still be this claim. The same run is claimed again
            # as it was (by this token the script grants it again), not taken as sent.
            logger.warning("beat: could not take back the claim of %r: %s", entry.name, exc)
            self._unsure[entry.name] = claimed
        finally:  # from the failure's end: an unanswered unclaim took a socket timeout
            self._backoff[entry.name] = (time.monotonic() + delay, delay)
            self._failed = True

    def _claim(self, entry: Any, new_entry: Any) -> _Claimed | None:
        token = self._token()
        prev = to_micros(entry.last_run_at) if entry.last_run_at else None
        if token is None:  # the term ended (told by the keeper): send nothing
            self._undo(entry, new_entry, prev)
            self._step_down(self._term.reason if self._term is not None else "not leading")
            return None
        # A claim whose reply was lost is tried again as it was (the script sees it is ours).
        unsure = self._unsure.pop(entry.name, None)
        if unsure is None:
            new = to_micros(new_entry.last_run_at)
        else:
            new = unsure.new
            self._set_last_run(new_entry, new)
        ttl_ms = self._record_ttl_ms(new_entry)
        once = one_off_record(entry)
        if once is not None:  # its last run means nothing: claimed only if none is on record
            op = claim_op(self._backend, self.redlock.name, token, once, None, new, MAX_TTL_MS)
            pending = _Claimed(token, None, new, MAX_TTL_MS, new_entry, once)
        else:
            op = claim_op(self._backend, self.redlock.name, token, entry.name, prev, new, ttl_ms)
            pending = _Claimed(token, prev, new, ttl_ms, new_entry)
        self._claims[entry.name] = pending  # from before it is sent (see close())
        try:
            outcome, recorded = self._backend.execute(op)
        except LockError as exc:
            # Unknown: not sent now, claimed again (the same run) after a pause.
            logger.warning("beat: could not claim %r, trying again: %s", entry.name, exc)
            self._unsure[entry.name] = pending
            self._undo(entry, new_entry, prev)
            self._pause_until = time.monotonic() + 1.0
            return None
        if outcome == CLAIMED:
            # The count reserve() added stays only once the publish is done (apply_entry).
            count = self._counts.pop(entry.name, None)
            if once is not None:
                return _Claimed(token, None, new, MAX_TTL_MS, new_entry, once, count)
            return _Claimed(token, prev, new, ttl_ms, new_entry, count=count)
        if outcome == ALREADY_SENT:
            logger.info("beat: %r was sent already by another beat: not sending", entry.name)
            if recorded is not None and once is None:
                self._set_last_run(new_entry, self._not_future(entry.name, new_entry, recorded))
            if once is not None:
                self._counts.pop(entry.name, None)  # run once, on record: disabled next
            self._heap = None  # its next due time follows the recorded run
            return None
        if unsure is not None:  # refused, but maybe on record from before: taken back
            self._unsure[entry.name] = unsure
        self._undo(entry, new_entry, prev)
        self._step_down("another beat took the lock")
        return None

    def _undo(self, entry: Any, new_entry: Any, prev: int | None) -> None:
        """Keep ``entry`` due: the run reserved was not sent, the next leader sends it."""
        if prev is not None:
            self._set_last_run(new_entry, prev)
        self._restore_count(new_entry, entry.name)
        self._heap = None

    def _restore_count(self, new_entry: Any, name: str, count: int | None = None) -> None:
        """A run not sent is not counted (a one-off counted once is disabled unsent)."""
        before = self._counts.pop(name, None)
        count = before if count is None else count
        model = getattr(new_entry, "model", None)
        if count is not None and model is not None:
            model.total_run_count = count

    def sync(self) -> None:
        # Only the leader writes the schedule's store (django-celery-beat's rows, shared by
        # every beat): one that stepped down would write its stale copy over the leader's.
        if not self.leads:
            dirty = getattr(self, "_dirty", None)
            if isinstance(dirty, set):
                dirty.clear()
        super().sync()

    def _record_ttl_ms(self, new_entry: Any) -> int:
        """A record lasts two periods of its entry (at least a minute): long enough for the
        next leader to find it, short enough to vanish with the entry. Not capped at a lock's
        30 days: a monthly or yearly entry's record gone before its next run is a run the next
        leader sends again (only a period past RECORD_TTL_MAX, a century, is cut)."""
        try:
            due_in = float(new_entry.schedule.is_due(new_entry.last_run_at)[1])
        except Exception:  # a schedule that cannot say: a day
            due_in = 86400.0
        if not math.isfinite(due_in):
            due_in = RECORD_TTL_MAX
        return to_ms(min(RECORD_TTL_MAX, max(60.0, 2 * due_in + 2 * self.redlock.ttl)))

    def close(self) -> None:
        # A claim a shutdown cut short (its reply on its way, or its publish under way:
        # Celery's SIGTERM handler closes, then raises SystemExit there) is not published: its
        # entry (and row: run, count) as before it, before super().close() writes the store.
        # A publish under way in its thread (the signal landed in the scheduler's wait for
        # it) is waited for, within its time: taken back once it went through, the next
        # leader would send the run again.
        for thread, _, until in list(self._publishing.values()):
            if thread is not threading.current_thread():
                thread.join(max(0.0, until - time.monotonic()))
        # Sent (the broker took it), whatever line the signal landed on since: not cut.
        cut = {
            name: claimed
            for name, claimed in self._claims.items()
            if claimed and not claimed.sent.is_set()
        }
        self._claims.clear()
        try:
            for name, claimed in cut.items():
                if claimed.prev is not None:
                    self._set_last_run(claimed.new_entry, claimed.prev)
                self._restore_count(claimed.new_entry, name, claimed.count)
            super().close()
        finally:
            self._forget_connection()
            self._term = None
            self._takeback.update(self._unsure)
            self._takeback.update(cut)
            self._unsure.clear()
            # Once: a claim left on record reads as sent to the next leader.
            answered = self._take_back()
            with contextlib.suppress(LockError):
                self._campaign.resign()  # a standby takes over now, not at the TTL
            if cut and answered:
                # A claim still on its way (on another connection) may have landed after its
                # take-back; resigned, none lands any more (its script checks the lead).
                self._takeback.update(cut)
                self._take_back()

    @property
    def info(self) -> str:
        config = self.redlock
        lead = f"    . leader lock -> {config.name!r} on {config.using!r}, ttl {config.ttl:g}s"
        return "\n".join(x for x in (super().info, lead) if x)


def _release(connection: Any) -> None:
    with contextlib.suppress(Exception):  # a link given up on: its errors are of no use
        connection.release()


class LockedScheduler(LeaderMixin, PersistentScheduler):
    """Celery's ``PersistentScheduler`` (a schedule file per process), one beat sending."""


def leader(config: BeatSettings | None = None) -> dict[str, Any] | None:
    """Who leads now: the holder's host, pid and fence (None when nobody does); as
    :func:`~django_redlock.current_leader` of the beat's lock says."""
    config = config or beat_settings()
    now = current_leader(config.name, using=config.using)
    if now is None:
        return None
    return {"host": now.host, "pid": now.holder.get("p"), "fence": now.fence, "ttl": now.ttl}


def __getattr__(name: str) -> Any:
    # django-celery-beat is optional (the `beat` extra): imported when this name is used.
    if name == "LockedDatabaseScheduler":
        try:
            from django_celery_beat.schedulers import DatabaseScheduler
        except ImportError as exc:
            raise ImportError(
                "LockedDatabaseScheduler needs django-celery-beat: pip install"
                " django-celery-beat (or this package with its [beat] extra:"
                ' pip install "/path/to/django-redlock[beat]")'
            ) from exc

        class LockedDatabaseScheduler(LeaderMixin, DatabaseScheduler):
            """django-celery-beat's ``DatabaseScheduler``, one beat sending."""

        LockedDatabaseScheduler.__module__ = __name__
        globals()[name] = LockedDatabaseScheduler
        return LockedDatabaseScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LeaderMixin", "LockedScheduler", "beat_settings", "leader"]
