"""Waiting in-process for a lock to be freed: the waiters and the hub contract.

A waiter (:class:`Waiter` for a thread, :class:`AsyncWaiter` for an asyncio task) sleeps
until it is woken or its time runs out. A :class:`ReleaseHub` wakes the waiters of one
backend in this process: by their id, or every waiter of a lock's channel. This module does
no I/O: the hubs that hear Redis's pub/sub messages are in :mod:`~django_redlock.waiting`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Protocol

from redis.exceptions import RedisClusterException, RedisError

logger = logging.getLogger("django_redlock")


#: Leaves owed for abandoned waiter ids, and when each was abandoned (monotonic).
Owed = dict[str, tuple[Callable[[], object], float]]


class AnyWaiter(Protocol):
    baton: bool
    unconfirmed: bool
    unheard: set[object]
    unheard_limit: int

    def wake(self) -> bool:
        """Wake it; False: it can never run again (its event loop is closed)."""
        ...


def unheard(waiter: AnyWaiter) -> bool:
    """Whether the servers ``waiter`` listens on went silent (:meth:`ReleaseHub.
    declare_unheard`): one server, or too many of a quorum's nodes for a majority."""
    return len(waiter.unheard) >= waiter.unheard_limit


class Waiter:
    """A waiting thread; woken by a message on its channel."""

    __slots__ = ("_gate", "baton", "unconfirmed", "unheard", "unheard_limit")

    def __init__(self) -> None:
        # Held while not woken: wake() releases it, the sleep takes it back. Not an Event,
        # whose wait (a Condition in Python) re-takes a lock in a ``finally`` that a second
        # interrupt can cut short (RuntimeError: release unlocked lock): a plain lock's
        # acquire is one call an interrupt either completes or leaves undone.
        self._gate = threading.Lock()
        self._gate.acquire()
        self.baton = False  # woken for a release, and not yet tried since
        #: The server did not confirm the subscription within the hub's confirm timeout
        #: (its socket timeout): the wait's set-up used it up (see ReleaseHub.watch).
        self.unconfirmed = False
        #: The hubs whose server left a PING unanswered for a socket timeout while this
        #: waiter slept, and how many of them make the wait fail (see :func:`unheard`).
        self.unheard: set[object] = set()
        self.unheard_limit = 1

    def wake(self) -> bool:
        with contextlib.suppress(RuntimeError):  # woken already (released, not taken back)
            self._gate.release()
        return True

    def wait(self, timeout: float) -> bool:
        return self._gate.acquire(timeout=max(0.0, timeout))


#: What a wait's set-up (a subscribe, an unsubscribe, a node's join) fails with by itself: the
#: server or its socket (redis-py's errors, OSError), no thread to be had or a closed hub
#: (RuntimeError), a socket closed meanwhile (ValueError). Caught there instead of Exception:
#: an exception a signal handler raised on those lines (Celery's SoftTimeLimitExceeded is an
#: Exception) must come out of the wait, not pass for a failed subscribe.
SETUP_FAILURES: tuple[type[Exception], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    RuntimeError,
    ValueError,
)


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``, an interrupt coming out as the interrupt (the thread may run all
    the same): start() waits on an Event for the thread to run, and a second interrupt
    landing in its Condition's ``finally`` made it raise ``RuntimeError: release unlocked
    lock`` instead; an exception a signal handler raised (a Celery soft time limit) as the
    new thread began made start()'s own clean-up fail with ``KeyError: <the thread>`` (it
    was no longer in ``threading._limbo``), which no ``except SoftTimeLimitExceeded`` sees."""
    try:
        thread.start()
    except RuntimeError as exc:
        interrupt = exc.__context__
        # Any interrupt, an Exception too (a soft time limit): as a RuntimeError it would
        # pass for "no thread to be had" (SETUP_FAILURES). Only that message's context is
        # surely one (another RuntimeError's may be what the caller was handling).
        if isinstance(interrupt, BaseException) and (
            not isinstance(interrupt, Exception) or exc.args == ("release unlocked lock",)
        ):
            raise interrupt from None
        raise
    except KeyError as exc:
        interrupt = exc.__context__
        if exc.args == (thread,) and isinstance(interrupt, BaseException):
            raise interrupt from None
        raise


async def sleep_on(future: asyncio.Future[None], timeout: float) -> None:
    """Wait until ``future`` is done or ``timeout`` passes.

    Not asyncio.wait_for, which can swallow a cancellation racing a result (Python < 3.12):
    a cancelled waiter must stop waiting.
    """
    loop = asyncio.get_running_loop()
    alarm = loop.call_later(max(0.0, timeout), _settle, future)
    try:
        await future
    finally:
        alarm.cancel()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class AsyncWaiter:
    """A waiting asyncio task; may be woken from any thread.

    The hub holds its waiters, so this one holds its sleep's future weakly: the future's
    callbacks hold the task, and a task the hub kept could never be collected once its loop
    was torn down (its clean-up, which leaves the hub and the queue, would never run). While
    the loop lives, the sleep's own timer holds the future."""

    __slots__ = ("_future", "_loop", "_woken", "baton", "unconfirmed", "unheard", "unheard_limit")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._woken = False
        self._future: weakref.ref[asyncio.Future[None]] | None = None
        self.baton = False
        self.unconfirmed = False
        self.unheard: set[object] = set()
        self.unheard_limit = 1

    def wake(self) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop is closed: this task never runs again
            return False
        return True

    def _set(self) -> None:
        self._woken = True
        future = None if self._future is None else self._future()
        if future is not None:
            _settle(future)

    async def wait(self, timeout: float) -> bool:
        if not self._woken:
            future = self._loop.create_future()
            self._future = weakref.ref(future)
            try:
                await sleep_on(future, timeout)
            finally:
                self._future = None
        woken, self._woken = self._woken, False
        return woken


class Confirmation:
    """Set when the server confirmed a subscription; awaitable from threads and tasks.

    A thread waits on a plain lock of its own, not an Event: an Event's wait (a Condition)
    re-takes a lock in a ``finally`` that a second interrupt of a burst cuts short, and
    ``RuntimeError: release unlocked lock`` came out of acquire() instead of the interrupt.
    A lock's acquire is one call an interrupt completes or leaves undone; the lock is the
    waiter's own, so an interrupt in one waiter's wait never holds up another's."""

    def __init__(self) -> None:
        self._set = False
        self._callbacks: list[Callable[[], None]] = []
        self._mutex = threading.Lock()
        self.error: BaseException | None = None  # the server refused the subscription

    def fail(self, error: BaseException) -> None:
        """The server refused the subscription (an ACL): whoever waits for it raises
        ``error`` instead of waiting for wake-ups that never come."""
        self.error = error
        self.set()

    def set(self) -> None:
        with self._mutex:
            self._set = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def wait(self, timeout: float) -> None:
        gate = threading.Lock()
        gate.acquire()
        opened = functools.partial(_open_gate, gate)
        self.then(opened)
        if gate.acquire(timeout=max(0.0, timeout)):
            return
        with self._mutex, contextlib.suppress(ValueError):  # not confirmed in time
            self._callbacks.remove(opened)

    def then(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once this is set (now, if it is)."""
        with self._mutex:
            if not self._set:
                self._callbacks.append(callback)
                return
        callback()

    @property
    def confirmed(self) -> bool:
        return self._set

    async def async_wait(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, done)

        with self._mutex:
            if self._set:
                return
            self._callbacks.append(wake)
        await sleep_on(done, timeout)


class StandBys:
    """Waiter ids told to stand by (the bounded hand-off, :meth:`ReleaseHub.stand_by`) and
    when each is due. One daemon thread wakes them all, started on demand and gone once none
    is pending: a timer thread per stand-by would cost every hand-off a thread's start."""

    def __init__(self, due: Callable[[str], None]) -> None:
        self._due = due
        self._cond = threading.Condition(threading.Lock())
        self._at: dict[str, float] = {}  # waiter id -> when (monotonic)
        self._heap: list[tuple[float, str]] = []  # may hold entries removed since: skipped
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, waiter_id: str, delay: float) -> bool:
        """Pending from now on, due in ``delay`` s or when an earlier stand-by of it is due;
        False when no thread could start."""
        at = time.monotonic() + delay
        with self._cond:
            if self._closed:
                return True
            pending = self._at.get(waiter_id)
            if pending is not None and pending <= at:
                return True
            # A later release may tell a shorter stand-by (the paused processes ahead died or
            # left): the earlier due time wins. The older heap entry is skipped (_take_due).
            self._at[waiter_id] = at
            heapq.heappush(self._heap, (at, waiter_id))
            if self._thread is not None:
                self._cond.notify()  # it may sleep past this one
                return True
            thread = threading.Thread(target=self._run, daemon=True, name="redlock-hand-off")
            try:
                thread.start()
            except Exception:  # no thread to be had (a pids limit)
                self._at.pop(waiter_id, None)
                return False
            self._thread = thread
        return True

    def remove(self, waiter_id: str) -> bool:
        """Whether ``waiter_id`` was pending (it is not any more)."""
        with self._cond:
            return self._at.pop(waiter_id, None) is not None

    def pending(self) -> list[str]:
        with self._cond:
            return list(self._at)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._at.clear()
            self._heap.clear()
            self._cond.notify()

    def _take_due(self) -> list[str] | None:
        """The ids due now, waiting for the first (None: nothing pending, the thread ends)."""
        with self._cond:
            while True:
                now = time.monotonic()
                due: list[str] = []
                while self._heap and (
                    self._heap[0][0] <= now or self._at.get(self._heap[0][1]) != self._heap[0][0]
                ):
                    at, waiter_id = heapq.heappop(self._heap)
                    if self._at.get(waiter_id) == at:
                        del self._at[waiter_id]
                        due.append(waiter_id)
                if due:
                    return due
                if not self._heap or self._closed:
                    self._thread = None  # under the lock: the next add starts another
                    return None
                self._cond.wait(self._heap[0][0] - now)

    def _run(self) -> None:
        while True:
            due = self._take_due()
            if due is None:
                return
            for waiter_id in due:
                try:
                    self._due(waiter_id)
                except Exception as exc:  # the others are still woken
                    logger.debug("redlock: hand-off to waiter %s failed: %s", waiter_id, exc)


def _open_gate(gate: threading.Lock) -> None:
    with contextlib.suppress(RuntimeError):  # opened already
        gate.release()


class ReleaseHub:
    """In-process waiter registry; a release calls :meth:`notify`.

    A release wakes one waiter of the process, the longest waiting, not all of them: only one
    can win, and 200 tasks retrying at every release would cost 200 round trips each time.
    The woken one holds the baton until it has tried again; if it leaves first (timed out,
    cancelled), it passes the baton on, so a release is never lost.
    """

    confirm_timeout = 0.0
    #: Whether a subscription the server did not confirm in time means the server does not
    #: answer (one server: the wait raises, its try would wait a second socket timeout).
    #: False for a plain composite of hubs: any of them may wake the waiter. (A Redlock's
    #: QuorumHub returns one confirmation, set once a quorum of nodes confirmed: needed.)
    confirm_needed = True
    #: The most waiter ids kept by :meth:`abandon`: over it, the oldest not watched any more
    #: is left at once (its leave runs), never forgotten.
    ABANDONED_MAX = 1000
    #: An id abandoned this recently is never left by the eviction: its waiter is still
    #: setting up (it is abandoned just before it starts watching).
    SETTING_UP = 1.0

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: dict[str, dict[AnyWaiter, None]] = {}  # ordered: longest waiting first
        self._abandoned: dict[str, Callable[[], object]] = {}  # waiter id -> its leave
        self._abandoned_at: dict[str, float] = {}  # waiter id -> when (monotonic)
        self._standing_by = StandBys(self.notify)
        #: Set by :meth:`hand_over`: where leaves owed here go from then on.
        self._heir: Callable[[Owed], None] | None = None

    @contextlib.contextmanager
    def watch(
        self, channel: str, by_id: bool = False, lock: str = "", waiter: Waiter | None = None
    ) -> Iterator[Waiter]:
        """Wait on ``channel``: a lock's release channel, or (``by_id``) the waiter's own id
        (``lock`` names the lock, for hubs whose inboxes are per lock). ``waiter``: the one
        to register (the caller's, so that it can leave should it never get this one back).

        The join is inside the ``try``: an interrupt at any line of it (a waiter in some
        hubs, a channel subscribed) is undone by the leave (which undoes a part too)."""
        waiter = Waiter() if waiter is None else waiter
        # One deadline for the subscribe (a connect's handshake) and every confirmation (a
        # quorum's hub waits for several).
        deadline = time.monotonic() + self.confirm_timeout
        try:
            confirmations = self.join(channel, waiter, by_id, lock)
            for _ in range(2):
                for confirmed in confirmations:
                    confirmed.wait(deadline - time.monotonic())
                    if confirmed.error is not None:
                        raise confirmed.error
                # Time this process did not run (a full GC, CPU starvation) is not the
                # nodes' silence: its readers stalled too, and may not have read the
                # confirmations that came. Past the deadline by that long, they get as long
                # again; with replies come and unread (readers starved), a confirm_timeout.
                late = time.monotonic() - deadline
                if all(c.confirmed for c in confirmations) or late < 0:
                    break
                more = self.confirm_timeout if self.unread() else late
                deadline = time.monotonic() + min(more, self.confirm_timeout)
            waiter.unconfirmed = self._unconfirmed(confirmations)
            yield waiter
        finally:
            self.leave(channel, waiter)

    @contextlib.asynccontextmanager
    async def awatch(
        self, channel: str, by_id: bool = False, lock: str = "", waiter: AsyncWaiter | None = None
    ) -> AsyncIterator[AsyncWaiter]:
        """:meth:`watch` in an event loop."""
        waiter = AsyncWaiter() if waiter is None else waiter
        deadline = time.monotonic() + self.confirm_timeout
        try:
            confirmations = self.join(channel, waiter, by_id, lock)
            for confirmed in confirmations:
                await confirmed.async_wait(deadline - time.monotonic())
                if confirmed.error is not None:
                    raise confirmed.error
            waiter.unconfirmed = self._unconfirmed(confirmations)
            yield waiter
        finally:
            self.leave(channel, waiter)

    def _unconfirmed(self, confirmations: list[Confirmation]) -> bool:
        """Whether the server failed to confirm within the confirm timeout: the wait's
        set-up used up the socket timeout, and its try must not wait another (the caller
        raises BackendUnavailable). Never for a hub that does not need it (``confirm_needed``)."""
        return self.confirm_needed and not all(c.confirmed for c in confirmations)

    def heard_until(self) -> float | None:
        """When a waiter's try must be answered by (monotonic), this hub's server being
        silent since it was last heard; None: no bound (see ``PubSubHub.heard_until``)."""
        return None

    def joins_at_once(self) -> bool:
        """Whether :meth:`join` returns without waiting for the server (no connect to make:
        a subscribe is then only written)."""
        return True

    def unread(self) -> bool:
        """Whether the server sent something this hub's reader has not read yet (it is
        behind: starved, or paused with the process)."""
        return False

    #: (monotonic, text) of the last refusal for now (BUSY: a long script) of a subscription,
    #: written by the reader: what an unconfirmed wait's error names as its cause.
    refused_for_now: tuple[float, str] | None = None

    def unconfirmed_error(self, alias: str, lock: str) -> str:
        message = (
            f"lock {lock!r}: backend {alias!r} did not confirm the wait's subscription within"
            f" {self.confirm_timeout:g} s"
        )
        refused = self.refused_for_now
        if refused is not None and time.monotonic() - refused[0] <= 2 * self.confirm_timeout:
            message += f": it refused it for now ({refused[1]})"
        return message

    def join(
        self, channel: str, waiter: AnyWaiter, by_id: bool = False, lock: str = ""
    ) -> list[Confirmation]:
        """Register a waiter; returns the subscriptions to wait for before re-trying."""
        confirmed = self._join(channel, waiter, by_id, lock)
        return [] if confirmed is None else [confirmed]

    def leave(self, channel: str, waiter: AnyWaiter) -> None:
        self._leave(channel, waiter)

    def _join(
        self, channel: str, waiter: AnyWaiter, by_id: bool, lock: str = ""
    ) -> Confirmation | None:
        with self._mutex:
            first = channel not in self._waiters
            self._waiters.setdefault(channel, {})[waiter] = None
        return self._subscribe_inbox() if by_id else self._subscribe(channel, first)

    def _leave(self, channel: str, waiter: AnyWaiter) -> None:
        with self._mutex:
            group = self._waiters.get(channel)
            if group is not None:
                group.pop(waiter, None)
                if not group:
                    del self._waiters[channel]
            # Nobody left, whoever took the group out: a leave cut short after that (an
            # interrupt) and tried again still unsubscribes (_unsubscribe is idempotent).
            last = channel not in self._waiters
        if waiter.baton:  # woken, but gone before trying: the next one tries instead
            waiter.baton = False
            self.notify(channel)
        if last:
            self._unsubscribe(channel)

    def abandon(self, waiter_id: str, leave: Callable[[], object]) -> None:
        """A waiter that stopped waiting still registered on the server (its leave was not
        sent after a try that got no answer in time, or got no answer itself). The server
        may wake it first at the next release, and a wake-up nobody here takes would leave
        the lock's next waiter asleep until the hold's expiry. So should a wake-up come for
        ``waiter_id``, ``leave`` runs then, in a thread of its own (it takes the id out and
        wakes the next waiter); failing, it is kept for the next wake-up. Call it before the
        waiter stops watching."""
        now = time.monotonic()
        if self._keep(waiter_id, leave, now):
            self._evict(now)

    def _keep(self, waiter_id: str, leave: Callable[[], object], at: float) -> bool:
        """Register an owed leave, here or with the heir (closed); whether here."""
        with self._mutex:
            heir = self._heir
            if heir is None:
                self._abandoned[waiter_id] = leave
                self._abandoned_at[waiter_id] = at
        if heir is not None:  # closed: this hub hears no wake-up any more
            heir({waiter_id: (leave, at)})
        return heir is None

    def _evict(self, now: float) -> None:
        """Leave now the oldest ids over ABANDONED_MAX (see :meth:`abandon`)."""
        with self._mutex:
            over = len(self._abandoned) - self.ABANDONED_MAX
            evicted: list[tuple[str, Callable[[], object]]] = []
            if over > 0:  # the oldest not watched any more: left now, not forgotten
                for old in list(self._abandoned):
                    if len(evicted) >= over:
                        break
                    # Not one still setting up (not watching yet): its leave would take
                    # it out of the lock's queue before it even waited.
                    at = self._abandoned_at.get(old, 0.0)
                    if old not in self._waiters and now - at >= self.SETTING_UP:
                        evicted.append((old, self._abandoned.pop(old)))
                        self._abandoned_at.pop(old, None)
        if evicted:
            self._start_leaves(evicted)

    def hand_over(self, heir: Callable[[Owed], None]) -> None:
        """Close() hands its owed leaves to the next hub: a closed hub hears no wake-up, and
        a new one that does not know an abandoned id would let the wake-up for it (the
        server's first in line) fall on nobody, every later hand-off of that lock waiting
        out the hold's TTL. ``heir`` gets them now, and any leave owed here later. Not
        those of waiters still watching here: each takes its own to the next hub as it
        moves (steps.py's _Watching), and handed over first, a wake-up that reached the next
        hub before the waiter would run its leave and drop a live waiter from the queue."""
        with self._mutex:
            self._heir = heir
            owed = {
                i: (leave, self._abandoned_at.get(i, 0.0))
                for i, leave in self._abandoned.items()
                if i not in self._waiters
            }
            self._abandoned, self._abandoned_at = {}, {}
        if owed:
            heir(owed)

    def take_over(self, owed: Owed) -> None:
        """Leaves owed by a closed hub of the same backend (:meth:`hand_over`), oldest first."""
        with self._mutex:
            heir = self._heir
            if heir is None:
                fresh = {i: owed[i][0] for i in owed if i not in self._abandoned}
                self._abandoned = {**fresh, **self._abandoned}
                for waiter_id in fresh:
                    self._abandoned_at[waiter_id] = owed[waiter_id][1]
        if heir is not None:  # closed meanwhile: on to the next one
            heir(owed)
            return
        self._evict(time.monotonic())

    def settle(self, waiter_id: str) -> None:
        """``waiter_id`` left the server's waiters (its leave was answered, or it took the
        hold): no leave is owed for it any more."""
        with self._mutex:
            self._abandoned.pop(waiter_id, None)
            self._abandoned_at.pop(waiter_id, None)

    def _start_leaves(self, leaves: list[tuple[str, Callable[[], object]]]) -> None:
        """Leaves dropped from the registry (over ABANDONED_MAX) are sent now, in a thread:
        forgotten, a wake-up for one would be heard by nobody, and the lock's next waiter
        would sleep until the hold's expiry. One that fails, or is not started, is kept
        (over the cap, evicted again by a later abandon): a plain lock's entry does not
        lapse on the server while other waiters keep its set alive."""

        def run() -> None:
            for waiter_id, leave in leaves:
                try:
                    leave()
                except Exception as exc:
                    logger.debug("redlock: leave of waiter %s failed: %s", waiter_id, exc)
                    self._keep(waiter_id, leave, time.monotonic())

        started = False
        try:
            start_thread(threading.Thread(target=run, daemon=True, name="redlock-leave"))
            started = True
        except SETUP_FAILURES as exc:  # no thread to be had ("can't start new thread")
            logger.debug("redlock: %d leaves not started: %s", len(leaves), exc)
        finally:
            # Not started, or an interrupt (a soft time limit is an Exception too: not
            # caught above, it comes out of the wait's set-up or clean-up): kept for a
            # wake-up or a later try (sent twice, should the thread run all the same: a
            # leave is idempotent).
            if not started:
                for waiter_id, leave in leaves:
                    self._keep(waiter_id, leave, time.monotonic())

    def notify(self, channel: str) -> None:
        """A release: wake the longest-waiting waiter that is not already about to try.

        If every waiter is about to try already, the release may have come after their try
        read the lock: wake the first one again, so it tries once more instead of sleeping
        on a stale TTL (its wake-up stays pending until it waits). A wake-up for a waiter
        id nobody watches runs its leave if it was abandoned (:meth:`abandon`).
        """
        # Both decided under the mutex: the group is the waiters' own dict, which a waiter
        # leaving empties in place once the mutex is let go (it tried at its deadline).
        while True:
            chosen = leave = None
            with self._mutex:
                group = self._waiters.get(channel)
                if group:
                    chosen = next((w for w in group if not w.baton), None) or next(iter(group))
                    chosen.baton = True
                else:
                    leave = self._abandoned.pop(channel, None)
                    self._abandoned_at.pop(channel, None)
            if chosen is None or chosen.wake():
                break
            # Its event loop is closed (torn down with the task pending): it never tries or
            # leaves, and holding the wake-up it would keep the lock's next waiter asleep.
            # Dropped, the wake-up goes on: to the next waiter here, or (the channel is its
            # id) to its leave, owed from its first try, sent in a thread below.
            chosen.baton = False
            self._leave(channel, chosen)
        if leave is not None:
            try:  # on the pub/sub reader's thread: whatever happens, it goes on reading
                start_thread(threading.Thread(target=self._run_leave, args=(channel, leave),
                                              daemon=True, name="redlock-leave"))  # fmt: skip
            except Exception as exc:  # no thread to be had (a pids limit): kept for later
                logger.debug("redlock: leave of abandoned waiter %s not started: %s", channel, exc)
                self.abandon(channel, leave)

    def hear(self, message: str) -> None:
        """A message in this process's inbox (lua/_wake.lua): ``<id>`` wakes waiter ``id``
        (:meth:`notify`); ``<id>|s<ms>`` tells it to stand by (:meth:`stand_by`);
        ``<id>|d`` to stand down (:meth:`stand_down`). Anything else is dropped: the reader
        that calls this goes on reading whatever it gets."""
        waiter_id, marked, what = message.partition("|")
        if not marked:
            self.notify(waiter_id)
        elif what == "d":
            self.stand_down(waiter_id)
        elif what[:1] == "s" and what[1:].isascii() and what[1:].isdigit():
            self.stand_by(waiter_id, int(what[1:]) / 1000)

    def stand_by(self, waiter_id: str, delay: float) -> None:
        """The bounded hand-off (HAND_OFF_MS in lua/_wake.lua): a release woke the waiter
        ahead of ``waiter_id``, which may be paused and never take the lock. Unless told to
        stand down first, ``waiter_id`` is woken in ``delay`` s like any wake-up
        (:meth:`notify`: a waiter gone meanwhile passes it on, an abandoned one runs its
        leave). Only for an id watched or abandoned here; once per id until it fires, at
        the earliest delay it was told meanwhile."""
        with self._mutex:
            known = waiter_id in self._waiters or waiter_id in self._abandoned
        if known and not self._standing_by.add(waiter_id, delay):
            logger.debug("redlock: no hand-off thread: waiter %s tries now", waiter_id)
            self.notify(waiter_id)  # a try early: the server decides

    def stand_down(self, waiter_id: str) -> None:
        """The waiter ahead of ``waiter_id`` took the lock: no try at the hand-off delay."""
        self._standing_by.remove(waiter_id)

    def _run_leave(self, waiter_id: str, leave: Callable[[], object]) -> None:
        try:
            leave()
        except Exception as exc:  # kept: the next wake-up for it tries again
            logger.debug("redlock: leave of abandoned waiter %s failed: %s", waiter_id, exc)
            self.abandon(waiter_id, leave)

    def declare_unheard(self, waiters: list[AnyWaiter] | None = None) -> None:
        """This hub's server left a PING unanswered for a socket timeout: ``waiters`` (else
        every waiter) are told, and woken once as many hubs as they need went silent
        (:func:`unheard`); their wait raises instead of sleeping until its next try."""
        if waiters is None:
            with self._mutex:
                waiters = [w for group in self._waiters.values() for w in group]
        for waiter in waiters:
            waiter.unheard.add(self)
            if unheard(waiter):
                waiter.wake()

    def declare_heard(self, waiters: list[AnyWaiter] | None = None) -> None:
        """This hub's server answered again (a quorum's node back before the waiters gave
        up): it no longer counts against them. Not against those the verdict reached (woken
        to raise): they gave up when it came."""
        if waiters is None:
            with self._mutex:
                waiters = [w for group in self._waiters.values() for w in group]
        for waiter in waiters:
            # Taken back, a woken waiter whose thread looked only after the reconnect was
            # heard (a few ms: the GIL, a busy machine) slept on, one that looked first raised.
            if not unheard(waiter):
                waiter.unheard.discard(self)

    def unheard_error(self, alias: str, lock: str) -> str:
        """What a waiter whose server went silent says (see :func:`unheard`)."""
        return (
            f"lock {lock!r}: backend {alias!r} did not answer the wait's PING within"
            f" {self.confirm_timeout:g} s"
        )

    def notify_all(self) -> None:
        """Something may have been missed (a lost connection): everyone looks again."""
        with self._mutex:
            waiters = [w for group in self._waiters.values() for w in group]
        for waiter in waiters:
            waiter.baton = True
            waiter.wake()

    def _subscribe(self, channel: str, first: bool) -> Confirmation | None:
        """Called for every waiter; returns what to wait on before re-trying, if anything."""
        return None

    def _subscribe_inbox(self) -> Confirmation | None:
        """Called for every waiter woken by id (in-process hubs wake by id directly)."""
        return None

    def _unsubscribe(self, channel: str) -> None:
        """Called when the last waiter of a channel leaves."""

    def close(self) -> None:
        self._standing_by.close()  # its waiters are all woken below
        self.notify_all()


class CompositeHub(ReleaseHub):
    """Waiters woken by a message from any of several hubs (Redlock's nodes)."""

    confirm_needed = False

    def __init__(self, hubs: list[ReleaseHub], confirm_timeout: float) -> None:
        super().__init__()
        self.hubs = hubs
        self.confirm_timeout = confirm_timeout

    def join(
        self, channel: str, waiter: AnyWaiter, by_id: bool = False, lock: str = ""
    ) -> list[Confirmation]:
        return self.join_hubs(list(self.hubs), channel, waiter, by_id, lock)

    def join_hubs(
        self, hubs: list[ReleaseHub], channel: str, waiter: AnyWaiter, by_id: bool, lock: str
    ) -> list[Confirmation]:
        """Join ``hubs`` (a QuorumHub's usable ones): the waiter fails as unheard once so
        many of all the hubs are out (not joined, or silent) that no majority can answer."""
        confirmations: list[Confirmation] = []
        joined = 0
        for hub in hubs:
            try:
                confirmations += hub.join(channel, waiter, by_id, lock)
            except SETUP_FAILURES as exc:  # a node that is down wakes nobody; the others do
                logger.debug("redlock: watching %s on a node failed: %s", channel, exc)
            else:
                joined += 1
        waiter.unheard_limit = self.unheard_limit(joined)
        return confirmations

    def unread(self) -> bool:
        return any(hub.unread() for hub in self.hubs)

    def unheard_limit(self, joined: int) -> int:
        """How many of the ``joined`` hubs going silent leave no majority of all the hubs."""
        quorum = len(self.hubs) // 2 + 1
        return max(1, joined - quorum + 1)

    def unheard_error(self, alias: str, lock: str) -> str:
        return (
            f"lock {lock!r}: backend {alias!r}: too few nodes answered the wait's PING within"
            f" {self.confirm_timeout:g} s for a quorum"
        )

    def leave(self, channel: str, waiter: AnyWaiter) -> None:
        for hub in self.hubs:
            hub.leave(channel, waiter)

    def abandon(self, waiter_id: str, leave: Callable[[], object]) -> None:
        # The nodes' hubs hear the wake-ups: each may run the leave, the first one does.
        ran = threading.Lock()  # held from the first start on, let go should it fail

        def once() -> object:
            if not ran.acquire(blocking=False):
                return None
            try:
                return leave()
            except BaseException:
                ran.release()
                raise

        for hub in self.hubs:
            hub.abandon(waiter_id, once)

    def settle(self, waiter_id: str) -> None:
        for hub in self.hubs:
            hub.settle(waiter_id)
