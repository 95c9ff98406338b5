"""Leader election: one process of a fleet leads a name at a time.

``with leader("ingest") as term:`` takes the lock of that name (waiting up to ``timeout``),
keeps it renewed from a thread of its own (:class:`Keeper`), and resigns (releases) the
moment the block ends, so the next candidate leads at once rather than after a TTL.
``term.lost`` is set the moment leadership ends without the block ending:

* the backend answered that the hold is gone (it expired in a pause, was force-released in
  the admin, the server restarted empty): the ``lock_lost`` notification, as for any lock;
* or no renewal was confirmed for the hold's TTL less a margin (the backend did not answer):
  the hold *may* be gone and another candidate may lead, so this one must stop acting. The
  lock itself never calls that lost (no answer is not a loss); a leader must not bet on it.

Every look at ``term.lost`` checks the second deadline itself (:class:`Ending`): a process
paused past it sees the term over at its first look, before the keeper's thread has run. A
forked child's ``term.lost`` is set at once: its parent leads, not it.

The Keeper is what ``manage.py redlock exec`` renews its hold with too, and Celery beat's
schedulers (``contrib.beat``) lead with :meth:`leader.campaign` and :meth:`leader.resign`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from .exceptions import (
    BackendUnavailable,
    LockError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumNotReached,
)
from .forks import after_fork_in_child
from .handler import DEFAULT_LOCK_ALIAS, locks
from .locking import BaseLock, Lock
from .validation import check_name

logger = logging.getLogger("django_redlock")

#: Seconds between renewals that got no answer (at most half a renewal period: the retry lands
#: before the give-up time, which is two periods after the last confirmed renewal).
RETRY = 0.5
#: Seconds a resignation waits for a renewal awaiting its answer (see :meth:`Keeper.stop`).
SETTLE = 0.1


class Ending(threading.Event):
    """A keeper's ``lost``: set by its thread, and seen set by any look once the give-up
    time has passed, before that thread has had its turn (a process paused past its lease
    wakes with every thread at once: its first look must say the term is over)."""

    def __init__(self, keeper: Keeper) -> None:
        super().__init__()
        self._keeper = weakref.ref(keeper)
        self._pid = os.getpid()

    def is_set(self) -> bool:
        if os.getpid() != self._pid:  # a forked child: the parent renews, not this process
            return True
        if not super().is_set():
            keeper = self._keeper()
            if keeper is not None:
                keeper.overdue()
        return super().is_set()

    def wait(self, timeout: float | None = None) -> bool:
        # A wait that timed out may have slept through the give-up time (a pause): look.
        return self.is_set() or super().wait(timeout) or self.is_set()


class Keeper:
    """Renews a held lock (taken with ``auto_renew=False``) every third of its TTL, until
    :meth:`stop`. ``lost`` is set, and ``reason`` and ``unknown`` say why, when the backend
    answers that the hold is gone (``unknown`` False), or when no renewal was confirmed for
    the TTL less ``margin`` seconds (``unknown`` True: the backend did not answer; the hold
    may still be there). A renewal counts from when it was *sent*: the server set the TTL at
    some point after that. Each renewal runs in a thread of its own, so a renewal that waits
    for its answer (up to a socket timeout) never delays that deadline.
    ``on_confirmed(until)`` hears each renewal confirmed: the hold lasts at least until
    ``until`` (monotonic)."""

    def __init__(
        self,
        held: BaseLock,
        margin: float,
        stop: threading.Event | None = None,
        since: float | None = None,
        on_confirmed: Callable[[float], None] | None = None,
    ) -> None:
        self.lock = held
        # Told each new confirmed_until (monotonic), from the renewal's thread; its errors
        # are logged, never the keeper's end.
        self._on_confirmed = on_confirmed
        self.ttl = float(held.lock_ttl)
        self.margin = min(max(margin, 0.0), self.ttl * 2 / 3)
        # Two renewals at least before giving up on unanswered ones.
        self.period = min(self.ttl / 3, (self.ttl - self.margin) / 2)
        self.lost: threading.Event = Ending(self)
        self.reason = ""
        self.unknown = False
        self._outside_stop = stop  # another reason to end (run_as_leader's stop)
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        # The hold counts from when its take was sent (``since``: see hold_start), not from
        # when the answer came: the server set its TTL at some point in between.
        since = time.monotonic() if since is None else since
        self._confirmed_until = since + self.ttl
        self._next_at = since + self.period
        self._awake = time.monotonic()  # the loop's last turn: a long gap is a pause of ours
        self._renewal: threading.Thread | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"redlock-keeper {held.name}", daemon=True
        )

    @property
    def confirmed_until(self) -> float:
        """Until when (monotonic) the hold lasts at least, as the last renewal confirmed."""
        with self._mutex:
            return self._confirmed_until

    def start(self) -> Keeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Renew no more (the keeper's thread ends within a quarter second). A renewal
        awaiting its answer is waited for :data:`SETTLE` seconds at most: one answered by
        then cannot meet the release that follows (its "gone", processed after the
        release ran, would be told as a loss); one still unanswered can only extend this
        hold's own token, which that release ends. Waiting for it longer made a resignation
        on a backend that stopped answering take two socket timeouts."""
        self._stop.set()
        for thread, wait in ((self._thread, None), (self._renewal, SETTLE)):
            if (
                thread is not None
                and thread.is_alive()
                and thread is not threading.current_thread()
            ):
                thread.join(wait)

    def forked(self) -> None:
        """In a forked child: the term is the parent's (its thread renews it, not ours).
        ``lost`` says so by the pid; no lock is taken (one may have been held at the fork)."""
        self._mutex = threading.Lock()
        self.reason = "this process is a fork of the leader: the term is its parent's"
        self.unknown = False

    def end(self, reason: str, unknown: bool) -> None:
        """Set ``lost`` (once: the first reason stays)."""
        with self._mutex:
            if threading.Event.is_set(self.lost):  # the flag: no overdue() under the mutex
                return
            self.reason, self.unknown = reason, unknown
            self.lost.set()

    def overdue(self) -> bool:
        """End the term (``lost``, ``unknown``) if no renewal was confirmed for the TTL less
        the margin: whoever looks first, this keeper's thread or a look at ``lost``."""
        with self._mutex:
            give_up_at = self._confirmed_until - self.margin
        now = time.monotonic()
        if now < give_up_at:
            return False
        stalled = now - self._awake  # since the keeper's last turn
        if stalled > self.period:  # not the backend: this process did not run
            self.end(
                f"this process did not run for {stalled:.1f} s (paused): no renewal"
                f" confirmed for {self.ttl - self.margin:g} s",
                unknown=True,
            )
        else:
            self.end(
                f"no renewal confirmed for {self.ttl - self.margin:g} s (the backend did"
                " not answer)",
                unknown=True,
            )
        return True

    def _run(self) -> None:
        try:
            self._keep()
        except BaseException as exc:  # no renewal thread (a thread limit), a bug: never silent
            logger.exception("redlock: the keeper of %s failed", self.lock.describe())
            self.end(f"the renewals stopped: {exc!r}", unknown=True)

    def _keep(self) -> None:
        while not threading.Event.is_set(self.lost):  # the flag: overdue() is looked at below
            with self._mutex:
                due, give_up_at = self._next_at, self._confirmed_until - self.margin
            if self._renewal is not None and self._renewal.is_alive():
                due = give_up_at  # its answer is awaited: no spinning meanwhile
            wait = min(due, give_up_at) - time.monotonic()
            if self._stop.wait(min(max(wait, 0.0), 0.25)):
                return
            if self._outside_stop is not None and self._outside_stop.is_set():
                return self.end("stopped", unknown=False)
            if self.overdue():
                return
            now = self._awake = time.monotonic()
            if now >= due and (self._renewal is None or not self._renewal.is_alive()):
                self._renewal = threading.Thread(
                    target=self._renew, name=f"redlock-keeper-renew {self.lock.name}", daemon=True
                )
                self._renewal.start()

    def _renew(self) -> None:
        sent = time.monotonic()
        try:
            self.lock.extend()
        except LockNotOwned as exc:  # LockLost too: the backend said it is gone
            if not self._stop.is_set():  # not our own release racing this renewal
                reason = self.lock.lost or str(exc)
                with self._mutex:
                    late = time.monotonic() - (self._confirmed_until - self.margin)
                if late >= 0:  # our own stall (a pause between the last look and the send)
                    reason += (
                        f"; the renewal was answered {late:.1f} s past the point where the"
                        " term ends unrenewed: this process (or the backend) was paused"
                    )
                self.end(reason, unknown=False)
            return
        except LockError as exc:  # no answer: unknown, try again soon
            if not self._stop.is_set():  # else the term ended meanwhile: nothing to say
                logger.warning("redlock: renewing %s: %s", self.lock.describe(), exc)
            retry = time.monotonic() + min(RETRY, self.period / 2)
        except Exception:  # a bug: keep trying rather than drop the hold silently
            logger.exception("redlock: renewing %s failed", self.lock.describe())
            retry = time.monotonic() + min(RETRY, self.period / 2)
        else:
            with self._mutex:
                self._confirmed_until = until = max(self._confirmed_until, sent + self.ttl)
                self._next_at = sent + self.period
            if self._on_confirmed is not None and not self._stop.is_set():
                try:
                    self._on_confirmed(until)
                except Exception:
                    logger.exception("redlock: telling a renewal of %s", self.lock.describe())
            return
        with self._mutex:
            self._next_at = retry


def _answered_soon(held: BaseLock, before: float) -> bool:
    return time.monotonic() - before <= float(held.lock_ttl) / 6


def hold_start(held: BaseLock, before: float) -> float:
    """When a hold just taken counts from (monotonic): ``before``, taken just before the take
    was sent, when the take answered soon; after a long wait (the try that won was sent at
    some unknown point of it) or a late answer, from a renewal sent now. Raises what the
    renewal raises (``LockNotOwned``: it expired already)."""
    if _answered_soon(held, before):
        return before
    sent = time.monotonic()
    held.extend()
    return sent


async def ahold_start(held: BaseLock, before: float) -> float:
    """:func:`hold_start` on the event loop."""
    if _answered_soon(held, before):
        return before
    sent = time.monotonic()
    await held.aextend()
    return sent


# The terms of this process, resigned at its clean exit (atexit) so that the next candidate
# leads at once, even for a term led from a daemon thread still in its block.
_terms: weakref.WeakSet[leader] = weakref.WeakSet()
EXIT_RESIGN = 2.0  # seconds the exit waits for the resignations at most


def _resign_all() -> None:
    campaigns = list(_terms)
    if not campaigns:
        return
    threads = [
        threading.Thread(target=campaign._resign_at_exit, name="redlock-resign", daemon=True)
        for campaign in campaigns
    ]
    deadline = time.monotonic() + EXIT_RESIGN
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_resign_all)


@after_fork_in_child
def _forked() -> None:
    """A forked child leads none of its parent's terms (``term.lost`` says so at once), and
    its exit resigns none of them."""
    for campaign in list(_terms):
        keeper = campaign._keeper
        if keeper is not None:
            keeper.forked()
    _terms.clear()


class Term:
    """One process's leadership of a name: from the campaign won to the resignation."""

    def __init__(self, name: str, using: str, fence: int, keeper: Keeper) -> None:
        self.name, self.using = name, using
        #: The hold's fencing token: strictly larger than every earlier leader's.
        self.fence = fence
        self._keeper = keeper

    @property
    def lost(self) -> threading.Event:
        """Set the moment leadership ends (see the module's doc); never cleared."""
        return self._keeper.lost

    @property
    def reason(self) -> str:
        """Why leadership ended: empty while leading."""
        return self._keeper.reason if self._keeper.lost.is_set() else ""

    def check(self) -> None:
        """Raise :class:`LockLost` once leadership is lost."""
        if self.lost.is_set():
            raise LockLost(f"leadership of {self.name!r} on {self.using!r} ended: {self.reason}")

    def __repr__(self) -> str:
        state = f"lost: {self.reason}" if self.lost.is_set() else "leading"
        return f"<Term {self.name!r} on {self.using!r} fence {self.fence} ({state})>"


class leader:  # lower case: used as a function: ``with leader("ingest") as term``
    """Campaign for ``name`` on backend ``using``; ``with`` / ``async with`` give a
    :class:`Term` once this process leads (``LockNotAcquired`` after ``timeout`` seconds;
    None: wait as long as it takes). Leaving the block resigns at once. ``stop``: an event
    that, once set, ends the term as a loss would (``term.lost``, reason "stopped")."""

    def __init__(
        self,
        name: str,
        *,
        using: str | None = None,
        ttl: float | None = None,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        # Every argument is checked here, before any Redis call.
        using = DEFAULT_LOCK_ALIAS if using is None else using
        self.lock = Lock(name, using=using, ttl=ttl, timeout=timeout, auto_renew=False)
        self.timeout = self.lock.timeout
        self._stop = stop
        self._keeper: Keeper | None = None

    def _lead(self, since: float) -> Term:
        # Leadership ends a third of the TTL before the hold could expire unrenewed.
        keeper = self._keeper = Keeper(self.lock, self.lock.lock_ttl / 3, self._stop, since)
        term = Term(self.lock.name, self.lock.using, self.lock.fence or 0, keeper)
        try:
            _terms.add(self)  # from here the exit resigns it, whatever happens next
            keeper.start()
            logger.info("redlock: leading %r on %r (fence %s)", term.name, term.using, term.fence)
            return term  # inside the try: an exception on this line resigns too
        except BaseException:  # no thread, a Ctrl-C, a logging filter that raised: the
            with contextlib.suppress(LockError):  # caller is told it does not lead, so resign
                self.resign()
            raise

    def _abandon(self) -> None:
        """A campaign that raised before handing its term over: the caller is told it does
        not lead, so nothing may stay held or renewed (a hidden leader until the exit)."""
        with contextlib.suppress(LockError):
            self.resign()

    def _not_leading(self) -> LockNotAcquired:
        return LockNotAcquired(f"{self.lock.describe()}: not leading within {self.timeout:g} s")

    def _began(self, before: Keeper | None) -> bool:
        """Whether a term began since ``before`` was this object's keeper (a campaign's
        caller that raised then never handed it on: it must resign)."""
        keeper = self._keeper
        return keeper is not None and keeper is not before

    def __enter__(self) -> Term:
        before = self._keeper
        try:
            return self.campaign()  # a Ctrl-C as it returns lands here: `with` will not exit
        except BaseException:
            if self._began(before):  # not "leading already": that term is the caller's
                self._abandon()
            raise

    def campaign(self) -> Term:
        """What ``with`` does, for code that cannot hold a ``with`` block open (a scheduler
        that leads across its ticks): the :class:`Term` once this process leads
        (``LockNotAcquired`` after ``timeout``). :meth:`resign` ends it. One object
        campaigns for one term at a time: a term still leading is ``LockError``; one that
        ended (lost, stopped) is resigned first (its hold may still be there)."""
        if self._ended():
            self.resign()
        before = time.monotonic()  # the hold counts from before its take was sent
        try:  # from the grant on, whatever raises gives the hold back (none: a no-op)
            if not self.lock.acquire(timeout=self.timeout):
                raise self._not_leading()
            # No nested `try:` here: CPython 3.11 leaves its line outside this guard.
            return self._lead(self._since(before))  # an exception on this line resigns
        except BaseException:  # unconfirmed, or raised before the term was handed over
            self._abandon()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.resign()

    def _since(self, before: float) -> float:
        try:
            return hold_start(self.lock, before)
        except LockNotOwned as exc:  # gone before its confirming renewal: not leading
            raise self._not_leading() from exc

    def resign(self) -> None:
        """End the term (``term.lost``, "resigned") and release the lock, so the next
        candidate leads at once. A hold lost already raises nothing (``term.lost`` told
        it). No answer raises ``BackendUnavailable``: the hold then runs out at its TTL,
        and this object's next campaign finishes the release first."""
        # Taken first: an interrupt after _end_term let go of it (its last line, or inside
        # Keeper.end before ``lost`` was set) must still end the term below.
        keeper = self._keeper
        try:
            self._end_term()
        except BaseException:  # a KeyboardInterrupt in the keeper's join (or before it):
            if keeper is not None:  # the term ends before its lock goes, all the same
                keeper.end("resigned", unknown=False)
            with contextlib.suppress(LockError):  # released; it goes on (the exit tries
                self._release()  # again)
            raise
        self._release()

    def _release(self) -> None:
        if self.lock.token is not None:  # else not leading (never, or lost and said so)
            with contextlib.suppress(LockNotOwned):  # lost already: term.lost said so
                self.lock.release()
        _terms.discard(self)  # only once released: until then the exit resigns it

    def _ended(self) -> bool:
        """Whether a term of this object ended without being resigned (LockError if one
        still leads)."""
        keeper = self._keeper
        if keeper is None:
            return False
        if not keeper.lost.is_set():
            raise LockError(f"{self.lock.describe()}: leading already (resign() first)")
        return True

    async def __aenter__(self) -> Term:
        if self._ended():
            await self.__aexit__(None, None, None)
        before = time.monotonic()
        try:  # from the grant on, as campaign()'s (no nested `try:` line outside it)
            if not await self.lock.aacquire(timeout=self.timeout):
                raise self._not_leading()
            return self._lead(await self._asince(before))
        except BaseException:
            if self.lock.token is None and self._keeper is None:
                raise  # nothing taken (a refusal, a wait cut short): nothing to give back
            # Resigned as a block's end is (off the event loop's thread, finished whatever
            # cancels the task meanwhile); what raised here is what the caller is told.
            with contextlib.suppress(LockError, asyncio.CancelledError):
                await self.__aexit__(None, None, None)
            raise

    async def _asince(self, before: float) -> float:
        try:
            return await ahold_start(self.lock, before)
        except LockNotOwned as exc:
            raise self._not_leading() from exc

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A cancellation while leaving (a shutdown, an asyncio.timeout around the block)
        # waits for the resignation, then goes on: else the next candidate waits a TTL.
        resigning = asyncio.ensure_future(self._aresign())
        cancelled = False
        while True:
            try:
                await asyncio.shield(resigning)
                break
            except asyncio.CancelledError:
                if resigning.done():
                    raise
                cancelled = True
            except Exception as exc:  # the resignation failed (no answer)
                if not cancelled:
                    raise
                # The cancellation goes on all the same: the task asked for it.
                logger.warning("redlock: resigning %s failed: %s", self.lock.describe(), exc)
                raise asyncio.CancelledError from exc
        if cancelled:
            raise asyncio.CancelledError

    async def _aresign(self) -> None:
        # The keeper's thread may take a quarter second to end: not on the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self._end_term)
        if self.lock.token is not None:  # else not leading (never, or lost and said so)
            with contextlib.suppress(LockNotOwned):
                await self.lock.arelease()
        _terms.discard(self)  # only once released: until then the exit resigns it

    def _end_term(self) -> None:
        keeper = self._keeper
        if keeper is not None:
            try:
                keeper.stop()
            finally:  # interrupted in its join: ended all the same
                self._keeper = None
                keeper.end("resigned", unknown=False)

    def _resign_at_exit(self) -> None:
        keeper = self._keeper
        if keeper is not None:
            keeper.end("the process exits", unknown=False)  # stop acting first, then resign
            keeper.stop()
        if self.lock.token is not None:  # also a resignation cut short before its release
            with contextlib.suppress(LockError):
                self.lock.release()


@dataclass(frozen=True)
class LeaderInfo:
    """Who leads a name now, as the backend says."""

    name: str
    using: str
    fence: int | None
    host: str | None
    pid: int | None
    #: The holder's fields as the admin shows them (host, pid, thread, task).
    holder: dict[str, Any]
    ttl: float | None
    acquired_at: datetime | None


def current_leader(name: str, *, using: str | None = None) -> LeaderInfo | None:
    """Who leads ``name`` on ``using`` (default: the default alias) now, from any process:
    None when nobody does."""
    check_name(name)
    using = DEFAULT_LOCK_ALIAS if using is None else using
    info = locks[using].inspect(name)
    if info is None:
        return None
    pid = info.holder.get("p")
    return LeaderInfo(
        name=name,
        using=using,
        fence=info.fence,
        host=info.holder.get("h"),
        pid=int(pid) if pid is not None and str(pid).isdigit() else None,
        holder=dict(info.holder),
        ttl=info.ttl,
        acquired_at=info.acquired_at,
    )


def run_as_leader(
    name: str,
    target: Callable[[Term], object],
    *,
    using: str | None = None,
    ttl: float | None = None,
    stop: threading.Event | None = None,
    standby_wait: float = 5.0,
    retry: float = 1.0,
) -> None:
    """Campaign for ``name``; while leading, run ``target(term)``, which should return soon
    after ``term.lost`` is set (or let ``term.check()``'s ``LockLost`` out); then campaign
    again, until ``stop`` is set (which sets ``term.lost`` too). Without ``stop`` a standby
    waits for the lock as long as it takes (woken by the leader's release, never polling);
    with one, it waits ``standby_wait`` seconds at a time to look at ``stop`` in between
    (each such wait that ends without leading is an ``acquire_timeout`` lock incident). A
    campaign or resignation the backend does not answer is tried again after ``retry``
    seconds. ``target``'s own exceptions (but ``LockLost``) resign and propagate."""
    timeout = None if stop is None else standby_wait
    campaign = leader(name, using=using, ttl=ttl, timeout=timeout, stop=stop)  # checked here

    def pause(exc: LockError) -> None:
        logger.warning("redlock: campaign for %r on %r: %s", name, using, exc)
        if stop is None:
            time.sleep(retry)
        else:
            stop.wait(retry)

    while stop is None or not stop.is_set():
        # One guard from the campaign to the target's end: a Ctrl-C as campaign() returns
        # its term (or before the target got it) resigns too, else a hidden leader.
        before = campaign._keeper
        term: Term | None = None
        try:
            term = campaign.campaign()
            target(term)
        except LockLost:
            if term is None or not term.lost.is_set():
                with contextlib.suppress(LockError):
                    campaign.resign()
                raise  # another lock's loss: the target's own error
        except (LockNotAcquired, BackendUnavailable, QuorumNotReached) as exc:
            # The target's errors are its own, whatever their class (its own lock's
            # LockNotAcquired too): resigned, then raised.
            if term is not None or campaign._began(before):
                with contextlib.suppress(LockError):
                    campaign.resign()
                raise
            if not isinstance(exc, LockNotAcquired):  # else still a standby: campaign again
                pause(exc)
            continue
        except BaseException:
            with contextlib.suppress(LockError):
                campaign.resign()
            raise
        try:
            campaign.resign()
        except (BackendUnavailable, QuorumNotReached) as exc:  # finished by the next campaign
            pause(exc)


__all__ = [
    "Keeper",
    "LeaderInfo",
    "Term",
    "current_leader",
    "hold_start",
    "leader",
    "run_as_leader",
]
