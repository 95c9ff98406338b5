"""The Lock: what users hold. All lock logic lives here once; backends only do the I/O.

Each operation (acquire, release, ...) is written once, as a generator that yields the steps
it needs: a backend :class:`~.backends.base.Op` (one round trip), or watching a channel and
sleeping on it. Two drivers run the steps, one for threads and one for asyncio, so
``lk.acquire()`` and ``await lk.acquire()`` share every line of the algorithm.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
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
from .renewer import Renewer, loop_renewer, thread_renewer
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
    depth: int = 0  # acquisitions through this Lock object by this owner
    renewer: Renewer | None = None


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

    In a running event loop, ``acquire``, ``release``, ``extend``, ``locked``, ``owned``,
    ``ttl`` and ``hold_count`` return awaitables (or call the ``a``-prefixed twins).
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
        self._holds: dict[str, _Hold] = {}  # owner ("" for plain locks) -> hold
        self._lost: str | None = None  # why the last hold was lost, if it was
        self._mutex = threading.Lock()

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

    def _run(self, steps: Steps[T]) -> Any:
        """Run now in a thread; in a running event loop, return an awaitable."""
        return self._adrive(steps) if _in_event_loop() else self._drive(steps)

    # -- acquire -----------------------------------------------------------------------------

    def _acquire(self, blocking: bool, timeout: float | None) -> Steps[bool]:
        _check_bool(blocking, "blocking")
        timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        if not blocking and timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        owner, kind, name, backend = self._owner(), self.kind, self.name, self.backend
        if not kind.reentrant and owner in self._holds:
            raise LockError(
                f"{self._describe()} is already held by this Lock object;"
                " use reentrant=True to take it again"
            )
        started = time.monotonic()
        token = owner if kind.reentrant else f"{self.token_prefix or ''}{new_token()}"
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
        except Exception:
            raise
        except BaseException:
            # Cancelled or interrupted while a reply was on its way: the server may have
            # granted the hold, so hand it back (the token is ours alone).
            if not kind.reentrant:
                with contextlib.suppress(Exception):
                    yield backend.op_release(name, token, kind)
            raise
        if not attempt.acquired:
            if blocking and timeout:
                acquire_timed_out.send_robust(sender=Lock, lock=self, timeout=timeout)
            return False
        self._record(owner, token, ttl_ms, attempt)
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

    def _record(self, owner: str, token: str, ttl_ms: int, attempt: Attempt) -> None:
        with self._mutex:
            hold = self._holds.get(owner)
            if hold is None:
                hold = self._holds[owner] = _Hold(token, attempt.fence)
            hold.depth += 1
            self._lost = None
        if self.auto_renew and hold.renewer is None:
            hold.renewer = loop_renewer() if _in_event_loop() else thread_renewer
            hold.renewer.soon(self, Renewal(self.name, token, ttl_ms), self.max_hold)
        if attempt.count_or_wait == 1:  # a new hold, not a re-entry
            logger.debug("redlock: acquired %s, fence %s", self._describe(), attempt.fence)
            lock_acquired.send_robust(sender=Lock, lock=self, fence=attempt.fence)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Any:
        """Take the lock; wait up to ``timeout`` seconds (None: forever) when ``blocking``.

        Returns True or False (in a running event loop: an awaitable of it).
        """
        return self._run(self._acquire(blocking, timeout))

    async def aacquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
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

    def _renewed_by(self, renewer: Renewer, token: str) -> bool:
        """Whether a hold with this token is held and meant to be renewed by ``renewer``."""
        return any(h.token == token and h.renewer is renewer for h in self._holds.values())

    def _release(self) -> Steps[None]:
        owner, hold = self._held()
        if hold.depth <= 1:
            # Whatever the release's fate (Redis may not answer), stop renewing: at worst
            # the hold runs out at its TTL, and release() can be called again meanwhile.
            self._stop_renewing(hold)
        left = yield self.backend.op_release(self.name, hold.token, self.kind)
        with self._mutex:
            if self._holds.get(owner) is hold:
                hold.depth -= 1
                if left <= 0 or hold.depth <= 0:
                    del self._holds[owner]
                    self._stop_renewing(hold)
        if left < 0:
            self._lost = "it expired or was released by someone else"
            logger.warning("redlock: %s lost before release: %s", self._describe(), self._lost)
            raise LockLost(f"{self._describe()} was lost before release: {self._lost}")
        if left == 0:
            logger.debug("redlock: released %s", self._describe())
            lock_released.send_robust(sender=Lock, lock=self)

    def release(self) -> Any:
        """Release one hold; LockNotOwned (or its subclass LockLost) if it is not ours."""
        return self._run(self._release())

    async def arelease(self) -> None:
        await self._adrive(self._release())

    def _extend(self, ttl: float | None) -> Steps[None]:
        seconds = check_ttl(ttl)
        _, hold = self._held()
        if seconds is not None:
            self.lock_ttl = seconds
        ttl_ms = to_ms(self.lock_ttl)
        if not (yield self.backend.op_extend(self.name, hold.token, ttl_ms)):
            self._mark_lost(hold.token, "it expired or was released by someone else")
            raise LockLost(f"{self._describe()} could not be extended: {self._lost}")
        if hold.renewer is not None:
            hold.renewer.add(self, Renewal(self.name, hold.token, ttl_ms), self.max_hold)

    def extend(self, ttl: float | None = None) -> Any:
        """Reset the hold's TTL to ``ttl`` seconds (default: the lock's) from now on."""
        return self._run(self._extend(ttl))

    async def aextend(self, ttl: float | None = None) -> None:
        await self._adrive(self._extend(ttl))

    def _mark_lost(self, token: str, reason: str) -> None:
        with self._mutex:
            owner = next((o for o, h in self._holds.items() if h.token == token), None)
            if owner is None:
                return
            hold = self._holds.pop(owner)
            self._lost = reason
            self._stop_renewing(hold)
        logger.warning("redlock: %s lost: %s", self._describe(), reason)
        lock_lost.send_robust(sender=Lock, lock=self, reason=reason)

    # -- queries -----------------------------------------------------------------------------

    def _owned(self) -> Steps[bool]:
        hold = self._holds.get(self._owner())
        if hold is None:
            return False
        if (yield self.backend.op_hold_count(self.name, hold.token)) > 0:
            return True
        self._mark_lost(hold.token, "it expired or was released by someone else")
        return False

    def owned(self) -> Any:
        """Whether this owner holds the lock, as Redis says now."""
        return self._run(self._owned())

    async def aowned(self) -> bool:
        return await self._adrive(self._owned())

    def _hold_count(self) -> Steps[int]:
        hold = self._holds.get(self._owner())
        if hold is None:
            return 0
        return cast(int, (yield self.backend.op_hold_count(self.name, hold.token)))

    def hold_count(self) -> Any:
        """How many times this owner holds the lock now (0: not at all)."""
        return self._run(self._hold_count())

    async def ahold_count(self) -> int:
        return await self._adrive(self._hold_count())

    def _locked(self) -> Steps[bool]:
        return cast(bool, (yield self.backend.op_locked(self.name)))

    def locked(self) -> Any:
        """Whether anyone holds the lock."""
        return self._run(self._locked())

    async def alocked(self) -> bool:
        return await self._adrive(self._locked())

    def _ttl(self) -> Steps[float | None]:
        pttl = yield self.backend.op_pttl(self.name)
        return None if pttl is None else pttl / 1000

    def ttl(self) -> Any:
        """Seconds left on the current hold of this name (whoever holds it); None if free."""
        return self._run(self._ttl())

    async def attl(self) -> float | None:
        return await self._adrive(self._ttl())

    @property
    def fence(self) -> int | None:
        """The fencing token of this owner's current hold; None when not held."""
        hold = self._holds.get(self._owner())
        return None if hold is None else hold.fence

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
