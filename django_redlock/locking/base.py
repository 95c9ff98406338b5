"""What every lock kind shares: taking, waiting, renewing, releasing and losing a hold.

A kind (a lock, a semaphore's permit, a read or write hold) says how to build its backend
ops; everything else is here once. Unknown is not lost: when a backend cannot answer, the
operation raises (``BackendUnavailable``, ``QuorumNotReached``) and the hold stays as it was.
A hold is declared lost only when the backend answered that its token no longer holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar, cast

from .. import fencing, forks, observe
from ..backends.base import Attempt, BaseLockBackend, LockInfo, Op, Renewal, by_deadline
from ..exceptions import BackendUnavailable, LockError, LockLost, LockNotAcquired, LockNotOwned
from ..handler import locks
from ..identity import holder_meta, lend_owner, new_token, owner_id, write_seq
from ..renewer import Renewer, thread_renewer
from ..signals import acquire_timed_out, lock_acquired, lock_lost, lock_released
from ..validation import (
    check_bool,
    check_name,
    check_optional_seconds,
    check_seconds,
    check_ttl,
    to_ms,
)
from ..waiters import start_thread
from . import finisher, holds
from .holds import (
    Hold,
    believed,
    holding,
    holds_levels,
    new_stamp,
    refence_of,
    refenced,
    settled,
    take,
    unsettled,
    unsure,
    untake,
)
from .steps import (
    Sleep,
    Steps,
    Unwatch,
    Watch,
    adrive,
    drive,
    finish_now,
    in_event_loop,
    leave_waiters,
    undo_take,
)
from .templates import (
    callable_name,
    is_async_callable,
    name_template,
    refuse_generator,
    refuse_generator_result,
)

logger = logging.getLogger("django_redlock")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
B = TypeVar("B", bound="BaseLock")


#: How many tokens of unanswered tries an object keeps to hand back beside the one it reuses.
_DISPLACED_MAX = 8


class _TakeUndo:
    """A take's hand-back (:meth:`BaseLock._undo_take`), called with no I/O to get its
    steps. :meth:`BaseLock._record` notes here the hold the take recorded."""

    __slots__ = ("__weakref__", "before", "depth", "lock", "owner", "recorded")

    def __init__(self, lock: BaseLock, owner: str, before: Hold | None, depth: int) -> None:
        self.lock, self.owner, self.before, self.depth = lock, owner, before, depth
        self.recorded: Hold | None = None

    def __call__(self) -> Steps[None]:
        return self.lock._undo_recorded(self.owner, self.recorded, self.before, self.depth)


def _no_take() -> None:
    return None


#: The take under way in this context (its thread, or its asyncio task), weakly.
_TAKING: contextvars.ContextVar[Callable[[], _TakeUndo | None]] = contextvars.ContextVar(
    "redlock_taking", default=_no_take
)


def _no_steps() -> Steps[None]:
    yield from ()


class _LeftWith:
    """One ``with lock:`` statement's level (not a fenced block's: fencing drops those), told
    the moment the statement is left (its exit token dies: :class:`~..fencing.TrackedExit`).

    CPython looks for pending signals as a function is entered, before its first line: an
    exception a signal handler raises there (Celery's soft time limit) as ``__exit__`` is
    entered, or as a call of the exit is (``_exit``, the release), leaves the ``with`` with
    its level held, and the watchdog would renew it for as long as the lock object lives.

    The invariant, whatever line an interrupt (a burst of them) lands on:

    * Owed is a fact read, never a state stored: the exit token is dead, the exit's release
      did not return (``done``) and the level is still the object's (``due``: the very
      hold, by identity, and its stamp). Nothing has to run for a level to become owed, so
      nothing cut short can lose one; :meth:`_gone` only wakes the payer early.
    * A level is paid by claiming its hold (:meth:`BaseLock._claim_owed`: renewal stopped,
      then ``releasing`` under the object's mutex, one store, only while still ``due``),
      then releasing that hold's own token, only while that very hold is the object's. A
      later hold of the object (another token: released and taken again meanwhile) is
      never due nor claimed, so never released by a payer. A claimed hold stays in the
      object, ``releasing``, until a release of it is answered: its payer sends one (again,
      if the object's next acquire claimed it and was cut short before its own), and the
      next acquire does (a release is idempotent); with no answer, its TTL ends it.
    * Its backend's payer (:class:`_Payer`) looks at every watch as it is woken, and every
      :data:`SWEEP` seconds while one is open: an owed level is paid within about a second
      even when the callback never ran. The object's next acquire claims it first if it
      comes first. An entry leaves the watch set only once it owes nothing (``done``, or
      no longer ``due``: paid, claimed, or the hold gone)."""

    __slots__ = ("__weakref__", "done", "hold", "level", "lock", "owner", "payer", "stamp", "watch")

    def __init__(
        self, lock: BaseLock, owner: str, hold: Hold, token: weakref.ref[Any], payer: _Payer
    ) -> None:
        self.lock, self.owner, self.hold, self.payer = lock, owner, hold, payer
        self.level = hold.depth
        self.stamp = hold.stamps[hold.depth - 1]
        self.done = False  # the exit's release returned: nothing owed
        bound = token()
        self.watch = None if bound is None else weakref.ref(bound, self._gone)

    def due(self) -> bool:
        """Whether its level is still this object's, and not being released. No I/O."""
        hold, level = self.hold, self.level
        return (
            self.lock._holds.get(self.owner) is hold
            and not hold.releasing
            and hold.depth >= level
            and len(hold.stamps) >= level
            and hold.stamps[level - 1] == self.stamp
        )

    def left(self) -> bool:
        """Whether its statement is over (the exit token is dead)."""
        return self.watch is None or self.watch() is None

    def owed(self) -> bool:
        """Whether its statement was left with the level held (see the class). No I/O."""
        return not self.done and self.left() and self.due()

    def claimed(self) -> bool:
        """Whether its hold was claimed (``releasing``) and is still the object's: a release
        of it not finished (cut short, or no answer). No I/O."""
        hold = self.hold
        return hold.releasing and self.lock._holds.get(self.owner) is hold

    def drop(self) -> None:
        """Out of the watch set and the object's list (each a no-op if done already)."""
        self.payer.watching.discard(self)
        with contextlib.suppress(ValueError):
            self.lock._withs.remove(self)

    def _gone(self, _: Any) -> None:
        # Runs as the ``with`` is left, on its thread, maybe inside an interrupt's unwinding:
        # no I/O, nothing raised (a weakref callback cannot). Only a shortcut: cut short, the
        # payer's sweep finds the same facts.
        with contextlib.suppress(Exception):
            if self.done:  # the usual case: nothing owed, nothing for the payer to do
                self.drop()
            elif self.payer.process == holds.process:  # (a forked child's: not ours)
                self.payer.wake.set()


#: How often a backend's payer looks at the watches while a ``with`` is open, should a
#: statement's callback never have run (an interrupt at its entry): "about a second".
SWEEP = 0.5


class _Payer:
    """The thread that pays the levels ``with`` statements on one backend left owed (see
    :class:`_LeftWith`): one per backend, so that a backend that does not answer delays its
    own owed levels only (each release is bounded by its socket timeout), never another's."""

    def __init__(self, using: str) -> None:
        self.using, self.process = using, holds.process
        self.wake = threading.Event()
        self.idle = False  # waiting with no timeout: a new watch wakes it (see watch())
        #: Watches of ``with`` statements open or owing (a weak reference's callback needs
        #: its reference kept): taken out only once they owe nothing.
        self.watching: set[_LeftWith] = set()
        self.thread = threading.Thread(
            target=self._run, name=f"redlock-left-withs:{using}", daemon=True
        )

    def watch(self, left: _LeftWith) -> None:
        self.watching.add(left)
        if self.idle:  # (idle marked before its look at the set: one of the two sees the other)
            self.wake.set()

    def _run(self) -> None:
        while True:
            self.idle = True
            if self.watching:  # a sweep now and then while one is open
                self.idle = False
                self.wake.wait(SWEEP)
            else:
                self.wake.wait()
            self.idle = False
            self.wake.clear()  # before the look: a wake-up from now on means another look
            self._look()

    def _look(self) -> None:
        # (A frame of its own: no watch, nor its lock object, stays referenced as it waits.)
        for left in list(self.watching):  # (one copy: owners add theirs meanwhile)
            if left.done or not (left.due() or left.claimed()):
                left.drop()  # nothing owed: the exit returned, paid, or the hold gone
            elif left.left():
                self._pay(left)  # owed, or claimed by an acquire cut short before its release

    def _pay(self, left: _LeftWith) -> None:
        lock = left.lock
        try:
            lock._drive(lock._pay_owed(left))
        except Exception as exc:  # no answer: released by its next acquire, else at its TTL
            logger.warning("redlock: %s: releasing the level of a `with` left as its exit"
                           " began failed: %s", lock.describe(), exc)  # fmt: skip
        finally:
            left.drop()  # claimed (or not due): owes nothing here any more


#: The payers of this process, by backend alias (a forked child starts with none).
_payers: dict[str, _Payer] = {}
_payers_mutex = [threading.Lock()]


def _payer_for(using: str) -> _Payer:
    payer = _payers.get(using)
    if payer is not None and payer.thread.is_alive():
        return payer
    with _payers_mutex[0]:
        payer = _payers.get(using)
        if payer is None or not payer.thread.is_alive():
            old, payer = payer, _Payer(using)
            if old is not None:  # (its thread died: its watches are the new one's)
                payer.watching |= old.watching
                for left in old.watching:
                    left.payer = payer
            _payers[using] = payer
            start_thread(payer.thread)
    return payer


@forks.after_fork_in_child
def _forget_payers() -> None:
    # The parent's payers (their threads, Events, watches) are not the child's: a payer may
    # have held its Event's lock at the fork, and nobody here would let it go.
    _payers.clear()
    _payers_mutex[0] = threading.Lock()


#: A try not made yet (immutable: one shared).
_NOT_TRIED = Attempt(False)

#: How long a queued waiter's place lasts before it must renew it (by trying again). A
#: waiter that dies blocks the queue for at most this long, or its own timeout.
WAITER_LEASE = 5.0


def _actor() -> Any:
    """The current thread, or asyncio task: a reentrant hold's owner."""
    task = asyncio.current_task() if in_event_loop() else None
    return task if task is not None else threading.current_thread()


def check_token_prefix(prefix: Any) -> str | None:
    if prefix is None:
        return None
    if not isinstance(prefix, str) or "|" in prefix or len(prefix) > 200:
        raise ValueError(f"token_prefix must be a str of <= 200 chars without '|', not {prefix!r}")
    return prefix


class BaseLock:
    """A named hold on one backend; not taken until :meth:`acquire` or ``with``.

    The sync methods always act synchronously; asyncio code awaits the ``a``-prefixed twins
    (``aacquire``, ``arelease``, ...). A blocking ``acquire`` in a running event loop raises
    :class:`LockError`: it would block the loop, and with it whoever may hold the lock.
    A hold belongs to the process that took it: a forked child does not hold its parent's.

    Subclasses build the ops (``_op_*``) and may override :meth:`_owner` (who holds: "" for
    the object itself), :attr:`reentrant`, :attr:`queued` (waiters keep a place in a queue)
    and :attr:`exclusive` (one holder per name: waiting for oneself is an error).
    """

    #: What the kind is called in messages and admin ("lock", "semaphore", ...).
    noun = "lock"
    reentrant: bool = False
    queued: bool = False
    exclusive: bool = True
    #: The database of ``atomic=``: ``with`` and the decorator run a fenced transaction there.
    database: str | None = None

    def __init__(
        self,
        name: str,
        *,
        ttl: float | None = None,
        using: str,
        timeout: float | None = None,
        blocking: bool = True,
        auto_renew: bool = True,
        max_hold: float | None = None,
        token_prefix: str | None = None,
    ) -> None:
        self.name = check_name(name)
        # The defaults (None, True) pass without a call: a lock is usually made per use.
        self.token_prefix = None if token_prefix is None else check_token_prefix(token_prefix)
        ttl = None if ttl is None else check_ttl(ttl)
        self.timeout = (
            None if timeout is None else check_seconds(timeout, "timeout", allow_zero=True)
        )
        self.blocking = True if blocking is True else check_bool(blocking, "blocking")
        self.auto_renew = True if auto_renew is True else check_bool(auto_renew, "auto_renew")
        self.max_hold = None if max_hold is None else check_seconds(max_hold, "max_hold")
        if not self.blocking and self.timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        if not isinstance(using, str):
            raise TypeError(f"using must be a backend alias (str), not {using!r}")
        self.using = using
        self.backend: BaseLockBackend = self._backend_for(using)
        self.lock_ttl = ttl if ttl is not None else self.backend.default_ttl
        self._holds_by_owner: dict[str, Hold] = {}  # owner ("" for the object) -> hold
        self._process = holds.process  # whose holds those are
        self._lost: str | None = None  # why the last hold was lost, if it was
        # Reentrant kinds: owner -> nested levels of a hold that was lost. Each later release
        # raises LockLost, and no acquire nests in what is gone, until they are all released.
        self._orphans: dict[str, int] = {}
        # The token of an acquire whose outcome is unknown (its reply was lost): the next try
        # uses it again, so that it finds the hold if the lost try took it.
        self._unsure_token: str | None = None
        # Whether that token is one given (use_token), not one an unanswered try left.
        self._token_given = False
        # Plain tokens whose hand-back a task of its own finishes (cancelled again): never
        # taken up by a next try, whose grant that task's release would delete.
        self._handing_back: set[str] = set()
        # Plain tokens of a waiter's try given up on while its command runs on (see
        # _late_take): not taken up by a next try, the late reply decides.
        self._late_tokens: set[str] = set()
        # Those tokens' commands whose late reply has not come (a loop closed with one
        # pending never calls back): settled by the next try (_next_token).
        self._late_commands: dict[str, weakref.ref[asyncio.Future[Attempt]]] = {}
        # Tokens of tries given up on, unanswered, while another's token was kept (one slot:
        # a next try can find one hold): released once the server answers the next try.
        # Oldest first, at most _DISPLACED_MAX (an older one's grant runs out at its TTL).
        self._displaced: dict[str, None] = {}
        # token -> why: a loss decided (the hold left the object) whose declaration was not
        # handed over yet; told again (the watchdog retells), the object hands it over then.
        # With the thread handing it over now (None: none, an exception ended its telling).
        self._undeclared: dict[str, tuple[str, str, Hold, threading.Thread | None]] = {}
        self._mutex = threading.Lock()
        # ``with`` statements open on it (watched), or left owing their level (_LeftWith).
        self._withs: list[_LeftWith] = []

    # -- what a kind provides ----------------------------------------------------------------

    def _backend_for(self, using: str) -> BaseLockBackend:
        return locks[using]  # an unknown alias is an error, still without I/O

    def _op_acquire(
        self, token: str, ttl_ms: int, meta: str, waiter: str | None, wait_ms: int
    ) -> Op[Attempt]:
        raise NotImplementedError

    #: Whether a reentrant release sets the owner's count to the levels it holds (settling a
    #: count left unsure in the same round trip), so that no settle goes before it.
    _release_settles = False

    def _op_release(self, token: str) -> Op[int]:
        """Holds left after releasing one (0: freed); -1 when the token holds none."""
        raise NotImplementedError

    def _op_drop(self, token: str) -> Op[int]:
        """Give back a hold the owner does not count (a re-entry refused), whole."""
        return self._op_release(token)

    def _op_hand_back(self, token: str, kept: bool = False) -> Op[int]:
        """A plain token's hand-back of a try that may be on the wire (:meth:`_hand_back`):
        a release that, reaching the server before that try, refuses it when it lands (see
        ``backend.op_hand_back``). ``kept``: a token kept from an unanswered try, which may
        land after this release frees its hold: marked then too."""
        return self._op_release(token)

    def _op_release_hold(self, hold: Hold) -> Op[int]:
        """The release of ``hold``'s last level: marked when its token was kept from an
        unanswered try (:attr:`Hold.kept`); else the common release."""
        if hold.kept:
            return self._op_hand_back(hold.token, True)
        return self._op_release(hold.token)

    def _op_extend(self, token: str, ttl_ms: int) -> Op[bool]:
        raise NotImplementedError

    def _op_hold_count(self, token: str) -> Op[int]:
        raise NotImplementedError

    def _op_locked(self) -> Op[bool]:
        raise NotImplementedError

    def _op_pttl(self) -> Op[int | None]:
        raise NotImplementedError

    def _op_inspect(self) -> Op[LockInfo | None]:
        raise NotImplementedError

    def _op_leave(self, waiter: str) -> Op[None]:
        return self.backend.op_leave(self.name, waiter)

    def _op_settle(self, owner: str, count: int, marks: bool = True) -> Op[int]:
        """Reentrant kinds: set ``owner``'s hold count on the server (see :meth:`_settle`),
        as the owner's latest write (a request of its that runs late changes nothing)."""
        return self.backend.op_settle(self.name, owner, count, write_seq(), marks)

    def _renewal(self, token: str, ttl_ms: int) -> Renewal:
        # tuple.__new__: a NamedTuple's own __new__ is Python code, twice the cost (a
        # renewal is made on every acquire).
        return tuple.__new__(Renewal, (self.name, token, ttl_ms))

    def _meta(self) -> str:
        return holder_meta(fair=self.queued)

    def _owner(self) -> str:
        if not self.reentrant:
            return ""
        return owner_id()

    def kind_label(self) -> str:
        """The lock's kind as its repr and the metrics' ``kind`` label name it ("lock",
        "reentrant fair lock", "semaphore"...). Internal: :mod:`~django_redlock.observe`."""
        return self.noun

    def _init_kwargs(self) -> dict[str, Any]:
        """What a copy under another name (the decorator's) is built with."""
        return {
            "ttl": self.lock_ttl,
            "using": self.using,
            "timeout": self.timeout,
            "blocking": self.blocking,
            "auto_renew": self.auto_renew,
            "max_hold": self.max_hold,
            "token_prefix": self.token_prefix,
        }

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def _holds(self) -> dict[str, Hold]:
        if self._process != holds.process:  # a forked child: the parent's holds are not ours
            self._holds_by_owner, self._process = {}, holds.process
            self._unsure_token, self._orphans, self._undeclared = None, {}, {}
            self._handing_back, self._late_tokens = set(), set()
            self._late_commands, self._displaced = {}, {}
            self._withs = []
            # Another thread (the watchdog's) may have held it at the fork: it never lets go.
            self._mutex = threading.Lock()
        return self._holds_by_owner

    def __repr__(self) -> str:
        hold = self._holds.get(self._owner())
        state = f"held, fence {self.fence}" if hold else "lost" if self._lost else "free"
        kind = type(self).__name__
        return f"<{kind} {self.name!r} ({self.kind_label()}) on {self.using!r}: {state}>"

    def describe(self) -> str:
        """How messages name this lock: ``lock 'name' on backend 'alias'`` (internal: for
        the modules that report on a lock, such as :mod:`~django_redlock.fencing`)."""
        return f"{self.noun} {self.name!r} on backend {self.using!r}"

    def _drive(self, steps: Steps[T]) -> T:
        return drive(self.backend, steps)

    async def _adrive(self, steps: Steps[T]) -> T:
        return await adrive(self.backend, steps)

    def _take(self, blocking: bool, timeout: float | None) -> bool:
        return drive(self.backend, self._acquire(blocking, timeout), self._undo_take())

    async def _atake(self, blocking: bool, timeout: float | None) -> bool:
        return await adrive(self.backend, self._acquire(blocking, timeout), self._undo_take())

    def _undo_take(self) -> _TakeUndo:
        """The hand-back of an acquire that raised (an interrupt as its steps ended, on a
        line of the driver or of their own after the record): the hold it recorded is
        released, since its caller believes nothing taken (docs: faq, "at any line of an
        acquire ... leaves nothing held"). Made as the take starts, in its context (its
        thread, or its task): :meth:`_record` notes there the hold this take recorded, so it
        knows that one, whatever another take of this object (another task's, another
        thread's) recorded meanwhile. No reset to undo: a later take replaces it, and it is
        held weakly (a finished take's is garbage)."""
        owner = self._owner()
        before = self._holds.get(owner)
        undo = _TakeUndo(self, owner, before, 0 if before is None else before.depth)
        _TAKING.set(weakref.ref(undo))
        return undo

    def _undo_recorded(self, owner: str, recorded: Hold | None, before: Hold | None,
                       depth: int) -> Steps[None]:  # fmt: skip
        # Decided when called (no I/O): at the interrupt, or at a coroutine's close, whose
        # clean-up the finisher runs later. Only the hold this take recorded: by then
        # another take of this object may have recorded one (a plain lock's owner is the
        # object: another task or thread of it, during this take's clean-up's round trips;
        # review wai2, 2), or this object taken the lock again (review asy, 1).
        mine = self._holds.get(owner)
        if recorded is None or mine is not recorded:
            return _no_steps()
        if mine.depth <= (depth if mine is before else 0):
            return _no_steps()
        return self._release_recorded(owner, mine)

    def _release_recorded(self, owner: str, hold: Any) -> Steps[None]:
        if self._holds.get(owner) is hold:  # still the cut take's: else let go meanwhile
            yield from self._release(owner)  # (its owner's, given: maybe on the finisher)

    # -- reentrant counts after lost replies --------------------------------------------------

    def levels(self, owner: str) -> int:
        """How many levels of reentrant ``owner``'s hold this object holds (internal:
        ``holds`` counts the owner's hold from them). No I/O."""
        hold = self._holds_by_owner.get(owner)
        return 0 if hold is None else hold.depth

    def _unsure(self, owner: str) -> None:
        if self.reentrant:
            unsure(self.backend, self.name, owner)

    def _sure(self, owner: str) -> None:
        """The object's levels are up to date with the server's last answer: the owner's
        count is sure again (a step of its own, after them: an interrupt before it leaves it
        to settle)."""
        if self.reentrant:
            settled(self.backend, self.name, owner, believed(self.backend, self.name, owner))

    def _settle(self, owner: str, marks: bool = True) -> Steps[None]:
        """Before a reentrant owner's next operation: if a reply was lost, the server's count
        may be one off (an acquire that went through although it raised, a release that did
        not): set it to what this process knows, the truth, so a retry never counts twice.
        ``marks``: a write of the owner's may still be on the wire (the one whose reply was
        lost): finding nothing held, the settle refuses it (lua/settle.lua)."""
        count = unsettled(self.backend, self.name, owner) if self.reentrant else None
        if count is not None:
            yield self._op_settle(owner, count, marks)
            settled(self.backend, self.name, owner, count)

    # -- acquire -----------------------------------------------------------------------------

    def _check_acquire(self, blocking: Any, timeout: Any) -> tuple[bool, float | None]:
        blocking = check_bool(blocking, "blocking")
        timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        if not blocking and timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        return blocking, timeout

    def _check_sync_wait(self, blocking: bool, timeout: float | None) -> None:
        if blocking and timeout != 0 and in_event_loop():
            raise LockError(
                f"{self.describe()}: a blocking acquire() in a running event loop would block"
                " the loop, and with it whoever may hold the lock; use `await lk.aacquire()`"
                " or `async with`, or acquire(blocking=False)"
            )

    def _acquire(self, blocking: bool, timeout: float | None) -> Steps[bool]:
        """Take a hold for this owner: checks, one try (then a wait when ``blocking``), the
        re-entry's check, and the outcome recorded. Arguments checked by the caller
        (:meth:`_check_acquire`).

        Each exit reports its outcome to ``observe`` once. What each unit does on an error
        or an interruption is in its own docstring: nothing is recorded before the last
        step answered; a try whose answer is unknown leaves its token to the next try (or a
        reentrant count to settle); an interrupted try hands back what it may have taken."""
        owner = self._owner()
        actor = owner if self.reentrant else owner_id()
        if self.reentrant or self._holds:
            yield from self._prepare_acquire(owner, actor, blocking, timeout)
        else:  # a plain lock this object does not hold: the one check that applies
            yield from self._refuse_self_wait(actor, blocking, timeout)
        started = time.monotonic()
        span = observe.acquire_started(self)
        token = owner if self.reentrant else self._next_token()
        # A token kept from an unanswered try: that try may land after this hold's release.
        kept = token == self._unsure_token and not self._token_given
        self._token_given = False
        ttl_ms, meta = to_ms(self.lock_ttl), self._meta()
        held = self._holds.get(owner)  # before: to tell whether an interrupt came after a record
        depth = 0 if held is None else held.depth
        attempt: Attempt | None = None
        tried = [started]  # when the last try was sent: the watchdog dates the hold from it
        # Unsure from before the try until the outcome is in the object: the server changes
        # the owner's count before this process does, and an interrupt (a burst: one more in
        # the hand-back) may end the acquire in between. The owner's next operation then
        # settles the count, whatever line the acquire ended on.
        if self.reentrant:
            self._unsure(owner)
        # A re-entry of a hold this process renews (through another object maybe) sets its
        # TTL: on its way, a shorter one is renewed on its schedule (review wdc4, 1).
        renewal = self._renewal(owner, ttl_ms) if self.reentrant else None
        flight = thread_renewer.sending(self, renewal) if renewal is not None else None
        try:
            # In the try: no line between the grant and the record is unguarded.
            attempt = yield from self._try_or_wait(
                owner, token, ttl_ms, meta, blocking, timeout, started, span, tried, kept
            )
            hold: Hold | None = None
            current = self._holds.get(owner) if self.reentrant else None
            refused = self._nests_in_nothing(owner, current, attempt)
            if attempt.acquired and not refused:
                hold = self._record(owner, actor, token, ttl_ms, attempt, sent=tried[0], kept=kept)
        except BaseException as exc:
            if attempt is None:
                if renewal is not None:
                    # No answer: a re-entry may have set this TTL on another object's hold,
                    # shorter maybe (review wdc2, 2).
                    thread_renewer.unsure_hold(self.backend, renewal, flight)
                raise  # the take's own: _try_or_wait handed back what it may have been granted
            # Granted and not recorded (_record undid its steps): hand it back. Recorded (an
            # interrupt as _record returned): released by the driver (_undo_take).
            mine = self._holds.get(owner)
            recorded = mine is not None and mine.depth > (depth if mine is held else 0)
            if attempt.acquired and not recorded:
                failed = observe.ERROR if isinstance(exc, Exception) else observe.TIMEOUT
                observe.acquire_ended(self, started, failed, None, span)
                yield from self._hand_back(owner, token, False, kept)
            raise
        finally:
            if renewal is not None:
                thread_renewer.landed(self, renewal, flight)  # after its news (soon)
        if hold is not None or not kept:
            self._unsure_token = None  # answered (and recorded): the token holds what it says
        # Else refused with a kept token: the unanswered try may still land and take the
        # lock once free, so the next try keeps to that token, and finds its grant.
        if refused:
            observe.acquire_ended(self, started, observe.ERROR, None, span)
            yield from self._refuse_reentry(owner, token, current)
        if self.reentrant:  # (a plain lock keeps no count)
            self._sure(owner)  # recorded, or not granted: the counts agree again
        if hold is None:
            outcome = observe.TIMEOUT if blocking and timeout else observe.BUSY
            observe.acquire_ended(self, started, outcome, None, span)
            if blocking and timeout:
                acquire_timed_out.send_robust(sender=type(self), lock=self, timeout=timeout)
            return False
        new = attempt.count_or_wait == 1  # not a re-entry
        if new:  # both hooks in one call
            observe.acquired(self, started, attempt.fence, span, hold)
        else:
            observe.acquire_ended(self, started, observe.ACQUIRED, attempt.fence, span)
        self._announce_held(hold, attempt, observed=new)
        return True

    def _prepare_acquire(
        self, owner: str, actor: str, blocking: bool, timeout: float | None
    ) -> Steps[None]:
        """Before a try: refuse to nest in a lost hold, settle a reentrant count left unsure,
        finish a release of this object that got no answer, and refuse to take a plain
        lock twice or to wait forever for oneself. Errors come out; nothing is recorded."""
        if self.reentrant and self._orphans.get(owner):
            raise LockLost(
                f"{self.describe()} was lost ({self._lost or 'expired'}): this acquire would"
                " nest in a hold that is gone; release the outer levels first"
            )
        for left in list(self._withs):  # a ``with`` left as its exit began: claimed here
            if left.owner == owner and left.owed():  # (released below, as "releasing")
                self._claim_owed(left)
        if self.reentrant:  # only a reentrant count is ever left to settle
            yield from self._settle(owner)
        stale = self._holds.get(owner)
        if stale is not None and stale.releasing:
            # This object's release got no answer and was not retried: finish it first (a
            # release is idempotent), so that what follows is a new hold, not the old one.
            if not self.reentrant:
                yield self._op_release_hold(stale)
            with self._mutex:
                self._forget(owner, stale)
        if not self.reentrant:
            if owner in self._holds:
                raise LockError(
                    f"{self.describe()} is already held by this object;"
                    " use reentrant=True to take it again"
                )
            yield from self._refuse_self_wait(actor, blocking, timeout)

    def _refuse_self_wait(self, actor: str, blocking: bool, timeout: float | None) -> Steps[None]:
        if not (self.exclusive and blocking and timeout is None):
            return
        for lk, token in holding(self.backend, self.name, actor):
            # Asked of the server first (one round trip, on this rare path only): a hold
            # renewed for good that the server lost (a restart, a flush) counts here until
            # its watchdog's next renewal, up to a third of its TTL, and the name is free.
            # An error (no answer) comes out: unknown is not lost.
            if (yield lk._op_hold_count(token)) <= 0:
                lk.mark_lost(token, "it expired or was released by someone else")
                continue
            # The process cannot tell a hold handed to another thread or task (whoever has
            # the object may release it) from one still this actor's: the message says so.
            raise LockError(
                f"{self.describe()} is held by this thread or task already: waiting for"
                " it with no timeout would wait for itself (forever while that hold is"
                " renewed); use reentrant=True, or give the wait a timeout= if that hold's"
                " Lock object was handed to another thread or task that releases it"
            )

    def held_tokens(self, actor: str, now: float) -> list[str]:
        """Internal API (holds.holding): the tokens of this object's holds taken by
        ``actor`` that may still be on the server at ``now`` (monotonic), by this
        process's clock: renewed for good, or not run out yet."""
        holds = list(self._holds.values())  # one copy: another thread may change the dict
        # An owed level's hold is renewed no more (its payer releases it): not "for good".
        owed = [left.hold for left in list(self._withs) if left.owed()]
        return [
            h.token
            for h in holds
            if h.actor == actor
            and (now < h.ends_by if h.ends_by is not None else all(h is not o for o in owed))
        ]

    def _next_token(self) -> str:
        """A plain hold's token: the one of a try whose answer was lost (the next try then
        finds the hold if that one took it), else a new one. Not one a write of which may
        still land late (a release or undo written, never answered): granted again, it
        would be deleted by that write (two holders); its hold is owed its release."""
        for late, ref in list(self._late_commands.items()):
            command = ref()
            # Its loop closed with it pending (run_until_complete() then close()): no reply
            # and no callback will come, and no hand-back can run: as unanswered.
            if command is None or command.get_loop().is_closed():
                self._late_commands.pop(late, None)
                if late not in self._handing_back:
                    self._keep_unsure(late)
        token = self._unsure_token
        if token is not None and not self.backend.token_reusable(token):
            token = self._unsure_token = None
        return token or f"{self.token_prefix or ''}{new_token()}"

    def _keep_unsure(self, token: str) -> None:
        """Keep an unanswered try's token for the next try; the slot taken by another's
        (kept first: its request was sent first, so the server runs it first), displaced."""
        if self._unsure_token is None and not self._holds:
            self._unsure_token = token
        elif self._unsure_token != token:
            self._displace(token)

    def _displace(self, token: str) -> None:
        self._displaced[token] = None
        while len(self._displaced) > _DISPLACED_MAX:  # (a next try's round trips: bounded)
            del self._displaced[next(iter(self._displaced))]

    def _release_displaced(self, token: str) -> Steps[bool]:
        """Release the displaced tokens' grants, if any (after an answer of the server:
        their requests, sent before, ran first). True when one held the lock. Unanswered:
        kept for the next time (never reused: its release landing late deletes nothing)."""
        freed = False
        for other in list(self._displaced):
            if other == token:
                continue
            try:
                # Marked: its request, unanswered, may still be on the wire (not run first).
                left = yield self._op_hand_back(other)
            except LockError:
                return freed
            self._displaced.pop(other, None)
            freed = freed or left == 0
        return freed

    def _try_or_wait(
        self,
        owner: str,
        token: str,
        ttl_ms: int,
        meta: str,
        blocking: bool,
        timeout: float | None,
        started: float,
        span: Any,
        tried: list[float],
        kept: bool = False,
    ) -> Steps[Attempt]:
        """One try that never queues or registers, then (``blocking``) the wait: the answer.

        No answer (``LockError``: the try may have taken it): the token is kept for the next
        try, or a reentrant count marked unsure (settled first next time). Interrupted (any
        other exception, a reply perhaps on its way): the hold is handed back with the
        token (kept while the hand-back may still be refused unsent, given up once it went
        unanswered: see :meth:`_give_back`), marked (``kept``: a token kept from an unanswered
        try, which may land after it). Each reports its outcome and re-raises."""
        attempt = _NOT_TRIED
        # Whether a try's request may be on the wire (interrupted before its reply was
        # taken): its hand-back, which may reach the server first, then marks the token.
        trying = [True]
        try:
            deadline = None if timeout is None or not blocking else started + timeout
            tried[0] = time.monotonic()
            attempt = yield by_deadline(deadline, self._op_acquire(token, ttl_ms, meta, None, -1))
            trying[0] = False
            freed = self._displaced and (yield from self._release_displaced(token))
            if freed and not attempt.acquired:
                # The lock was a lost try's of this object: once more, now it is free.
                take = self._op_acquire(token, ttl_ms, meta, None, -1)
                trying[0], tried[0] = True, time.monotonic()
                attempt = yield by_deadline(deadline, take)
                trying[0] = False
            if (
                not attempt.acquired
                and blocking
                and timeout != 0
                and (deadline is None or time.monotonic() < deadline)  # not used up by the try
            ):
                # A waiter with an id is woken by that id alone; else by the release channel.
                queued = self.queued or self.backend.wakes_one
                waiter = self.backend.new_waiter_id() if queued else None
                attempt = yield from self._wait(
                    token, ttl_ms, meta, waiter, deadline, trying, tried
                )
            return attempt  # in the try: an interrupt here hands the grant back too
        except LockError as exc:
            # No answer (BackendUnavailable, QuorumNotReached): the try may have taken the
            # lock. The next try uses the same token, and finds the hold if it did.
            if self.reentrant:
                self._unsure(owner)  # maybe one too many now: settle
            elif token in self._late_tokens:
                self._late_tokens.discard(token)  # its late reply decides (_late_take)
            else:
                self._keep_unsure(token)
            observe.acquire_ended(self, started, observe.ERROR, None, span)
            current = self._holds.get(owner)
            if isinstance(exc, LockLost) and current is not None:
                # The hold this re-entry was to nest in is gone (nothing was taken).
                self.mark_lost(current.token, "it expired or was released by someone else")
            raise
        except BaseException as exc:
            # Cancelled or interrupted while a reply was on its way or being parsed (an
            # ``Exception`` too: a signal handler's, Celery's soft time limit): the server may
            # have granted the hold, so hand it back (the token is ours alone).
            self._late_tokens.discard(token)  # (handed back here as well: idempotent)
            other = self._unsure_token
            if other is not None and other != token and not self.reentrant:
                # Kept meanwhile (a late try's): the hand-back takes the slot for its own.
                self._displace(other)
                self._unsure_token = None
            failed = observe.ERROR if isinstance(exc, Exception) else observe.TIMEOUT
            observe.acquire_ended(self, started, failed, None, span)
            yield from self._hand_back(owner, token, trying[0], kept)
            raise

    def _late_take(self, token: str, command: asyncio.Future[Attempt]) -> None:
        """A plain waiter's try given up on at its hub's verdict (``aexecute_by``) while its
        command runs on to its own socket timeout. The rule: a grant that the server still
        answers is handed back, so that no hold is left to its TTL held by nobody when no
        next try comes (the caller got BackendUnavailable, and may never try again). Its
        token is not kept for a next try meanwhile: that try's grant would be deleted by the
        hand-back. No reply at all: the request may still reach the server (a paused one
        resumed, a delay on the wire), and nothing will hand that grant back: the token is
        kept for the object's next try, which then finds its own hold (as a sync try's)."""
        self._late_tokens.add(token)
        if self._unsure_token == token:  # (a try before this one's, unanswered, kept it)
            self._unsure_token = None
        self._late_commands[token] = weakref.ref(command)
        command.add_done_callback(functools.partial(self._late_reply, token))

    def _late_reply(self, token: str, command: asyncio.Future[Attempt]) -> None:
        if self._late_commands.pop(token, None) is None:
            return  # settled already by a next try (its loop was closed)
        if command.cancelled() or command.exception() is not None:
            # No answer after all (a loop's shutdown: cancelled). Kept, or displaced (see
            # _keep_unsure), unless a hand-back of it is under way (an interrupt came after
            # the verdict).
            if token not in self._handing_back:
                self._keep_unsure(token)
            return
        if command.result().acquired:
            self._handing_back.add(token)
            again = functools.partial(self._give_back_again, token, token)
            self._finish_later(self._give_back(token, token), again)

    def _hand_back(
        self, owner: str, token: str, marks: bool = False, kept: bool = False
    ) -> Steps[None]:
        """Give back a hold the server may have granted that this object does not hold (an
        interrupt before it was recorded). A reentrant count is marked unsure and settled
        now (else before the owner's next operation); a plain hold is released by its
        token, kept for a next try only while that release has not gone unanswered (an
        unanswered one may land late: the next try takes a new token, and the grant, if
        any, expires at its TTL). An error of the hand-back is not raised: the caller
        raises what interrupted it.

        ``marks``: the try may still be on the wire. The hand-back goes on another
        connection and may reach the server first: finding nothing, it leaves a marker that
        refuses that try when it lands (backend.op_hand_back; a reentrant owner's settle
        refuses its older writes). Without a try on the wire, nothing is marked. ``kept``: the
        token was kept from an unanswered try, which may land even after a hand-back that
        freed a hold: marked then too."""
        self._unsure(owner)
        if not self.reentrant:
            if not finisher.on_finisher():
                self._unsure_token = token  # kept while the hand-back may be refused unsent
            elif self._unsure_token == token:
                # A closed coroutine's, run later: no try of its own comes again, and one of
                # another task of this object given this token would be deleted by this
                # hand-back's release, landing after its grant (review wai2, 1).
                self._unsure_token = None
        try:
            yield from self._give_back(owner, token, marks, kept)
        except asyncio.CancelledError:
            # Cancelled again: a task of its own finishes it. A next try of this object (the
            # caller may catch the cancellation) takes a new token: the task's release would
            # delete a grant of this one.
            if not self.reentrant:
                self._handing_back.add(token)
                if self._unsure_token == token:
                    self._unsure_token = None
            again = functools.partial(self._give_back_again, owner, token, marks, kept)
            self._finish_later(self._give_back(owner, token, marks, kept), again)
            raise
        except Exception:
            pass

    def _give_back(
        self, owner: str, token: str, marks: bool = False, kept: bool = False
    ) -> Steps[None]:
        if self.reentrant:
            yield from self._settle(owner, marks)
            return
        try:
            yield self._op_hand_back(token, kept) if marks or kept else self._op_release(token)
        except BaseException as exc:
            # Unanswered (no reply, or an interrupt while waiting for it), the release may
            # still run at any later time (TCP delivers what was written before a close): a
            # try granted this token again would be deleted by it (two holders). The next try
            # takes a new token; the grant expires at its TTL. (Cancelled: a task of its own
            # finishes it, see _hand_back.)
            if not isinstance(exc, asyncio.CancelledError):
                self._handing_back.discard(token)
            if self._unsure_token == token:
                self._unsure_token = None
            raise
        self._handing_back.discard(token)
        if self._unsure_token == token:
            self._unsure_token = None

    def _give_back_again(
        self, owner: str, token: str, marks: bool = False, kept: bool = False
    ) -> Steps[None]:
        """A hand-back whose finishing task was cancelled, given back once more unless done
        since (a plain token's release answered, or unanswered: nothing more to do). No try
        of this object takes such a token up (see :meth:`_hand_back`). A reentrant count is
        settled (what the objects hold: never a later level)."""
        if self.reentrant or token in self._handing_back:
            yield from self._give_back(owner, token, marks, kept)

    def _nests_in_nothing(self, owner: str, current: Hold | None, attempt: Attempt) -> bool:
        """Whether a reentrant grant is a new hold where this process holds levels: a new
        fence, or a count of 1 where this object (or another of the same owner) holds
        levels, means the hold it was to nest in is gone. Catches the hold up with a
        re-fence that got no answer first (a larger fence on a nested grant is its own)."""
        fresh = attempt.count_or_wait == 1  # the server's count for the owner: a new hold
        backend, name = self.backend, self.name
        if current is not None:
            self._catch_up(current)
            unanswered = refence_of(backend, name, owner)[1]
            if (
                unanswered
                and attempt.acquired
                and not fresh
                and (attempt.fence or 0) > (current.fence or 0)
            ):
                # A re-fence of this hold got no answer: this larger fence is its own.
                refenced(backend, name, owner, attempt.fence)
                self._catch_up(current)
        return (
            attempt.acquired
            and self.reentrant
            and (
                (current is not None and attempt.fence != current.fence)
                or (fresh and believed(backend, name, owner) > 0)
            )
        )

    def _refuse_reentry(self, owner: str, token: str, current: Hold | None) -> Steps[None]:
        """Hand the fresh hold back (no answer: settled before the owner's next operation),
        declare the old one lost, raise LockLost."""
        try:
            yield self._op_drop(token)
        except LockError:
            self._unsure(owner)  # settled before the next operation
        if current is not None:
            self.mark_lost(current.token, "it expired or was released by someone else")
        raise LockLost(
            f"{self.describe()} was lost before this re-entry: it expired or was released"
            " by someone else"
        )

    def _wait(
        self,
        token: str,
        ttl_ms: int,
        meta: str,
        waiter: str | None,
        deadline: float | None,
        trying: list[bool],
        tried: list[float],
    ) -> Steps[Attempt]:
        """Sleep until a release (pub/sub) or the holder's expiry; never poll blindly.

        A registered ``waiter`` left without the hold (refused, an error, an interrupt)
        leaves the queue or the waiters' set (:func:`~.steps.leave_waiters`: not after a try
        that got no answer in time; a leave not sent or not answered is sent when a wake-up
        still comes for the waiter, else its entry lapses: a fair queue's place at its
        lease, at most :data:`WAITER_LEASE`, a plain waiter with the waiters' set). The hub
        holds the leave from before the first try (see :class:`~.steps.Watch`): an interrupt
        at any line of the clean-up still leaves through it."""
        queued = self.queued
        if waiter:
            handle = yield Watch(waiter, True, self.name, self._op_leave(waiter))
        else:
            handle = yield Watch(self.backend.channel(self.name), False)
        attempt = Attempt(False)
        unanswered = False
        try:
            while True:
                # Registered before this try, so a release right after it still wakes us.
                remaining = float("inf") if deadline is None else deadline - time.monotonic()
                if queued:  # the queue keeps our place until then
                    wait_ms = to_ms(min(max(remaining, 0.0), WAITER_LEASE))
                else:  # registered (with an id) or not
                    wait_ms = 0 if waiter else -1
                take = self._op_acquire(token, ttl_ms, meta, waiter, wait_ms)
                if not self.reentrant:  # (a reentrant count is settled at its next operation)
                    take = replace(take, late=functools.partial(self._late_take, token))
                trying[0] = True  # (see _try_or_wait)
                tried[0] = time.monotonic()
                attempt = yield by_deadline(deadline, take)
                trying[0] = False
                handle[1].baton = False  # tried: a wake-up we were handed is used up
                if attempt.acquired:
                    if waiter:  # taken: out of the server's waiters, nothing to leave
                        self.backend.hub.settle(waiter)
                    return attempt
                remaining = float("inf") if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return attempt
                hint = attempt.count_or_wait  # ms until the hold expires or the queue moves
                pause = max(hint / 1000, 0.001) if hint >= 0 else self.lock_ttl
                if queued:  # come back before our place in the queue lapses
                    pause = min(pause, WAITER_LEASE / 2)
                yield Sleep(handle[1], min(pause, remaining), self.name, handle)
        except BackendUnavailable as exc:
            unanswered = exc.timed_out
            raise
        finally:
            try:
                if waiter and not attempt.acquired:
                    leave = by_deadline(deadline, self._op_leave(waiter))
                    yield from leave_waiters(self.backend, waiter, leave, unanswered)
            finally:  # an interrupt in the leave too: a wake-up for the id runs the leave
                yield Unwatch(handle)

    def _record(
        self,
        owner: str,
        actor: str,
        token: str,
        ttl_ms: int,
        attempt: Attempt,
        adopted: float | None = None,
        sent: float | None = None,
        kept: bool = False,
    ) -> Hold:
        """Make ``owner``'s a hold the backend granted (or that :meth:`adopt` took over): in
        the object, counted as taken by its actor (a renewed exclusive hold), one level more
        (a reentrant owner's count too), and on the watchdog's schedule. Returns the hold;
        the caller announces it (:meth:`_announce_held`).

        All or nothing, so that nothing reports a hold that nobody renews. An exception at
        any step (an interrupt too: KeyboardInterrupt, a signal handler's exception) undoes
        the steps before it (:meth:`_unrecord`) and comes out: the object then holds what it
        held before (a new hold: ``token`` None, not taken, not renewed; a re-entry: the
        level and the count as they were), so a retry works. The caller gives the grant
        back: :meth:`_acquire` releases it (:meth:`_hand_back`), :meth:`_adopt` leaves it to
        the holder it came from (renewed by it, or run out at its TTL). Once this returns,
        the hold is complete: an exception in the announcement leaves it held and renewed.

        The steps, in order: (a reentrant owner's) this object's levels counted in the
        owner's count, the hold into the object with one level (or one level more: the
        owner's count with it, one store), counted as taken, ``lost`` cleared, on the
        renewer's schedule (``soon``; ``add`` for an adoption, in the renewer before adopt()
        returns; a re-entry's ``soon`` too: its take set the TTL again). Each undo works from
        the state the step left (idempotent), whichever steps ran."""
        with self._mutex:
            hold = self._holds.get(owner)
            was = (hold, 0 if hold is None else hold.depth, self._lost)
            renewer = None if hold is None else hold.renewer
            try:
                if self.reentrant:
                    holds_levels(self.backend, self.name, owner, self)
                if hold is None:
                    # Into the object with its level: one store (a hold without a level
                    # would be reported held, and its release would give back another's).
                    hold = Hold(token, attempt.fence, actor, depth=1, prior=attempt.prior,
                                stamps=(new_stamp(),), kept=kept)  # fmt: skip
                    if self.max_hold is not None:  # the cap counts from here, extend or not
                        hold.stop_at = time.monotonic() + self.max_hold
                    if not self.auto_renew or hold.stop_at is not None:  # it runs out itself
                        renewed_to = hold.stop_at if self.auto_renew else None
                        hold.ends_by = (renewed_to or time.monotonic()) + ttl_ms / 1000
                    self._holds[owner] = hold
                    if self.exclusive and hold.ends_by is None:
                        # An exclusive hold renewed for good (plain or reentrant): a plain wait
                        # of the same actor with no timeout would wait for it for ever, so it
                        # is refused at once. One that runs out by itself (not renewed, or
                        # capped) is waited for: the server may end it before this process's
                        # clock says (a clock step, a restart), and a refusal then is wrong.
                        hold.taken = take(self.backend, self.name, actor, self)
                else:
                    # The level's stamp first: cut short before the depth, the stamp names a
                    # level not held (a debt naming the old one is then never paid: safe).
                    hold.stamps = (*hold.stamps[: hold.depth], new_stamp())
                    hold.depth += 1
                self._lost = None
                if self.auto_renew and hold.renewer is None:
                    self._renew_from_now(hold, ttl_ms, adopted, sent)
                elif was[0] is not None and hold.renewer is not None:
                    # A re-entry set this object's TTL again: it is the one set last, which
                    # a hold shared with another object follows (review wdc3, 2).
                    renewal = self._renewal(hold.token, ttl_ms)
                    lives = _actor() if self.reentrant else None
                    hold.renewer.soon(self, renewal, hold.stop_at, lives, sent)
                taking = _TAKING.get()()
                if taking is not None and taking.lock is self:
                    taking.recorded = hold  # (last: before it, an interrupt unrecords)
            except BaseException:
                self._unrecord(owner, hold, renewer, *was)
                raise
        return hold

    def _renew_from_now(
        self, hold: Hold, ttl_ms: int, adopted: float | None, sent: float | None = None
    ) -> None:
        """Put ``hold`` on the watchdog's schedule (:meth:`_record`'s step), dated from
        ``sent`` (when its take was sent; None: now)."""
        # One watchdog thread renews sync and asyncio holds alike: it outlives any event
        # loop, so a hold taken in a short-lived loop (asyncio.run) is still renewed.
        hold.renewer = thread_renewer
        renewal = self._renewal(hold.token, ttl_ms)
        if adopted is not None:
            # In the renewer before adopt() returns (the old object may be collected
            # next), on the schedule of the TTL adopt() set at ``adopted`` (a batch of
            # the old object's that lands after it is renewed again: see renewer.py).
            thread_renewer.add(self, renewal, hold.stop_at, adopted)
        else:
            # A reentrant hold is renewed while its owner lives (see renewer.py).
            lives = _actor() if self.reentrant else None
            thread_renewer.soon(self, renewal, hold.stop_at, lives, sent)

    def _unrecord(
        self,
        owner: str,
        hold: Hold | None,
        renewer: Any,
        held: Hold | None,
        depth: int,
        lost: str | None,
    ) -> None:
        """Undo the steps of :meth:`_record` that ran (called locked): ``held``, ``depth``,
        ``lost`` and ``renewer`` are what the object had before. A new hold leaves the
        object, the taken count and the renewer (its news, if sent, is dropped: the
        renewer asks :meth:`renewed_by` first); a re-entry goes back to its depth. A
        renewer that renewed the hold before goes on (an adoption's entry may be shared by
        another object of the token: only this one leaves it)."""
        if hold is None:
            return  # interrupted before anything
        if held is None:
            if self._holds.get(owner) is hold:
                del self._holds[owner]
            self._untake(hold)
        if renewer is None:
            self._stop_renewing(hold)
        hold.depth = depth
        self._lost = lost

    def _announce_held(self, hold: Hold, attempt: Attempt, observed: bool = False) -> None:
        """A hold just recorded: metrics, span (unless ``observed`` already), log and
        ``lock_acquired`` for a new one."""
        if attempt.count_or_wait == 1:  # a new hold, not a re-entry
            if not observed:
                observe.hold_started(self, hold)
            if logger.isEnabledFor(logging.DEBUG):  # describe() is not free
                logger.debug("redlock: acquired %s, fence %s", self.describe(), attempt.fence)
            if lock_acquired.receivers:  # none, mostly: the call alone costs every hold
                lock_acquired.send_robust(sender=type(self), lock=self, fence=attempt.fence)

    def took(
        self,
        token: str,
        fence: int | None,
        ttl_ms: int,
        prior: str | None = None,
        sent: float | None = None,
    ) -> None:
        """Internal API (``lock_all``): record a new hold, ``token``'s with ``fence``, taken
        for this object by another operation (one script for several names), as if
        :meth:`acquire` had taken it: renewed by the watchdog, signalled, counted. Only on a
        plain (not reentrant) lock that holds nothing; LockError otherwise, nothing recorded.
        ``sent``: when the take was sent (the watchdog dates the hold from it; None: now).
        """
        if self.reentrant or not self.exclusive or "" in self._holds:
            raise LockError(f"{self.describe()}: took() records a new plain hold only")
        attempt = Attempt(True, fence, 1, prior)
        hold = self._record("", owner_id(), token, ttl_ms, attempt, sent=sent)
        self._announce_held(hold, attempt)

    def release_steps(self) -> Steps[None]:
        """Internal API (``lock_all``): the steps of :meth:`release`, for a caller that runs
        several holds' releases together (one pipelined round trip). Each yielded step is a
        backend ``Op``; the same errors as :meth:`release` come out."""
        return self._release()

    def use_token(self, token: str) -> None:
        """Internal API (``compat``'s ``token=``): the next acquire takes its hold with
        ``token``, as a retry after a lost reply does (the try is then idempotent: it finds
        the hold if that token took it already). The caller checks the token first."""
        self._unsure_token, self._token_given = token, True

    def acquire_steps(self, blocking: bool, timeout: float | None) -> Steps[bool]:
        """Internal API (``lock_view``): the steps of :meth:`acquire`, for a caller that
        picks its driver (:func:`~.steps.drive` in a sync view that may run where an event
        loop is running). ``blocking`` and ``timeout`` are as :meth:`acquire` checked them."""
        return self._acquire(blocking, timeout)

    def ttl_steps(self) -> Steps[float | None]:
        """Internal API (``lock_view``): the steps of :meth:`ttl`."""
        return self._ttl()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take it; wait up to ``timeout`` seconds (None: forever) when ``blocking``.

        In a running event loop only a non-blocking try is allowed here: await
        :meth:`aacquire` instead.
        """
        blocking, timeout = self._check_acquire(blocking, timeout)
        self._check_sync_wait(blocking, timeout)
        return self._take(blocking, timeout)

    async def aacquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        self.check_async()
        blocking, timeout = self._check_acquire(blocking, timeout)
        if self.reentrant:
            self._refuse_a_task_of_its_own(inspect.currentframe())
        return await self._atake(blocking, timeout)

    def _refuse_a_task_of_its_own(self, frame: Any) -> None:
        """A reentrant hold belongs to the task that takes it. An ``aacquire()`` that is the
        whole of its task (``asyncio.wait_for`` before Python 3.12, ``gather``,
        ``create_task``) would be held by a task that ends as it returns: True, yet nobody
        could ever release it or see it as theirs. LockError, before any Redis call."""
        task = asyncio.current_task()
        if task is not None and getattr(task.get_coro(), "cr_frame", None) is frame:
            raise LockError(
                f"{self.describe()}: this aacquire() runs as a task of its own (asyncio.wait_for"
                " before Python 3.12, gather, create_task), which would own the reentrant hold"
                " and end at once; await it in the task that uses the lock, with"
                " aacquire(timeout=...) or `async with asyncio.timeout(...)`"
            )

    # -- release, extend, adopt --------------------------------------------------------------

    def current_hold(self, owner: str | None = None) -> tuple[str, Hold]:
        """The current owner and its hold, with the fence a re-fence through another object
        gave it (internal: a fenced block's start). No I/O: LockLost when it was declared
        lost, else LockNotOwned when this owner holds nothing here. ``owner``: another than
        the current one (a release finished on its behalf)."""
        owner = self._owner() if owner is None else owner
        hold = self._holds.get(owner)
        if hold is None:
            if self._lost is not None:
                raise LockLost(f"{self.describe()} was lost: {self._lost}")
            raise LockNotOwned(f"{self.describe()} is not held by this owner")
        return owner, self._catch_up(hold)

    def refencer(self, hold: Hold) -> Callable[[int], int]:
        """``hold``'s re-fence for a fenced block (internal: :mod:`~django_redlock.fencing`
        calls it when the lock's row holds a fence above the hold's). One round trip
        (:meth:`~.backends.base.BaseLockBackend.op_refence`): the new fence, which the hold
        takes; or 0 (nobody holds the lock) or -1 (another hold does) when the hold is not
        current. No answer raises (BackendUnavailable, QuorumNotReached): unknown is not
        stale, and the transaction rolls back all the same."""

        def refence(recorded: int) -> int:
            backend = self.backend
            client_us = time.time_ns() // 1000  # the new fence is above it (refence_least)
            op = backend.op_refence(self.name, hold.token, recorded, client_us)
            try:
                fence = backend.execute(op)
            except BaseException:
                if self.reentrant:  # it may have re-fenced: the owner's next re-entry may say so
                    refenced(backend, self.name, hold.token, None)
                raise
            if fence > 0:
                hold.fence = fence
                if self.reentrant:  # every object holding levels of the owner's hold takes it
                    refenced(backend, self.name, hold.token, fence)
            return fence

        return refence

    def _catch_up(self, hold: Hold) -> Hold:
        """A reentrant owner's hold is one hold in Redis, whichever objects hold levels of
        it: take the fence a re-fence through another object gave it (never a lower one)."""
        if self.reentrant and hold.fence is not None:
            fence, _ = refence_of(self.backend, self.name, hold.token)
            if fence > hold.fence:
                hold.fence = fence
        return hold

    def _stop_renewing(self, hold: Hold) -> None:
        renewer, hold.renewer = hold.renewer, None  # first: a hold still pending stays out
        if renewer is not None:
            renewer.remove(self, hold.token)

    def _untake(self, hold: Hold) -> None:
        """Not counted as taken any more: released, lost, or no longer renewed (it runs out)."""
        if hold.taken is not None:
            handle, hold.taken = hold.taken, None
            untake(handle)

    def _forget(self, owner: str, hold: Hold) -> bool:
        """Drop a hold from this object (called locked); False if it was gone already."""
        if self._holds.get(owner) is not hold:
            return False
        del self._holds[owner]
        if self.reentrant and hold.depth > 0 and not hold.releasing:
            self._orphans[owner] = hold.depth  # lost under nested levels still to release
        self._stop_renewing(hold)
        self._untake(hold)
        observe.hold_ended(self, hold)
        hold.depth = 0  # out of the owner's count already: out of the object
        return True

    def _let_go(self, owner: str, hold: Hold) -> None:
        """The rest of :meth:`_forget` for a hold already out of ``_holds`` whose forgetting
        an exception cut short (called locked): each step only if not done yet."""
        if self.reentrant and hold.depth > 0 and owner not in self._orphans:
            self._orphans[owner] = hold.depth
        self._stop_renewing(hold)
        self._untake(hold)
        hold.depth = 0

    def renewed_by(self, renewer: Renewer, token: str) -> bool:
        """Whether a hold with this token is held and meant to be renewed by ``renewer``
        (internal: the watchdog's protocol, :class:`~django_redlock.renewer.Lock`)."""
        held = self._holds  # mostly empty: released before the renewer looked
        if not held:
            return False
        # One copy: the owners' threads change the dict meanwhile (threads sharing a read lock).
        return any(h.token == token and h.renewer is renewer for h in list(held.values()))

    def _release(self, owner: str | None = None) -> Steps[None]:
        owner = self._owner() if owner is None else owner  # (given: finished on its behalf)
        found = self._holds.get(owner)
        if found is None and self._orphans.get(owner):
            with self._mutex:
                self._orphans[owner] -= 1
                if self._orphans[owner] <= 0:
                    del self._orphans[owner]
            raise LockLost(f"{self.describe()} was lost: {self._lost or 'it expired'}")
        if found is None or self.reentrant:  # else current_hold()'s answer: nothing to catch up
            owner, found = self.current_hold(owner)
        hold = found
        if hold.releasing and self.reentrant:
            yield from self._finish_unsure_release(owner, hold)
            return
        if hold.depth <= 1:
            # Whatever the release's fate (Redis may not answer), stop renewing: at worst
            # the hold runs out at its TTL, and release() can be called again meanwhile.
            self._stop_renewing(hold)
            with self._mutex:
                self._untake(hold)
        # A retry of a release whose outcome was unknown: a token found gone is then no loss.
        was_releasing, depth = hold.releasing, hold.depth
        left: int | None = None  # the server's answer, once it came
        try:
            if self.reentrant and not self._release_settles:  # else settled by the release
                yield from self._settle(owner)
            if hold.depth <= 1:
                # Marked before it is sent: a renewal (the watchdog's, a leader's keeper's)
                # answered "gone" from now on met this release, no loss; one answered before
                # is still reported (mark_lost compares the times).
                hold.release_began = time.monotonic()
            if self.reentrant:
                self._unlevel(owner, hold)
            left = yield self._op_release_hold(hold)
            with self._mutex:
                mine = self._holds.get(owner) is hold  # else lost meanwhile, declared then
                if mine:
                    if not self.reentrant:
                        hold.depth = 0
                    if left <= 0 or hold.depth <= 0:
                        self._forget(owner, hold)
        except BaseException:
            if left is not None and (left <= 0 or not self.reentrant):
                # Interrupted once the server answered: the name is released (or was
                # gone), so the hold is not reported held (forgetting twice is nothing).
                with self._mutex:
                    hold.depth = 0
                    self._forget(owner, hold)
            elif left is None and not self.reentrant:
                # No answer, or interrupted while one was on its way (KeyboardInterrupt, a
                # time limit): the release may have gone through. Kept for a retry, which is
                # then no loss if it finds the token gone.
                hold.releasing = True
                with self._mutex:
                    hold.depth = 0
                observe.hold_unsure(self, hold)  # not a hold this process holds any more
            elif left is None:
                if hold.depth == depth:
                    # Before the level left the object (the settle got no answer, or an
                    # interrupt): out now, as if sent, so that an object dropped after this
                    # error counts for nothing; the owner's next operation settles.
                    self._unlevel(owner, hold)
                if hold.releasing and not was_releasing:
                    observe.hold_unsure(self, hold)  # a reentrant last level, out already
            # Else a reentrant level answered, out of the object before it was sent: the
            # count stays unsure, and the owner's next operation settles it (a no-op).
            raise
        if self.reentrant:  # (a plain lock keeps no count)
            self._sure(owner)  # the answer is in the object: the counts agree again
        if left < 0 and not was_releasing:
            reason = "it expired or was released by someone else"
            if mine:  # whoever took the hold out of this object declares the loss: once
                self._declare_lost(reason)
            raise LockLost(f"{self.describe()} was lost before release: {self._lost or reason}")
        if left <= 0:
            self._announce_released()

    def _claim_owed(self, left: _LeftWith) -> bool:
        """Claim the hold of an owed level (see :class:`_LeftWith`): renewed no more, then
        ``releasing`` (one store, under the mutex, only if still ``due``), so that exactly
        this hold is released, once, whoever comes first (its payer, the owner's next
        acquire). False if it was not due (paid, claimed, or the hold gone). No I/O."""
        hold = left.hold
        if not left.due():
            return False
        # First: cut short after it, the level is still owed, and claimed again later.
        self._stop_renewing(hold)
        with self._mutex:
            if not left.due():
                return False
            hold.depth, hold.releasing = 0, True  # claimed: the object's next acquire ends it
            # A renewal in flight answered "gone" from now on met this release: no loss.
            hold.release_began = time.monotonic()
            self._untake(hold)
        return True

    def _pay_owed(self, left: _LeftWith) -> Steps[None]:
        """The payer's release of an owed level: that hold's own token, never whatever the
        object holds by then; unanswered, it stays ``releasing`` for the next acquire."""
        self._claim_owed(left)  # (or claimed already: an acquire cut short before its release)
        hold = left.hold
        if not left.claimed():
            return  # not owed (paid, or the hold gone): never whatever the object holds now
        try:
            answer = yield self._op_release_hold(hold)
        except BaseException:
            observe.hold_unsure(self, hold)  # not a hold this process holds any more
            raise
        with self._mutex:
            mine = self._forget(left.owner, hold)  # (else finished by its next acquire)
        if mine and answer == 0:
            self._announce_released()

    def _watch_with(self, token: weakref.ref[Any]) -> None:
        """Watch the ``with`` statement whose exit token is ``token`` (see :class:`_LeftWith`):
        the level just taken, owed should the statement be left with it held."""
        if self.reentrant:
            # Not a reentrant kind: its levels' ``with`` statements may end out of order
            # (generators, threads sharing a read lock) and no level is one statement's.
            return
        owner = self._owner()
        hold = self._holds.get(owner)
        if hold is None or hold.depth < 1:
            return
        payer = _payer_for(self.using)
        left = _LeftWith(self, owner, hold, token, payer)
        if left.watch is not None:
            self._withs.append(left)
            payer.watch(left)

    def _exited(self) -> None:
        """The exit's release returned: its ``with`` (this owner's innermost one watched: an
        inner one is gone before) owes nothing, whatever the level count says then."""
        if self._withs:
            owner = self._owner()
            for left in reversed(self._withs):
                if left.owner == owner and not left.done:
                    left.done = True
                    return

    def _unlevel(self, owner: str, hold: Hold) -> None:
        """A reentrant release's level leaves the object before the release is sent (one
        store), the owner's count marked unsure first: whatever line an interrupt (a burst
        of them) ends the release on, the owner's next operation tells the server what the
        objects hold, releasing the level if it was not. A nested level counts as released
        (sent again, the release could free the lock under the outer levels); the last is
        kept, ``releasing``, for a retry (:meth:`_finish_unsure_release`: it settles, no
        second release), and is no hold this process holds any more."""
        self._unsure(owner)
        with self._mutex:
            if hold.depth > 1:
                hold.depth -= 1
            else:  # one store: both or neither
                hold.depth, hold.releasing = 0, True

    def _announce_released(self) -> None:
        """A hold freed: the log and ``lock_released``."""
        if logger.isEnabledFor(logging.DEBUG):  # describe() is not free
            logger.debug("redlock: released %s", self.describe())
        if lock_released.receivers:  # none, mostly: the call alone costs every release
            lock_released.send_robust(sender=type(self), lock=self)

    def _finish_unsure_release(self, owner: str, hold: Hold) -> Steps[None]:
        """A reentrant release retried after no answer: its level is already out of the
        count this process believes, so settling that count is the whole release, whether
        the server ran the first one or not. Sent again, the release would count twice
        and could free the name under a level the owner still holds. Never a loss: a
        count gone on the server is settled as nothing."""
        yield from self._settle(owner)
        with self._mutex:
            self._forget(owner, hold)
        if not believed(self.backend, self.name, owner):
            self._announce_released()

    def release(self) -> None:
        """Release one hold; LockNotOwned (or its subclass LockLost) if it is not ours.

        If Redis does not answer, the error is raised and the hold is kept: call
        ``release()`` again (a release that had in fact gone through is then no loss).
        """
        self._drive(self._release())

    async def arelease(self) -> None:
        await self._adrive(self._release())

    def _extend(self, ttl: float | None) -> Steps[None]:
        seconds = check_ttl(ttl)
        owner, hold = self.current_hold()
        ttl_ms = to_ms(self.lock_ttl if seconds is None else seconds)
        yield from self._settle(owner)
        renewer, renewal = hold.renewer, self._renewal(hold.token, ttl_ms)
        # On its way, a shorter TTL is renewed on its schedule: Redis may run it any time
        # before the answer comes, which may come after another extend's (review wdc3, 1).
        flight = renewer.sending(self, renewal) if renewer is not None else None
        try:
            yield from self._extend_sent(hold, seconds, ttl_ms, renewal, flight)
        finally:
            if renewer is not None:
                renewer.landed(self, renewal, flight)  # (told already, mostly: a no-op)

    def _extend_sent(
        self,
        hold: Hold,
        seconds: float | None,
        ttl_ms: int,
        renewal: Renewal,
        flight: int | None,
    ) -> Steps[None]:
        sent = time.monotonic()  # a renewal settled after this may have landed after it
        try:
            extended = yield self._op_extend(hold.token, ttl_ms)
        except BaseException:
            # No answer: Redis may have set this TTL, shorter maybe (review wdc2, 1).
            self._unsure_ttl(hold, ttl_ms, flight)
            raise
        if not extended:
            # When the answer came: a release begun after it (another thread's) did not cause it.
            found = time.monotonic()
            self.mark_lost(hold.token, "it expired or was released by someone else", found=found)
            if hold.releasing or hold.release_began is not None:
                raise LockNotOwned(f"{self.describe()} was released")
            raise LockLost(f"{self.describe()} could not be extended: {self._lost}")
        if seconds is not None:
            self.lock_ttl = seconds
        if hold.ends_by is not None:  # it runs out later now
            hold.ends_by = max(hold.ends_by, time.monotonic() + ttl_ms / 1000)
        if hold.renewer is not None:
            # The owner too: this may reach the renewer before the acquire's own news does.
            lives = _actor() if self.reentrant else None
            hold.renewer.add(self, renewal, hold.stop_at, sent, lives, flight)

    def _unsure_ttl(self, hold: Hold, ttl_ms: int, flight: int | None = None) -> None:
        """A command of ``hold``'s token that may have set ``ttl_ms`` got no answer: the
        watchdog renews it as if it had (at once, on that TTL's schedule, if shorter).
        ``flight``: the extend's number from the renewer's ``sending``."""
        if hold.renewer is not None and hold.token:
            lives = _actor() if self.reentrant else None
            renewal = self._renewal(hold.token, ttl_ms)
            hold.renewer.unsure(self, renewal, hold.stop_at, lives, flight)

    def extend(self, ttl: float | None = None) -> None:
        """Reset the hold's TTL to ``ttl`` seconds (default: the lock's) from now on."""
        self._drive(self._extend(ttl))

    async def aextend(self, ttl: float | None = None) -> None:
        await self._adrive(self._extend(ttl))

    def _adopt(self, token: Any) -> Steps[None]:
        if not isinstance(token, str) or not token:
            raise TypeError(f"token must be a non-empty str, not {token!r}")
        if self.reentrant:
            raise LockError(f"{self.describe()}: a reentrant hold belongs to its owner")
        if "" in self._holds:
            raise LockError(f"{self.describe()} is already held by this object")
        fence = yield self._op_fence_of(token)
        if fence is None:
            raise LockNotOwned(f"{self.describe()}: token {token!r} holds nothing")
        attempt = Attempt(True, fence or None, 0)
        # The server's TTL is the last holder's, set at a time unknown here: ours is set
        # before adopt() returns (so a later extend() of ours is never overtaken by it).
        ttl_ms = to_ms(self.lock_ttl)
        renewal = self._renewal(token, ttl_ms)
        # On its way, our TTL (shorter maybe) is renewed on its schedule if this process
        # renews the hold (review wdc4, 1).
        flight = thread_renewer.sending(self, renewal)
        try:
            sent = time.monotonic()
            try:
                extended = yield self._op_extend(token, ttl_ms)
            except BaseException:
                # No answer: it may have set our TTL on the old holder's hold (review wdc2, 2).
                thread_renewer.unsure_hold(self.backend, renewal, flight)
                raise
            if not extended:
                raise LockNotOwned(f"{self.describe()}: token {token!r} holds nothing")
            self._record("", owner_id(), token, ttl_ms, attempt, adopted=sent)  # (no announce)
        finally:
            thread_renewer.landed(self, renewal, flight)

    def _op_fence_of(self, token: str) -> Op[int | None]:
        """The fence of ``token``'s hold (0 if it has none), None if it holds nothing."""

        def parse(info: LockInfo | None) -> int | None:
            if info is None or info.token != token:
                return None
            return info.fence or 0

        op = self._op_inspect()
        return Op(op.name, op.request, lambda reply: parse(op.parse(reply)))

    def adopt(self, token: str) -> None:
        """Become the holder of an existing hold by its token (e.g. taken by another process,
        to extend or release it here); ``LockNotOwned`` if it holds nothing. The adopting
        object renews it from now on (``auto_renew``), with its own TTL. The holder it came
        from may renew it on until it lets go of its object: a renewal never shortens a
        hold, so its TTL does not cut the adopter's short."""
        self._drive(self._adopt(token))

    async def aadopt(self, token: str) -> None:
        await self._adrive(self._adopt(token))

    def _declare_lost(self, reason: str) -> None:
        """The backend answered that a hold's token holds nothing: tell everyone."""
        self._lost = reason
        self._announce_lost(reason)

    def _announce_lost(self, reason: str) -> None:
        """The loss's notification: metrics, a warning, ``lock_lost`` (receivers run here)."""
        observe.lost(self)
        logger.warning("redlock: %s lost: %s", self.describe(), reason)
        lock_lost.send_robust(sender=type(self), lock=self, reason=reason)

    def mark_lost(
        self,
        token: str,
        reason: str,
        later: Callable[[Callable[[], None]], None] | None = None,
        found: float | None = None,
    ) -> None:
        """``token``'s hold is gone: decided here, under the mutex, so once per object (the
        hold leaves the object: ``owned()`` is False, ``lost`` says why, from now on). The
        notification runs now, or is handed to ``later`` (the watchdog's notifier thread).
        Internal: the watchdog's protocol (:class:`~django_redlock.renewer.Lock`) and this
        class's own queries; only for an answer that the token holds nothing. ``found``:
        when that answer came (monotonic; None: now); one that came once this object's
        release began is that release's doing, no loss.

        An exception after the hold left the object and before its declaration was handed
        over leaves the loss noted as undeclared: telling the object again (the watchdog
        does, until a telling returns) hands it over then, once. (One landing inside the
        hand-over after ``later`` queued it, before it returned, could declare it twice.)
        Told by two threads at once (on Cluster each shard's renewal worker tells every
        loss queued), the one handing it over declares it, the other returns."""
        me = threading.current_thread()
        with self._mutex:
            owner = next((o for o, h in self._holds.items() if h.token == token), None)
            if owner is None:
                if token not in self._undeclared:
                    return  # gone already, and declared (or our own release)
                reason, owner, hold, teller = self._undeclared[token]
                if teller is not None and teller is not me and teller.is_alive():
                    return  # being handed over by that thread (it was declared twice)
                self._undeclared[token] = (reason, owner, hold, me)
                self._let_go(owner, hold)  # what the interrupted telling may not have done
                self._lost = reason
            else:
                hold = self._holds[owner]
                began = hold.release_began
                if not hold.releasing and began is not None and (found is None or found >= began):
                    # Answered once our release was sent (``found``: when; None, now): that
                    # release's answer decides, the hold stays for it (-1: a loss before it).
                    return
                if not hold.releasing:  # first: from here on the loss is this object's
                    self._undeclared[token] = (reason, owner, hold, me)
                self._forget(owner, hold)
                if hold.releasing:  # our own release, whose reply was lost, freed it
                    return
                self._lost = reason
        try:
            if later is None:
                self._announce_lost(reason)
            else:
                later(functools.partial(self._announce_lost, reason))
        except BaseException:
            with self._mutex:  # not handed over: the next telling, whoever's, does it
                undeclared = self._undeclared.get(token)
                if undeclared is not None:
                    self._undeclared[token] = (*undeclared[:3], None)
            raise
        self._undeclared.pop(token, None)

    # -- queries -----------------------------------------------------------------------------

    def _owned(self) -> Steps[bool]:
        hold = self._holds.get(self._owner())
        if hold is None:
            return False
        # An error (no answer) propagates: unknown is not lost.
        if (yield self._op_hold_count(hold.token)) > 0:
            return True
        self.mark_lost(hold.token, "it expired or was released by someone else")
        return False

    def owned(self) -> bool:
        """Whether this owner holds it, as Redis says now."""
        return self._drive(self._owned())

    async def aowned(self) -> bool:
        return await self._adrive(self._owned())

    def _hold_count(self) -> Steps[int]:
        hold = self._holds.get(self._owner())
        if hold is None:
            return 0
        return cast(int, (yield self._op_hold_count(hold.token)))

    def hold_count(self) -> int:
        """How many times this owner holds it now (0: not at all)."""
        return self._drive(self._hold_count())

    async def ahold_count(self) -> int:
        return await self._adrive(self._hold_count())

    def _locked(self) -> Steps[bool]:
        return cast(bool, (yield self._op_locked()))

    def locked(self) -> bool:
        """Whether anyone holds it."""
        return self._drive(self._locked())

    async def alocked(self) -> bool:
        return await self._adrive(self._locked())

    def _ttl(self) -> Steps[float | None]:
        pttl = yield self._op_pttl()
        return None if pttl is None else pttl / 1000

    def ttl(self) -> float | None:
        """Seconds left on the current hold of this name (whoever holds it); None if free."""
        return self._drive(self._ttl())

    async def attl(self) -> float | None:
        return await self._adrive(self._ttl())

    @property
    def fence(self) -> int | None:
        """The fencing token of this owner's current hold; None when not held."""
        hold = self._holds.get(self._owner())
        return None if hold is None else self._catch_up(hold).fence

    @property
    def token(self) -> str | None:
        """The token of this owner's current hold (None when not held)."""
        hold = self._holds.get(self._owner())
        return None if hold is None else hold.token

    @property
    def lost(self) -> str | None:
        """Why the last hold was lost, or None."""
        return self._lost

    # -- with, async with, decorator ---------------------------------------------------------

    def _not_acquired(self) -> LockNotAcquired:
        waited = "" if self.timeout is None else f" within {self.timeout:g} s"
        return LockNotAcquired(f"{self.describe()} could not be acquired{waited}")

    def _timeout(self) -> float | None:
        return self.timeout if self.blocking else None

    def __enter__(self: B) -> B:
        # A fenced block tells from the ``with`` statement's frame (this call's caller, taken
        # here, not counted from further down) when its ``with`` is gone.
        # First: its exit token (fencing.TrackedExit) before anything looks up an __exit__.
        # A plain ``with``: its exit token too, so that a statement left as its exit began (a
        # signal handled at the exit's entry) releases its level all the same (_LeftWith).
        frame = getattr(inspect.currentframe(), "f_back", None)
        where = fencing.with_frame(frame, self) if self.database else None
        token = None if self.database else fencing.with_exit_token(frame, self)
        timeout = self._timeout()
        self._check_sync_wait(self.blocking, timeout)
        if self.database is not None:  # autocommit off: refused before the lock is taken
            fencing.drop_abandoned(self.database)  # (not a block's leftover transaction)
            fencing.refuse_manual_commit(self.database, self.describe())
        undo = self._undo_take()
        if not drive(self.backend, self._acquire(self.blocking, timeout), undo):
            raise self._not_acquired()
        # One line, as __exit__'s: an interrupt on any line from here on, the ``with`` block
        # never entered, hands the hold back (a fenced block's own failures release it).
        try: return self._entered(where, token)  # noqa: E701  # fmt: skip
        except BaseException:
            undo_take(self.backend, undo)
            raise

    def _entered(self: B, where: fencing.With | None, token: weakref.ref[Any] | None) -> B:
        if self.database is not None:
            # Returned as it is opened: no line between the block's opening and the ``with``
            # (an exception there would leave the block's transaction open, its exit never run).
            return fencing.enter_block(self, where)
        if token is not None:
            self._watch_with(token)
        return self

    @fencing.tracked_exit
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The try on one line holds from its first instruction: an exception a signal handler
        # raises on any line of the exit (Celery's soft time limit) still ends a fenced block
        # (rolled back; once committed, it returns) and releases (fencing.leave_failed).
        # First, no call before it: a fenced block's exit began (should every line of it be
        # cut short, the thread's next block rolls it back: fencing.drop_abandoned).
        try: self.fenced_withs -= self.database is not None; return self._exit(exc_type, exc, tb)  # noqa: E701, E702  # fmt: skip
        except BaseException as error: return self._exit_failed(error)  # noqa: E701  # fmt: skip

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.database is not None:
            return fencing.leave_block(self, exc_type, exc, tb)
        try:
            self._drive(self._release())
        except LockNotOwned:
            if exc_type is None:
                raise
            # The body's own exception says more; the loss is logged.
        self._exited()

    def _exit_failed(self, error: BaseException) -> None:
        if self.database is None:
            raise error
        fencing.leave_failed(self, error)

    #: ``with`` blocks of this object open (``atomic=``: fencing.enter_block counts them in).
    fenced_withs = 0

    def atomic(self, using: str | None = None) -> AbstractContextManager[None]:
        """This held lock's fenced transaction: ``transaction.atomic(using=using)`` (default:
        the lock's ``atomic=`` database, else Django's default) whose first statement records
        the hold's fence in the lock's row and keeps that row locked until the transaction
        ends; ``StaleFence`` (nothing committed) when a later hold's fence is recorded there.
        ``LockNotOwned`` (or ``LockLost``) when not held, before the database is touched."""
        return fencing.fenced_transaction(self, using)

    def check_async(self) -> None:
        """Internal API (``lock_view``): LockError when this lock cannot be used in an event
        loop at all (``atomic=``: Django's transactions are synchronous)."""
        if self.database is not None:
            raise LockError(
                f"{self.describe()} opens a database transaction (atomic={self.database!r}),"
                " and Django's transactions are synchronous: run the locked code in a thread,"
                " e.g. `await sync_to_async(locked_function)()` with the lock taken there"
            )

    async def __aenter__(self: B) -> B:
        self.check_async()
        undo = self._undo_take()
        if not await adrive(self.backend, self._acquire(self.blocking, self._timeout()), undo):
            raise self._not_acquired()
        try: return self  # noqa: E701  # fmt: skip
        except BaseException:
            undo_take(self.backend, undo)
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is GeneratorExit and finisher.must_hand_over():
            # Closed (its loop torn down with the task pending, the task collected): nothing
            # can be awaited, and this may run in a finalizer (review asy, 2 and 4).
            self.release_closed()
            return
        try:
            await finisher.arelease_exiting(self)
        except LockNotOwned:
            if exc_type is None:
                raise

    def release_closed(self) -> None:
        """Internal API (``async with``, ``lock_all``, ``lock_view``). The coroutine holding
        this lock is being closed (GeneratorExit), maybe by the collector, maybe with no loop
        running: the hold it has now is released on the finisher thread, soon after, unless
        let go by then. No I/O here. A reentrant lock's owner is a task's, which cannot be
        told at a close: nothing is handed over (docs/topics/asyncio.md)."""
        if self.reentrant:
            return
        hold = self._holds.get("")  # decided now: the object may hold again by then
        if hold is not None:
            finisher.hand(functools.partial(self._finish_closed_release, hold))

    def _finish_closed_release(self, hold: Hold) -> None:
        # Not sent to a backend a finish just found not answering: the hold runs out at its TTL.
        try:
            finish_now(self.backend, lambda: drive(self.backend, self._release_recorded("", hold)))
        except LockError:
            # Not sent, or unanswered: no owner will try again. Left here, the hold would be
            # renewed for as long as the object lives (review asy3 3), and the object would
            # say it holds: it runs out at its TTL instead.
            with self._mutex:
                self._forget("", hold)
            raise

    def finish_release_later(self) -> None:
        """Internal API (``async with``, ``lock_all``'s too). A cancellation (often a second
        one) interrupted the release, e.g. while it waited for a pooled connection: the
        release is unknown, and renewal has stopped. Finish it in a task of its own, acting
        as this owner, instead of leaving the hold to run out at its TTL while the next
        waiter waits."""
        owner = self._owner()
        hold = self._holds.get(owner)
        if hold is None or not hold.releasing:  # released, or a nested level (counted)
            return
        # That hold's release, decided now: the task runs a loop turn later or more, and the
        # object may have finished it and taken a new hold by then, in another thread (review
        # asy3 6: the new one was released under its holder).
        again = functools.partial(self._release_again, owner, hold)
        self._finish_later(self._release_recorded(owner, hold), again)

    def _release_again(self, owner: str, hold: Hold) -> Steps[None]:
        """A release whose finishing task was cancelled, sent once more unless done since."""
        if self._holds.get(owner) is hold and hold.releasing:
            yield from self._release(owner)

    def _finish_later(self, steps: Steps[None], again: Callable[[], Steps[None]]) -> None:
        """Drive ``steps`` (a release) in a task of their own, acting as this owner; should
        that task be cancelled, ``again`` is driven as it ends (:meth:`_release_finished`), or
        by the finisher should its loop be closed with it pending (no done-callback runs)."""
        once_more = functools.partial(self._release_once_more, again)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # No loop: the finisher runs a closed coroutine's steps (a hand-back cut there).
            # Finished here and now, as a cancelled task's would be (review asy3 7).
            steps.close()
            once_more()
            return
        task = finisher.finishing_task(loop, self._adrive(steps), once_more)
        lend_owner(task)
        task.add_done_callback(functools.partial(self._release_finished, once_more))

    def _release_finished(self, once_more: Callable[[], None], task: asyncio.Task[None]) -> None:
        if task.cancelled():
            # asyncio.run's (or asgiref's) shutdown cancels every task, this one too, before
            # it sent anything: the hold would stay to its TTL, held by nobody. Finished here,
            # synchronously (each round trip bounded by the socket timeout); nothing else of
            # the loop runs meanwhile. A done-callback runs from the loop's own turn, never
            # from a finalizer (a task collected pending calls none), so its I/O is allowed.
            once_more()
        elif task.exception() is not None:
            self._unfinished(task.exception())

    def _release_once_more(self, again: Callable[[], Steps[None]]) -> None:
        # Not sent once a finish found the backend not answering (steps.finish_now).
        try:
            finish_now(self.backend, lambda: drive(self.backend, again()))
        except Exception as exc:
            self._unfinished(exc)

    def _unfinished(self, error: BaseException | None) -> None:
        if not isinstance(error, LockNotOwned):  # it runs out at its TTL
            what = self.describe()
            logger.warning("redlock: %s: finishing an interrupted release: %s", what, error)

    def _with_name(self: B, name: str) -> B:
        return type(self)(name, **self._init_kwargs())

    def __call__(self, func: F) -> F:
        """Use as a decorator: the name is a ``str.format`` template over the arguments.

        An async callable (any: templates.py's rule) gets an async wrapper that awaits it
        while the lock is held; a sync call that returns an awaitable or a generator anyway
        is refused (TypeError, nothing of it run) before the release."""
        decorator = f"@{self.noun}(...)"
        refuse_generator(func, decorator)
        name_for = name_template(self.name, inspect.signature(func), callable_name(func))
        if is_async_callable(func):  # the rule: templates.py, "async callables"
            self.check_async()

            @functools.wraps(func)
            async def locked_acall(*args: Any, **kwargs: Any) -> Any:
                async with self._with_name(name_for(args, kwargs)):
                    result = func(*args, **kwargs)
                    return await result if inspect.isawaitable(result) else result

            return cast(F, locked_acall)

        @functools.wraps(func)
        def locked_call(*args: Any, **kwargs: Any) -> Any:
            held = self._with_name(name_for(args, kwargs))
            result = None
            try:
                with held:
                    result = func(*args, **kwargs)
                    refuse_generator_result(result, func, decorator)
            except Exception as error:
                # A signal handler's exception once the exit returned committed (CPython runs
                # it on the ``with`` line): returning, as the exit would have. A second one
                # here (a burst), on the call's first line: asked again, logged or not.
                try: left = fencing.left_committed(held)  # noqa: E701  # fmt: skip
                except Exception: left = fencing.left_committed(held)  # noqa: E701  # fmt: skip
                if not left:
                    raise error
                try: fencing.log_after_exit(held.describe(), error)  # noqa: E701, SIM105  # fmt: skip
                except Exception: pass  # noqa: E701  # fmt: skip
            return result

        return cast(F, locked_call)
