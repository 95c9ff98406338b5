"""The watchdog: one daemon thread per process renews every held lock that asked for it.

Each hold is renewed at about a third of its TTL. Holds that fall due close together are
renewed together, one pipelined round trip per backend per batch, so 1,000 held locks cost a
few round trips per period rather than 1,000.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .backends.base import BaseLockBackend, Renewal

if TYPE_CHECKING:
    from .locking import Lock

logger = logging.getLogger("django_redlock")


@dataclass
class _Entry:
    ref: weakref.ref[Lock]
    backend: BaseLockBackend
    renewal: Renewal
    interval: float  # seconds between renewals
    due: float  # monotonic time of the next renewal
    confirmed_until: float  # the hold is certainly ours until then
    stop_at: float | None  # the cap on renewing, if any


class Renewer:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entries: dict[int, _Entry] = {}
        self._thread: threading.Thread | None = None

    def add(self, lock: Lock, renewal: Renewal, max_hold: float | None) -> None:
        now = time.monotonic()
        ttl = renewal.ttl_ms / 1000
        key = id(lock)

        def forget(_: object, key: int = key) -> None:
            self._drop(key)

        entry = _Entry(
            ref=weakref.ref(lock, forget),
            backend=lock.backend,
            renewal=renewal,
            interval=ttl / 3,
            due=now + ttl / 3,
            confirmed_until=now + ttl,
            stop_at=None if max_hold is None else now + max_hold,
        )
        with self._cond:
            self._entries[key] = entry
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="redlock-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def remove(self, lock: Lock) -> None:
        self._drop(id(lock))

    def _drop(self, key: int) -> None:
        with self._cond:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            by_backend: dict[int, list[tuple[int, _Entry]]] = defaultdict(list)
            for key, entry in batch:
                by_backend[id(entry.backend)].append((key, entry))
            for group in by_backend.values():
                self._renew(group)

    def _next_batch(self) -> list[tuple[int, _Entry]]:
        with self._cond:
            while True:
                now = time.monotonic()
                if not self._entries:
                    self._cond.wait()
                    continue
                first = min(entry.due for entry in self._entries.values())
                if first > now:
                    self._cond.wait(first - now)
                    continue
                # Take the holds due within half an interval as well, so they line up.
                batch = [
                    (key, entry)
                    for key, entry in self._entries.items()
                    if entry.due <= now + entry.interval / 2
                ]
                capped = [k for k, e in batch if e.stop_at is not None and e.stop_at <= now]
                for key in capped:
                    del self._entries[key]  # the hold now runs out at its TTL
                return [(k, e) for k, e in batch if k not in capped]

    def _renew(self, group: list[tuple[int, _Entry]]) -> None:
        backend = group[0][1].backend
        started = time.monotonic()
        try:
            results = backend.renew_many([entry.renewal for _, entry in group])
        except Exception as exc:  # a backend bug must not kill the watchdog
            logger.exception("redlock: renewing on %s failed", backend.describe())
            results = [exc] * len(group)
        lost: list[tuple[Lock, str]] = []
        with self._cond:
            for (key, entry), result in zip(group, results, strict=True):
                if self._entries.get(key) is not entry:
                    continue  # released (or re-acquired) meanwhile
                if result is True:
                    entry.due = started + entry.interval
                    entry.confirmed_until = started + entry.renewal.ttl_ms / 1000
                    continue
                now = time.monotonic()
                if result is False:
                    reason = "the lock expired or was released by someone else"
                elif now >= entry.confirmed_until:
                    reason = f"renewals failed until the TTL ran out ({result})"
                else:  # try again soon; the hold is still ours for a while
                    entry.due = now + min(entry.interval / 4, 1.0)
                    continue
                del self._entries[key]
                lock = entry.ref()
                if lock is not None:
                    lost.append((lock, reason))
        for lock, reason in lost:
            lock._mark_lost(reason)

    def _forget_after_fork(self) -> None:
        self._cond = threading.Condition()
        self._entries = {}
        self._thread = None


renewer = Renewer()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=renewer._forget_after_fork)
