"""One Redis server by URL: ``redis://``, ``rediss://`` or ``unix://``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .. import scripts
from ..exceptions import BackendUnavailable
from ..scripts import Call, script
from ..waiting import PubSubHub, Waiter
from .base import Attempt, BaseLockBackend, LockInfo, Renewal, parse_plain_value

logger = logging.getLogger("django_redlock")

#: Errors that mean "Redis did not answer", as opposed to "Redis said no".
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)
RENEW_BATCH = 500


def text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class RedisBackend(BaseLockBackend):
    """Locks on one Redis through redis-py (with hiredis), on a connection pool of its own."""

    default_options: dict[str, Any] = {
        "socket_timeout": 2.0,
        "socket_connect_timeout": 2.0,
    }

    def __init__(self, alias: str, params: Any) -> None:
        super().__init__(alias, params)
        self._client: Any = None
        self._hub: PubSubHub | None = None
        self._setup = threading.Lock()

    # -- connections -------------------------------------------------------------------------

    def make_client(self) -> Any:
        options = {**self.default_options, **self.options}
        # redis-py retries failed commands by default; a retried acquire could outlive the
        # socket timeout several times over, so one try it is (acquire is idempotent anyway).
        options.setdefault("retry", Retry(NoBackoff(), 0))
        return redis.Redis.from_url(str(self.location), **options)

    @property
    def client(self) -> Any:
        if self._client is None:
            with self._setup:
                if self._client is None:
                    self._client = self.make_client()
        return self._client

    @property
    def socket_timeout(self) -> float:
        kwargs = self.client.connection_pool.connection_kwargs
        return float(kwargs.get("socket_timeout") or 2.0)

    def _make_hub(self) -> PubSubHub:
        return PubSubHub(lambda: self.client.pubsub(), confirm_timeout=self.socket_timeout)

    @property
    def hub(self) -> PubSubHub:
        if self._hub is None:
            with self._setup:
                if self._hub is None:
                    self._hub = self._make_hub()
        return self._hub

    @contextmanager
    def _io(self, name: str) -> Iterator[None]:
        self.round_trips += 1
        try:
            yield
        except UNAVAILABLE as exc:
            raise BackendUnavailable(
                f"lock {name!r}: backend {self.describe()} is unavailable: {exc}"
            ) from exc

    def _run(self, name: str, call: Call) -> Any:
        with self._io(name):
            return scripts.run(self.client, call)

    # -- operations --------------------------------------------------------------------------

    def try_acquire(self, name: str, token: str, ttl_ms: int, meta: str) -> Attempt:
        keys = (self.key(name), self.fence_key(name))
        acquired, value = self._run(name, Call(script("acquire"), keys, (token, ttl_ms, meta)))
        if acquired:
            return Attempt(True, int(value))
        return Attempt(False, None, int(value))

    def release(self, name: str, token: str) -> bool:
        keys = (self.key(name), self.channel(name))
        return bool(self._run(name, Call(script("release"), keys, (token,))))

    def extend(self, name: str, token: str, ttl_ms: int) -> bool:
        return bool(self._run(name, Call(script("extend"), (self.key(name),), (token, ttl_ms))))

    def renew_many(self, renewals: Sequence[Renewal]) -> list[bool | Exception]:
        results: list[bool | Exception] = []
        extend = script("extend")
        for start in range(0, len(renewals), RENEW_BATCH):
            batch = renewals[start : start + RENEW_BATCH]
            calls = [Call(extend, (self.key(r.name),), (r.token, r.ttl_ms)) for r in batch]
            try:
                with self._io(batch[0].name):
                    replies = scripts.run_many(self.client, calls)
            except BackendUnavailable as exc:
                results.extend(exc for _ in batch)
                continue
            results.extend(r if isinstance(r, Exception) else bool(r) for r in replies)
        return results

    def is_locked(self, name: str) -> bool:
        with self._io(name):
            return bool(self.client.exists(self.key(name)))

    def holds(self, name: str, token: str) -> bool:
        with self._io(name):
            try:
                value = text(self.client.get(self.key(name)))
            except ResponseError:  # another kind of lock holds the name
                return False
        return isinstance(value, str) and value.startswith(f"{token}|")

    def pttl(self, name: str) -> int | None:
        with self._io(name):
            pttl = int(self.client.pttl(self.key(name)))
        return pttl if pttl >= 0 else None

    def inspect(self, name: str) -> LockInfo | None:
        kind, pttl, value = self._run(name, Call(script("inspect"), (self.key(name),), ()))
        if text(kind) != "string" or value is None:
            return None
        return parse_plain_value(name, self.alias, text(value), int(pttl))

    def force_release(self, name: str) -> bool:
        keys = (self.key(name), self.channel(name))
        return bool(self._run(name, Call(script("force_release"), keys, ())))

    def iter_locks(self, match: str = "*") -> Iterator[LockInfo]:
        pattern = f"{self.key_prefix}{{{match}}}"
        with self._io(match):
            keys = [text(k) for k in self.client.scan_iter(match=pattern, count=1000)]
        for key in keys:
            name = self.name_from_key(key)
            info = self.inspect(name) if name is not None else None
            if info is not None:
                yield info

    def watch(self, name: str) -> AbstractContextManager[Waiter]:
        return self.hub.watch(self.channel(name))

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> None:
        try:
            with self._io("(startup)"):
                scripts.register(self.client)
        except BackendUnavailable as exc:
            logger.warning("redlock: could not load the Lua scripts at startup: %s", exc)

    def close(self) -> None:
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        if self._client is not None:
            self._client.close()
            self._client = None
