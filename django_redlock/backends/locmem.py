"""Locks inside one process: the same semantics (TTL, fencing, waking waiters) without Redis.

For users' unit tests and single-process development. Stores are shared per LOCATION, like
Django's locmem cache, so two aliases with one LOCATION see the same locks.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..waiting import ReleaseHub, Waiter
from .base import Attempt, BaseLockBackend, LockInfo, Renewal, parse_plain_value


@dataclass
class _Hold:
    token: str
    value: str  # the same token|fence|acquired-ms|holder layout the Redis scripts write
    fence: int
    expires: float  # monotonic


@dataclass
class _Store:
    mutex: threading.Lock = field(default_factory=threading.Lock)
    holds: dict[str, _Hold] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    hub: ReleaseHub = field(default_factory=ReleaseHub)

    def live(self, name: str, now: float) -> _Hold | None:
        hold = self.holds.get(name)
        if hold is not None and hold.expires <= now:
            del self.holds[name]
            return None
        return hold


_stores: dict[str, _Store] = {}
_stores_mutex = threading.Lock()


class LocMemBackend(BaseLockBackend):
    needs_location = False

    def __init__(self, alias: str, params: Any) -> None:
        super().__init__(alias, params)
        with _stores_mutex:
            self._store = _stores.setdefault(str(self.location or ""), _Store())

    def try_acquire(self, name: str, token: str, ttl_ms: int, meta: str) -> Attempt:
        self.round_trips += 1
        store, now = self._store, time.monotonic()
        with store.mutex:
            hold = store.live(name, now)
            if hold is None:
                fence = store.fences.get(name, 0) + 1
                store.fences[name] = fence
                at = int(time.time() * 1000)
                value = f"{token}|{fence}|{at}|{meta}"
                store.holds[name] = _Hold(token, value, fence, now + ttl_ms / 1000)
                return Attempt(True, fence)
            if hold.token == token:
                hold.expires = now + ttl_ms / 1000
                return Attempt(True, hold.fence)
            return Attempt(False, None, max(0, round((hold.expires - now) * 1000)))

    def release(self, name: str, token: str) -> bool:
        return self._delete(name, token)

    def force_release(self, name: str) -> bool:
        return self._delete(name, None)

    def _delete(self, name: str, token: str | None) -> bool:
        self.round_trips += 1
        store = self._store
        with store.mutex:
            hold = store.live(name, time.monotonic())
            if hold is None or (token is not None and hold.token != token):
                return False
            del store.holds[name]
        store.hub.notify(name)
        return True

    def extend(self, name: str, token: str, ttl_ms: int) -> bool:
        return self.renew_many([Renewal(name, token, ttl_ms)])[0] is True

    def renew_many(self, renewals: Sequence[Renewal]) -> list[bool | Exception]:
        self.round_trips += 1
        store, now = self._store, time.monotonic()
        results: list[bool | Exception] = []
        with store.mutex:
            for renewal in renewals:
                hold = store.live(renewal.name, now)
                ours = hold is not None and hold.token == renewal.token
                if ours and hold is not None:
                    hold.expires = now + renewal.ttl_ms / 1000
                results.append(ours)
        return results

    def is_locked(self, name: str) -> bool:
        return self._get(name) is not None

    def holds(self, name: str, token: str) -> bool:
        hold = self._get(name)
        return hold is not None and hold.token == token

    def pttl(self, name: str) -> int | None:
        hold = self._get(name)
        return None if hold is None else max(0, round((hold.expires - time.monotonic()) * 1000))

    def _get(self, name: str) -> _Hold | None:
        self.round_trips += 1
        with self._store.mutex:
            return self._store.live(name, time.monotonic())

    def inspect(self, name: str) -> LockInfo | None:
        hold = self._get(name)
        if hold is None:
            return None
        pttl = max(0, round((hold.expires - time.monotonic()) * 1000))
        return parse_plain_value(name, self.alias, hold.value, pttl)

    def iter_locks(self, match: str = "*") -> Iterator[LockInfo]:
        with self._store.mutex:
            names = [n for n in self._store.holds if fnmatch.fnmatchcase(n, match)]
        for name in names:
            info = self.inspect(name)
            if info is not None:
                yield info

    def watch(self, name: str) -> AbstractContextManager[Waiter]:
        return self._store.hub.watch(name)

    def clear(self) -> None:
        """Forget every lock of this store (fences stay, they never go backwards)."""
        with self._store.mutex:
            names = list(self._store.holds)
            self._store.holds.clear()
        for name in names:
            self._store.hub.notify(name)
