"""The bound on an outermost fenced block's exit: Django's ``atomic()`` exit, the COMMIT and,
after a lost reply, the reconnect that turns autocommit back on.

Why: a reconnect is more than a handshake (``connect_timeout`` bounds only that): Django then
sends ``set_config('TimeZone', ...)`` whenever the server's time zone is not the one it wants
(and ``SET ROLE`` with ``assume_role``), statements with no timeout. A database that goes
silent after the handshake (a partition, a hung pooler that answers the startup itself)
leaves them waiting for ever, the block's lock renewed all along, every other holder of the
name waiting too. So an exit that outlives its bound has its connection's socket shut down
(on a thread of its own, the one guard thread of the process): the statement fails with a
connection error, and the block asks the COMMIT's outcome, itself bounded
(:func:`~.fence_table.commit_outcome`), instead of hanging.

The rule: only a connection still inside the exit it was armed for is cut (the exit's
``finally`` sets ``ended``, a store with no call, so no interrupt lands between; an exit
that never armed cuts nothing); one whose exit
outlives the cut (another statement waiting) is cut again each second. PostgreSQL only (a
socket to cut: ``fileno()``); SQLite runs in the process.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any

from . import forks
from .waiters import start_thread

logger = logging.getLogger("django_redlock")

#: How long after a cut the guard looks again at an exit still running.
AGAIN = 1.0


class Exit:
    """One outermost block's exit, armed with a deadline ``seconds`` from :meth:`arm`;
    ``ended`` set as the exit ends, however (its ``finally``). ``wrapper``: the block's Django
    connection (``connections[using]``: read from the guard thread for its current raw
    connection, which a reconnect replaces)."""

    __slots__ = ("ended", "seconds", "thread", "wrapper")

    def __init__(self, wrapper: Any, seconds: float) -> None:
        self.wrapper, self.seconds, self.ended = wrapper, seconds, False
        self.thread = threading.current_thread()

    def arm(self) -> None:
        _guard[0].add(self, time.monotonic() + self.seconds)

    def due(self) -> bool:
        return not self.ended and self.thread.is_alive()


class _Guard:
    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.heap: list[tuple[float, int, Exit]] = []
        self.serial = itertools.count()
        self.thread: threading.Thread | None = None

    def add(self, exit_: Exit, deadline: float) -> None:
        with self.cond:
            heapq.heappush(self.heap, (deadline, next(self.serial), exit_))
            if self.thread is None:
                thread = threading.Thread(target=self.run, name="redlock-exit-guard", daemon=True)
                self.thread = thread
                try:
                    start_thread(thread)
                except RuntimeError as exc:  # no thread to be had: unbounded, as before
                    self.thread = None
                    logger.debug("redlock: no exit guard thread: %s", exc)
            elif self.heap[0][2] is exit_:  # sooner than the one it waits for
                self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                while self.heap and not self.heap[0][2].due():
                    heapq.heappop(self.heap)  # ended: the common case, dropped unlooked-at
                if not self.heap:
                    self.thread = None  # idle: the next exit starts another
                    return
                deadline, _, exit_ = self.heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self.cond.wait(min(wait, 60.0))
                    continue
                heapq.heapreplace(self.heap, (time.monotonic() + AGAIN, next(self.serial), exit_))
            _cut(exit_)


def _cut(exit_: Exit) -> None:
    """Shut down the socket of the exit's current connection (a dup of its descriptor: the
    driver's own is left to the driver, which then sees the connection closed)."""
    raw = exit_.wrapper.connection
    fileno = getattr(raw, "fileno", None)
    if fileno is None or not exit_.due():
        return  # between connections (its connect is bounded by connect_timeout), or ended
    with contextlib.suppress(Exception):  # (closed meanwhile: nothing to cut)
        fd = os.dup(fileno())
        with socket.socket(fileno=fd) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        logger.warning(
            "redlock: a fenced block's exit on database %r outlived its bound (%g s): its"
            " connection was cut, the COMMIT's outcome is asked",
            exit_.wrapper.alias,
            exit_.seconds,
        )


_guard = [_Guard()]


@forks.after_fork_in_child
def _forget_guard() -> None:
    _guard[0] = _Guard()  # the parent's thread and exits are not the child's
