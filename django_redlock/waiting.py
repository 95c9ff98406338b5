"""Waking waiters the moment a lock is freed, without polling.

A waiter registers on the lock's release channel, re-tries once, then sleeps until a release
message or the holder's remaining TTL, whichever comes first. All waiters of a backend in one
process share one :class:`ReleaseHub` (for Redis: one pub/sub connection and one reader thread).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

logger = logging.getLogger("django_redlock")


class Waiter:
    """One waiting call; woken by a release on its channel."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> bool:
        woken = self._event.wait(max(0.0, timeout))
        self._event.clear()
        return woken


class ReleaseHub:
    """In-process waiter registry; a release calls :meth:`notify`."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: dict[str, set[Waiter]] = {}

    @contextmanager
    def watch(self, channel: str) -> Iterator[Waiter]:
        waiter = Waiter()
        with self._mutex:
            first = channel not in self._waiters
            self._waiters.setdefault(channel, set()).add(waiter)
        try:
            if first:
                self._subscribe(channel)
            yield waiter
        finally:
            with self._mutex:
                group = self._waiters.get(channel)
                if group is not None:
                    group.discard(waiter)
                    last = not group
                    if last:
                        del self._waiters[channel]
                else:
                    last = False
            if last:
                self._unsubscribe(channel)

    def notify(self, channel: str) -> None:
        with self._mutex:
            waiters = list(self._waiters.get(channel, ()))
        for waiter in waiters:
            waiter.wake()

    def notify_all(self) -> None:
        with self._mutex:
            waiters = [w for group in self._waiters.values() for w in group]
        for waiter in waiters:
            waiter.wake()

    def _subscribe(self, channel: str) -> None:
        """Called for the first waiter of a channel."""

    def _unsubscribe(self, channel: str) -> None:
        """Called when the last waiter of a channel leaves."""

    def close(self) -> None:
        self.notify_all()


_pubsub_hubs: weakref.WeakSet[PubSubHub] = weakref.WeakSet()


class PubSubHub(ReleaseHub):
    """One pub/sub connection per backend per process, read by one daemon thread."""

    def __init__(self, make_pubsub: Callable[[], Any], confirm_timeout: float) -> None:
        super().__init__()
        self._make_pubsub = make_pubsub
        self._confirm_timeout = confirm_timeout
        self._pubsub: Any = None
        self._thread: threading.Thread | None = None
        self._confirmed: dict[str, threading.Event] = {}
        self._closed = False
        _pubsub_hubs.add(self)

    def _subscribe(self, channel: str) -> None:
        confirmed = threading.Event()
        with self._mutex:
            self._confirmed[channel] = confirmed
            pubsub = self._ensure_started()
        try:
            pubsub.subscribe(channel)
        except Exception as exc:  # the reader thread reconnects; waiters fall back to TTL waits
            logger.debug("redlock: subscribe to %s failed: %s", channel, exc)
            return
        # Only after the server confirmed can a re-try not miss the release message.
        confirmed.wait(self._confirm_timeout)

    def _unsubscribe(self, channel: str) -> None:
        with self._mutex:
            self._confirmed.pop(channel, None)
            pubsub = self._pubsub
        if pubsub is not None:
            try:
                pubsub.unsubscribe(channel)
            except Exception as exc:
                logger.debug("redlock: unsubscribe from %s failed: %s", channel, exc)

    def _ensure_started(self) -> Any:
        if self._pubsub is None:
            self._pubsub = self._make_pubsub()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._read_forever, name="redlock-pubsub", daemon=True
            )
            self._thread.start()
        return self._pubsub

    def _read_forever(self) -> None:
        pubsub = self._pubsub
        while not self._closed:
            try:
                message = pubsub.get_message(timeout=1.0)
            except Exception as exc:
                if self._closed:
                    return
                logger.debug("redlock: pub/sub connection failed: %s", exc)
                # A release may have been missed: let every waiter look again.
                self.notify_all()
                threading.Event().wait(0.1)
                continue
            if message is None:
                continue
            channel = message["channel"]
            if isinstance(channel, bytes):
                channel = channel.decode()
            if message["type"] in ("message", "smessage"):
                self.notify(channel)
            elif message["type"] in ("subscribe", "ssubscribe"):
                with self._mutex:
                    confirmed = self._confirmed.get(channel)
                if confirmed is not None:
                    confirmed.set()

    def close(self) -> None:
        self._closed = True
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with suppress(Exception):
                pubsub.close()
        super().close()

    def _forget_after_fork(self) -> None:
        # The reader thread does not exist in a forked child, and the parent's socket must
        # not be shared: start from nothing.
        self._pubsub = None
        self._thread = None
        self._mutex = threading.Lock()
        self._waiters = {}
        self._confirmed = {}


def _after_fork_in_child() -> None:
    for hub in list(_pubsub_hubs):
        hub._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
