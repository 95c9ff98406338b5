"""The Lock: what users hold. All lock logic lives here once; backends only do the I/O."""

from __future__ import annotations

import functools
import inspect
import logging
import string
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, cast

from .backends.base import Attempt, BaseLockBackend, Renewal
from .exceptions import LockError, LockLost, LockNotAcquired, LockNotOwned
from .handler import DEFAULT_LOCK_ALIAS, locks
from .identity import holder_meta, new_token
from .renewer import renewer
from .signals import lock_acquired, lock_lost, lock_released
from .validation import check_name, check_optional_seconds, to_ms

logger = logging.getLogger("django_redlock")

F = TypeVar("F", bound=Callable[..., Any])


def _check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {value!r}")
    return value


class Lock:
    """A named lock on one backend; not acquired until :meth:`acquire` or ``with``.

    A plain Lock object is the holder: whoever has the object may release it, so it can be
    handed to another thread. Every acquisition gets a fresh random token and a fencing
    token that is strictly greater than any earlier one for the same name.
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
    ) -> None:
        self.name = check_name(name)
        ttl = check_optional_seconds(ttl, "ttl")
        self.timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        self.blocking = _check_bool(blocking, "blocking")
        self.auto_renew = _check_bool(auto_renew, "auto_renew")
        self.max_hold = check_optional_seconds(max_hold, "max_hold")
        if _check_bool(reentrant, "reentrant") or _check_bool(fair, "fair"):
            raise NotImplementedError("reentrant and fair locks are not available yet")
        if not isinstance(using, str):
            raise TypeError(f"using must be a backend alias (str), not {using!r}")
        self.using = using
        self.backend: BaseLockBackend = locks[using]  # unknown alias: error, still no I/O
        self.lock_ttl = ttl if ttl is not None else self.backend.default_ttl
        self._token: str | None = None
        self._fence: int | None = None
        self._lost: str | None = None  # why the last hold was lost, if it was
        self._mutex = threading.Lock()

    def __repr__(self) -> str:
        state = f"held, fence {self._fence}" if self._token else "lost" if self._lost else "free"
        return f"<Lock {self.name!r} on {self.using!r}: {state}>"

    def _describe(self) -> str:
        return f"lock {self.name!r} on backend {self.using!r}"

    # -- acquire -----------------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; wait up to ``timeout`` seconds (None: forever) when ``blocking``."""
        _check_bool(blocking, "blocking")
        timeout = check_optional_seconds(timeout, "timeout", allow_zero=True)
        if not blocking and timeout:
            raise ValueError("a timeout makes no sense with blocking=False")
        if self._token is not None:
            raise LockError(
                f"{self._describe()} is already held by this Lock object;"
                " use reentrant=True to take it again"
            )
        started = time.monotonic()
        token, meta, ttl_ms = new_token(), holder_meta(), to_ms(self.lock_ttl)
        attempt = self.backend.try_acquire(self.name, token, ttl_ms, meta)
        if not attempt.acquired and blocking and timeout != 0:
            deadline = None if timeout is None else started + timeout
            attempt = self._wait(token, ttl_ms, meta, deadline)
        if not attempt.acquired:
            return False
        with self._mutex:
            self._token, self._fence, self._lost = token, attempt.fence, None
        if self.auto_renew:
            renewer.add(self, Renewal(self.name, token, ttl_ms), self.max_hold)
        logger.debug("redlock: acquired %s, fence %s", self._describe(), attempt.fence)
        lock_acquired.send_robust(sender=Lock, lock=self, fence=attempt.fence)
        return True

    def _wait(self, token: str, ttl_ms: int, meta: str, deadline: float | None) -> Attempt:
        """Sleep until the holder releases (pub/sub) or its TTL runs out; never poll blindly."""
        with self.backend.watch(self.name) as waiter:
            while True:
                # Registered before this try, so a release right after it still wakes us.
                attempt = self.backend.try_acquire(self.name, token, ttl_ms, meta)
                if attempt.acquired:
                    return attempt
                remaining = float("inf") if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return attempt
                if attempt.pttl_ms >= 0:  # woken at the holder's expiry at the latest
                    pause = max(attempt.pttl_ms / 1000, 0.001)
                elif attempt.pttl_ms == -2:  # freed between the two reads
                    pause = 0.0
                else:  # a key without expiry (not ours): wait for its release message
                    pause = self.lock_ttl
                waiter.wait(min(pause, remaining))

    # -- release, extend ---------------------------------------------------------------------

    def _held_token(self) -> str:
        token = self._token
        if token is None:
            if self._lost is not None:
                raise LockLost(f"{self._describe()} was lost: {self._lost}")
            raise LockNotOwned(f"{self._describe()} is not held by this Lock object")
        return token

    def release(self) -> None:
        """Free the lock; LockNotOwned (or its subclass LockLost) if it is not ours any more."""
        token = self._held_token()
        renewer.remove(self)
        released = self.backend.release(self.name, token)
        with self._mutex:
            if self._token == token:
                self._token = self._fence = None
        if not released:
            self._mark_lost("it expired or was released by someone else", signal=False)
            raise LockLost(f"{self._describe()} was lost before release: {self._lost}")
        logger.debug("redlock: released %s", self._describe())
        lock_released.send_robust(sender=Lock, lock=self)

    def extend(self, ttl: float | None = None) -> None:
        """Reset the hold's TTL to ``ttl`` (default: the lock's) from now on."""
        seconds = check_optional_seconds(ttl, "ttl")
        token = self._held_token()
        if seconds is not None:
            self.lock_ttl = seconds
        ttl_ms = to_ms(self.lock_ttl)
        if not self.backend.extend(self.name, token, ttl_ms):
            self._mark_lost("it expired or was released by someone else")
            raise LockLost(f"{self._describe()} could not be extended: {self._lost}")
        if self.auto_renew:
            renewer.add(self, Renewal(self.name, token, ttl_ms), self.max_hold)

    def _mark_lost(self, reason: str, *, signal: bool = True) -> None:
        with self._mutex:
            if self._token is None and self._lost is not None:
                return
            self._token, self._fence, self._lost = None, None, reason
        renewer.remove(self)
        logger.warning("redlock: %s lost: %s", self._describe(), reason)
        if signal:
            lock_lost.send_robust(sender=Lock, lock=self, reason=reason)

    # -- queries -----------------------------------------------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return self.backend.is_locked(self.name)

    def owned(self) -> bool:
        """Whether this Lock object holds it, as Redis says now."""
        token = self._token
        if token is None:
            return False
        if self.backend.holds(self.name, token):
            return True
        if self._token == token:
            self._mark_lost("it expired or was released by someone else")
        return False

    def ttl(self) -> float | None:
        """Seconds left on the current hold of this name (whoever holds it); None if free."""
        pttl = self.backend.pttl(self.name)
        return None if pttl is None else pttl / 1000

    @property
    def fence(self) -> int | None:
        """The fencing token of this object's current hold; None when not held."""
        return self._fence

    @property
    def lost(self) -> str | None:
        """Why the last hold was lost, or None."""
        return self._lost

    # -- with, decorator ---------------------------------------------------------------------

    def __enter__(self) -> Lock:
        if not self.acquire(self.blocking, self.timeout if self.blocking else None):
            waited = "" if self.timeout is None else f" within {self.timeout:g} s"
            raise LockNotAcquired(f"{self._describe()} could not be acquired{waited}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockNotOwned:
            if exc_type is None:
                raise
            # The body's own exception says more; the loss is logged by _mark_lost.

    def _with_name(self, name: str) -> Lock:
        return Lock(
            name,
            ttl=self.lock_ttl,
            using=self.using,
            timeout=self.timeout,
            blocking=self.blocking,
            auto_renew=self.auto_renew,
            max_hold=self.max_hold,
        )

    def __call__(self, func: F) -> F:
        """Use as a decorator: the name is a ``str.format`` template over the arguments."""
        name_for = name_template(self.name, func)

        @functools.wraps(func)
        def locked_call(*args: Any, **kwargs: Any) -> Any:
            with self._with_name(name_for(args, kwargs)):
                return func(*args, **kwargs)

        return cast(F, locked_call)


def name_template(template: str, func: Callable[..., Any]) -> Callable[[tuple, dict], str]:
    """Check a ``{arg}`` template against ``func``'s signature; return the name builder."""
    signature = inspect.signature(func)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(f"lock name template {template!r}: use argument names, not {{}}")
        if root not in signature.parameters and not takes_kwargs:
            raise ValueError(
                f"lock name template {template!r} uses {root!r}, which is not an argument"
                f" of {func.__qualname__}{signature}"
            )

    def build(args: tuple, kwargs: dict) -> str:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        try:
            return check_name(template.format(**bound.arguments))
        except (KeyError, AttributeError, IndexError) as exc:
            raise ValueError(f"lock name template {template!r} failed: {exc!r}") from exc

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
) -> Lock:
    """A :class:`Lock` on backend ``using``; use with ``with``, as a decorator, or by hand."""
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
    )
