"""The Lock: what users hold. All lock logic lives here once; backends only do the I/O.

Each operation (acquire, release, ...) is written once, as a generator that yields the steps
it needs: a backend :class:`~.backends.base.Op` (one round trip), or watching a channel and
sleeping on it. Two drivers run the steps, one for threads and one for asyncio, so
``lk.acquire()`` and ``await lk.aacquire()`` share every line of the algorithm.

Unknown is not lost: when a backend cannot answer, the operation raises
(``BackendUnavailable``, ``QuorumNotReached``) and the hold stays as it was. A hold is declared
lost only when the backend answered that its token no longer holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import string
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, TypeVar, cast

from .backends.base import Attempt, BaseLockBackend, Kind, Op, Renewal
from .exceptions import LockError, LockLost, LockNotAcquired, LockNotOwned
from .handler import DEFAULT_LOCK_ALIAS, locks
from .identity import holder_meta, new_token, new_waiter_id, owner_id
from .renewer import Renewer, thread_renewer
from .signals import acquire_timed_out, lock_acquired, lock_lost, lock_released
from .validation import check_name, check_optional_seconds, check_ttl, to_ms

logger = logging.getLogger("django_redlock")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
Steps = Generator[Any, Any, T]

#: How long a fair waiter's place in the queue lasts before it must renew it (by trying
#: again). A waiter that dies blocks the queue for at most this long, or its own timeout.
WAITER_LEASE = 5.0


class _Watch(NamedTuple):
    channel: str  # the lock's release channel, or the waiter's id
    by_id: bool


class _Sleep(NamedTuple):
    waiter: Any
    seconds: float


class _Unwatch(NamedTuple):
    handle: Any


@dataclass
class _Hold:
    token: str
    fence: int | None
    actor: str  # the thread or asyncio task that took it (see _taken)
    depth: int = 0  # acquisitions through this Lock object by this owner
    renewer: Renewer | None = None
    releasing: bool = False  # a release was sent whose outcome is unknown
    taken: bool = False  # counted in _taken (until its release is sent)


#: Plain holds of this process by (backend, name) -> the actors holding them: taking a name
#: again that one's own thread or task holds would wait for itself.
_taken: dict[tuple[int, str], dict[str, int]] = {}
_taken_mutex = threading.Lock()


def _note_taken(backend: BaseLockBackend, name: str, actor: str, delta: int) -> None:
    key = (id(backend), name)
    with _taken_mutex:
        actors = _taken.setdefault(key, {})
        count = actors.get(actor, 0) + delta
        if count > 0:
            actors[actor] = count
        else:
            actors.pop(actor, None)
            if not actors:
                del _taken[key]


def _holds_it(backend: BaseLockBackend, name: str, actor: str) -> bool:
    return actor in _taken.get((id(backend), name), ())


def _forget_taken_after_fork() -> None:
    global _taken_mutex
    _taken.clear()  # the child holds nothing: its parent's holds are the parent's
    _taken_mutex = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_taken_after_fork)


def _check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {value!r}")
    return value


def _check_token_prefix(prefix: Any) -> str | None:
    if prefix is None:
        return None
    if not isinstance(prefix, str) or "|" in prefix or len(prefix) > 200:
        raise ValueError(f"token_prefix must be a str of <= 200 chars without '|', not {prefix!r}")
    return prefix


def _in_event_loop() -> bool:
    # Not get_running_loop(): raising and catching on every sync call costs time.
    return asyncio._get_running_loop() is not None


class Lock:
    """A named lock on one backend; not acquired until :meth:`acquire` or ``with``.

    A plain Lock object is the holder: whoever has the object may release it, so it can be
    handed to another thread. A reentrant lock is held by an owner, the current thread or
    asyncio task, which may take it again and must release it as often. Every new hold gets a
    fencing token strictly greater than any earlier one for the same name.

    The sync methods always act synchronously; asyncio code awaits the ``a``-prefixed twins
    (``aacquire``, ``arelease``, ...). A blocking ``acquire`` in a running event loop raises
    :class:`LockError`: it would block the loop, and with it whoever may hold the lock.

    A hold belongs to the process that took it: a forked child does not hold its parent's.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float | None = None,
        using: str = DEFAULT_LOCK_ALIAS,
        timeout: float | None = None,
        blocking: bool = True,
        auto_renew: bool = True,
        max_hold: float | None = None,
        reentrant: bool = False,
        fair: bool = False,
        token_prefix: str | None = None,
    ) -> None:
        self.name = check_name(name)
        self.token_prefix = _check_token_prefix(token_prefix)
        ttl = check_ttl(ttl)
        self.timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        self.blocking = _check_bool(blocking, "blocking")
        self.auto_renew = _check_bool(auto_renew, "auto_renew")
        self.max_hold = check_optional_seconds(max_hold, "max_hold")
        if not self.blocking and self.timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        self.kind = Kind(_check_bool(reentrant, "reentrant"), _check_bool(fair, "fair"))
        if not isinstance(using, str):
            raise TypeError(f"using must be a backend alias (str), not {using!r}")
        self.using = using
        self.backend: BaseLockBackend = locks[using]  # unknown alias: error, still no I/O
        self.backend.check_kind(self.kind)
        self.lock_ttl = ttl if ttl is not None else self.backend.default_ttl
        self._holds_by_owner: dict[str, _Hold] = {}  # owner ("" for plain locks) -> hold
        self._pid = os.getpid()  # whose holds those are
        self._lost: str | None = None  # why the last hold was lost, if it was
        # The token of an acquire whose outcome is unknown (its reply was lost): the next try
        # uses it again, so that it finds the hold if the lost try took it.
        self._unsure_token: str | None = None
        self._mutex = threading.Lock()

    @property
    def _holds(self) -> dict[str, _Hold]:
        if self._pid != os.getpid():  # a forked child: the parent's holds are not ours
            self._holds_by_owner, self._pid = {}, os.getpid()
            self._unsure_token = None
        return self._holds_by_owner

    def __repr__(self) -> str:
        hold = self._holds.get(self._owner())
        state = f"held, fence {hold.fence}" if hold else "lost" if self._lost else "free"
        return f"<Lock {self.name!r} ({self.kind.label}) on {self.using!r}: {state}>"

    def _describe(self) -> str:
        return f"lock {self.name!r} on backend {self.using!r}"

    def _owner(self) -> str:
        return owner_id() if self.kind.reentrant else ""

    # -- drivers -----------------------------------------------------------------------------

    def _drive(self, steps: Steps[T]) -> T:
        backend, reply, error = self.backend, None, None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return cast(T, done.value)
            reply = error = None
            try:
                if isinstance(step, Op):
                    reply = backend.execute(step)
                elif isinstance(step, _Sleep):
                    reply = step.waiter.wait(step.seconds)
                elif isinstance(step, _Watch):
                    watching = backend.hub.watch(*step)
                    reply = (watching, watching.__enter__())
                else:
                    step.handle[0].__exit__(None, None, None)
            except BaseException as exc:
                error = exc

    async def _adrive(self, steps: Steps[T]) -> T:
        backend, reply, error = self.backend, None, None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return cast(T, done.value)
            reply = error = None
            try:
                if isinstance(step, Op):
                    reply = await backend.aexecute(step)
                elif isinstance(step, _Sleep):
                    reply = await step.waiter.wait(step.seconds)
                elif isinstance(step, _Watch):
                    watching = backend.hub.awatch(*step)
                    reply = (watching, await watching.__aenter__())
                else:
                    await step.handle[0].__aexit__(None, None, None)
            except BaseException as exc:
                error = exc

    # -- acquire -----------------------------------------------------------------------------

    def _check_acquire(self, blocking: Any, timeout: Any) -> tuple[bool, float | None]:
        blocking = _check_bool(blocking, "blocking")
        timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        if not blocking and timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        return blocking, timeout

    def _check_sync_wait(self, blocking: bool, timeout: float | None) -> None:
        if blocking and timeout != 0 and _in_event_loop():
            raise LockError(
                f"{self._describe()}: a blocking acquire() in a running event loop would block"
                " the loop, and with it whoever may hold the lock; use `await lk.aacquire()`"
                " or `async with`, or acquire(blocking=False)"
            )

    def _acquire(self, blocking: bool, timeout: float | None) -> Steps[bool]:
        """Arguments checked by the caller (:meth:`_check_acquire`)."""
        owner, kind, name, backend = self._owner(), self.kind, self.name, self.backend
        actor = owner if kind.reentrant else owner_id()
        if not kind.reentrant:
            if owner in self._holds:
                raise LockError(
                    f"{self._describe()} is already held by this Lock object;"
                    " use reentrant=True to take it again"
                )
            if blocking and timeout is None and _holds_it(backend, name, actor):
                raise LockError(
                    f"{self._describe()} is held by this thread or task already: waiting for"
                    " it with no timeout would wait for itself forever; use reentrant=True"
                )
        started = time.monotonic()
        if kind.reentrant:
            token = owner
        else:
            token = self._unsure_token or f"{self.token_prefix or ''}{new_token()}"
        ttl_ms, meta = to_ms(self.lock_ttl), holder_meta(fair=kind.fair)
        attempt = Attempt(False)
        try:
            # One try that never queues or registers: only a waiter does.
            attempt = yield backend.op_acquire(name, token, ttl_ms, meta, kind)
            if not attempt.acquired and blocking and timeout != 0:
                deadline = None if timeout is None else started + timeout
                # A waiter with an id is woken by that id alone; else by the release channel.
                waiter = new_waiter_id() if kind.fair or backend.wakes_one else None
                attempt = yield from self._wait(token, ttl_ms, meta, waiter, deadline)
        except LockError:
            # No answer (BackendUnavailable, QuorumNotReached): the try may have taken the
            # lock. The next try uses the same token, and finds the hold if it did.
            if not kind.reentrant:
                self._unsure_token = token
            raise
        except Exception:
            raise
        except BaseException:
            # Cancelled or interrupted while a reply was on its way: the server may have
            # granted the hold, so hand it back (the token is ours alone).
            if not kind.reentrant:
                self._unsure_token = token  # kept should the hand-back fail
                with contextlib.suppress(Exception):
                    yield backend.op_release(name, token, kind)
                    self._unsure_token = None
            raise
        self._unsure_token = None  # answered: the token holds what the answer says
        if not attempt.acquired:
            if blocking and timeout:
                acquire_timed_out.send_robust(sender=Lock, lock=self, timeout=timeout)
            return False
        self._record(owner, actor, token, ttl_ms, attempt)
        return True

    def _wait(
        self, token: str, ttl_ms: int, meta: str, waiter: str | None, deadline: float | None
    ) -> Steps[Attempt]:
        """Sleep until a release (pub/sub) or the holder's expiry; never poll blindly."""
        backend, name, kind = self.backend, self.name, self.kind
        fair = kind.fair
        handle = yield _Watch(waiter, True) if waiter else _Watch(backend.channel(name), False)
        attempt = Attempt(False)
        try:
            while True:
                # Registered before this try, so a release right after it still wakes us.
                remaining = float("inf") if deadline is None else deadline - time.monotonic()
                if fair:  # the queue keeps our place until then
                    wait_ms = to_ms(min(max(remaining, 0.0), WAITER_LEASE))
                else:  # registered (with an id) or not
                    wait_ms = 0 if waiter else -1
                attempt = yield backend.op_acquire(name, token, ttl_ms, meta, kind, waiter, wait_ms)
                handle[1].baton = False  # tried: a wake-up we were handed is used up
                if attempt.acquired:
                    return attempt
                remaining = float("inf") if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return attempt
                hint = attempt.count_or_wait  # ms until the hold expires or the queue moves
                pause = max(hint / 1000, 0.001) if hint >= 0 else self.lock_ttl
                if fair:  # come back before our place in the queue lapses
                    pause = min(pause, WAITER_LEASE / 2)
                yield _Sleep(handle[1], min(pause, remaining))
        finally:
            if waiter and not attempt.acquired:
                with contextlib.suppress(Exception):
                    yield backend.op_leave(name, waiter)
            yield _Unwatch(handle)

    def _record(self, owner: str, actor: str, token: str, ttl_ms: int, attempt: Attempt) -> None:
        with self._mutex:
            hold = self._holds.get(owner)
            if hold is None:
                hold = self._holds[owner] = _Hold(token, attempt.fence, actor)
                if not self.kind.reentrant and self.auto_renew and self.max_hold is None:
                    hold.taken = True  # renewed for as long as it is held
                    _note_taken(self.backend, self.name, actor, 1)
            hold.depth += 1
            self._lost = None
        if self.auto_renew and hold.renewer is None:
            # One watchdog thread renews sync and asyncio holds alike: it outlives any event
            # loop, so a hold taken in a short-lived loop (asyncio.run) is still renewed.
            hold.renewer = thread_renewer
            hold.renewer.soon(self, Renewal(self.name, token, ttl_ms), self.max_hold)
        if attempt.count_or_wait == 1:  # a new hold, not a re-entry
            logger.debug("redlock: acquired %s, fence %s", self._describe(), attempt.fence)
            lock_acquired.send_robust(sender=Lock, lock=self, fence=attempt.fence)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; wait up to ``timeout`` seconds (None: forever) when ``blocking``.

        In a running event loop only a non-blocking try is allowed here: await
        :meth:`aacquire` instead.
        """
        blocking, timeout = self._check_acquire(blocking, timeout)
        self._check_sync_wait(blocking, timeout)
        return self._drive(self._acquire(blocking, timeout))

    async def aacquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        blocking, timeout = self._check_acquire(blocking, timeout)
        return await self._adrive(self._acquire(blocking, timeout))

    # -- release, extend ---------------------------------------------------------------------

    def _held(self) -> tuple[str, _Hold]:
        owner = self._owner()
        hold = self._holds.get(owner)
        if hold is None:
            if self._lost is not None:
                raise LockLost(f"{self._describe()} was lost: {self._lost}")
            raise LockNotOwned(f"{self._describe()} is not held by this owner")
        return owner, hold

    def _stop_renewing(self, hold: _Hold) -> None:
        renewer, hold.renewer = hold.renewer, None  # first: a hold still pending stays out
        if renewer is not None:
            renewer.remove(self, hold.token)

    def _untake(self, hold: _Hold) -> None:
        """Not counted as taken any more: released, lost, or no longer renewed (it runs out)."""
        if hold.taken:
            hold.taken = False
            _note_taken(self.backend, self.name, hold.actor, -1)

    def _forget(self, owner: str, hold: _Hold) -> bool:
        """Drop a hold from this Lock (called locked); False if it was gone already."""
        if self._holds.get(owner) is not hold:
            return False
        del self._holds[owner]
        self._stop_renewing(hold)
        self._untake(hold)
        return True

    def _renewed_by(self, renewer: Renewer, token: str) -> bool:
        """Whether a hold with this token is held and meant to be renewed by ``renewer``."""
        return any(h.token == token and h.renewer is renewer for h in self._holds.values())

    def _release(self) -> Steps[None]:
        owner, hold = self._held()
        if hold.depth <= 1:
            # Whatever the release's fate (Redis may not answer), stop renewing: at worst
            # the hold runs out at its TTL, and release() can be called again meanwhile.
            self._stop_renewing(hold)
            with self._mutex:
                self._untake(hold)
        try:
            left = yield self.backend.op_release(self.name, hold.token, self.kind)
        except LockError:
            if hold.depth > 1:
                # A nested reentrant release: count it as done. Sent again, it could free
                # the lock under the outer hold; not sent, the count is one too many at
                # worst, and the lock runs out at its TTL after the last release.
                with self._mutex:
                    hold.depth -= 1
            else:
                hold.releasing = True  # a retry that finds the token gone is not a loss
            raise
        with self._mutex:
            if self._holds.get(owner) is hold:
                hold.depth -= 1
                if left <= 0 or hold.depth <= 0:
                    self._forget(owner, hold)
        if left < 0 and not hold.releasing:
            self._declare_lost(hold, "it expired or was released by someone else")
            raise LockLost(f"{self._describe()} was lost before release: {self._lost}")
        if left <= 0:
            logger.debug("redlock: released %s", self._describe())
            lock_released.send_robust(sender=Lock, lock=self)

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
        _, hold = self._held()
        ttl_ms = to_ms(self.lock_ttl if seconds is None else seconds)
        extended = yield self.backend.op_extend(self.name, hold.token, ttl_ms)
        if not extended:
            self._mark_lost(hold.token, "it expired or was released by someone else")
            if hold.releasing:
                raise LockNotOwned(f"{self._describe()} was released")
            raise LockLost(f"{self._describe()} could not be extended: {self._lost}")
        if seconds is not None:
            self.lock_ttl = seconds
        if hold.renewer is not None:
            hold.renewer.add(self, Renewal(self.name, hold.token, ttl_ms), self.max_hold)

    def extend(self, ttl: float | None = None) -> None:
        """Reset the hold's TTL to ``ttl`` seconds (default: the lock's) from now on."""
        self._drive(self._extend(ttl))

    async def aextend(self, ttl: float | None = None) -> None:
        await self._adrive(self._extend(ttl))

    def _adopt(self, token: Any) -> Steps[None]:
        if not isinstance(token, str) or not token:
            raise TypeError(f"token must be a non-empty str, not {token!r}")
        if self.kind.reentrant:
            raise LockError(f"{self._describe()}: a reentrant hold belongs to its owner")
        if "" in self._holds:
            raise LockError(f"{self._describe()} is already held by this Lock object")
        info = yield self.backend.op_inspect(self.name)
        if info is None or info.token != token:
            raise LockNotOwned(f"{self._describe()}: token {token!r} holds nothing")
        ttl_ms = to_ms(self.lock_ttl)
        self._record("", owner_id(), token, ttl_ms, Attempt(True, info.fence, 0))

    def adopt(self, token: str) -> None:
        """Become the holder of an existing plain hold by its token (e.g. taken by another
        process, to extend or release it here); ``LockNotOwned`` if it holds nothing. The
        adopting object renews it from now on (``auto_renew``), with its own TTL."""
        self._drive(self._adopt(token))

    async def aadopt(self, token: str) -> None:
        await self._adrive(self._adopt(token))

    def _declare_lost(self, hold: _Hold, reason: str) -> None:
        """The backend answered that ``hold``'s token holds nothing: tell everyone."""
        self._lost = reason
        logger.warning("redlock: %s lost: %s", self._describe(), reason)
        lock_lost.send_robust(sender=Lock, lock=self, reason=reason)

    def _mark_lost(self, token: str, reason: str) -> None:
        with self._mutex:
            owner = next((o for o, h in self._holds.items() if h.token == token), None)
            if owner is None:
                return
            hold = self._holds[owner]
            self._forget(owner, hold)
        if not hold.releasing:  # else our own release, whose reply was lost, freed it
            self._declare_lost(hold, reason)

    # -- queries -----------------------------------------------------------------------------

    def _owned(self) -> Steps[bool]:
        hold = self._holds.get(self._owner())
        if hold is None:
            return False
        # An error (no answer) propagates: unknown is not lost.
        if (yield self.backend.op_hold_count(self.name, hold.token)) > 0:
            return True
        self._mark_lost(hold.token, "it expired or was released by someone else")
        return False

    def owned(self) -> bool:
        """Whether this owner holds the lock, as Redis says now."""
        return self._drive(self._owned())

    async def aowned(self) -> bool:
        return await self._adrive(self._owned())

    def _hold_count(self) -> Steps[int]:
        hold = self._holds.get(self._owner())
        if hold is None:
            return 0
        return cast(int, (yield self.backend.op_hold_count(self.name, hold.token)))

    def hold_count(self) -> int:
        """How many times this owner holds the lock now (0: not at all)."""
        return self._drive(self._hold_count())

    async def ahold_count(self) -> int:
        return await self._adrive(self._hold_count())

    def _locked(self) -> Steps[bool]:
        return cast(bool, (yield self.backend.op_locked(self.name)))

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return self._drive(self._locked())

    async def alocked(self) -> bool:
        return await self._adrive(self._locked())

    def _ttl(self) -> Steps[float | None]:
        pttl = yield self.backend.op_pttl(self.name)
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
        return None if hold is None else hold.fence

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
        return LockNotAcquired(f"{self._describe()} could not be acquired{waited}")

    def _timeout(self) -> float | None:
        return self.timeout if self.blocking else None

    def __enter__(self) -> Lock:
        self._check_sync_wait(self.blocking, self._timeout())
        if not self._drive(self._acquire(self.blocking, self._timeout())):
            raise self._not_acquired()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._drive(self._release())
        except LockNotOwned:
            if exc_type is None:
                raise
            # The body's own exception says more; the loss is logged.

    async def __aenter__(self) -> Lock:
        if not await self._adrive(self._acquire(self.blocking, self._timeout())):
            raise self._not_acquired()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._adrive(self._release())
        except LockNotOwned:
            if exc_type is None:
                raise

    def _with_name(self, name: str) -> Lock:
        return Lock(
            name,
            ttl=self.lock_ttl,
            using=self.using,
            timeout=self.timeout,
            blocking=self.blocking,
            auto_renew=self.auto_renew,
            max_hold=self.max_hold,
            reentrant=self.kind.reentrant,
            fair=self.kind.fair,
            token_prefix=self.token_prefix,
        )

    def __call__(self, func: F) -> F:
        """Use as a decorator: the name is a ``str.format`` template over the arguments."""
        name_for = name_template(self.name, inspect.signature(func), func.__qualname__)
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def locked_acall(*args: Any, **kwargs: Any) -> Any:
                async with self._with_name(name_for(args, kwargs)):
                    return await func(*args, **kwargs)

            return cast(F, locked_acall)

        @functools.wraps(func)
        def locked_call(*args: Any, **kwargs: Any) -> Any:
            with self._with_name(name_for(args, kwargs)):
                return func(*args, **kwargs)

        return cast(F, locked_call)


def name_template(
    template: str, signature: inspect.Signature, where: str
) -> Callable[[tuple, dict], str]:
    """Check a ``{arg}`` template against a signature; return the name builder.

    Fields name parameters; a function with ``**kwargs`` also lends its keyword arguments by
    name (``{user_id}`` over ``def f(**kwargs)``), so those are checked at call time.
    """
    params = signature.parameters
    extra = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(f"lock name template {template!r}: use argument names, not {{}}")
        if root not in params and extra is None:
            raise ValueError(
                f"lock name template {template!r} uses {root!r}, which is not an argument"
                f" of {where}{signature}"
            )

    def build(args: tuple, kwargs: dict) -> str:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        if extra is not None:
            values = {**values.pop(extra, {}), **values}
        try:
            return check_name(template.format(**values))
        except (KeyError, AttributeError, IndexError) as exc:
            raise ValueError(
                f"lock name template {template!r} failed for this call of {where}: {exc!r}"
            ) from exc

    return build


def lock(
    name: str,
    *,
    ttl: float | None = None,
    using: str = DEFAULT_LOCK_ALIAS,
    timeout: float | None = None,
    blocking: bool = True,
    auto_renew: bool = True,
    max_hold: float | None = None,
    reentrant: bool = False,
    fair: bool = False,
    token_prefix: str | None = None,
) -> Lock:
    """A :class:`Lock` on backend ``using``; use with ``with``, ``async with``, as a
    decorator, or by hand. ``token_prefix`` starts every hold token (the rest is random), so
    another process that knows it can find and release the hold (Celery does, on revoke)."""
    return Lock(
        name,
        ttl=ttl,
        using=using,
        timeout=timeout,
        blocking=blocking,
        auto_renew=auto_renew,
        max_hold=max_hold,
        reentrant=reentrant,
        fair=fair,
        token_prefix=token_prefix,
    )
