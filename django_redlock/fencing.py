"""Fenced transactions: a lock's critical section that ends at the database.

A fenced block is ``transaction.atomic(using=...)``, opened once the lock is held, whose first
statement records the hold's fence in the lock's row of :class:`~.models.Fence` and checks it
at once: ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` on PostgreSQL and SQLite, which also
keeps the row locked until the transaction ends. A row with a larger fence raises
:class:`~.exceptions.StaleFence` before the body runs. So, per lock, committed fenced
transactions are in fence order, a stale holder never commits, and a holder's body starts only
once the previous holder's transaction ended, whatever became of that hold in Redis.

The block is a state machine (docs/topics/fencing.md draws it): waiting in Redis, holding,
row locked, committed, released. Its one rule for callers: **a block that raises committed
nothing; a block that returns committed** (a savepoint, inside an outer transaction), save
``CommitOutcomeUnknown``: the COMMIT did not answer and the rows cannot prove either way (and
an interrupt, which says "stop"). So:

* the wait for the row is bounded (:func:`row_wait`): a cycle through Redis and the database
  (one thread holds a lock in Redis and waits for a row, the other holds the row and waits
  in Redis) is invisible to both, and would never end;
* a transaction the body left unable to commit (PostgreSQL's aborted state after a caught
  error, Django's ``needs_rollback``, SQLite's own rollback inside the body) is rolled back
  and raised, never reported as committed;
* a COMMIT whose reply was lost or interrupted (any exception out of it) is settled from the
  lock's row, read on a new connection (:func:`commit_outcome`): the block's upsert wrote its
  fence and mark there, in the same transaction, and a later block's keeps both in
  ``previous`` and ``previous_mark``; nested blocks of the row write the outer block's mark;
  other blocks of the same hold (other threads, a process that adopted it) make a mark other
  than its own prove nothing (:class:`_Seen`);
  an ``Exception`` during that read (a soft time limit) has it asked again (:func:`_check`),
  never raised as "nothing committed";
* blocks exited out of order by hand are refused and rolled back (Django's exits would mix
  their savepoints up); a connection with autocommit off is refused;
* once the COMMIT happened (a first robust ``on_commit`` marks it), nothing is raised as if it
  had not: an ``on_commit`` callback's error is logged, and a lost hold at the release too
  (the lost-hold rule: raising would invite a retry, which would apply the work twice);
* an exception a signal handler raises on any line of the exit (a soft time limit) is
  caught from the exit's first instruction (:class:`FencedTransaction`, :func:`leave_failed`):
  before the COMMIT, rolled back and raised; after it, logged (an interrupt goes on); the
  lock released at once either way. One CPython handles once ``__exit__`` returned, on the
  caller's ``with`` line, no exit can catch: the decorator forms, which own that line, ask
  :func:`left_committed` (the exit's last step records it) and return; a caller's own
  ``with`` raises it (docs/topics/fencing.md, "After the exit returned");
* a block a burst of such exceptions abandoned (its opening, or its exit's clean-up, Django's
  ``Atomic.__exit__`` included, cut short at every line), or one such exception as its
  ``__exit__`` was entered, leaves its transaction (or savepoint) open: whatever opened it,
  it is rolled back and its lock released the moment its ``with`` statement is left, before
  the code after it runs (:func:`drop_left_scopes`, told by the statement's exit token:
  :class:`TrackedExit`), not when the block is collected; cut short again, the thread's next
  block as it opens (:func:`drop_abandoned`) or the request's or task's end does it, rather
  than run as a savepoint of it and return "committed" with nothing ever committed.
  Abandoned: its ``with`` statement (recorded by every entry, :func:`with_frame`) is over,
  returned or runs past its body (:func:`_with_left`);
* a nested block whose savepoint exit Django did not finish (it pops the savepoint's id before
  it releases the savepoint) is rolled back to its savepoint, or, when the savepoint may be
  released already, the outer transaction is marked for rollback (:func:`_undo_savepoint`):
  a block that raised never has its writes commit with the outer transaction;
* a block's release is owed before it is tried (:func:`owe`): cut short (a burst) or
  unanswered, the thread's next block or the request's or task's end makes it, for that very
  hold only.

The SQL of the fence table (record and check, the read after a lost COMMIT, pruning) is
:mod:`.fence_table`'s; this module runs the block around it.
"""

from __future__ import annotations

import collections
import contextlib
import dis
import functools
import inspect
import logging
import secrets
import signal
import sys
import threading
import types
import weakref
from collections.abc import Callable, Generator
from types import CodeType, FrameType, TracebackType
from typing import Any, NoReturn, Protocol, TypeVar, cast

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    connections,
    transaction,
)
from django.db.transaction import TransactionManagementError

from . import exit_bound, fence_table
from .exceptions import CommitOutcomeUnknown, LockError, LockLost, LockNotOwned
from .fence_table import check_fence, commit_outcome, pid_of
from .fence_table import prune_fences as prune_fences  # its old path

logger = logging.getLogger("django_redlock")


class FencedHold(Protocol):
    """What a fenced block reads and writes of a hold (``locking.holds.Hold``)."""

    fence: int | None
    token: str
    prior: str | None
    depth: int
    releasing: bool
    stamps: tuple[int, ...]  # one per level held, new each time the level is taken


class FencedLock(Protocol):
    """What a fenced block asks of its lock (``locking.base.BaseLock``: the locking layer sits
    above this module and hands itself in; this module never imports it)."""

    name: str
    using: str
    database: str | None
    blocking: bool
    timeout: float | None
    lock_ttl: float
    fenced_withs: int  # its ``with`` blocks open: counted in here, out as their exit begins

    @property
    def exclusive(self) -> bool: ...

    def describe(self) -> str:
        """How messages name the lock."""

    def current_hold(self) -> tuple[str, FencedHold]:
        """This owner's hold; LockNotOwned or LockLost when there is none (no I/O)."""

    def refencer(self, hold: Any) -> Callable[[int], int]:
        """``hold``'s re-fence: see :meth:`~.locking.base.BaseLock.refencer`."""

    def release(self) -> None: ...


Held = TypeVar("Held", bound=FencedLock)


def database_of(atomic: Any) -> str | None:
    """The database alias ``atomic=`` names (True: Django's default), or None for no fenced
    transaction. Checked when the lock is built, before any Redis call."""
    if atomic is None or atomic is False:
        return None
    if atomic is True:
        return DEFAULT_DB_ALIAS
    if not isinstance(atomic, str):
        raise TypeError(f"atomic must be True, False or a DATABASES alias (str), not {atomic!r}")
    return check_database(atomic)


def check_database(alias: str) -> str:
    known = list(connections)
    if alias not in known:
        raise ValueError(
            f"atomic={alias!r} names no database: DATABASES has {', '.join(map(repr, known))}"
        )
    return alias


def _check_wait(lock: FencedLock) -> float:
    """The outcome check's wait (its bound less the slack; an outermost exit's bound too)."""
    return min(max(row_wait(lock), 5.0), 60.0)


def row_wait(lock: FencedLock) -> float:
    """How long a block waits for its lock's row (seconds): ``timeout=`` when the lock has
    one, else the lock's TTL; ``blocking=False``: not at all. The row is locked by another
    transaction only when the previous holder's transaction outlived its hold (released early
    inside an outer transaction, lost, or paused in its block): past this wait, the lock is
    treated as busy (``LockNotAcquired``), which also breaks a wait cycle through Redis."""
    if not lock.blocking:
        return 0.0
    return lock.timeout if lock.timeout is not None else lock.lock_ttl


#: The last exit token a ``with`` statement of this thread took (the object's id, a weak
#: reference to the bound exit). Per thread: a ``with`` statement looks ``__exit__`` up and
#: calls ``__enter__`` at once, in its thread; kept on the object, a token another thread's
#: statement stored between the two (one object shared by threads) was read as this one's,
#: and the statement watched was another thread's.
_exit_tokens = threading.local()


class TrackedExit:
    """A context manager's ``__exit__`` whose lookup by a ``with`` statement hands it a new
    callable, kept on that statement's stack (and nowhere else) until the statement is left,
    however (its exit ran, an exception entering it, the frame gone): a weak reference to it
    dies at that moment. That tells one run of a statement from a later run of the same
    statement in the same frame (a loop), or from a later call reusing the frame's id, which
    the frame's position cannot. A bound method, not a ``functools.partial``: CPython checks
    for pending signals after a call to a C callable returns, in the caller's frame, which
    widened the window after the exit (nor does any frame of its own keep a bound method alive
    in a traceback). It does not close it: a signal arriving after the exit's last check for
    signals is handled on the caller's ``with`` line once the exit returned, whatever the exit
    is (see :func:`left_committed`)."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func

    def __get__(self, obj: Any, cls: Any = None) -> Callable[..., Any]:
        if obj is None:  # ``type(cm).__exit__`` (ExitStack): the function
            return self.func
        bound = types.MethodType(self.func, obj)
        _exit_tokens.last = (id(obj), weakref.ref(bound))
        return bound


_Exit = TypeVar("_Exit", bound=Callable[..., Any])


def tracked_exit(func: _Exit) -> _Exit:
    """Decorate a context manager's ``__exit__`` as a :class:`TrackedExit`."""
    return cast(_Exit, TrackedExit(func))


class _Committed:
    """Set by the block's first ``on_commit`` callback (robust: it cannot fail): Django runs
    the callbacks after the COMMIT, in order, so once this is set the COMMIT happened. (Set
    too when a lost COMMIT's outcome check proved it; and, nested in an outer transaction, as
    Django's exit of its savepoint returns from the ``RELEASE SAVEPOINT``: its writes are the
    outer transaction's from then on, so nothing after that raises "nothing committed".)
    ``pending``: the COMMIT was sent and its outcome not yet settled: an ``Exception``
    escaping the block then says "unknown"."""

    done = False
    pending = False
    steps: weakref.ReferenceType[Generator[None, None, None]] | None = None  # the block's
    # Its ``with`` holds it: its opening returned to the ``with``, and its exit has not begun
    # (``with lock``: nor that of the lock's ``with`` at ``level``, its own).
    live = False
    lock: FencedLock | None = None
    level = 0
    _where: Any = None
    _watch: weakref.ReferenceType[Any] | None = None
    # Opened by the same ``with`` (``lock_all``'s other members: savepoints of this one), and
    # what frees its locks, should that ``with`` abandon it: see :func:`drop_abandoned`.
    nested: tuple[_Committed, ...] = ()
    abandon: Callable[[], None] | None = None
    gives_back: tuple[FencedLock, ...] = ()  # (the locks ``abandon`` releases)
    using: str | None = None  # its database, once its transaction (or savepoint) is opened
    atomic: weakref.ReferenceType[Any] | None = None  # (its Django ``Atomic``)
    # The detached list whose cut loop :func:`_run_rest` found cut with none raising: the
    # rest is due, decided once (a later call sees the list it changed: review f4, 1).
    rest_of: list[Any] | None = None

    def __init__(self) -> None:
        # Django logs a robust callback's error with its ``__qualname__``: without one, that
        # log raised AttributeError and every later callback of the transaction was dropped.
        self.__qualname__ = "django_redlock.fencing._Committed"

    def __call__(self) -> None:
        self.done = True

    @property
    def where(self) -> Any:
        """Its ``with`` statement (:func:`with_frame`), if known."""
        return self._where

    @where.setter
    def where(self, where: Any) -> None:
        self._where, self._watch = where, None
        bound = where[3]() if where is not None and where[3] is not None else None
        if bound is not None:  # told the moment its ``with`` is left (see _with_gone)
            self._watch = weakref.ref(bound, _with_gone(weakref.ref(self)))


def _with_gone(committed: weakref.ReferenceType[_Committed]) -> Callable[[Any], None]:
    """Called as a block's ``with`` statement is left (its exit token dies: the statement's
    stack entry is dropped as the statement ends, before the code after it runs): every block
    of the thread whose ``with`` is left and whose exit never ended it (an exception as its
    ``__exit__`` was entered, a burst cutting the exit short) is rolled back and its lock
    released at once, whatever opened it (:func:`drop_left_scopes`). Later is too late: in
    an outer transaction, the outer ``Atomic``'s exit would take the block's savepoint for its
    own, or the ``except`` clause's writes would land in the abandoned savepoint (and be
    rolled back with it); in its own transaction, the handler's autocommit writes would land
    in the abandoned transaction."""

    def gone(_: Any) -> None:
        # A weakref callback cannot raise: what fails here is left to the thread's next
        # block or the request's end (an interrupt goes to sys.unraisablehook).
        with contextlib.suppress(Exception):
            drop_left_scopes()

    return gone


def fenced_transaction(lock: FencedLock, using: str | None = None) -> FencedTransaction:
    """``lock.atomic(using)``: see :meth:`~.locking.base.BaseLock.atomic`; docs/topics/fencing.md
    tabulates every way out. Its steps: :func:`_fenced_steps`; its exit:
    :class:`FencedTransaction`."""
    return FencedTransaction(lock, using)


class FencedTransaction:
    """A fenced block as a context manager, whose exit holds against an exception a signal
    handler raises on any of its lines (Celery's soft time limit, ``SIGALRM``): one that lands
    before the block's exit ran rolls it back and goes on (nothing committed); once the
    COMMIT happened, an ``Exception`` is logged and the block returns (raising would invite a
    retry that applies the work twice), a ``BaseException`` goes on."""

    def __init__(self, lock: FencedLock, using: str | None = None) -> None:
        self.lock = lock
        self.committed = _Committed()
        self.by_lock = False  # opened by ``with lock`` (enter_block), which marks it live
        self.depth = 0  # ``with lock``: the hold's depth once it opened this block
        self.left = False  # ``with lock``: committed or rolled back, and released
        self.exit_debts: list[_Debt] = []  # ``with lock``: its release, owed as its exit began
        self.exit_watch: weakref.ReferenceType[Any] | None = None  # (see _owe_until_left)
        self._steps = _fenced_steps(lock, using, self.committed)
        self.committed.steps = weakref.ref(self._steps)

    # Each try below is on one line with what it runs: it then holds from the line's first
    # instruction (a ``try:`` line of its own is an instruction before the protected range,
    # where an exception raised on that line would escape it).
    def __enter__(self) -> None:
        try: self._open()  # noqa: E701  # fmt: skip
        except BaseException as error: self._stop(error)  # noqa: E701  # fmt: skip

    def _open(self) -> None:
        if not self.by_lock:  # ``with lk.atomic()``, run_held's: the caller of __enter__
            self.committed.where = with_frame(frame_above(2), self)
        next(self._steps)
        if not self.by_lock:  # ``with lk.atomic()``: the ``with`` has it from here on
            self.committed.live = True

    @tracked_exit
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.committed.live = False  # its exit began (not a call: nothing interrupts it)
        try: return self._leave(exc)  # noqa: E701  # fmt: skip
        except BaseException as error: return self._settle(error)  # noqa: E701  # fmt: skip

    def _stop(self, error: BaseException) -> NoReturn:
        """An exception as the block opened: rolled back with it, if it had opened."""
        steps = self._steps
        if inspect.getgeneratorstate(steps) == inspect.GEN_SUSPENDED:
            with contextlib.suppress(StopIteration):
                steps.throw(error)
        raise error

    def _leave(self, exc: BaseException | None) -> bool:
        """Resume the steps after the body (``contextlib.contextmanager``'s exit)."""
        if exc is None:
            try:
                next(self._steps)
            except StopIteration:
                return False
            raise RuntimeError("a fenced block's steps did not stop")
        try:
            self._steps.throw(exc)
        except StopIteration as stop:
            return stop is not exc
        except BaseException as raised:
            if raised is exc:
                return False  # the body's exception goes on: ``with`` raises it
            raise
        raise RuntimeError("a fenced block's steps did not stop after an exception")

    def _settle(self, error: BaseException) -> bool:
        """``error`` came out of the exit: the block's outcome, or an exception that landed on
        a line of the exit. Before the steps resumed: they roll back with it. Once committed:
        an ``Exception`` is logged, and the block returns."""
        steps = self._steps
        if inspect.getgeneratorstate(steps) == inspect.GEN_SUSPENDED:
            with contextlib.suppress(StopIteration):
                steps.throw(error)  # rolled back: raises (nothing of it committed)
        if self.committed.done and isinstance(error, Exception):
            logger.warning("redlock: %s: its fenced transaction committed; then %s: %s (logged,"
                           " not raised: the block returns)", self.lock.describe(),
                           type(error).__name__, error)  # fmt: skip
            return False
        if self.committed.pending and isinstance(error, Exception):
            # Landed while the COMMIT's outcome was being settled (a signal handler's, on a
            # line the check's retry does not cover): not "nothing committed".
            cut = "was not answered, and its outcome check was cut short"
            raise _unknown(self.lock.describe(), error, cut) from error
        raise error


def _fenced_steps(
    lock: FencedLock, using: str | None, committed: _Committed
) -> Generator[None, None, None]:
    """The fenced block's steps, up to the body (``yield``) and after it.

    Raises (nothing committed): ``StaleFence``; ``LockNotAcquired`` when the row stayed
    locked past :func:`row_wait`; the body's exception; ``TransactionManagementError`` when
    the body left the transaction unable to commit; the database's error when the COMMIT
    failed. Returns once committed: an ``on_commit`` callback's ``Exception`` is then logged,
    not raised (a ``BaseException`` such as ``KeyboardInterrupt`` still propagates).

    Any ``Exception`` out of the outermost transaction's exit before the commit marker ran (a
    lost connection; an exception a signal handler raised while the COMMIT's reply was late,
    which Django turns into ``ProgrammingError``; the COMMIT's own error, save PostgreSQL's
    error reply, which proves the rollback: :func:`_refused`) leaves the COMMIT's outcome to
    be learnt: :func:`~.fence_table.commit_outcome` reads the lock's row on a new
    connection. Committed: the block returns (a warning logged; its ``on_commit`` callbacks
    did not run). Not committed: the exception, as it came. Not provable either way:
    ``CommitOutcomeUnknown``. An ``Exception`` raised during the check (a signal handler's)
    has it asked once more: its answer stands; cut short again, ``CommitOutcomeUnknown``."""
    if not lock.exclusive:
        raise TypeError(
            f"{lock.describe()} is shared by several holders at once: a fenced transaction"
            " needs an exclusive lock (a lock, or the write of a read-write lock)"
        )
    using = check_database(using) if using is not None else lock.database or DEFAULT_DB_ALIAS
    _drop_abandoned(using)  # a block whose steps ended and left their transaction open
    refuse_manual_commit(using, lock.describe())
    _owner, hold = lock.current_hold()  # LockNotOwned / LockLost, before the database is touched
    if hold.fence is None:
        raise LockError(f"{lock.describe()}: this hold has no fencing token to record")
    outermost = not connections[using].in_atomic_block  # its exit is the COMMIT
    outer_savepoints = len(connections[using].savepoint_ids)
    # An exception already being handled where the block runs (it runs in an ``except:``) is
    # not one that interrupted this block's COMMIT.
    handled = sys.exc_info()[1]
    # With the fence, this block's mark in the row. A block nested in one of the same row (a
    # re-entry, lk.atomic() inside) writes the outer block's mark: the outer COMMIT's outcome
    # check looks for it.
    marks, row = _marks(), (using, lock.using, lock.name)
    _forget_ended(marks)
    outer = marks.get(row)
    outer_mark = None if outer is None else outer[0]
    mark = _new_mark() if outer_mark is None else outer_mark
    own_mark = outer_mark is None
    if own_mark:  # with its block's steps: told from one a burst left behind (_forget_ended)
        marks[row] = (mark, committed.steps)
    # This process's other blocks of the row (other threads' blocks of the same hold write
    # the same fence with their own marks): what the outcome check may conclude from them.
    seen = _open_block(row[1:], mark) if own_mark else None
    fence, again, exiting, misnested, pid = hold.fence, False, False, False, None
    proved_hooks: list[Callable[[], None]] = []
    hooks: list[Any] | None = None  # the list Django's loop takes the callbacks from
    entries: list[Any] = []  # its entries as the COMMIT is sent (the loop pops from the front)
    scope: _Scope | None = None
    # Until the except path's steps ran: the block's end runs them (a burst cut that path).
    late = outermost
    kept: list[Any] = []  # its callbacks the close of an unfinished exit took off (see below)
    proved_late = ""  # the block's end proved the COMMIT: its callbacks, from where (prove_late)

    def prove_late(proved: list[Callable[[], None]], kept: list[Any]) -> None:
        """The except path's outcome check, at the block's end, when a burst cut that path
        short before it decided: the COMMIT sent, not known to have committed (else the
        block said "unknown" with no check made, its callbacks dropped: review f4, 4). Then,
        proved, its callbacks run (again, should that be cut short: each once)."""
        nonlocal proved_late
        connection = connections[using]
        undecided = exiting and committed.pending and not committed.done
        if undecided and isinstance(sys.exc_info()[1], Exception):  # (an interrupt stands)
            if connection.in_atomic_block or _begun_unknown(using):
                return  # no COMMIT sent: the transaction is rolled back as abandoned
            if not kept:
                _drop_unfinished(using, committed, kept)
            ended = seen.ended if seen is not None else ()
            outcome, _stopped = _check(lambda: commit_outcome(
                using, lock.using, lock.name, fence, mark, again,
                _check_wait(lock), pid, ended_marks=ended,
            ))  # fmt: skip
            if outcome is None:
                return  # unknown: said as the exit settles
            if not outcome:
                committed.pending = False  # settled: the rows prove it never committed
                _drop_own_hooks(using, committed)
                return
            # Where its callbacks are, decided once (run again after a cut: each once).
            pending = _pending_hooks(using, committed)
            proved_late = "kept" if kept else "pending" if pending else "proved"
            committed.done = True  # first, as on the except path
            logger.warning("redlock: %s: the COMMIT of its fenced transaction was cut short,"
                           " its outcome check too; asked at the block's end, the lock's row"
                           " proves that it committed", lock.describe())  # fmt: skip
        if proved_late == "kept":
            _run_kept(lock.describe(), using, kept, committed)
        elif proved_late == "pending":
            _run_pending(lock.describe(), using, committed)
        elif proved_late == "proved" and proved:
            hooks_proved = list(proved)
            proved.clear()  # (once: run again after a cut, it would run twice)
            _run_proved(lock.describe(), hooks_proved)

    try:
        atomic = transaction.atomic(using=using)
        committed.using, committed.atomic = using, weakref.ref(atomic)
        if outermost:  # known as a fenced block's, should its exit never run (drop_abandoned)
            _opened()[using] = (weakref.ref(atomic), committed)
        bound = _check_wait(lock) + fence_table.CHECK_SLACK
        postgres = outermost and connections[using].vendor == "postgresql"
        scope = _Scope(
            atomic, using, committed, nested=not outermost, bound=bound if postgres else 0.0
        )
        with scope:
            _live().append(committed)  # open: rolled back should its ``with`` abandon it
            depth = len(connections[using].savepoint_ids)  # atomic() blocks opened inside
            again = check_fence(using, lock.using, lock.name, hold.fence, lock.describe(),
                                lock.refencer(hold), wait=row_wait(lock), token=hold.token,
                                prior=hold.prior, mark=mark)  # fmt: skip
            # The fence this block wrote (its check may have re-fenced the hold): the outcome
            # is asked with it, not with the hold's fence at the end, which a block nested on
            # another database may have re-fenced again (that row is not this one).
            fence = hold.fence
            pid = _backend_pid(using) if outermost else None  # whose COMMIT may be in flight
            transaction.on_commit(committed, using=using, robust=True)  # first: marks COMMIT
            try:
                yield
            finally:  # blocks exited out of order, by hand: Django's exits mix them up
                inside = len(connections[using].savepoint_ids) - depth
                misnested, late = inside > 0, outermost and inside <= 0
            if inside:
                where = "before a block opened inside it" if misnested else "after its outer one"
                raise LockError(
                    f"{lock.describe()}: its fenced block was left {where} (exited out of"
                    " order, by hand): rolled back, nothing committed"
                )
            refuse_unfinished(using, lock.describe())
            proved_hooks = _proved_hooks(using) if outermost else []  # this transaction's
            hooks = connections[using].run_on_commit if outermost else None
            entries = _watch_hooks(hooks) if hooks is not None else []
            exiting = committed.pending = outermost  # from here on, only the COMMIT can fail
        if hooks is not None and not hooks and hooks is not connections[using].run_on_commit:
            _run_uncalled(lock.describe(), entries, committed)  # Django's loop ran them all
    except BaseException as exc:
        if misnested and connections[using].in_atomic_block:
            # Django's exit rolled back to the inner block's savepoint and kept the
            # transaction open: marked for rollback, the inner blocks' exits commit nothing.
            connections[using].needs_rollback = True
        elif outermost and (connections[using].in_atomic_block or _begun_unknown(using)):
            # Django's enter or exit was cut short before it left the transaction (an
            # exception from a signal handler on its first lines), or its enter after the
            # driver began one and before Django knew: no COMMIT was sent, and the
            # transaction would stay open, the next block a savepoint of it.
            committed.pending = False
            _abandon(using)
            raise
        elif not outermost and not misnested and scope is not None and not scope.exited:
            # The same, nested: Django's exit of the block's savepoint did not finish (cut
            # short, or never run): the block's writes must not commit with the outer
            # transaction. Rolled back to the savepoint here, or, if it may have been
            # released already, the outer transaction marked for rollback.
            _undo_savepoint(using, outer_savepoints, scope)
        cut_loop = False  # Django's loop over the callbacks cut, none raising: the rest ran
        if outermost and not misnested and isinstance(exc, Exception):
            cut_loop = _run_rest(lock.describe(), using, hooks, entries, exc, committed)
        late = False
        began = committed.done and not cut_loop  # the callbacks had begun: one raised
        if outermost and not misnested and _commit_answered(using):
            _finish_autocommit(lock.describe(), using, committed)  # its callbacks run
        if committed.done and not began and isinstance(exc, Exception):
            logger.warning("redlock: %s: its fenced transaction committed; then %s: %s as"
                           " Django's exit ended (logged, not raised: the block returns)",
                           lock.describe(), type(exc).__name__, exc)  # fmt: skip
            return
        if committed.done:
            if not isinstance(exc, Exception):
                raise  # an interrupt after the COMMIT: it stands, and the interrupt goes on
            # The COMMIT happened (nested: the savepoint was released into the outer
            # transaction, which commits the block's writes); an on_commit callback, or a
            # signal handler, raised after it. Raising now would say "not committed" and
            # invite a retry that applies the work twice.
            logger.exception(
                "redlock: %s: its fenced transaction committed%s; then %s (logged, not raised:"
                " the block returns)",
                lock.describe(),
                "" if outermost else " into the outer transaction",
                "an on_commit callback raised" if outermost else "an exception",
            )
            return
        if outermost:  # an exit cut short (the COMMIT's, a rollback's) leaves it unusable
            _drop_unfinished(using, committed, kept)
        if not exiting:  # rolled back: nothing committed
            if outermost:  # its callbacks, should Django's rollback have kept them
                _drop_own_hooks(using, committed)
            interrupt = _interrupt_in(exc, handled)
            if isinstance(exc, DatabaseError) and interrupt is not None:
                raise interrupt from None  # Django's rollback had made it a database error
            raise
        # A block nested on this row and re-fenced after this one's check wrote a larger
        # fence with this block's mark: found all the same (the mark is the proof).
        ended = seen.ended if seen is not None else ()
        outcome: bool | None
        stopped: Exception | None
        if _refused(exc, using, handled):  # the server answered: rolled back, nothing to ask
            outcome, stopped = False, None
        else:
            outcome, stopped = _check(lambda: commit_outcome(
                using, lock.using, lock.name, fence, mark, again,
                _check_wait(lock), pid, ended_marks=ended,
            ))  # fmt: skip
        interrupt = _interrupt_in(exc, handled)
        if interrupt is not None:
            # "Stop", not "failed": the interrupt goes on, whatever the outcome (logged).
            said = {True: "it committed", False: "nothing committed", None: "UNKNOWN"}
            logger.warning(
                "redlock: %s: %s interrupted the COMMIT of its fenced transaction: %s",
                lock.describe(),
                type(interrupt).__name__,
                said[outcome],
            )
            if interrupt is exc:
                raise
            raise interrupt from None  # Django's exit had made it a database error
        if outcome is None:
            committed.pending = False  # settled: unknown, said below
            _drop_own_hooks(using, committed)  # as Django drops them when the COMMIT fails
            if stopped is not None:
                cut = "was not answered, and its outcome check was cut short twice"
                raise _unknown(lock.describe(), stopped, cut) from stopped
            raise _unknown(lock.describe(), exc, f"on database {using!r} did not answer") from exc
        if not outcome:
            committed.pending = False  # settled: the rows prove it never committed
            _drop_own_hooks(using, committed)
            if stopped is not None:
                raise stopped from exc  # it said "stop": nothing committed, proven
            raise
        committed.done = True  # first: an exception from here on finds it committed
        # Still pending on the connection (Django's exit cut short after the COMMIT, before
        # it ran them), or taken off it as it was closed above after the driver's COMMIT had
        # answered (review f3, 3): they run below, the latter from ``kept`` (the close
        # cleared the connection's list; put back on it, an exception before they ran left
        # them to its next connect(), which clears it: review f4, 2), again at the block's
        # end should this be cut short. Else Django dropped them with the connection.
        pending = bool(kept) or _pending_hooks(using, committed)
        logger.warning(
            "redlock: %s: the COMMIT of its fenced transaction %s (%s: %s), yet the lock's row"
            " proves that it committed%s",
            lock.describe(),
            "did not answer" if isinstance(exc, DatabaseError) else "was cut short",
            type(exc).__name__,
            exc,
            "" if pending else " (its on_commit callbacks did not run)",
        )
        if stopped is not None:  # committed: raising it would invite a retry (logged)
            logger.warning("redlock: %s: %s interrupted the outcome check of its fenced"
                           " transaction, asked again: it committed (logged, not raised)",
                           lock.describe(), type(stopped).__name__)  # fmt: skip
        if kept:
            _run_kept(lock.describe(), using, kept, committed)  # before the release, as Django
        elif pending:
            _run_pending(lock.describe(), using, committed)  # before the release, as Django
        else:
            _run_proved(lock.describe(), proved_hooks)  # before the release, as on_commit's
    finally:
        # First, on one line (see FencedTransaction), and again should it be cut short: a mark
        # left behind would be every later block's of the row on this thread (whose outcome
        # check would take this block's write for its own). The rest, skipped by an
        # exception, is cleaned up later (the block's steps are over).
        # Then the rest, each step after the one before it however that ended: one
        # exception (a soft time limit) skips no step.
        try: _forget_mark(marks, row, own_mark, seen)  # noqa: E701  # fmt: skip
        finally:
            try: _forget_mark(marks, row, own_mark, seen)  # noqa: E701  # fmt: skip
            finally:
                # A plain callback raised after robust ones a signal cut (see _run_rest): those
                # run, even after a second soft time limit cut the except path (twice: one
                # landing as it is entered). So do those Django's loop, cut, left to
                # _run_rest when the except path was cut before it. Before the wrappers forget
                # their calls.
                try: _run_left(lock.describe(), using, hooks, entries, committed, late, kept)  # noqa: E701  # fmt: skip
                finally:
                    try: _run_left(lock.describe(), using, hooks, entries, committed, late, kept)  # noqa: E701  # fmt: skip
                    finally:  # (twice: an exception as it is entered would skip all of it)
                        try: prove_late(proved_hooks, kept)  # noqa: E701  # fmt: skip
                        finally:
                            try: prove_late(proved_hooks, kept)  # noqa: E701  # fmt: skip
                            finally:
                                try: _let_go(using, committed, outermost, hooks, entries, proved_hooks)  # noqa: E501, E701  # fmt: skip
                                finally: _let_go(using, committed, outermost, hooks, entries, proved_hooks)  # noqa: E501, E701  # fmt: skip
        del hooks, entries, proved_hooks, kept
        with contextlib.suppress(ValueError):
            _live().remove(committed)
        if outermost:  # the transaction ended as it should: nothing to roll back later
            _ended_clean(using)


def _let_go(
    using: str,
    committed: _Committed,
    outermost: bool,
    hooks: list[Any] | None,
    entries: list[Any],
    proved: list[Callable[[], None]],
) -> None:
    """The block's end, each step run whatever the one before it raised: the block's frame
    lives on in a raised exception's traceback (kept by a reference cycle, an error reporter,
    a test), and a callback a rollback (or Django's rule) dropped must be freed at once: its
    finalizer may hold a key (dedupe_queued's). So must the frames of this module's helpers
    an exception left on that traceback (``_watch_hooks``'s entry, for one)."""
    try:
        committed.where = None  # (not kept alive by the block)
        if outermost and not committed.done:  # (again, should the except path be cut short)
            _drop_own_hooks(using, committed)
    finally:
        # Again, should a burst have cut the except path before it: Django's flag left off
        # (autocommit), its next atomic() a savepoint of nothing (review f3, 4).
        try: _drop_unfinished(using) if outermost else None  # noqa: E701  # fmt: skip
        finally:
            try: _forget_calls(using, hooks, entries); proved.clear()  # noqa: E701, E702  # fmt: skip
            finally:
                try: _forget_calls(using, hooks, entries); proved.clear()  # noqa: E701, E702  # fmt: skip
                finally: _clear_helper_frames(sys.exc_info()[1])  # noqa: E701  # fmt: skip


def _clear_helper_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames of this module's helpers on the tracebacks of
    ``error`` and the exceptions it chains (see :func:`_let_go`). No I/O."""
    helpers = _helper_codes()
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in helpers:
                with contextlib.suppress(RuntimeError):  # still running: left as it is
                    tb.tb_frame.clear()
            tb = tb.tb_next
        error = error.__context__ or error.__cause__


@functools.cache
def _helper_codes() -> frozenset[CodeType]:
    """The code of the helpers whose frames hold a block's callbacks or marks (and their
    comprehensions')."""
    funcs: list[Any] = [_watch_hooks, _proved_hooks, _forget_mark, _forget_calls,
                        _drop_own_hooks, _let_go, _Called.__init__, _Seen.close,
                        _run_before_raised, _raised_plain, _run_left,
                        _run_rest_late, _drop_unfinished, _run_kept]  # fmt: skip
    codes: set[CodeType] = set()
    todo = [func.__code__ for func in funcs]
    while todo:
        code = todo.pop()
        codes.add(code)
        todo.extend(const for const in code.co_consts if isinstance(const, CodeType))
    return frozenset(codes)


class _ProvedHook:
    """An ``on_commit`` callback that also runs when a lost COMMIT is proved committed."""

    def __init__(self, func: Callable[[], None]) -> None:
        self.func = func
        # Django logs a robust callback's error with its ``__qualname__`` (see _Committed).
        self.__qualname__ = getattr(func, "__qualname__", type(func).__qualname__)

    def __call__(self) -> None:
        self.func()


def on_commit_or_proved(func: Callable[[], None], using: str) -> None:
    """``transaction.on_commit(func, using, robust=True)``; in a fenced block whose COMMIT's
    reply was lost and whose row proved it committed (Django then runs no callback), ``func``
    runs too, before the release (an ``Exception`` from it logged), as it would have."""
    transaction.on_commit(_ProvedHook(func), using=using, robust=True)


def _proved_hooks(using: str) -> list[Callable[[], None]]:
    """The transaction's :func:`on_commit_or_proved` callbacks, read before its COMMIT
    (Django drops them when the COMMIT fails). No I/O."""
    pending = connections[using].run_on_commit
    return [entry[1] for entry in pending if isinstance(entry[1], _ProvedHook)]


def _run_proved(describe: str, hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception:
            logger.exception("redlock: %s: a callback of its fenced transaction, proved"
                             " committed, raised", describe)  # fmt: skip


def _forget_mark(
    marks: dict[tuple[str, str, str], Any],
    row: tuple[str, str, str],
    own: bool,
    seen: _Seen | None,
) -> None:
    if own:
        marks.pop(row, None)
    if seen is not None:
        seen.close()


def _check(ask: Callable[[], bool | None]) -> tuple[bool | None, Exception | None]:
    """A lost COMMIT's outcome check, and the ``Exception`` a signal handler raised during it
    (Celery's soft time limit, while the check waits for the row): then asked once more, as
    the exit's other steps are, since escaping would say "nothing committed" for a block that
    may have committed. Interrupted again: unknown (None). Each try on one line (see
    :class:`FencedTransaction`); an exception between them finds ``committed.pending``."""
    stopped: Exception | None = None
    try: return ask(), None  # noqa: E701  # fmt: skip
    except Exception as error: stopped = error  # noqa: E701  # fmt: skip
    try: return ask(), stopped  # noqa: E701  # fmt: skip
    except Exception: return _check_cut_short(stopped)  # noqa: E701  # fmt: skip


def _check_cut_short(stopped: Exception) -> tuple[None, Exception]:
    logger.warning("redlock: the outcome check of a lost COMMIT, asked again after %s, was cut"
                   " short: the outcome is unknown", type(stopped).__name__,
                   exc_info=True)  # fmt: skip
    return None, stopped


def _unknown(describe: str, error: BaseException, what: str) -> CommitOutcomeUnknown:
    return CommitOutcomeUnknown(
        f"{describe}: the COMMIT of its fenced transaction {what} ({type(error).__name__}:"
        f" {error}), and the database could not prove whether it committed: the outcome is"
        " UNKNOWN. Do not retry blindly: check what the block wrote first."
    )


def refuse_manual_commit(using: str, describe: str) -> None:
    """Raise ``LockError`` when the connection of ``using`` has autocommit off (Django's
    ``set_autocommit(False)``, or ``AUTOCOMMIT: False``): ``atomic()`` then neither starts
    nor commits a transaction, and a fenced block would return as committed with nothing
    committed. No I/O: called before the lock is taken."""
    connection = connections[using]
    if connection.in_atomic_block:  # an outermost atomic() found autocommit off: no COMMIT
        manual = not connection.commit_on_exit
    elif connection.connection is not None:
        manual = not connection.autocommit
    else:  # a new connection takes the setting
        manual = not connection.settings_dict.get("AUTOCOMMIT", True)
    if manual:
        raise LockError(
            f"{describe}: database {using!r}'s connection has autocommit off"
            " (transaction.set_autocommit(False), or AUTOCOMMIT: False): Django's atomic() then"
            " commits nothing, so a fenced transaction cannot end at a COMMIT; turn autocommit"
            " back on (or commit yourself, then use the lock without atomic=)"
        )


def _commit_answered(using: str) -> bool:
    """Whether Django's exit was cut short after its COMMIT answered, as it switched
    autocommit back on (before or after storing it) or was about to run the ``on_commit``
    callbacks: ``commit()`` returned (its flag for them is set, cleared once they ran). The
    COMMIT is proved: no outcome check. No I/O."""
    connection = connections[using]
    return bool(
        connection.connection is not None
        and not connection.in_atomic_block
        and connection.run_commit_hooks_on_set_autocommit_on
    )


def _finish_autocommit(describe: str, using: str, committed: _Committed) -> None:
    """Django's cut step, done again: autocommit on (the driver's switch is idempotent), then
    the ``on_commit`` callbacks, the block's marker first (see :func:`_run_loop`). An
    ``Exception`` from it (a callback's, another time limit) is logged; if the callbacks never
    started, the lost-COMMIT path settles the connection."""
    try:
        _run_loop(describe, using, committed, lambda: connections[using].set_autocommit(True))
    except Exception:
        logger.warning("redlock: %s: finishing Django's exit after its COMMIT answered raised",
                       describe, exc_info=True)  # fmt: skip


def _run_loop(describe: str, using: str, committed: _Committed, run: Callable[[], None]) -> None:
    """Django's loop over the callbacks, run again (by ``run``) after an exception cut its exit
    short: as after the first, those it took and never called (a signal handler's exception
    on a robust one's call line, which Django's ``try:`` swallows) run after it, the block's
    marker included (:func:`_run_uncalled`); an ``Exception`` out of it has the rest run by
    :func:`_run_rest`'s rule, then goes on."""
    connection = connections[using]
    hooks = connection.run_on_commit
    entries = _watch_hooks(hooks)  # (wrapped as the COMMIT was sent: the same wrappers)
    try:
        run()
        if not hooks and hooks is not connection.run_on_commit:
            _run_uncalled(describe, entries, committed)  # Django's loop ran them all
    except Exception as exc:
        _run_rest(describe, using, hooks, entries, exc, committed)
        raise


def _pending_hooks(using: str, committed: _Committed) -> bool:
    """Whether the block's transaction's ``on_commit`` callbacks are still pending on its
    connection, never run: its marker (registered first) among them. No I/O."""
    connection = connections[using]
    return not connection.in_atomic_block and any(
        entry[1] is committed for entry in connection.run_on_commit
    )


def _run_pending(describe: str, using: str, committed: _Committed) -> None:
    """Run them as Django would have after its COMMIT (see :func:`_run_loop`; an
    ``Exception`` from one logged)."""
    try:
        _run_loop(describe, using, committed, connections[using].run_and_clear_commit_hooks)
    except Exception:
        logger.exception("redlock: %s: a callback of its fenced transaction, proved committed,"
                         " raised", describe)  # fmt: skip


class _Called:
    """An ``on_commit`` callback of a fenced transaction, wrapped as its COMMIT is sent: it
    records what became of its call, for :func:`_run_rest` and :func:`_run_uncalled` (see
    :meth:`ran`). Not a flag set before the call: a signal handled between the flag and the
    call would leave the callback marked called and never run."""

    returned = False  # the user's function returned (the line after its call)
    frame: FrameType | None = None  # this call's frame: where it stopped (its ``f_lasti``)
    error: BaseException | None = None  # what came out of the ``try:`` around the call

    def __init__(self, func: Callable[[], None]) -> None:
        # An on_commit_or_proved callback's own wrapper is skipped: a signal handled on its
        # line would look like the user's function entered.
        self.func = func.func if isinstance(func, _ProvedHook) else func
        # Django logs a robust callback's error with its ``__qualname__`` (see _Committed).
        self.__qualname__ = getattr(func, "__qualname__", type(func).__qualname__)

    def __call__(self) -> None:
        # One line: a signal is handled before it (not called, told by None) or after both.
        self.frame, self.error = inspect.currentframe(), None  # (a call again: the last one's)
        try:
            self.func()
        except BaseException as exc:
            self.error = exc
            raise
        self.returned = True

    def ran(self) -> tuple[bool, bool]:
        """Whether the user's function ran (entered past its first instruction), and whether
        it raised. From this call's own facts, not the traceback's depth: a Python signal
        handler's frame lies below the frame it interrupted wherever it landed. Left open,
        for a callback written in C only: a signal it handles while it runs (``time.sleep``)
        is taken for its return (it ran, did not raise); one handled as it returns, in the
        same instruction as the call, is told from its raising only when the handler is an
        installed Python signal handler (else: it raised)."""
        if self.returned:
            return True, False
        if self.frame is None:  # cut before this call's first line ended
            return False, False
        if self.error is not None:
            return _outcome(self.frame, self.error)
        # Cut in the ``except`` before it stored the error (it raised), or after the return.
        if self.frame.f_lasti < _CALL[0]:
            return False, False
        return True, self.frame.f_lineno != _CALL[1]


def _call_offsets(code: CodeType) -> tuple[int, int]:
    """In :meth:`_Called.__call__`'s bytecode: the offset of the first instruction of the
    call of the user's function, and the line that records its return."""
    ops = list(dis.get_instructions(code))
    load = next(i for i, op in enumerate(ops) if op.argval == "func")
    calls = ("CALL", "PRECALL")  # (PRECALL: Python 3.11's, which calls a C function itself)
    call = next(ops[i].offset for i in range(load, len(ops)) if ops[i].opname.startswith(calls))
    store = next(op.offset for op in ops if op.argval == "returned")
    return call, max(line for at, line in dis.findlinestarts(code) if at <= store and line)


_CALL = _call_offsets(_Called.__call__.__code__)


def _outcome(frame: FrameType, error: BaseException) -> tuple[bool, bool]:
    """:meth:`_Called.ran` from the exception that came out of its call's ``try:``: where
    the wrapper's frame was (before the call: not called), then the frame below it: none (a
    C callback raised), an installed signal handler's (it ran after a C callback returned),
    or the callback's own, cut at its first instruction (a signal pending as it was entered:
    nothing of it ran), or past it (it raised)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame is not frame:
        tb = tb.tb_next
    if tb is None or tb.tb_lasti < _CALL[0]:
        return False, False
    below = tb.tb_next
    if below is None:
        return True, True
    if below.tb_frame.f_code in _handler_codes():
        return True, False
    if below.tb_next is not None and below.tb_lasti <= _first_offset(below.tb_frame.f_code):
        return False, False
    return True, True


def _handler_codes() -> set[CodeType]:
    """The code of the Python signal handlers installed now (Celery's soft time limit's)."""
    codes = set()
    for signum in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            code = getattr(signal.getsignal(signum), "__code__", None)
            if isinstance(code, CodeType):
                codes.add(code)
    return codes


def _first_offset(code: CodeType) -> int:
    """The offset of a function's first instruction that is its own (``RESUME``: where a
    pending signal is handled as it is entered; 0 before Python 3.11)."""
    return next((op.offset for op in dis.get_instructions(code) if op.opname == "RESUME"), 0)


def _watch_hooks(hooks: list[Any]) -> list[Any]:
    """Wrap the transaction's ``on_commit`` callbacks in :class:`_Called` (a block's marker,
    which records its call itself, is left as it is), in place; return the entries, in order,
    as Django's loop will take them. No I/O."""
    for i, entry in enumerate(hooks):
        if not isinstance(entry[1], (_Committed, _Called)):  # each entry swapped in one step
            hooks[i] = (entry[0], _Called(entry[1]), *entry[2:])
    return list(hooks)


def _run_uncalled(describe: str, entries: list[Any], committed: _Committed) -> None:
    """After Django's loop took every callback and returned: run those it never called. An
    exception a signal handler raised on the line that calls a robust one, before the call,
    is inside Django's ``try:``, which logs it as that callback's error and goes on: the
    callback never ran (the block's marker too: the COMMIT happened, it is marked here, so
    that a later exception of the exit is not taken for "nothing committed"). An ``Exception``
    from one: logged."""
    committed.done = True  # first: Django's loop runs only after the COMMIT
    for entry in entries:
        func = entry[1]
        if isinstance(func, _Called) and not func.ran()[0]:
            try:
                func()
            except Exception:
                if not func.ran()[0]:
                    raise  # not its error (a signal handler's, before it ran): _run_rest
                logger.exception("redlock: %s: a callback of its fenced transaction raised",
                                 describe)  # fmt: skip


def _run_rest(
    describe: str,
    using: str,
    hooks: list[Any] | None,
    entries: list[Any],
    exc: Exception,
    committed: _Committed,
) -> bool:
    """Run the callbacks Django's loop had not run when ``exc`` (a signal handler's) cut its
    exit short after the COMMIT, on one of the loop's own instructions or later (as it ended,
    in :func:`_run_uncalled`): their list, detached from the connection, would have run; and
    every entry the loop took and never ran, first (the exception landed as ``pop(0)``
    returned, before a call, or on a robust one's call line inside Django's ``try:``). Not
    when the entry taken last, a plain one, raised (Django drops the rest); a robust one's
    error Django logged and went on. An ``Exception`` from one: logged. Told from what each
    callback's wrapper recorded of its call (:meth:`_Called.ran`), not the loop's source nor
    the traceback's depth (a signal handler's frame lies below wherever it landed). Returns
    whether the loop was cut with no callback raising. When the plain one taken last raised,
    the entries before it Django's ``try:`` swallowed a cut of (robust ones, never called)
    still run: they were due before it; and the block is marked committed (its marker among
    them: a cut on its call line must not make that error read as a COMMIT cut short)."""
    if hooks is None or hooks is connections[using].run_on_commit:
        return False  # not detached: the loop never began
    # Taken off the list: told by identity, not by its length, which an earlier call changed
    # by putting entries back (counted again, one was put back twice and ran twice: review
    # f4, 1). Django's loop pops them from the front; so does _run_each.
    on_list = {id(entry) for entry in hooks}
    taken = [entry for entry in entries if id(entry) not in on_list]
    if committed.rest_of is not hooks:  # Django's loop: how it ended, decided once
        if not taken:  # a rollback detaches the list too: the loop began if it is on the stack
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_name != "run_and_clear_commit_hooks":
                tb = tb.tb_next
            if tb is None:
                return False
        if taken:
            committed.done = True  # first: Django's loop runs only after the COMMIT
            last = taken[-1]
            func, robust = last[1], len(last) > 2 and bool(last[2])
            if isinstance(func, _Called) and func.ran()[1] and not robust:
                # It raised, and Django drops the rest; not those before it that never ran.
                _run_before_raised(describe, entries)
                return False
        committed.rest_of = hooks
    hooks[:0] = [entry for entry in taken if not _ran(entry[1])]  # first, in order
    _run_each(describe, hooks)
    return True


def _run_left(
    describe: str,
    using: str,
    hooks: list[Any] | None,
    entries: list[Any],
    committed: _Committed,
    late: bool,
    kept: list[Any],
) -> None:
    """At the block's end: :func:`_run_before_raised`; then, when ``late`` (an outermost
    block, not misnested, whose except path a burst cut short before its steps ran), those
    steps: its transaction, left open by Django's exit cut before it left it, rolled back
    (:func:`_abandon`: else the thread's next ``atomic()`` is a savepoint of it, its write
    lost); the callbacks Django's cut loop left (:func:`_run_rest_late`); Django's exit
    finished after its COMMIT answered (:func:`_finish_autocommit`: its callbacks, once;
    else the block, committed, was reported "unknown"). Each whatever the one before raised.
    ``hooks`` None: not the exit of a COMMIT. First, once the row proved the COMMIT, the
    callbacks kept off a closed connection that have not run (:func:`_run_kept`)."""
    try:
        if committed.done and kept:
            _run_kept(describe, using, kept, committed)
    finally:
        try:
            _run_before_raised(describe, entries)
        finally:
            try:
                connection = connections[using]
                if late and (connection.in_atomic_block or _begun_unknown(using)):
                    committed.pending = False  # no COMMIT sent: nothing committed
                    _abandon(using)
            finally:
                try:
                    if late:
                        _run_rest_late(describe, using, hooks, entries, committed)
                finally:
                    if late and hooks is not None and _commit_answered(using):
                        _finish_autocommit(describe, using, committed)


def _run_kept(describe: str, using: str, kept: list[Any], committed: _Committed) -> None:
    """Run the block's callbacks :func:`_drop_unfinished` kept off the connection it closed,
    once the row proved the COMMIT: in order, each taken off ``kept`` once called (a wrapper
    that ran is not run again: the block's end runs the rest should an exception cut this
    short). An ``Exception`` from one: logged; a plain one's drops the rest, Django's rule."""
    _drop_own_hooks(using, committed)  # (a close that left them on it: in-memory SQLite's)
    while kept:
        entry = kept[0]
        if _raised_plain(entry):
            kept.clear()  # Django's rule (checked first: again after a cut, the same)
            return
        func = entry[1]
        if not _ran(func):
            try:
                func()
            except Exception:
                if isinstance(func, _Called) and not func.ran()[0]:
                    raise  # not its error (a signal handler's, before it ran): run again later
                logger.exception("redlock: %s: a callback of its fenced transaction, proved"
                                 " committed, raised", describe)  # fmt: skip
                continue  # (a plain one's: the rest dropped above)
        del kept[0]


def _run_rest_late(
    describe: str,
    using: str,
    hooks: list[Any] | None,
    entries: list[Any],
    committed: _Committed,
) -> None:
    """:func:`_run_rest`, at the block's end, when a second exception (a burst: a soft time
    limit in Django's loop over the callbacks, another as the ``except`` clause was entered,
    or on its first lines) cut the except path short before it: the callbacks Django's loop
    had detached and not run would be dropped with the block committed (review f3, 2). With
    the exception that cut the loop, from the chain of the one propagating (an ``Exception``:
    an interrupt stands, as on the except path). Idempotent: each entry's wrapper tells
    whether it ran."""
    error = sys.exc_info()[1]
    if not isinstance(error, Exception):
        return
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, Exception) and _run_rest(
            describe, using, hooks, entries, error, committed
        ):
            return
        error = error.__context__


def _run_before_raised(describe: str, entries: list[Any]) -> None:
    """When a plain callback raised in Django's loop (so the COMMIT happened): run the entries
    before it that never ran (robust ones whose call line a signal cut, inside Django's
    ``try:``; the block's marker), each once, in order (an ``Exception`` from one: logged).
    Those after it are dropped, Django's rule. Idempotent: told from what each wrapper
    recorded of its call, it is run again at the block's end should an exception cut it."""
    at = next((i for i, entry in enumerate(entries) if _raised_plain(entry)), None)
    if at is None:
        return
    for entry in entries[:at]:
        func = entry[1]
        if _ran(func):
            continue
        try:
            func()
        except Exception:
            if isinstance(func, _Called) and not func.ran()[0]:
                raise  # not its error (a signal handler's, before it ran): run again later
            logger.exception("redlock: %s: a callback of its fenced transaction raised", describe)


def _raised_plain(entry: Any) -> bool:
    func, robust = entry[1], len(entry) > 2 and bool(entry[2])
    return isinstance(func, _Called) and not robust and func.ran() == (True, True)


def _run_each(describe: str, hooks: list[Any]) -> None:
    """Run the entries, taken off ``hooks`` one by one (an ``Exception`` from one: logged);
    one whose wrapper says it ran already is not run again."""
    while hooks:
        func = hooks.pop(0)[1]
        if isinstance(func, _Called) and func.ran()[0]:
            continue
        try:
            func()
        except Exception:
            logger.exception("redlock: %s: a callback of its fenced transaction raised", describe)


def _forget_calls(using: str, hooks: list[Any] | None, entries: list[Any]) -> None:
    """Once the block's steps are over: the callbacks' wrappers forget their calls (a call's
    frame holds its wrapper: a reference cycle, and its error's traceback another), and the
    entries left on a list Django detached (dropped) are let go. No I/O."""
    for entry in entries:
        if isinstance(entry[1], _Called):
            entry[1].frame = entry[1].error = None
    entries.clear()
    if hooks is not None and hooks is not connections[using].run_on_commit:
        hooks.clear()


def _drop_own_hooks(using: str, committed: _Committed) -> None:
    """An outermost block that did not commit (or whose outcome is unknown): its ``on_commit``
    callbacks, its marker first, dropped from the connection. Django clears the list only at
    the end of its ``rollback()``: an exception a signal handler raised after the ROLLBACK
    (or a rollback never run) leaves them there, and the thread's next COMMIT would run them
    (charge the card of a rolled-back order). Only the marker's entry and those after it, each
    registered inside this block. No I/O."""
    connection = connections[using]
    if connection.in_atomic_block:
        return  # still open: rolled back as abandoned (_abandon clears the list)
    hooks = connection.run_on_commit
    at = next((i for i, entry in enumerate(hooks) if entry[1] is committed), None)
    if at is not None:
        del hooks[at:]  # one step


def _ran(func: Any) -> bool:
    if isinstance(func, _Committed):
        return func.done
    return func.ran()[0] if isinstance(func, _Called) else True


def _drop_unfinished(
    using: str, committed: _Committed | None = None, kept: list[Any] | None = None
) -> None:
    """Close the connection when the COMMIT's exit left it unfinished: an exception while
    the reply was awaited leaves the driver mid-COMMIT and Django with autocommit off, and
    every later use would fail (or be refused as autocommit off). A COMMIT the server got
    completes all the same; one it got only part of is rolled back when the socket closes.
    Puts in ``kept`` ``committed``'s block's ``on_commit`` entries the close drops, when the
    driver had answered a COMMIT (out of any transaction: a burst cut Django's exit after its
    ``commit()`` returned, before it stored its flag for them, then its switch of autocommit):
    the outcome check decides whether they run (review f3, 3). The caller's list, filled
    before the close: returned, they were lost with this frame to an exception as it returned
    (review f4, 4). Closed too: a connection left mid-query out of any atomic block (an
    exception from a signal handler while Django's connect awaited its ``set_config``,
    at the block's enter or the exit's reconnect: review fen3, 1), which every later
    ``atomic()`` would refuse ("can't change 'autocommit' now"). No I/O but the close."""
    connection = connections[using]
    unfinished = not connection.in_atomic_block and not connection.autocommit
    if connection.connection is None or not (unfinished or _mid_query(using)):
        return
    if committed is not None and kept is not None and _driver_idle(using):
        hooks = connection.run_on_commit
        at = next((i for i, entry in enumerate(hooks) if entry[1] is committed), None)
        kept[:] = hooks[at:] if at is not None else []  # one step
    with contextlib.suppress(Exception):
        connection.close()


# SQLSTATE classes of a COMMIT PostgreSQL refused: data exception and integrity constraint
# violation (deferred constraints and triggers), transaction rollback (serialization failure,
# deadlock), PL/pgSQL's RAISE in a deferred trigger.
_COMMIT_REFUSALS = frozenset({"22", "23", "40", "P0"})


def _refused(exc: BaseException, using: str, handled: BaseException | None) -> bool:
    """Whether PostgreSQL answered the COMMIT with an ERROR (a deferred constraint, a
    serialization failure): the server rolled the transaction back, so nothing committed,
    whatever the rows say (a floor a prune raised made them say "unknown": review fen, 3).
    The rule: an error the server sent (a SQLSTATE) of severity ERROR, raised while no other
    exception was being handled (``handled``, the block's caller's, aside): the COMMIT's own
    reply. FATAL or PANIC (a shutdown, a crash) may come after the commit record; an error
    without a SQLSTATE is the client's (a lost connection, an interrupted wait); one raised
    while another was handled came later (Django's reconnect in its exit after a lost
    COMMIT): not proven."""
    if not isinstance(exc, DatabaseError) or connections[using].vendor != "postgresql":
        return False
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) is None and getattr(cause, "pgcode", None) is None:
        return False
    if cause.__context__ is not None and cause.__context__ is not handled:
        return False
    diag = getattr(cause, "diag", None)
    severity = getattr(diag, "severity_nonlocalized", None) or getattr(diag, "severity", None)
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None) or ""
    # Only the classes a COMMIT's own refusal has: a deferred check or trigger, a
    # serialization failure or deadlock. A pooler in front of the server (older PgBouncer)
    # sends "08P01 server conn crashed?" at severity ERROR after the server committed:
    # connection classes and all others go to the outcome check (review fen2, 1).
    return severity == "ERROR" and code[:2] in _COMMIT_REFUSALS


def _mid_query(using: str) -> bool:
    """Whether the driver's connection has a statement running (its reply never read) while
    Django holds it out of any atomic block. No I/O."""
    connection = connections[using]
    raw = connection.connection
    if raw is None or connection.in_atomic_block or connection.vendor != "postgresql":
        return False
    try:
        info = getattr(raw, "info", None)  # psycopg 3
        status = info.transaction_status if info is not None else raw.get_transaction_status()
        return bool(status == 1)  # ACTIVE
    except connection.Database.Error:  # (closed: nothing running)
        return False


def _driver_idle(using: str) -> bool:
    """Whether the driver's connection is out of any transaction, no command running (its
    COMMIT, or ROLLBACK, answered). No I/O."""
    connection = connections[using]
    raw = connection.connection
    try:
        if connection.vendor == "sqlite":
            return not raw.in_transaction
        if connection.vendor == "postgresql":
            info = getattr(raw, "info", None)  # psycopg 3
            status = info.transaction_status if info is not None else raw.get_transaction_status()
            return bool(status == 0)  # IDLE
    # The driver's own errors only (a closed connection: nothing answered is known); a soft
    # time limit is an Exception too, and taken for "not idle" it dropped the callbacks kept
    # for after the outcome check, the limit swallowed (review f4, 3): it goes on.
    except connection.Database.Error:
        return False
    return False


def drop_abandoned(using: str) -> None:
    """Roll back the transaction a fenced block of this thread opened on ``using`` and
    abandoned: exceptions a signal handler raised (a burst of interrupts, time limits) cut its
    opening short before its ``with`` had it, or its exit's clean-up (Django's
    ``Atomic.__exit__`` included, at its first line). Left open, the thread's next blocks would
    be savepoints of it, reported committed while nothing ever commits. Called as a block
    opens: a block that is not running (in its body, or an ``on_commit`` callback) and whose
    ``with`` does not hold it never will again. Called by every opener before it takes its
    lock: releases a block's end owed and could not make are made first (:func:`owe`)."""
    pay_owed()
    _drop_abandoned(using)


def _drop_abandoned(using: str) -> None:
    """:func:`drop_abandoned` without paying owed releases (a block's own opening, once its
    lock is taken: a level owed and then taken again by a re-entry must not be released)."""
    drop_left_scopes()
    opened = _opened().get(using)
    if opened is None:
        return
    atomic, committed = opened[0](), opened[1]
    steps = committed.steps() if committed.steps is not None else None
    state = inspect.GEN_CLOSED if steps is None else inspect.getgeneratorstate(steps)
    lock = committed.lock
    held = committed.live and (lock is None or lock.fenced_withs >= committed.level)
    if held and committed.where is not None:  # its ``with`` returned or went past its body
        held = not _with_left(committed.where)
    if state == inspect.GEN_RUNNING or (state == inspect.GEN_SUSPENDED and held):
        return  # open: this block runs inside it
    del _opened()[using]
    connection = connections[using]
    blocks = connection.atomic_blocks
    # Only its transaction, nothing opened on top of it since (that is left as it is).
    ours = not connection.savepoint_ids and (not blocks or blocks == [atomic])
    logged = False
    if steps is not None and state == inspect.GEN_SUSPENDED and not ours:
        for inner in reversed(committed.nested):  # its ``with``'s own savepoints: rolled back
            inner_steps = inner.steps() if inner.steps is not None else None
            if inner_steps is not None:
                with contextlib.suppress(Exception):
                    inner_steps.close()  # (a no-op once ended)
        ours = not connection.savepoint_ids and (not blocks or blocks == [atomic])
    if steps is not None and state == inspect.GEN_SUSPENDED and ours:  # its exit never ran
        logged = _log_abandoned(using)
        with contextlib.suppress(Exception):
            steps.close()  # rolled back as Django's exit rolls back
        if lock is not None:  # ``with lock``: its level of the lock released, as its exit would
            _drop_block(lock, committed)
        if committed.abandon is not None:  # ``lock_all``'s: its names released
            with contextlib.suppress(Exception):
                committed.abandon()
    if connection.in_atomic_block:  # left open by Django's exit cut short (or its enter)
        if not ours:
            return
    elif connection.connection is None or (connection.autocommit and not _begun_unknown(using)):
        return  # ended as Django's exit ends it
    # else Django's enter or exit was cut short between autocommit and the atomic block flag
    if not logged:
        _log_abandoned(using)
    _abandon(using)


#: The instruction a frame is at while a ``with`` statement calls ``__enter__``.
_WITH_OPS = {dis.opmap[name] for name in ("BEFORE_WITH", "SETUP_WITH") if name in dis.opmap}


#: Frames that leave the stack while their ``with`` goes on: generators, coroutines.
_SUSPENDS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


#: A ``with`` statement: its frame's id (not the frame: a block kept by its frame, as run_held's
#: is, would make a cycle, and an abandoned block would wait for the garbage collector to be
#: rolled back), the frame's code, the statement's offset in it, and this run's exit token
#: (see :class:`TrackedExit`; None when not known).
With = tuple[int, CodeType, int, "weakref.ReferenceType[Any] | None"]


def _exit_token(owner: Any) -> weakref.ReferenceType[Any] | None:
    """The token of the ``__exit__`` a ``with`` statement took from ``owner`` just before
    calling its ``__enter__`` (None if there is none alive: ``__enter__`` called by hand)."""
    last = getattr(_exit_tokens, "last", None) if owner is not None else None
    token = last[1] if last is not None and last[0] == id(owner) else None
    bound = token() if token is not None else None
    if bound is None or getattr(bound, "__self__", None) is not owner:
        return None
    return cast("weakref.ReferenceType[Any]", token)


def with_frame(frame: Any, owner: Any = None) -> With | None:
    """The ``with`` statement ``frame`` (the caller of an ``__enter__``) runs, if it runs one
    and stays on the stack while it runs (not a generator's), else None
    (``ExitStack.enter_context``, a ``@contextmanager``: frames off the stack while the block
    is open). ``owner``: the object whose ``__exit__`` (a :class:`TrackedExit`) the statement
    took: its token is taken along, called before any other ``__exit__`` of ``owner``."""
    try:
        code, at = frame.f_code, frame.f_lasti
        if code.co_flags & _SUSPENDS or code.co_code[at] not in _WITH_OPS:
            return None
    except (AttributeError, IndexError):
        return None
    return id(frame), code, at, _exit_token(owner)


def with_exit_token(frame: Any, owner: Any) -> weakref.ReferenceType[Any] | None:
    """The exit token (:class:`TrackedExit`) of the ``with`` statement ``frame`` (the caller
    of ``owner``'s ``__enter__``) runs, if it runs one (a generator's too: the token is on its
    frame's stack, whether or not the frame is); None when ``__enter__`` was called by hand
    (``ExitStack``, an explicit call). No I/O."""
    try:
        if frame.f_code.co_code[frame.f_lasti] not in _WITH_OPS:
            return None
    except (AttributeError, IndexError):
        return None
    return _exit_token(owner)


def frame_above(levels: int) -> FrameType | None:
    """The frame ``levels`` calls above the caller of this function (0: the caller's own)."""
    frame = inspect.currentframe()
    for _ in range(levels + 1):
        frame = frame.f_back if frame is not None else None
    return frame


def _with_left(where: With) -> bool:
    """Whether the ``with`` statement ``where`` is done with its block: its frame returned, or
    runs past the ``with``'s body (its exit began: the call of ``__exit__``, or code after the
    statement, an ``except`` clause of the same function). Read from the frame's position, so
    an exception raised as ``__exit__`` is entered, before any line of it ran, cannot hide it
    (a flag set by the exit would never be set)."""
    token = where[3]
    if token is not None and token() is None:  # this run of the statement is over
        return True
    frame = _on_stack(where[0], where[1])
    # With a live token the frame is the statement's own; without one (not known), another
    # frame of that id and code is taken for a later call, at its own ``with``.
    return frame is None or _in_body(frame, where[2]) is False


def _in_body(frame: FrameType, start: int) -> bool | None:
    """Whether ``frame`` runs inside the body of its ``with`` statement at offset ``start``
    (the call of a function from there included); None when this Python cannot tell (no
    exception table: 3.10). The body is what the ``with``'s handler (``PUSH_EXC_INFO``,
    ``WITH_EXCEPT_START``) protects, directly or through handlers nested in it; neither its
    exit's call nor the handler itself is."""
    table = _exception_table(frame.f_code)
    if table is None:
        return None
    handler = _handler_of(table, start + 2)  # the instruction after BEFORE_WITH
    code = frame.f_code.co_code
    if handler is None or code[handler : handler + 4 : 2] != _WITH_HANDLER:
        return None
    at: int | None = frame.f_lasti
    seen: set[int] = set()
    while at is not None and at not in seen:
        seen.add(at)
        at = _handler_of(table, at)
        if at == handler:
            return True
    return False


_WITH_HANDLER = bytes(dis.opmap.get(name, 0) for name in ("PUSH_EXC_INFO", "WITH_EXCEPT_START"))


@functools.lru_cache(maxsize=1024)
def _exception_table(code: CodeType) -> tuple[tuple[int, int, int], ...] | None:
    """``code``'s exception table: (start, end, handler) ranges (None before Python 3.11)."""
    entries = getattr(dis.Bytecode(code), "exception_entries", None)
    if entries is None or not _WITH_OPS:
        return None
    return tuple((entry.start, entry.end, entry.target) for entry in entries)


def _handler_of(table: tuple[tuple[int, int, int], ...], at: int) -> int | None:
    return next((handler for start, end, handler in table if start <= at < end), None)


def _on_stack(frame: int, code: CodeType) -> FrameType | None:
    """The frame of id ``frame`` running ``code`` in this thread's stack, if there is one."""
    here = inspect.currentframe()
    while here is not None:
        if id(here) == frame and here.f_code is code:
            return here
        here = here.f_back
    return None


def _live() -> list[_Committed]:
    """This thread's open fenced blocks (whatever opened them), innermost last."""
    live = getattr(_local, "live", None)
    if live is None:
        live = _local.live = []
    return live


def drop_left_scopes() -> None:
    """Roll back and release every open fenced block of this thread whose ``with`` statement
    is left (:func:`_with_left`: its exit token died, its frame returned or runs past its
    body), from the innermost, each while it is the last ``atomic()`` open on its connection
    (one opened on top of it and not closed is left as it is: Django's exits would mix their
    savepoints up). One rule for every opener: ``with lock`` (its level released),
    ``lk.atomic()`` and ``@single_instance``/``@lock_view``'s (their caller releases),
    ``lock_all`` (its names released once its first member is rolled back). Blocks whose
    ``with`` is not known (an ``ExitStack``'s) are left to their exit."""
    live = _live()
    for committed in reversed(list(live)):
        steps = committed.steps() if committed.steps is not None else None
        if steps is None or inspect.getgeneratorstate(steps) == inspect.GEN_CLOSED:
            with contextlib.suppress(ValueError):
                live.remove(committed)  # ended (its clean-up was cut short)
            continue
        where = committed.where
        if inspect.getgeneratorstate(steps) != inspect.GEN_SUSPENDED or where is None:
            continue
        if not _with_left(where) or not _last_atomic(committed):
            continue
        logger.warning("redlock: database %r: a fenced block's `with` was left without its exit"
                       " (an exception raised as the exit was entered, or its exit cut short):"
                       " rolled back now, nothing of it committed", committed.using)  # fmt: skip
        debts = _owe_for(committed)  # first: its release, cut short from here on, is owed
        committed.live = False
        with contextlib.suppress(Exception):
            steps.close()  # rolled back (to its savepoint), as its exit would
        if committed.lock is not None:  # ``with lock``: its level of the lock released
            _drop_block(committed.lock, committed)
        if committed.abandon is not None:  # ``lock_all``'s: its names released
            give_back, committed.abandon = committed.abandon, None
            give_back()
        paid(debts)


def _owe_for(committed: _Committed) -> list[_Debt]:
    """The releases an abandoned block's clean-up is to make, owed (:func:`owe`): ``with
    lock``'s level of its lock, ``lock_all``'s names (``lk.atomic()``'s lock is its caller's)."""
    if committed.lock is not None:
        depths = [each.depth for each in _blocks() if each.committed is committed]
        return owe([committed.lock], depths[0]) if depths else []
    return owe(committed.gives_back)


def _drop_block(lock: FencedLock, committed: _Committed) -> None:
    blocks = _blocks()
    for block in [each for each in blocks if each.committed is committed]:
        debts = owe([lock], block.depth)  # first: a release cut short stays owed
        block.left = True
        blocks.remove(block)
        if committed.level:  # its exit may never have counted it out: fewer are open now
            lock.fenced_withs = min(lock.fenced_withs, committed.level - 1)
        with contextlib.suppress(Exception):
            _release_level(lock, block, committed=False)
        paid(debts)


def _log_abandoned(using: str) -> bool:
    logger.warning(
        "redlock: database %r: a fenced block's transaction was left open (its opening or exit"
        " was cut short by exceptions a signal handler raised): rolled back now, nothing of it"
        " committed",
        using,
    )
    return True


def _ended_clean(using: str) -> None:
    connection = connections[using]
    ended = connection.connection is None or connection.autocommit
    if not connection.in_atomic_block and ended and not _begun_unknown(using):
        _opened().pop(using, None)


def _begun_unknown(using: str) -> bool:
    """Whether the driver is in a transaction (or out of autocommit) while Django believes
    autocommit on, out of any atomic block: ``set_autocommit(False)`` runs the driver's step
    (SQLite's ``BEGIN``, psycopg's ``autocommit = False``) before it stores Django's flag, and
    an exception a signal handler raises between the two leaves a transaction nobody commits
    (the thread's autocommit writes then run in it). Only the driver's state tells. No I/O."""
    connection = connections[using]
    raw = connection.connection
    if raw is None or connection.in_atomic_block or not connection.autocommit:
        return False
    try:
        if connection.vendor == "sqlite":
            # Django keeps sqlite3 in its autocommit mode (isolation_level None) outside
            # transactions, and opens them with an explicit BEGIN.
            return bool(raw.in_transaction or raw.isolation_level is not None)
        if connection.vendor == "postgresql":
            info = getattr(raw, "info", None)  # psycopg 3
            status = info.transaction_status if info is not None else raw.get_transaction_status()
            return bool(not raw.autocommit or status in (2, 3))  # INTRANS, INERROR
    # A closed driver connection (its own errors only): no transaction of ours in it. Not a
    # soft time limit, an Exception too: it goes on (review f4, 3).
    except connection.Database.Error:
        return False
    return False


def _opened() -> dict[str, tuple[weakref.ReferenceType[Any], _Committed]]:
    """The outermost transaction (Django's ``Atomic``) a fenced block of this thread opened,
    by database alias, and that block's state."""
    opened = getattr(_local, "opened", None)
    if opened is None:
        opened = _local.opened = {}
    return opened


def _abandon(using: str) -> None:
    """Roll back a transaction Django's ``atomic()`` left open (its enter or exit cut short
    before it committed or rolled back), and leave the connection as after an exit: out of
    any atomic block, autocommit on. Closed instead when that fails (the server then rolls
    back)."""
    connection = connections[using]
    connection.in_atomic_block = False
    connection.savepoint_ids = []
    connection.atomic_blocks = []
    connection.needs_rollback = False
    connection.commit_on_exit = True
    try:
        if connection.connection is not None and not connection.closed_in_transaction:
            connection.rollback()
            connection.set_autocommit(True)
            return
    except Exception:  # the connection is broken: dropped, the server rolls back
        with contextlib.suppress(Exception):
            connection.close()
        return
    finally:
        connection.closed_in_transaction = False
        connection.run_on_commit = []
    connection.connection = None  # closed inside the transaction: reconnect when next used


class _Scope:
    """A fenced block's Django ``Atomic`` as its steps enter and leave it, and what is known of
    its exit: ``sid``, the savepoint it opened (None: its own transaction, or none made);
    ``exited``: Django's exit returned. Django's exit pops the savepoint's id before it
    releases or rolls back to it, so an exception on one of its lines (a signal handler's)
    leaves a savepoint no longer listed, neither released nor rolled back: the outer
    transaction would commit the block's writes. :func:`_undo_savepoint` settles it.

    The rule for a nested block: until Django's exit returns from releasing the savepoint,
    an exception rolls it back to the savepoint or, if it may be released, marks the outer
    transaction for rollback; from the moment it returns (``committed.done`` set, in the same
    stretch with no call), the block's writes are the outer transaction's, and an exception
    on any later line of the exit is logged, not raised as "nothing committed" (an interrupt
    goes on), as after an outermost block's COMMIT."""

    def __init__(
        self, atomic: Any, using: str, committed: _Committed, nested: bool, bound: float
    ) -> None:
        self.atomic, self.using, self.committed, self.nested = atomic, using, committed, nested
        self.bound = bound  # an outermost exit's, on PostgreSQL (exit_bound): else 0
        self.sid: str | None = None
        self.entered = self.exited = False

    def __enter__(self) -> None:
        self.atomic.__enter__()
        ids = connections[self.using].savepoint_ids
        self.sid = ids[-1] if ids else None
        self.entered = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # ``exited`` unset by an exception on its line: the savepoint is then treated as
        # possibly released (the outer transaction cannot commit): never the other way round.
        # Released (nested, no exception): committed into the outer transaction. No call
        # between Django's exit returning and the stores: nothing lands between them.
        released = self.nested and exc_type is None
        if not self.nested and (exc_type is not None or connections[self.using].needs_rollback):
            _roll_back_first(self.using)  # Django's exit rolls back: done first
        bounded = exit_bound.Exit(connections[self.using], self.bound) if self.bound else None
        try:
            if bounded is not None:
                bounded.arm()  # the COMMIT, and a reconnect after a lost reply: cut past it
            self.atomic.__exit__(exc_type, exc, tb); self.exited = True; self.committed.done = self.committed.done or released  # noqa: E702, E501  # fmt: skip
        finally:
            if bounded is not None:
                bounded.ended = True  # (a store, no call: no interrupt lands before it)


def _roll_back_first(using: str) -> None:
    """The driver's ROLLBACK of an outermost block's transaction, before Django's exit rolls it
    back: Django's exit drops its atomic flag before its ROLLBACK, and its ``finally`` turns
    autocommit back on, which on SQLite COMMITs a transaction still open. An exception a signal
    handler raised between the two (a soft time limit) would commit the writes of a block that
    raises "nothing committed". Rolled back here, Django's ROLLBACK is a no-op; cut short before
    this call, the transaction is still Django's (``in_atomic_block``) and the steps roll it back
    (:func:`_abandon`). A driver that fails to roll back: closed (the server rolls back)."""
    connection = connections[using]
    raw = connection.connection
    if raw is None or not connection.in_atomic_block or connection.savepoint_ids:
        return  # closed (the server rolled back), or not only this block's transaction
    if connection.closed_in_transaction:
        return
    try:
        raw.rollback()
    except connection.Database.Error:
        with contextlib.suppress(Exception):
            connection.close()  # in an atomic block: Django's exit then forgets the connection


def _undo_savepoint(using: str, depth: int, scope: _Scope) -> None:
    """A nested block's savepoint whose exit did not finish (``scope.exited`` unset): rolled
    back to it, whether Django's exit still lists it (cut short before its first lines, or
    never run) or popped it already. A savepoint that is gone (released: ``ROLLBACK TO``
    fails) or unknown marks the outer transaction for rollback: it cannot commit what the
    block wrote, so the block's "nothing committed" holds."""
    connection = connections[using]
    blocks = connection.atomic_blocks
    if blocks and blocks[-1] is scope.atomic:  # Django's exit never reached its first line
        blocks.pop()
    if len(connection.savepoint_ids) > depth:
        _roll_back_to(using, depth)
    elif scope.entered:
        _roll_back_to(using, depth, scope.sid)


def _roll_back_to(using: str, depth: int, sid: str | None = None) -> None:
    """Roll back to the savepoint at ``depth`` (a nested block's exit that never ran) and
    drop it and those after it, as Django's exit would have (``sid``: the savepoint, when its
    id is no longer listed); failing that (or cut short), the transaction is marked for
    rollback: it cannot commit what the block wrote."""
    connection = connections[using]
    if len(connection.savepoint_ids) > depth:
        sid = connection.savepoint_ids[depth]
        del connection.savepoint_ids[depth:]
    done = False
    try:
        with contextlib.suppress(Exception):
            if sid is not None:
                connection.savepoint_rollback(sid)
                connection.savepoint_commit(sid)
                done = True
    finally:
        if not done:
            connection.needs_rollback = True


def _backend_pid(using: str) -> int | None:
    """The PostgreSQL server process of ``using``'s connection (no I/O), or None."""
    connection = connections[using]
    if connection.vendor != "postgresql" or connection.connection is None:
        return None
    return pid_of(connection)


def _interrupt_in(exc: BaseException, handled: BaseException | None) -> BaseException | None:
    """The ``KeyboardInterrupt``/``SystemExit``-like exception ``exc`` is, or that Django's
    exit turned into a database error (``can't change 'autocommit' now``): its context, up to
    ``handled``, the exception the block ran while handling (an older one, not this COMMIT's)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None or seen is handled:
            return None
        if not isinstance(seen, Exception):
            return seen
        seen = seen.__context__
    return None


_local = threading.local()


def _new_mark() -> int:
    """A block's mark: 63 bits from the OS's random source, so no two blocks share one, in
    any process (a hold adopted by another; a forked child's differ from its parent's),
    whatever the clocks do (a time, even made unique per process, is not: under a frozen or
    stepped clock two processes gave blocks of one hold the same, and a lost COMMIT's check
    took another block's write for this one's, or an ended block's for proof of none)."""
    return secrets.randbits(63)


class _Seen:
    """A block's view of this process's other blocks of its row, for its outcome check (when
    the row, or a later block's ``previous_mark``, carries another mark than its own).

    ``ended``: the marks of the row's blocks that had ended when this one began: written, if
    at all, before this block's upsert, and never again after it (a mark is a block's own, and
    its nested blocks'), so the row showing one proves this block's write is not there. Any
    other mark (another thread's block of the same hold, or another process's that adopted
    it: marks this one never saw) proves nothing: unknown, not "not committed"."""

    def __init__(self, row: tuple[str, str], mark: Any, ended: tuple[Any, ...]) -> None:
        self.row, self.mark, self.ended = row, mark, ended
        self.open = True

    def close(self) -> None:
        """The block ended: its mark joins the row's ended ones (idempotent). No lock: an
        exception on any line (a signal handler's) must not leave one held, which hung every
        later block of the process. Each step is one dict operation, atomic under the GIL; two
        blocks ending at once may lose one's mark: a forgotten proof, "unknown", never a wrong
        one. Marked closed last: cut short, the second call records it."""
        if not self.open:
            return
        ended = _ended_marks.get(self.row, ())
        _ended_marks[self.row] = (*ended, self.mark)[-_ENDED_KEPT:]
        with contextlib.suppress(KeyError):  # (evicted meanwhile by another thread)
            _ended_marks.move_to_end(self.row)  # the newest last: the oldest row goes first
        while len(_ended_marks) > _ROWS_KEPT:
            with contextlib.suppress(KeyError):
                _ended_marks.popitem(last=False)
        self.open = False


def _open_block(row: tuple[str, str], mark: Any) -> _Seen:
    """Register a block (the outermost of its row on this thread); ``row``: (backend, lock
    name), whatever the database alias (two aliases may be one database)."""
    return _Seen(row, mark, _ended_marks.get(row, ()))


#: row -> the marks of its latest ended blocks, oldest first (bounded: a proof forgotten says
#: "unknown"). Tuples, replaced whole: readers in other threads never see one change.
_ended_marks: collections.OrderedDict[tuple[str, str], tuple[Any, ...]] = collections.OrderedDict()
_ENDED_KEPT = 8
_ROWS_KEPT = 4096


def _marks() -> dict[tuple[str, str, str], tuple[int, Any]]:
    """This thread's open fenced blocks' marks, by (database, backend, lock name): each with
    a weak reference to its block's steps."""
    marks = getattr(_local, "marks", None)
    if marks is None:
        marks = _local.marks = {}
    return marks


def _forget_ended(marks: dict[tuple[str, str, str], tuple[int, Any]]) -> None:
    """Drop the marks of blocks that ended without forgetting them (a burst of exceptions cut
    both of the steps' tries short): taken for an outer block's, one would be written by every
    later block of its row on this thread, and a lost COMMIT's check would take an earlier
    block's write for its own ("committed", nothing committed). No I/O."""
    for row, (_, ref) in list(marks.items()):
        steps = ref() if ref is not None else None
        if steps is None or inspect.getgeneratorstate(steps) == inspect.GEN_CLOSED:
            marks.pop(row, None)


def refuse_unfinished(using: str, describe: str) -> None:
    """Raise ``TransactionManagementError`` if the transaction cannot commit: Django marked it
    for rollback (``set_rollback(True)``, an inner ``atomic(savepoint=False)`` that failed),
    or PostgreSQL aborted it (an error the body caught without a savepoint). Its COMMIT would
    roll back, silently: the block must not return as if it had committed."""
    connection = connections[using]
    if connection.needs_rollback:
        why = "it was marked for rollback (transaction.set_rollback(True), or a failed inner block)"
    elif _rolled_back(connection):
        raise TransactionManagementError(
            f"{describe}: its fenced transaction was rolled back by the database inside the"
            " block (SQLite does so on a trigger's RAISE(ROLLBACK), a full disk, an I/O error,"
            " out of memory, an interrupt), and the body went on: nothing of the transaction"
            " committed, but statements the body ran after that error ran outside it, each"
            " committed on its own, without the fence check. Do not catch such errors in the"
            " block."
        )
    elif _aborted(connection):
        why = "an error inside it (caught by the body, without a savepoint) aborted it"
    else:
        return
    raise TransactionManagementError(
        f"{describe}: its fenced transaction cannot commit: {why}; rolled back, nothing"
        " committed. Catch database errors inside `with transaction.atomic():` in the block."
    )


def _rolled_back(connection: Any) -> bool:
    """Whether SQLite ended the block's transaction itself: some errors (a trigger's
    ``RAISE(ROLLBACK)``, SQLITE_FULL, IOERR, NOMEM, INTERRUPT) roll it back whole, and the
    statements after them autocommit. Mid-block the driver is then out of any transaction
    (the block's upsert ran in it, so it was in one)."""
    if connection.vendor != "sqlite" or connection.connection is None:
        return False
    return not connection.connection.in_transaction


def _aborted(connection: Any) -> bool:
    """Whether PostgreSQL holds the connection's transaction in its failed state."""
    if connection.vendor != "postgresql" or connection.connection is None:
        return False
    raw = connection.connection
    info = getattr(raw, "info", None)  # psycopg 3
    if info is not None:
        return bool(info.transaction_status == 3)  # pq.TransactionStatus.INERROR
    return bool(raw.get_transaction_status() == 3)  # psycopg2: TRANSACTION_STATUS_INERROR


# -- ``with lock`` for a lock built with ``atomic=`` -------------------------------------------

# The fenced blocks this thread is in, innermost last: per thread, as Django's transactions
# are (a connection per thread), so a block is closed on the connection that opened it.
_open = threading.local()


def enter_block(lock: Held, where: With | None) -> Held:
    """After the acquire: open the fenced block, or release the lock and raise. Returns
    ``lock`` (``with``'s value). ``where``: the ``with`` statement that called ``__enter__``
    (:func:`with_frame`, taken as ``__enter__`` began), if known."""
    note_left(None)  # (a failed entry must not find an earlier block's record)
    block = FencedTransaction(lock)
    block.by_lock, held = True, block.committed
    held.lock, held.where = lock, where
    try:
        drop_left_blocks()  # (this block is not among them yet)
        block.__enter__()
        block.depth = lock.current_hold()[1].depth
        _blocks().append(block)
        # Live, counted in, returned to the ``with``: one line, no call (nothing interrupts).
        held.live = True; lock.fenced_withs += 1; held.level = lock.fenced_withs; return lock  # noqa: E702  # fmt: skip
    except BaseException as exc:
        # StaleFence, the row wait ran out, or the database failed: nothing committed. Free
        # the lock for others (a stale hold is most likely lost: that is logged). An
        # interrupt once the block was open: rolled back now, not when collected.
        with contextlib.suppress(BaseException):
            block.__exit__(type(exc), exc, exc.__traceback__)
        with contextlib.suppress(ValueError):
            _blocks().remove(block)
        _release_unopened(lock)
        raise


def _release_unopened(lock: Held) -> None:
    """The release of a block that never opened (nothing committed). Owed first (see owe): a
    signal handler's ``Exception`` (a soft time limit) landing in it leaves the hold
    ``releasing``, which no undo hands back: tried once more here, then raised; cut short
    again, it stays owed. Only its level (a reentrant owner's outer ones are not this block's)."""
    try:
        depth: int | None = lock.current_hold()[1].depth
    except LockError:
        depth = None  # (not held: nothing owed)
    debts = owe([lock], depth)
    try:
        with contextlib.suppress(LockError):
            lock.release()
    except Exception:
        with contextlib.suppress(Exception):
            _release(lock, depth)
        raise
    finally:
        paid(debts)


def leave_block(
    lock: FencedLock,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Commit (or roll back), then release: never the release first. The fenced transaction
    raises only when nothing committed, save a ``BaseException`` (``KeyboardInterrupt``) from
    an ``on_commit`` callback after the COMMIT. The caller's ``try`` holds from its first
    instruction: any exception out of here, whichever line it landed on, goes to
    :func:`leave_failed`, which finishes the exit."""
    blocks = _blocks()
    _drop_left(lock)
    block = _innermost(lock)
    # Owed from here on, payable once its ``with`` is left: an exception on the caller's
    # ``except`` line (or before ``leave_failed`` ran) would leave the hold renewed for ever.
    debts = _owe_until_left(lock, block)
    block.__exit__(exc_type, exc, tb)  # raises: nothing committed (or an interrupt after it)
    if exc_type is None:
        release_after_commit(lock, block.depth)
    else:  # rolled back: as any lock's `with`, the body's exception says more than a loss
        try:
            lock.release()
        except LockNotOwned:
            pass
        except LockError as error:
            # The body's exception says more than a release Redis did not answer (review
            # fen, 4): raised, as run_held does; the hold, kept (and renewed), stays owed.
            logger.warning("redlock: %s: rolled back (nothing committed); its release then"
                           " failed (%s: %s): owed, the body's exception raised",
                           lock.describe(), type(error).__name__, error)  # fmt: skip
            debts = debts or owe([lock], block.depth)
            paid(debts)  # owed while still held
            debts = []
    _forget(debts)  # released (or owed by release_after_commit itself)
    block.left = True
    _open.left = weakref.ref(lock) if exc_type is None else None  # committed: left_committed
    del blocks[blocks.index(block)]  # last: no instruction after it can be interrupted


def leave_failed(lock: FencedLock, error: BaseException) -> None:
    """``error`` came out of :func:`leave_block` (its outcome, or an exception a signal handler
    raised on any of its lines): finish the exit. Not yet ended, the block rolls back with
    it; committed, an ``Exception`` is logged and the block returns; the lock's level of
    this block is released if it is still held. Raises what the block's exit says."""
    blocks = _blocks()
    with contextlib.suppress(Exception):
        _drop_left(lock)
    block = next((each for each in reversed(blocks) if each.lock is lock), None)
    if block is None:
        raise error
    outcome: BaseException | None = error
    if not block.left:
        try:
            block.__exit__(type(error), error, error.__traceback__)
        except BaseException as raised:  # nothing committed (or an interrupt after it)
            outcome = raised
        else:  # committed, an Exception after the COMMIT (logged): the block returns
            swallowed = block.committed.done and isinstance(error, Exception)
            outcome = None if swallowed else error
        # First: a release cut short stays owed (leave_block's debt, if it made one: paid
        # as soon as the ``with`` is left).
        debts = block.exit_debts or owe([lock], block.depth)
        with contextlib.suppress(BaseException):
            _release_level(lock, block, committed=outcome is None)
        paid(debts)
    elif block.committed.done and isinstance(error, Exception):  # after all of it
        logger.warning("redlock: %s: its fenced transaction committed and the lock was"
                       " released; then %s: %s (logged, not raised)", lock.describe(),
                       type(error).__name__, error)  # fmt: skip
        outcome = None
    block.left = True
    with contextlib.suppress(ValueError):
        blocks.remove(block)
    if outcome is not None:
        _open.left = None
        raise outcome
    note_left(lock)  # last: committed, and released (or owed)


def _owe_until_left(lock: FencedLock, block: FencedTransaction) -> list[_Debt]:
    """Owe ``block``'s level of the lock as its ``with``'s exit begins, payable only once that
    ``with`` is left (its exit token dead: see :class:`TrackedExit`) with the block ended, and
    paid at that very moment (a weak reference's callback): an exception a signal handler
    raises after the exit failed and before :func:`leave_failed` ran (``BaseLock.__exit__``'s
    ``except`` line, ``_exit_failed``'s first line) would otherwise leave the hold held, and
    renewed by the watchdog, for as long as the process lives. None when the ``with`` is not
    known (an ``ExitStack``'s). No I/O."""
    where = block.committed.where
    token = where[3] if where is not None else None
    # The token is never held in a local: this frame, cut short (a burst), lives on in the
    # exception's traceback, kept as long as the exception is (an ``except ... as e`` kept,
    # an error reporter), and the token it held would never die: the ``with`` left, the
    # block never rolled back nor its lock released (review f3, 1).
    if token is None or token() is None:
        return []
    debts = owe([lock], block.depth)
    for debt in debts:
        debt.until, debt.block = token, block
    block.exit_debts = debts
    block.exit_watch = weakref.ref(token(), functools.partial(_exit_left, debts))
    return debts


def _exit_left(debts: list[_Debt], _gone: Any) -> None:
    """A ``with`` statement left (its exit token died): its block's release, if still owed
    (the exit never reached :func:`leave_failed`), made now, in the ``with``'s thread."""
    owed = _owed()
    for debt in debts:
        if debt not in owed or not debt.due():
            continue
        try:
            debt.pay()
            if debt.held():  # pay() settles a LockError: still held is no answer, not "released"
                logger.warning("redlock: %s: a fenced block's release, owed as its `with` was"
                               " left, got no answer (kept)", debt.lock.describe())  # fmt: skip
            else:
                logger.warning("redlock: %s: its `with` was left before its exit finished (an"
                               " exception as it handed its failure on): released now",
                               debt.lock.describe())  # fmt: skip
        except BaseException:  # (nothing propagates out of a weak reference's callback)
            logger.warning("redlock: %s: a fenced block's release, owed as its `with` was left,"
                           " failed (kept)", debt.lock.describe(), exc_info=True)  # fmt: skip
        paid([debt])
        block = debt.block
        if block is not None and not block.left and not _is_open(block):
            block.left = True
            with contextlib.suppress(ValueError):
                _blocks().remove(block)


def note_left(lock: object | None) -> None:
    """Record, as the last step of a fenced ``with``'s exit, that ``lock``'s block committed
    and its lock was released (None: no block has, since). See :func:`left_committed`."""
    _open.left = None if lock is None else weakref.ref(lock)


def log_after_exit(describe: str, error: Exception) -> None:
    """An ``Exception`` out of a fenced ``with`` after its exit returned committed: logged,
    the call returns."""
    logger.warning("redlock: %s: its fenced transaction committed; then %s: %s (logged, not"
                   " raised: the call returns)", describe, type(error).__name__,
                   error)  # fmt: skip


def left_committed(lock: object) -> bool:
    """Whether the last fenced ``with`` block this thread left was ``lock``'s, committed and
    released: its exit's last step recorded it. CPython may run a signal handler (Celery's
    soft time limit) after an ``__exit__`` returned, on the ``with`` line of its caller, where
    no ``try`` of the exit holds: the decorator forms, which own that line, ask this of an
    ``Exception`` out of their ``with`` (a user's ``with`` cannot: docs/topics/fencing.md).
    No I/O."""
    left = getattr(_open, "left", None)
    return left is not None and left() is lock


def _release_level(lock: FencedLock, block: FencedTransaction, committed: bool) -> None:
    """Release ``block``'s level of the lock unless that is done (or the hold is gone). The
    callers owe it first (:func:`owe`): an exception raised during the release (a burst: a
    second time limit) leaves it to the thread's next fenced block or the request's or
    task's end."""
    if committed:
        release_after_commit(lock, block.depth)
        return
    with contextlib.suppress(LockError):
        _release(lock, block.depth)


def _drop_left(lock: FencedLock) -> None:
    """As ``lock``'s ``with`` exits: roll back and release the blocks of this thread their
    ``with`` statements left without their exit ever running (an exception raised as their
    ``__exit__`` was entered: a reentrant re-entry inside this one, another lock's block
    nested in it), rather than exit one of them in this one's place, or leave it open and its
    lock renewed. The ``with`` exiting is ``lock``'s innermost open block, unless that block's
    frame returned, or it is left and so is the next outer one of the same frame (its exit
    would have come inside that one's body): then that outer one. Every open block above the
    one exiting whose ``with`` is left is abandoned."""
    blocks = _blocks()
    mine = [each for each in blocks if each.lock is lock and _is_open(each)]
    if not mine:
        return
    at = len(mine) - 1
    while at > 0 and _inside_left(mine[at], mine[at - 1]):
        at -= 1
    _drop_left_above(blocks[blocks.index(mine[at]) + 1 :])


def drop_left_blocks() -> None:
    """As a ``with lock`` block opens: roll back and release the thread's open ``with lock``
    blocks (innermost first) whose ``with`` is left (an exception as their exit was entered,
    caught in the same function, in an outer transaction: savepoints :func:`drop_abandoned`,
    which looks at the outermost transaction, does not see)."""
    _drop_left_above(list(_blocks()))


def drop_all_abandoned(**_: Any) -> None:
    """Roll back and release every fenced block of this thread abandoned by its ``with`` (on
    any database): connected to the end of a request (Django's ``request_finished``) and of a
    Celery task (``task_postrun``), where every ``with`` of the work has ended, so that an
    abandoned block's lock is not renewed until the thread's next fenced block. Blocks whose
    ``with`` is not known (an ``ExitStack``'s) and those still in their body are left."""
    with contextlib.suppress(Exception):
        drop_left_blocks()
    with contextlib.suppress(Exception):
        drop_left_scopes()
    for using in list(_opened()):
        with contextlib.suppress(Exception):
            _drop_abandoned(using)
    with contextlib.suppress(Exception):
        pay_owed()


def _drop_left_above(blocks: list[FencedTransaction]) -> None:
    """Roll back and release each of ``blocks`` (innermost last) left by its ``with``, from the
    innermost, while each is the last ``atomic()`` open on its connection (one opened on top of
    it since and not closed is left as it is: Django's exits would mix their savepoints up)."""
    for block in reversed(blocks):
        if not _is_open(block):
            continue
        committed = block.committed
        if not _left(block) or not _last_atomic(committed):
            return
        logger.warning("redlock: %s: its `with` was left without its exit (an exception raised"
                       " as the exit was entered): its fenced block rolled back now, nothing of"
                       " it committed", block.lock.describe())  # fmt: skip
        with contextlib.suppress(Exception):
            block._steps.close()  # rolled back (to its savepoint), as its exit would
        _drop_block(block.lock, committed)


def _is_open(block: FencedTransaction) -> bool:
    return not block.left and inspect.getgeneratorstate(block._steps) == inspect.GEN_SUSPENDED


def _last_atomic(committed: _Committed) -> bool:
    atomic = committed.atomic() if committed.atomic is not None else None
    if atomic is None or committed.using is None:
        return False
    opened = connections[committed.using].atomic_blocks
    return bool(opened) and opened[-1] is atomic


def _inside_left(inner: FencedTransaction, outer: FencedTransaction) -> bool:
    """Whether ``inner`` (a later block of the same lock than ``outer``) was abandoned by its
    ``with``, now that one of the two exits: its frame returned, or both are left in one frame
    (``inner``'s exit is inside ``outer``'s body: the one exiting is ``outer``)."""
    where, around = inner.committed.where, outer.committed.where
    if where is None:
        return False
    if where[3] is not None and where[3]() is None:  # its ``with`` is over
        return True
    if _on_stack(where[0], where[1]) is None:
        return True
    return around is not None and around[:2] == where[:2] and _left(inner) and _left(outer)


def _left(block: FencedTransaction) -> bool:
    where = block.committed.where
    return where is not None and _with_left(where)


def _innermost(lock: FencedLock) -> FencedTransaction:
    return next(each for each in reversed(_blocks()) if each.lock is lock)


def release_after_commit(lock: FencedLock, depth: int | None = None) -> None:
    """Release after a fenced block committed (the lost-hold rule): whatever the release
    finds (lost, or no answer: the hold then runs out at its TTL), nothing is raised. The
    commit stands, in fence order (the lock's row was locked from the check to the commit),
    and raising would invite a retry that applies the work twice. So is any ``Exception``
    raised meanwhile (a signal handler's: Celery's soft time limit, ``autoretry_for``'s
    trigger): logged, the block returns, and the release is tried once more (the watchdog
    would renew the hold on); an interrupt (``KeyboardInterrupt``) propagates. ``depth``: the
    hold's depth at the block (a level released already is not released again)."""
    # Owed first (see owe): should both tries fail (no answer) or be cut short, the thread's
    # next fenced block or the request's or task's end releases it.
    debts = owe([lock], depth)
    # On one line: the try holds from its first instruction (see FencedTransaction).
    try: _release(lock, depth)  # noqa: E701  # fmt: skip
    except LockError as exc:
        logger.warning("redlock: %s: its fenced transaction committed; then: %s",
                       lock.describe(), exc)  # fmt: skip
    except Exception:
        logger.exception("redlock: %s: its fenced transaction committed; then the release"
                         " raised (tried once more)", lock.describe())  # fmt: skip
        with contextlib.suppress(Exception):
            _release(lock, depth)
    paid(debts)  # (unless still held: no answer)


class _Debt:
    """A release a fenced block's end owes: ``lock``'s hold, at ``depth`` (None: the whole
    hold). Paid only while that very hold and level are still held: never a later hold of the
    same lock object, nor a level of it taken again since (a reentrant owner's token is the
    same for all its holds; a level is named by its stamp, new each time it is taken)."""

    #: Payable only once this is dead (a ``with``'s exit token: see _owe_until_left).
    until: weakref.ReferenceType[Any] | None = None
    block: FencedTransaction | None = None  # ... and this block is no longer open

    def __init__(self, lock: FencedLock, hold: FencedHold, depth: int | None) -> None:
        self.lock, self.token, self.depth = lock, hold.token, depth
        level = 1 if depth is None else depth
        stamps = hold.stamps
        self.stamp = stamps[level - 1] if 0 < level <= len(stamps) else None

    def due(self) -> bool:
        """Whether it is to be paid now: held, and (owed as a ``with``'s exit began) that
        ``with`` is left and its block ended. No I/O."""
        if self.until is not None and self.until() is not None:
            return False  # its exit runs: it releases
        if self.block is not None and _is_open(self.block):
            return False  # left open: rolled back first (drop_left_blocks), then released
        return self.held()

    def held(self) -> bool:
        """Whether that hold (and level) is still held here. No I/O."""
        try:
            _owner, hold = self.lock.current_hold()
        except LockError:
            return False  # released, or lost
        level = 1 if self.depth is None else self.depth
        stamps = hold.stamps
        if hold.token != self.token or len(stamps) < level or stamps[level - 1] != self.stamp:
            return False  # that hold (or level) ended; this is another
        return self.depth is None or hold.depth >= self.depth or hold.releasing

    def pay(self) -> None:
        """Release it if still held; a ``LockError`` (lost, not ours) settles it too."""
        if self.due():
            with contextlib.suppress(LockError):
                _release(self.lock, self.depth)


def _owed() -> list[_Debt]:
    owed = getattr(_local, "owed", None)
    if owed is None:
        owed = _local.owed = []
    return owed


def owe(locks: Any, depth: int | None = None) -> list[_Debt]:
    """Record, before releasing them, that each of ``locks``' current holds (at ``depth``) is
    to be released, and return the records: :func:`paid` once the release is made. A release
    cut short in between (a second time limit, an interrupt) or unanswered stays owed, and
    :func:`pay_owed` makes it: the thread's next fenced block, as it opens, and the end of the
    request (``request_finished``) or Celery task (``task_postrun``). No I/O."""
    debts: list[_Debt] = []
    for lk in locks:
        with contextlib.suppress(LockError):
            debts.append(_Debt(lk, lk.current_hold()[1], depth))
    owed = _owed()
    owed.extend(debts)  # one call, after the look-ups: all owed, or none
    if len(owed) > _OWED_KEPT:  # (Redis down for long: bounded, the oldest given up)
        logger.warning("redlock: %d fenced blocks' releases owed: the oldest given up (their"
                       " holds stay held until released by hand or lost)",
                       len(owed))  # fmt: skip
        del owed[:-_OWED_KEPT]
    return debts


_OWED_KEPT = 256


def paid(debts: list[_Debt]) -> None:
    """The releases ``debts`` record were tried: those made (or settled: lost, not ours) are no
    longer owed; one whose hold is still held (no answer: Redis keeps it, and the watchdog
    renews it) stays owed. No I/O."""
    owed = _owed()
    for debt in debts:
        if not debt.held():
            with contextlib.suppress(ValueError):
                owed.remove(debt)


def _forget(debts: list[_Debt]) -> None:
    """No longer owed, whatever their state (another debt covers them). No I/O."""
    owed = _owed()
    for debt in debts:
        with contextlib.suppress(ValueError):
            owed.remove(debt)


def pay_owed(**_: Any) -> None:
    """Make this thread's owed releases (see :func:`owe`), oldest first; one that fails again
    (no answer, cut short) stays owed."""
    owed = _owed()
    for debt in list(owed):
        try:
            debt.pay()
        except Exception:
            logger.warning("redlock: %s: a fenced block's release, owed, failed again (kept)",
                           debt.lock.describe(), exc_info=True)  # fmt: skip
        paid([debt])


def _release(lock: FencedLock, depth: int | None) -> None:
    """Release the lock, unless its level at ``depth`` (None: the current one) is released."""
    if depth is not None:
        try:
            _owner, hold = lock.current_hold()
        except LockLost:
            pass  # the release says so (logged)
        except LockError:
            return  # released
        else:
            # A release begun and cut short before its reply (depth 0, ``releasing``) is
            # this level's: sent again (no loss if it had gone through).
            if hold.depth < depth and not hold.releasing:
                return
    lock.release()


def _blocks() -> list[FencedTransaction]:
    blocks = getattr(_open, "blocks", None)
    if blocks is None:
        blocks = _open.blocks = []
    return blocks


# -- manage.py redlock prune-fences ----------------------------------------------------------
