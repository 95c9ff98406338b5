"""redis-py's ``Lock`` API over django-redlock's locks: a drop-in ``lock_class``.

    client.lock("report", timeout=30, lock_class=RedisPyLock)

or, for every ``client.lock(...)`` of a client (and so django-redis's ``cache.lock(...)``),
the client class :class:`Redis` (django-redis: ``"REDIS_CLIENT_CLASS":
"django_redlock.compat.Redis"`` in the cache's OPTIONS).

redis-py's semantics are kept (``timeout``, ``blocking``, ``blocking_timeout``,
``thread_local``, ``token=``, ``extend(additional_time, replace_ttl)``, ``reacquire()``,
``raise_on_release_error``, and its ``LockError`` / ``LockNotOwnedError``), with our
guarantees underneath: waiters are woken by the release instead of polling every ``sleep``,
holds carry fencing tokens, and there are no immortal locks: ``timeout=None`` is a hold
renewed by the watchdog for as long as this process holds it, freed at the backend's TTL
after the process dies. The key is ``redlock:{name}``, not ``name``: during a migration,
redis-py's own ``Lock`` and this one do not exclude each other on the same name.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace, TracebackType
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import LockError as RedisLockError
from redis.exceptions import LockNotOwnedError as RedisLockNotOwnedError
from redis.exceptions import NoPermissionError as RedisNoPermissionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..backends.base import BaseLockBackend, Op
from ..backends.redis import RedisBackend
from ..exceptions import BackendUnavailable, LockError, LockNotOwned, MissingPermission
from ..locking import Lock, finisher

logger = logging.getLogger("django_redlock")

#: The backend of each client used: keyed weakly by the client, and the backend holds the
#: client weakly too (a strong reference in the value would keep its own key, and with it
#: the client's pool and connections, for the life of the process).
_backends: weakref.WeakKeyDictionary[Any, RedisBackend] = weakref.WeakKeyDictionary()
_backends_mutex = threading.Lock()


class _ClientBackend(RedisBackend):
    """A RedisBackend on a client the user made (its pool, its timeouts), which it holds
    weakly: the client lives as long as the user (and each lock made on it) keeps it. Not
    ours to close: ``close()`` leaves it alone (``_client``, which it would close, stays
    None)."""

    def __init__(self, client: Any) -> None:
        kwargs = client.connection_pool.connection_kwargs
        where = f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        super().__init__(f"redis-py client {where}", {"LOCATION": where})
        self._ref = weakref.ref(client)

    @property
    def client(self) -> Any:
        client = self._ref()
        if client is None:  # each lock holds its client: only a caller of none gets here
            raise ReferenceError(f"the redis-py client of {self.alias!r} is gone")
        return client

    def make_client(self) -> Any:
        return self.client

    def _call_timeout(self, client: Any) -> float | None:
        timeout = super()._call_timeout(client)
        self._timeout_of = None  # it keeps the client: read again per op (no I/O)
        return timeout


def _backend(client: Any) -> RedisBackend:
    with _backends_mutex:
        backend = _backends.get(client)
        if backend is None:
            finisher.ensure_started()  # (here: the finalizer below may not start it)
            backend = _backends[client] = _ClientBackend(client)
            # Once the client goes: the backend's hub (a reader thread and its pub/sub
            # connection) and watchdog worker go too. Not at exit: never closed there before.
            # On the finisher: the close joins the reader and disconnects pools, which a
            # finalizer may not (any thread, any lock held: finisher.py).
            weakref.finalize(client, finisher.hand, backend.close).atexit = False
        return backend


# -- errors: what redis-py's Lock raises, and still ours -----------------------------------------
# A drop-in raises what the original raises: code written for redis-py catches
# redis.exceptions.ConnectionError / TimeoutError / LockError. Each class below is also the
# matching django_redlock error, so code written for this app catches it too.


class ConnectionUnavailable(BackendUnavailable, RedisConnectionError):
    """The Redis could not be reached or the connection was cut (redis-py's Lock:
    ``redis.exceptions.ConnectionError``); a :class:`~django_redlock.BackendUnavailable`."""


class TimeoutUnavailable(BackendUnavailable, RedisTimeoutError):
    """No answer within the socket timeout (redis-py's Lock: ``redis.exceptions.TimeoutError``);
    a :class:`~django_redlock.BackendUnavailable` with ``timed_out``."""


class PermissionRefused(MissingPermission, RedisNoPermissionError):
    """The client's Redis user may not do what the lock needs (redis-py's Lock:
    ``redis.exceptions.NoPermissionError``); a :class:`~django_redlock.MissingPermission`."""


class DropInLockError(LockError, RedisLockError):
    """Any other refusal of ours (redis-py's Lock: ``redis.exceptions.LockError``), such as a
    thread waiting with no timeout for a lock it holds itself; a
    :class:`~django_redlock.LockError`."""


@contextmanager
def _as_redis_py(name: str) -> Iterator[None]:
    """Our errors raised as the classes above (LockNotOwned: each method's own message)."""
    try:
        yield
    except (RedisLockError, LockNotOwned, RedisConnectionError, RedisTimeoutError):
        raise
    except RedisNoPermissionError:
        raise
    except MissingPermission as exc:
        raise PermissionRefused(str(exc), exc.needs, exc.rule) from exc
    except BackendUnavailable as exc:
        unavailable = TimeoutUnavailable if exc.timed_out else ConnectionUnavailable
        raise unavailable(str(exc), exc.timed_out) from exc
    except LockError as exc:
        raise DropInLockError(str(exc), lock_name=name) from exc


class _Local(threading.local):
    """Per thread: every thread starts with no hold (redis-py's ``local.token``)."""

    token: bytes | None = None
    held: _Held | None = None


class _Held(Lock):
    """One hold of a RedisPyLock: our Lock on the client's backend."""

    def __init__(self, client: Any, name: str, **kwargs: Any) -> None:
        self._client = client
        super().__init__(name, **kwargs)

    def _backend_for(self, using: str) -> BaseLockBackend:
        return _backend(self._client)

    _own_token: str | None = None

    def use_token(self, token: str) -> None:
        self._own_token = token
        super().use_token(token)

    def _op_hand_back(self, token: str, *args: Any, **kwargs: Any) -> Op[int]:
        # A caller's own token (token=) is tried again: a marker would refuse the free lock
        # to it for minutes. A late try's grant is the token's, found by its next acquire.
        if token == self._own_token:
            return self._op_release(token)
        return super()._op_hand_back(token, *args, **kwargs)


def _hand_back(held: _Held) -> None:
    """Release ``held`` if it took its hold: its taker was interrupted before it could pass it
    on, so nobody else would (a hold with no timeout is renewed while the object lives)."""
    if held.token is None:
        return
    try:
        held.release()
    except LockError as exc:  # not held any more, or no answer: it expires at its TTL
        logger.warning("redlock: could not hand back %r after an interrupt: %s", held.name, exc)


class RedisPyLock:
    """redis-py's ``redis.lock.Lock``, on django-redlock (see the module's docstring)."""

    def __init__(
        self,
        redis: Any,
        name: str,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
    ) -> None:
        self.redis = redis
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.timeout = timeout
        self.sleep = sleep  # accepted; waiters are woken by the release instead
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.thread_local = bool(thread_local)
        self.raise_on_release_error = raise_on_release_error
        self.local: Any = _Local() if self.thread_local else SimpleNamespace(token=None, held=None)
        # Checks the arguments now, as redis-py would fail later: no Redis call yet.
        self._new()

    def _new(self) -> _Held:
        # Named after the client's own backend (messages, lock_lost, incidents), not "default".
        using = _backend(self.redis).alias
        if self.timeout:  # redis-py's timeout: the hold expires after it, unless extended
            return _Held(
                self.redis, self.name, ttl=float(self.timeout), auto_renew=False, using=using
            )
        return _Held(self.redis, self.name, using=using)  # no timeout: renewed while held

    def _held(self) -> _Held | None:
        return self.local.held

    def __enter__(self) -> RedisPyLock:
        before = self._held()
        try:
            if self.acquire():
                return self
        except BaseException:
            # Interrupted once acquire() took the hold (as it returned): __exit__ never runs,
            # and the watchdog would renew the hold for as long as this object lives.
            held = self._held()
            if held is not None and held is not before:
                self.local.held = self.local.token = None
                _hand_back(held)
            raise
        raise RedisLockError(
            "Unable to acquire lock within the time specified", lock_name=self.name
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except RedisLockError:
            if self.raise_on_release_error:
                raise
            logger.warning("Lock was unlocked or no longer owned when exiting context manager.")

    def acquire(
        self,
        sleep: float | None = None,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """As redis-py's: True once acquired; False when not blocking, or after
        ``blocking_timeout`` seconds. A ``token`` of your own is used as the hold's token.
        An acquire with it interrupted while its try was on the wire does not refuse that
        token later: the try, if it lands after the hand-back, holds the lock for the token
        until the token's next acquire takes it up (or its TTL)."""
        blocking = self.blocking if blocking is None else blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        held = self._new()
        if token is not None:  # used as it is: the try is then idempotent, like a retry
            text = token.decode() if isinstance(token, bytes) else str(token)
            if not text or "|" in text:
                raise ValueError(f"token must be non-empty text without '|', not {token!r}")
            held.use_token(text)
        timeout = None if blocking_timeout is None else max(0.0, float(blocking_timeout))
        try:
            with _as_redis_py(self.name):
                acquired = held.acquire(
                    blocking=bool(blocking), timeout=timeout if blocking else None
                )
            if not acquired:
                return False
            self.local.held = held
            self.local.token = held.token.encode() if held.token is not None else None
        except BaseException:
            # An interrupt once the hold was taken: the caller is told nothing was acquired.
            if self.local.held is held:
                self.local.held = self.local.token = None
            _hand_back(held)
            raise
        return True

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        with _as_redis_py(self.name):
            return self._new().locked()

    def owned(self) -> bool:
        """Whether this lock (in this thread, with ``thread_local``) holds it now."""
        held = self._held()
        with _as_redis_py(self.name):
            return held is not None and held.owned()

    def release(self) -> None:
        held = self._held()
        if held is None:
            raise RedisLockError(
                "Cannot release a lock that's not owned or is already unlocked.",
                lock_name=self.name,
            )
        self.local.held = self.local.token = None
        try:
            with _as_redis_py(self.name):
                held.release()
        except LockNotOwned as exc:
            raise RedisLockNotOwnedError(
                "Cannot release a lock that's no longer owned", lock_name=self.name
            ) from exc

    def extend(self, additional_time: float, replace_ttl: bool = False) -> bool:
        """Add ``additional_time`` seconds to the hold's TTL (or set it, ``replace_ttl``)."""
        held = self._held()
        if held is None:
            raise RedisLockError("Cannot extend an unlocked lock", lock_name=self.name)
        if self.timeout is None:
            raise RedisLockError("Cannot extend a lock with no timeout", lock_name=self.name)
        try:
            with _as_redis_py(self.name):
                ttl = float(additional_time)
                if not replace_ttl:
                    ttl += held.ttl() or 0.0
                held.extend(ttl)
        except LockNotOwned as exc:
            raise RedisLockNotOwnedError(
                "Cannot extend a lock that's no longer owned", lock_name=self.name
            ) from exc
        return True

    def reacquire(self) -> bool:
        """Reset the hold's TTL to ``timeout``."""
        held = self._held()
        if held is None:
            raise RedisLockError("Cannot reacquire an unlocked lock", lock_name=self.name)
        if self.timeout is None:
            raise RedisLockError("Cannot reacquire a lock with no timeout", lock_name=self.name)
        try:
            with _as_redis_py(self.name):
                held.extend(float(self.timeout))
        except LockNotOwned as exc:
            raise RedisLockNotOwnedError(
                "Cannot reacquire a lock that's no longer owned", lock_name=self.name
            ) from exc
        return True

    @property
    def fence(self) -> int | None:
        """The fencing token of this lock's current hold (ours, not redis-py's)."""
        held = self._held()
        return None if held is None else held.fence


class Redis(redis.Redis):
    """A redis-py client whose ``lock()`` makes a :class:`RedisPyLock` unless told otherwise
    (django-redis: ``"REDIS_CLIENT_CLASS": "django_redlock.compat.Redis"``)."""

    def lock(
        self,
        name: Any,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        lock_class: Any = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
    ) -> Any:
        return (lock_class or RedisPyLock)(
            self,
            name,
            timeout=timeout,
            sleep=sleep,
            blocking=blocking,
            blocking_timeout=blocking_timeout,
            thread_local=thread_local,
            raise_on_release_error=raise_on_release_error,
        )


__all__ = [
    "ConnectionUnavailable",
    "DropInLockError",
    "LockError",
    "PermissionRefused",
    "Redis",
    "RedisPyLock",
    "TimeoutUnavailable",
]
