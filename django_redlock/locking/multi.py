"""Several names at once: :func:`lock_all`, all of them or none, never a deadlock.

The rules, and who owns what:

* A :class:`MultiLock` owns one plain :class:`~.lock.Lock` per distinct name (its members), in
  the canonical order (sorted). Each member's hold is a normal hold: the watchdog renews it,
  ``lock_lost`` names it when it is lost, the admin lists it. The holder metadata of every
  member carries the same group id (:func:`~..identity.group_meta`).
* Taking, on a backend that has every name on one server (one Redis, django-redis,
  Sentinel): one script (``lua/acquire_all.lua``) takes every name or none, in one round trip.
  A busy set is waited for on the first busy name's wake-up (pub/sub, the waiting machinery
  of one lock), holding nothing meanwhile. On Redis Cluster and Redlock: the members are taken
  one by one in the canonical order, with one deadline for all. Either way two callers with
  overlapping sets never wait for each other in a cycle.
* One by one, the set is returned held only while every member's hold is still valid,
  measured as the take returns: a member taken early may run out while a later one is
  waited for (not renewed, or a TTL shorter than the wait). A take slower than the TTL
  extends every member; one gone gives the whole set back, and a blocking take starts
  again within its deadline (:meth:`MultiLock._take_each`).
* All or none: a timeout, a busy name with ``blocking=False``, an error, or an interrupt
  at any line from the take's call up to the body (the driver throws one that lands between
  its steps into them) gives back whatever may have been taken before it is raised; the
  backend builds the take (:meth:`~..backends.redis.RedisBackend.op_acquire_all`: Sentinel's
  waits for ``min_replicas`` there, or gives the set back). After a lost connection
  (``BackendUnavailable``) the give-back is tried once; failing that, the holds are not
  renewed and run out at their TTL. After a timeout (``BackendUnavailable.timed_out``) it is
  not tried: it would keep the caller another socket timeout, and a slow or paused server
  could run it before the take it undoes; the holds run out at their TTL.
* Releasing releases every member (one script, ``lua/release_all.lua``, on one server). A
  member found lost is losing the whole: ``LockLost`` naming it, every other member released
  all the same.
* ``atomic=``: once every name is held, one transaction records every member's fence, rows
  locked in the canonical order (each member's own fenced block, nested: :meth:`atomic`),
  before the body runs; a stale fence of any name raises ``StaleFence``, nothing committed,
  every name released. A block that committed never raises a lock error on the way out (as a
  single fenced block).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, NoReturn, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS

from .. import observe
from ..backends.base import BaseLockBackend, Op
from ..backends.redis import RedisBackend, TakenAll
from ..exceptions import BackendUnavailable, LockError, LockLost, LockNotAcquired, LockNotOwned
from ..fencing import (
    FencedTransaction,
    With,
    check_database,
    database_of,
    drop_abandoned,
    fenced_transaction,
    frame_above,
    left_committed,
    log_after_exit,
    note_left,
    owe,
    paid,
    refuse_manual_commit,
    tracked_exit,
    with_frame,
)
from ..handler import DEFAULT_LOCK_ALIAS
from ..identity import group_meta, holder_meta, lend_owner, new_token, new_waiter_id, owner_id
from ..scripts import Call, script
from ..validation import check_bool, check_optional_seconds, check_ttl, to_ms
from . import finisher
from .holds import holds_it
from .lock import Lock
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

#: The most distinct names one ``lock_all`` takes: one script holds them all (5 keys each),
#: and a set that large is most likely a mistake (a loop's names passed by accident).
MAX_NAMES = 64


class MemberLock(Lock):
    """One name of a :class:`MultiLock`: a plain lock whose holder metadata names its group."""

    def __init__(self, name: str, *, group: str, size: int, **kwargs: Any) -> None:
        self.group, self.size = group, size
        super().__init__(name, **kwargs)

    def _meta(self) -> str:
        return group_meta(holder_meta(), self.group, self.size)


def one_server(backend: BaseLockBackend) -> bool:
    """Whether ``backend`` keeps every name on one server, waking one waiter per release:
    then one script takes a whole set (one Redis, django-redis, Sentinel; not Cluster, whose
    names live in different slots, nor Redlock's independent nodes)."""
    return (
        isinstance(backend, RedisBackend)
        and not backend.publishes_releases
        and bool(backend.wakes_one)
    )


def check_names(names: Sequence[Any]) -> list[str]:
    """The distinct names in canonical (sorted) order; TypeError / ValueError, before any I/O,
    for no names, a name that is not a str, or more than :data:`MAX_NAMES` distinct ones."""
    if not names:
        raise ValueError("lock_all() needs at least one name")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"lock_all() names must be str, not {type(name).__name__}: {name!r}")
    distinct = sorted(set(names))
    if len(distinct) > MAX_NAMES:
        raise ValueError(
            f"lock_all() takes at most {MAX_NAMES} distinct names, not {len(distinct)}"
        )
    return distinct


def _details(
    exc: BaseException | None,
) -> tuple[type[BaseException] | None, BaseException | None, TracebackType | None]:
    return (None, None, None) if exc is None else (type(exc), exc, exc.__traceback__)


class MultiBlock:
    """:meth:`MultiLock.atomic`'s block: each member's fenced block, opened in the canonical
    order and left innermost first. Its exit holds against an exception a signal handler
    raises on any of its lines (a soft time limit), as a single block's does
    (:class:`~..fencing.FencedTransaction`): every member not yet left is left with it, by
    the same steps as ``lock_all(atomic=)``'s exit (:meth:`MultiLock._leave_members`). Before
    the COMMIT, rolled back and raised; once committed, an ``Exception`` is logged and the
    block returns, an interrupt goes on. The names stay held: the caller releases them."""

    def __init__(self, multi: MultiLock, using: str) -> None:
        self.multi, self.using = multi, using
        self.members: list[FencedTransaction] = []

    # Each try on one line with what it runs: it holds from the line's first instruction.
    def __enter__(self) -> None:
        try: return self._open()  # noqa: E701  # fmt: skip
        except BaseException as error: self._not_opened(error)  # noqa: E701  # fmt: skip

    @tracked_exit
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try: return self._leave(exc)  # noqa: E701  # fmt: skip
        except BaseException as error: return self._settle(error)  # noqa: E701  # fmt: skip

    def _open(self) -> None:
        multi = self.multi
        missing = [lk.name for lk in multi.locks if lk.fence is None]
        if missing:
            lost = [lk.name for lk in multi.locks if lk.lost is not None and lk.token is None]
            error = LockLost if lost else LockNotOwned
            raise error(f"{multi.describe()}: {', '.join(map(repr, missing))} not held"
                        f"{' (lost)' if lost else ''}")  # fmt: skip
        where = with_frame(frame_above(2), self)  # the ``with`` statement: the caller of __enter__
        for lk in multi.locks:  # canonical order: the rows are locked in that order
            block = fenced_transaction(lk, self.using)
            self.members.append(block)  # first: one opened is left whatever comes next
            block.__enter__()
        for block in self.members:  # once all opened: the ``with`` is not in its body yet
            block.committed.where = where
        self.members[0].committed.nested = tuple(each.committed for each in self.members[1:])

    def _not_opened(self, error: BaseException) -> NoReturn:
        """StaleFence, the database failed, an interrupt: nothing committed; the members
        opened are rolled back with it (one that never opened leaves as it came)."""
        with contextlib.suppress(BaseException):
            MultiLock._leave_members(self.members, error)
        raise error

    def _leave(self, exc: BaseException | None) -> bool:
        pending = MultiLock._leave_members(self.members, exc)
        if pending is None:
            return exc is not None  # a member's exit swallowed it: committed (logged)
        if pending is exc:
            return False  # the body's exception goes on: ``with`` raises it
        raise pending  # nothing committed (or an interrupt after the COMMIT)

    def _settle(self, error: BaseException) -> bool:
        """``error`` came out of :meth:`_leave`: its outcome, or an exception that landed on
        one of its lines. Members not yet left roll back with it; once committed, an
        ``Exception`` is logged and the block returns."""
        pending = MultiLock._leave_members(self.members, error)
        committed = bool(self.members) and self.members[0].committed.done
        if pending is None or (committed and isinstance(pending, Exception)):
            if pending is not None:
                logger.warning("redlock: %s: its fenced transaction committed; then %s: %s"
                               " (logged, not raised: the block returns)",
                               self.multi.describe(), type(pending).__name__,
                               pending)  # fmt: skip
            return False
        raise pending


class MultiLock:
    """Several names held together: all of them, or none. Use with ``with`` or as a
    decorator (each name a ``str.format`` template over the arguments), or by hand
    (:meth:`acquire`, :meth:`release`); ``async with``, ``aacquire`` and ``arelease`` on an
    event loop (not with ``atomic=``: Django's transactions are synchronous).
    """

    def __init__(
        self,
        *names: str,
        ttl: float | None = None,
        timeout: float | None = None,
        blocking: bool = True,
        using: str | None = None,
        auto_renew: bool = True,
        atomic: bool | str | None = False,
    ) -> None:
        self.names = check_names(names)
        ttl = check_ttl(ttl)
        self.timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        self.blocking = check_bool(blocking, "blocking")
        self.auto_renew = check_bool(auto_renew, "auto_renew")
        if not self.blocking and self.timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        if using is None:
            using = DEFAULT_LOCK_ALIAS
        if not isinstance(using, str):
            raise TypeError(f"using must be a backend alias (str), not {using!r}")
        self.using = using
        self.database = database_of(atomic)
        self.group = new_token()
        # The members wait as the set does: a fenced block's wait for a row follows them.
        options = {"ttl": ttl, "using": using, "auto_renew": self.auto_renew,
                   "blocking": self.blocking, "timeout": self.timeout}  # fmt: skip
        self.locks: list[Lock] = [
            MemberLock(name, group=self.group, size=len(self.names), **options)
            for name in self.names  # each name checked (length, encoding) here
        ]
        self.backend = self.locks[0].backend  # one alias for all: one backend
        self.lock_ttl = self.locks[0].lock_ttl
        self.together = one_server(self.backend)
        self._block: list[FencedTransaction] | None = None  # each member's, in order

    def __repr__(self) -> str:
        state = "held" if self.held() else "free"
        return f"<MultiLock {self.names!r} on {self.using!r}: {state}>"

    def describe(self) -> str:
        return f"lock_all({', '.join(map(repr, self.names))}) on backend {self.using!r}"

    @property
    def fences(self) -> dict[str, int | None]:
        """Each name's fencing token while held (None for a name not held)."""
        return {lk.name: lk.fence for lk in self.locks}

    def held(self) -> bool:
        """Whether this object holds every name, as far as this process knows."""
        return all(lk.token is not None for lk in self.locks)

    # -- acquire -----------------------------------------------------------------------------

    def _check_wait(self, blocking: bool, timeout: float | None, in_loop: bool = False) -> None:
        if blocking and timeout != 0 and not in_loop and in_event_loop():
            raise LockError(
                f"{self.describe()}: a blocking acquire in a running event loop would block"
                " the loop; use `await held.aacquire()` or `async with`"
            )
        if any(lk.token is not None for lk in self.locks):
            raise LockError(f"{self.describe()} is already held by this object")
        if blocking and timeout is None:
            actor = owner_id()
            mine = [n for n in self.names if holds_it(self.backend, n, actor)]
            if mine:
                raise LockError(
                    f"{self.describe()}: this thread holds {', '.join(map(repr, mine))}"
                    " already: waiting for it with no timeout would wait forever"
                )

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take every name, or none; wait up to ``timeout`` seconds (None: forever) when
        ``blocking``. False when not all could be taken: nothing is held then."""
        blocking = check_bool(blocking, "blocking")
        timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        if not blocking and timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        self._check_wait(blocking, timeout)
        try:
            if self.together:
                return drive(self.backend, self._take_together(blocking, timeout))
            return self._take_in_order(blocking, timeout)
        except BaseException:
            self._give_back_held()  # interrupted after the take recorded its holds
            raise

    async def aacquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """:meth:`acquire` on the running event loop."""
        self.check_async()
        blocking = check_bool(blocking, "blocking")
        timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        if not blocking and timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        self._check_wait(blocking, timeout, in_loop=True)
        try:
            if self.together:
                return await adrive(self.backend, self._take_together(blocking, timeout))
            return await self._atake_in_order(blocking, timeout)
        except BaseException as exc:
            if isinstance(exc, GeneratorExit) and finisher.must_hand_over():
                self.release_closed()  # closed: nothing can be awaited (review asy, 3)
                raise
            await self._agive_back_held()  # interrupted after the take recorded its holds
            raise

    async def _atake_in_order(self, blocking: bool, timeout: float | None) -> bool:
        """:meth:`_take_in_order` on the running event loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = await self._atake_each(blocking, deadline)
            if taken is not None:
                return taken
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                return False

    async def _atake_each(self, blocking: bool, deadline: float | None) -> bool | None:
        """:meth:`_take_each` on the running event loop."""
        since = time.monotonic()
        tried: list[Lock] = []
        outcome: bool | None = False
        closed = False
        self._busy = None
        try:
            for lk in self.locks:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                tried.append(lk)  # before its acquire: held from the grant on
                if not await lk.aacquire(blocking=blocking, timeout=left if blocking else None):
                    self._busy = lk.name
                    break
            else:
                outcome = None if await self._aran_out(since) else True
        except GeneratorExit:
            # Closed (a loop torn down with the task pending): nothing can be awaited, and
            # this may be a finalizer. The members granted go to the finisher (review asy, 3).
            closed = finisher.must_hand_over()
            if closed:
                self._release_closed(tried[::-1])
            raise
        finally:
            if outcome is not True and not closed:  # refused, ran out, an error, or cancelled
                await self._arelease_members(tried[::-1])
        return outcome

    def check_async(self) -> None:
        if self.database is not None:
            raise LockError(
                f"{self.describe()} opens a database transaction (atomic={self.database!r}),"
                " and Django's transactions are synchronous: take the names in a thread"
                " (sync_to_async)"
            )

    def _take_in_order(self, blocking: bool, timeout: float | None) -> bool:
        """Each member in canonical order, one deadline for all; all or none. A member that
        ran out before the set was complete gives the set back; blocking, it is taken again
        within the deadline (see :meth:`_take_each`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = self._take_each(blocking, deadline)
            if taken is not None:
                return taken
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                return False

    def _take_each(self, blocking: bool, deadline: float | None) -> bool | None:
        """One take of every member: True, every hold valid as it returns; False, refused
        (nothing held); None, a member ran out first (nothing held).

        The rule: the set is held only while every member's hold is still valid, measured
        when the take returns. Every member was granted after ``since``, so its hold lasts
        at least ``since + ttl - drift`` (:meth:`~..backends.base.BaseLockBackend.drift_ms`)
        even unrenewed. A take slower than that (a later member was waited for) extends
        every member, from a new ``since``: one gone (``LockNotOwned``) ran out while the others
        were taken, and may have had another holder meanwhile.

        A member is put on the give-back list before its acquire is sent: an interrupt at
        any line after its grant (even the one right after ``acquire`` returned) finds it
        there, and the ``finally`` releases every member that holds."""
        since = time.monotonic()
        tried: list[Lock] = []
        outcome: bool | None = False
        self._busy = None
        try:
            for lk in self.locks:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                tried.append(lk)  # before its acquire: held from the grant on
                if not lk.acquire(blocking=blocking, timeout=left if blocking else None):
                    self._busy = lk.name
                    break
            else:
                outcome = None if self._ran_out(since) else True
        finally:
            if outcome is not True:  # refused, ran out, an error, or an interrupt
                for lk in reversed(tried):
                    if lk.token is not None:  # an interrupted acquire gave its own back
                        with contextlib.suppress(LockError):
                            lk.release()
        return outcome

    def _ran_out(self, since: float) -> bool:
        """Whether a member ran out while the others were taken (see :meth:`_take_each`):
        not valid since ``since`` by this process's clock, and not there to extend."""
        if self._valid_since(since):
            return False
        since = time.monotonic()
        try:
            for lk in self.locks:
                lk.extend()
        except LockNotOwned:  # gone (LockLost): another may have held it meanwhile
            return True
        return not self._valid_since(since)

    async def _aran_out(self, since: float) -> bool:
        """:meth:`_ran_out` on the running event loop."""
        if self._valid_since(since):
            return False
        since = time.monotonic()
        try:
            for lk in self.locks:
                await lk.aextend()
        except LockNotOwned:
            return True
        return not self._valid_since(since)

    def _valid_since(self, since: float) -> bool:
        """Whether every member, granted (or extended) after ``since``, is still held and
        valid by this process's clock."""
        ttl_ms = to_ms(self.lock_ttl)
        ends = since + (ttl_ms - self.backend.drift_ms(ttl_ms)) / 1000
        return time.monotonic() < ends and all(lk.token is not None for lk in self.locks)

    def _give_back_held(self) -> None:
        """Release every member recorded as held (an interrupt after the take recorded them,
        before the caller learnt of it): none is left renewed. Owed first (fencing.owe): cut
        short or unanswered, the thread's next fenced block or the request's end finishes it."""
        debts = owe(self.locks) if self.database is not None else []
        for lk in reversed(self.locks):
            if lk.token is not None:
                with contextlib.suppress(LockError):
                    lk.release()
        paid(debts)

    def release_closed(self) -> None:
        """Internal API (``async with``, ``lock_view``): :meth:`Lock.release_closed` for
        every name, in the release order: no I/O here, the finisher releases them."""
        self._release_closed(self.locks[::-1])

    def finish_release_later(self) -> None:
        """Internal API (``async with``): :meth:`Lock.finish_release_later` for every name."""
        for held in self.locks:
            held.finish_release_later()

    def _release_closed(self, members: list[Lock]) -> None:
        for lk in members:
            lk.release_closed()

    async def _agive_back_held(self) -> None:
        """:meth:`_give_back_held` on the running event loop."""
        await self._arelease_members(self.locks[::-1])

    async def _arelease_members(self, members: list[Lock]) -> None:
        """Release each of ``members`` still held. Cancelled meanwhile (often a second
        cancellation), the rest is finished by a task of its own, acting as this owner,
        rather than left renewed or to run out at its TTL."""
        for i, lk in enumerate(members):
            if lk.token is None:  # an interrupted acquire gave its own back
                continue
            try:
                await lk.arelease()
            except LockError:
                pass
            except asyncio.CancelledError:
                lk.finish_release_later()
                rest = members[i + 1 :]
                if rest:
                    again = functools.partial(self._release_now, rest)
                    self._finish_later(self._arelease_members(rest), again)
                raise

    def _release_now(self, members: list[Lock]) -> None:
        """Release each of ``members`` still held, or whose release is unsure, in this
        thread: a finishing task cancelled, the ones it would have made since too (made
        during the loop's shutdown, they may never run). Errors are not raised."""
        for lk in members:
            if lk.token is not None:
                with contextlib.suppress(LockError):  # not sent once the backend did not answer
                    finish_now(lk.backend, lk.release)

    def _finish_later(self, release: Coroutine[Any, Any, None], again: Callable[[], None]) -> None:
        """Run ``release`` in a task of its own, acting as this owner; should that task be
        cancelled, ``again`` runs as it ends (see :meth:`_finished`), or on the finisher should
        its loop be closed with it pending (no done-callback runs)."""
        once_more = functools.partial(self._give_back_once_more, again)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # No loop: the finisher runs a closed coroutine's steps (a give-back cut there).
            # Finished here and now, as a cancelled task's would be (review asy3 7).
            release.close()
            once_more()
            return
        task = finisher.finishing_task(loop, release, once_more)
        lend_owner(task)
        task.add_done_callback(functools.partial(self._finished, once_more))

    def _finished(self, once_more: Callable[[], None], task: asyncio.Task[None]) -> None:
        if task.cancelled():
            # Cancelled before it was done (asyncio.run's shutdown cancels every task): done
            # here, synchronously, as BaseLock._release_finished does.
            once_more()
        elif task.exception() is not None:
            self._unfinished(task.exception())

    def _give_back_once_more(self, again: Callable[[], None]) -> None:
        try:
            again()
        except Exception as exc:
            self._unfinished(exc)

    def _unfinished(self, error: BaseException | None) -> None:  # what is left runs out at its TTL
        what = self.describe()
        logger.warning("redlock: %s: finishing an interrupted give-back: %s", what, error)

    def _backend(self) -> RedisBackend:
        backend = self.backend
        assert isinstance(backend, RedisBackend)  # one_server(): a set is taken by one script
        return backend

    def _op_take(self, token: str, ttl_ms: int, meta: str, waiter: str) -> Op[TakenAll]:
        # The backend builds it: it may add to it (Sentinel: min_replicas' confirmation).
        return self._backend().op_acquire_all(self.names, token, ttl_ms, meta, waiter)

    def _give_back(self, token: str, marks: bool = False) -> Steps[None]:
        """Give back what ``token`` may hold, in one round trip: a member recorded as held is
        released as such (no longer renewed, not held in this process), every other name by
        the token (-1 from a name it did not get). ``marks``: a take may still be on the
        wire; the give-back, on another connection, may overtake it: finding nothing, it
        leaves the token's marker, and the take is refused when it lands."""
        recorded = [lk for lk in self.locks if lk.token == token]
        others = [lk.name for lk in self.locks if lk not in recorded]
        runs = [lk.release_steps() for lk in recorded]
        if others:
            runs.append(self._hand_back(others, token, marks))
        for outcome in (yield from side_by_side(runs)):
            if outcome is not None and not isinstance(outcome, Exception):
                raise outcome  # an interrupt of the give-back itself

    def _give_back_now(self, token: str, marks: bool = False) -> None:
        """:meth:`_give_back` in this thread (its finishing task cancelled): the token is
        this take's alone, never a later try's."""
        finish_now(self.backend, lambda: drive(self.backend, self._give_back(token, marks)))

    def _hand_back(self, names: list[str], token: str, marks: bool = False) -> Steps[None]:
        # The marker at the set's first name, where acquire_all.lua looks (the token is this
        # take's alone: never tried again once given back).
        mark = self.names[0] if marks else None
        yield self._backend().op_release_all(names, token, mark)

    def _take_together(self, blocking: bool, timeout: float | None) -> Steps[bool]:
        """One script for the whole set; wait on a busy one's wake-up, holding nothing.

        From the script's call until the last member is recorded (``took``), any exception,
        an interrupt included (the driver throws one that lands between its steps into these
        steps), gives back every name the token may hold, members already recorded
        included, before it is raised. Each name counts as one acquisition in the metrics,
        with the set's outcome (the one-by-one path counts each member's own)."""
        started = time.monotonic()
        token, ttl_ms = new_token(), to_ms(self.lock_ttl)
        meta = group_meta(holder_meta(), self.group, len(self.names))
        spans = [observe.acquire_started(lk) for lk in self.locks]
        tried = [time.monotonic()]  # when the last try was sent: the holds count from it
        trying = [True]  # whether a take's request may be on the wire (its reply not taken)
        try:
            taken = yield self._op_take(token, ttl_ms, meta, "")
            trying[0] = False
            if not taken.acquired and blocking and timeout != 0:
                deadline = None if timeout is None else started + timeout
                taken = yield from self._wait(token, ttl_ms, meta, deadline, tried, trying)
            self._busy = None if taken.acquired else self.names[taken.busy]
            if not taken.acquired:
                refused = observe.TIMEOUT if blocking and timeout else observe.BUSY
                self._acquire_ended(started, refused, spans)
                return False
            priors = taken.priors or (None,) * len(self.locks)
            for lk, fence, prior in zip(self.locks, taken.fences, priors, strict=True):
                lk.took(token, fence, ttl_ms, prior, tried[0])
            self._acquire_ended(started, observe.ACQUIRED, spans, taken.fences)
        except BaseException as exc:
            failed = observe.ERROR if isinstance(exc, Exception) else observe.TIMEOUT  # as lock()
            self._acquire_ended(started, failed, spans)
            # No answer, or interrupted while one was on its way or being recorded: the
            # script may have taken every name. Give them back (the token is ours alone);
            # failing that, or after a timeout (see the module's docstring), nothing renews
            # them and they run out at their TTL.
            if not (isinstance(exc, BackendUnavailable) and exc.timed_out):
                marks = trying[0]
                try:
                    yield from self._give_back(token, marks)
                except asyncio.CancelledError:  # again: this object is usually thrown away
                    again = functools.partial(self._give_back_now, token, marks)
                    give_back = self._give_back(token, marks)
                    self._finish_later(adrive(self.backend, give_back), again)
                    raise
                except Exception:
                    pass
            raise
        return True

    def _acquire_ended(
        self, started: float, outcome: str, spans: list[Any], fences: Sequence[int] = ()
    ) -> None:
        """The metrics' and tracing's end of each member's acquisition (``spans``: theirs)."""
        for i, (lk, span) in enumerate(zip(self.locks, spans, strict=True)):
            observe.acquire_ended(lk, started, outcome, fences[i] if fences else None, span)

    def _wait(
        self,
        token: str,
        ttl_ms: int,
        meta: str,
        deadline: float | None,
        tried: list[float],
        trying: list[bool],
    ) -> Steps[TakenAll]:
        """Register on the first busy name and sleep until its release wakes this waiter (or
        its hold's expiry); then try the whole set again. Never polls blindly.

        Left without the set (refused, an error, an interrupt), the waiter leaves every
        name's waiters, in one round trip (:func:`~.steps.leave_waiters`: not after a try
        that got no answer in time; a leave not sent or not answered is sent when a wake-up
        still comes for the waiter, else its entry lapses with the waiters' set)."""
        waiter = new_waiter_id()
        handle = yield Watch(waiter, True, self.names[0])
        taken = TakenAll(False)
        unanswered = False
        try:
            while True:
                tried[0] = time.monotonic()
                trying[0] = True
                taken = yield self._op_take(token, ttl_ms, meta, waiter)
                trying[0] = False
                handle[1].baton = False  # tried: a wake-up we were handed is used up
                if taken.acquired:
                    return taken
                remaining = float("inf") if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return taken
                hint = taken.wait_ms
                pause = max(hint / 1000, 0.001) if hint >= 0 else self.lock_ttl
                yield Sleep(handle[1], min(pause, remaining), self.names[0], handle)
        except BackendUnavailable as exc:
            unanswered = exc.timed_out
            raise
        finally:
            try:
                if not taken.acquired:
                    # Out of every name's waiters (after an error it is not known where this
                    # waiter registered), in one round trip; a free name's next waiter is woken.
                    leave = self.backend.op_leave
                    out = Op(self.names[0], [leave(n, waiter).request for n in self.names], list)
                    yield from leave_waiters(self.backend, waiter, out, unanswered)
            finally:  # an interrupt in the leave too: a wake-up for the id runs the leave
                yield Unwatch(handle)

    _busy: str | None = None

    def _not_acquired(self, timeout: float | None) -> LockNotAcquired:
        waited = "" if timeout is None else f" within {timeout:g} s"
        busy = f" ({self._busy!r} is held)" if self._busy else ""
        return LockNotAcquired(f"{self.describe()} could not be acquired{waited}{busy}")

    # -- release -----------------------------------------------------------------------------

    def release(self) -> None:
        """Release every name. ``LockLost`` if any was lost (every other one is released all
        the same), ``LockNotOwned`` if none is held; ``BackendUnavailable`` (no answer) keeps
        the unanswered holds: call ``release()`` again."""
        if self.together:
            outcomes = drive(self.backend, side_by_side([lk.release_steps() for lk in self.locks]))
        else:
            outcomes = []
            for lk in reversed(self.locks):
                try:
                    lk.release()
                except BaseException as exc:  # every member is released
                    outcomes.append(exc)
                else:
                    outcomes.append(None)
            outcomes.reverse()
        self._raise_for(outcomes)

    async def arelease(self) -> None:
        """:meth:`release` on the running event loop."""
        if self.together:
            runs = [lk.release_steps() for lk in self.locks]
            outcomes = await adrive(self.backend, side_by_side(runs))
        else:
            outcomes = []
            for lk in reversed(self.locks):
                try:
                    await lk.arelease()
                except BaseException as exc:  # every member is released
                    outcomes.append(exc)
                else:
                    outcomes.append(None)
            outcomes.reverse()
        self._raise_for(outcomes)

    def _raise_for(self, outcomes: list[BaseException | None]) -> None:
        for exc in outcomes:
            if exc is not None and not isinstance(exc, Exception):
                raise exc  # an interrupt first
        lost = [n for n, e in zip(self.names, outcomes, strict=True) if isinstance(e, LockLost)]
        if lost:
            raise LockLost(
                f"{self.describe()} was lost: {', '.join(map(repr, lost))} expired or was"
                " released by someone else (the other names were released)"
            )
        errors = [e for e in outcomes if e is not None]
        if not errors:
            return
        if all(isinstance(e, LockNotOwned) for e in errors):
            if len(errors) == len(outcomes):
                raise LockNotOwned(f"{self.describe()} is not held by this object")
            raise LockNotOwned(f"{self.describe()}: some names were not held")
        raise next(e for e in errors if not isinstance(e, LockNotOwned))

    # -- with, decorator ---------------------------------------------------------------------

    def _timeout(self) -> float | None:
        return self.timeout if self.blocking else None

    def __enter__(self) -> MultiLock:
        # A fenced block tells from the ``with`` statement's frame when its ``with`` is left.
        where = with_frame(frame_above(1), self) if self.database is not None else None
        if self.database is not None:  # autocommit off: refused before the lock is taken
            note_left(None)  # (a failed entry must not find an earlier block's record)
            drop_abandoned(self.database)  # (not a block's leftover transaction)
            refuse_manual_commit(self.database, self.describe())
        self._block = None  # a previous block's, left
        try:
            if not self.acquire(self.blocking, self._timeout()):
                raise self._not_acquired(self._timeout())
            if self.database is not None:
                self._open_block(self.database, where)
            return self
        except BaseException as exc:
            # Up to the body, an exception (an interrupt on the way back from the take, on
            # any line) leaves nothing held nor open: the body's ``with`` never exits it.
            if self._block is not None:
                with contextlib.suppress(BaseException):
                    self._exit_failed(exc)
            else:
                self._give_back_held()
            raise

    @tracked_exit
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The try on one line holds from its first instruction (as BaseLock.__exit__'s): an
        # exception a signal handler raises on any line of the exit still ends the block.
        try: return self._exit(exc_type, exc)  # noqa: E701  # fmt: skip
        except BaseException as error: return self._exit_failed(error)  # noqa: E701  # fmt: skip

    def _exit(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        if self.database is not None:
            self._leave_block(exc_type, exc)
            return
        try:
            self.release()
        except LockNotOwned:
            if exc_type is None:
                raise
            # The body's own exception says more; the loss is logged and signalled.

    def _exit_failed(self, error: BaseException) -> None:
        """An exception out of :meth:`_exit`, from any line: finish the fenced block (each
        member not yet left, innermost first), release, and raise what the block says:
        nothing committed, the exception; committed, an ``Exception`` logged, an interrupt
        raised."""
        members = self._block
        if self.database is None or members is None:
            raise error
        # Owed first: a second exception entering the release (a burst) leaves it to the
        # thread's next fenced block or the request's or task's end (fencing.owe).
        debts = owe(self.locks)
        pending = self._leave_members(members, error)  # (all left: ``error`` itself)
        committed = members[0].committed.done
        if pending is None or (committed and isinstance(pending, Exception)):
            if pending is not None:
                logger.warning("redlock: %s: its fenced transaction committed; then %s: %s"
                               " (logged, not raised)", self.describe(),
                               type(pending).__name__, pending)  # fmt: skip
            with contextlib.suppress(Exception):
                self.release()
            paid(debts)
            note_left(self)  # last: committed, and released (or owed)
            return
        with contextlib.suppress(LockError):
            self.release()
        paid(debts)
        note_left(None)
        raise pending

    def atomic(self, using: str | None = None) -> AbstractContextManager[None]:
        """This held multi-lock's fenced transaction, in ``using`` (default: the ``atomic=``
        database, else Django's default): every member's own fenced block
        (:meth:`Lock.atomic <django_redlock.Lock.atomic>`), nested in the canonical order, so
        the first opens the transaction and each next one records its fence in a savepoint
        of it: every name's row locked in that order, until the one COMMIT. Raises as a
        single fenced block does, nothing committed: ``StaleFence`` for any name,
        ``LockNotAcquired`` when a row stayed locked past the wait, ... ``LockNotOwned`` (or
        ``LockLost``) when not every name is held, before the database is touched. Its exit
        holds against an exception a signal handler raises on any of its lines, as a single
        block's does."""
        using = check_database(using) if using is not None else self.database or DEFAULT_DB_ALIAS
        return MultiBlock(self, using)

    async def __aenter__(self) -> MultiLock:
        try:
            if not await self.aacquire(self.blocking, self._timeout()):
                raise self._not_acquired(self._timeout())
            return self
        except BaseException as exc:
            if isinstance(exc, GeneratorExit) and finisher.must_hand_over():
                self.release_closed()  # closed: nothing can be awaited
                raise
            await self._agive_back_held()  # as __enter__: nothing held short of the body
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is GeneratorExit and finisher.must_hand_over():
            self.release_closed()  # closed: nothing can be awaited (review asy, 4)
            return
        try:
            await finisher.arelease_exiting(self)
        except LockNotOwned:
            if exc_type is None:
                raise

    def _open_block(self, using: str, where: With | None = None) -> None:
        """The fenced block of ``with``: opened once every name is held, before the body:
        each member's own block, in the canonical order (see :meth:`atomic`)."""
        members: list[FencedTransaction] = []
        try:
            for lk in self.locks:
                block = fenced_transaction(lk, using)
                members.append(block)  # first: one opened is left whatever comes next
                block.__enter__()
            for block in members:  # once all opened: the ``with`` is not in its body yet
                block.committed.where = where
            members[0].committed.nested = tuple(each.committed for each in members[1:])
            members[0].committed.abandon = self._give_back_held  # its names, should it be left
            members[0].committed.gives_back = tuple(self.locks)
            self._block = members
        except BaseException as exc:
            # StaleFence, or the database failed: nothing committed. Free every name.
            with contextlib.suppress(BaseException):
                self._leave_members(members, exc)
            with contextlib.suppress(LockError):
                self.release()
            raise

    @staticmethod
    def _leave_members(
        members: list[FencedTransaction], pending: BaseException | None
    ) -> BaseException | None:
        """Exit each member's block not yet left, innermost first, passing the exception on
        as ``ExitStack`` does: what is left to raise (``pending`` itself: it goes on)."""
        for block in reversed(members):
            # Again when cut short before its exit ran (once it ran, an exit is a no-op).
            for _ in range(3):
                if block.left:
                    break
                try:
                    if block.__exit__(*_details(pending)):
                        pending = None
                    block.left = True
                except BaseException as raised:
                    pending = raised
        return pending

    def _leave_block(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        """Commit (or roll back), then release: never the release first."""
        members = self._block
        assert members is not None
        pending = self._leave_members(members, exc)
        if pending is not None and pending is not exc:  # nothing committed (or an interrupt)
            raise pending  # _exit_failed releases
        debts = owe(self.locks)  # a release cut short or unanswered stays owed
        if exc_type is not None:
            try:
                self.release()
            except LockNotOwned:
                pass
            except LockError as error:  # no answer: the body's exception says more (owed)
                logger.warning("redlock: %s: rolled back (nothing committed); its release then"
                               " failed (%s: %s): owed, the body's exception raised",
                               self.describe(), type(error).__name__, error)  # fmt: skip
            paid(debts)
            note_left(None)
            return
        try:  # committed: whatever the release finds, raising would invite a second run
            self.release()
        except Exception as error:  # a lost hold, a soft time limit: the commit stands
            logger.warning("redlock: %s: its fenced transaction committed; then: %s",
                           self.describe(), error)  # fmt: skip
            with contextlib.suppress(Exception):  # once more: else the watchdog renews on
                self.release()
        paid(debts)
        # self._block stays (every member left): an exception after this line is
        # _exit_failed's to settle by the members' outcome.
        note_left(self)  # last: the block committed and was released (left_committed)

    def _options(self) -> dict[str, Any]:
        return {"ttl": self.lock_ttl, "timeout": self.timeout, "blocking": self.blocking,
                "using": self.using, "auto_renew": self.auto_renew,
                "atomic": self.database or False}  # fmt: skip

    def __call__(self, func: F) -> F:
        """Use as a decorator: each name is a ``str.format`` template over the arguments.

        An async callable (any: templates.py's rule) gets an async wrapper that awaits it
        while the lock is held; a sync call that returns an awaitable or a generator anyway
        is refused (TypeError, nothing of it run) before the release."""
        refuse_generator(func, "@lock_all(...)")
        signature = inspect.signature(func)
        builders = [name_template(n, signature, callable_name(func)) for n in self.names]
        options = self._options()
        if is_async_callable(func):  # the rule: templates.py, "async callables"
            self.check_async()

            @functools.wraps(func)
            async def locked_acall(*args: Any, **kwargs: Any) -> Any:
                async with MultiLock(*(build(args, kwargs) for build in builders), **options):
                    result = func(*args, **kwargs)
                    return await result if inspect.isawaitable(result) else result

            return cast(F, locked_acall)

        @functools.wraps(func)
        def locked_call(*args: Any, **kwargs: Any) -> Any:
            held = MultiLock(*(build(args, kwargs) for build in builders), **options)
            result = None
            try:
                with held:
                    result = func(*args, **kwargs)
                    refuse_generator_result(result, func, "@lock_all(...)")
            except Exception as error:
                # A signal handler's exception once the exit returned committed (CPython runs
                # it on the ``with`` line): returning, as the exit would have. A second one
                # here (a burst), on the call's first line: asked again, logged or not.
                try: left = left_committed(held)  # noqa: E701  # fmt: skip
                except Exception: left = left_committed(held)  # noqa: E701  # fmt: skip
                if not left:
                    raise error
                try: log_after_exit(held.describe(), error)  # noqa: E701, SIM105  # fmt: skip
                except Exception: pass  # noqa: E701  # fmt: skip
            return result

        return cast(F, locked_call)


def _batch(name: str, calls: list[Call]) -> Op[list[Any]]:
    """One round trip for several script calls: releases (lua/release.lua's, the common case)
    as one call of lua/release_all.lua, which answers as each would; else a pipeline."""
    release = script("release")
    if all(c.script == release and len(c.keys) == 5 and len(c.args) == 3 for c in calls):
        keys = [key for call in calls for key in call.keys]
        args = [arg for call in calls for arg in call.args]
        return Op(name, Call(script("release_all"), keys, args), list)
    return Op(name, list(calls), list)


def side_by_side(runs: list[Steps[None]]) -> Steps[list[BaseException | None]]:
    """Several operations' steps side by side, as one run of steps: each round's ops go in
    one round trip (:func:`_batch`; ops that are not single script calls go one by one). The
    result: each run's outcome, None or the exception it ended with. No answer for a round
    is thrown into every run of it. Driven by :func:`~.steps.drive` or ``adrive``."""
    outcomes: list[BaseException | None] = [None] * len(runs)
    feed: dict[int, tuple[Any, BaseException | None]] = {i: (None, None) for i in range(len(runs))}
    while feed:
        ops: dict[int, Op[Any]] = {}
        for i, (reply, error) in feed.items():
            try:
                step = runs[i].send(reply) if error is None else runs[i].throw(error)
            except StopIteration:
                continue
            except BaseException as exc:  # the run's outcome
                outcomes[i] = exc
                continue
            ops[i] = step
        feed = {}
        if not ops:
            break
        if all(isinstance(op.request, Call) for op in ops.values()):
            first = next(iter(ops.values()))
            try:
                replies = yield _batch(first.name, [op.request for op in ops.values()])
            except BaseException as exc:  # thrown into each run
                feed = {i: (None, exc) for i in ops}
                continue
            for (i, op), reply in zip(ops.items(), replies, strict=True):
                if isinstance(reply, Exception):
                    feed[i] = (None, reply)
                    continue
                try:
                    feed[i] = (op.parse(reply), None)
                except Exception as exc:  # thrown into the run
                    feed[i] = (None, exc)
        else:
            for i, op in ops.items():
                try:
                    feed[i] = ((yield op), None)
                except BaseException as exc:  # thrown into the run
                    feed[i] = (None, exc)
    return outcomes


def lock_all(
    *names: str,
    ttl: float | None = None,
    timeout: float | None = None,
    blocking: bool = True,
    using: str | None = None,
    auto_renew: bool = True,
    atomic: bool | str | None = False,
) -> MultiLock:
    """Every name held, or none: a :class:`MultiLock` on backend ``using``; use with ``with``
    or as a decorator. ``held.fences`` maps each name to its fence. Duplicate names count
    once; at most 64 distinct names (``MAX_NAMES``). ``atomic=True`` (or a ``DATABASES``
    alias): one transaction records every fence before the body runs, committed before the
    release."""
    return MultiLock(
        *names,
        ttl=ttl,
        timeout=timeout,
        blocking=blocking,
        using=using,
        auto_renew=auto_renew,
        atomic=atomic,
    )
