"""What a Redlock knows of its nodes' health, per process: the breaker and its probes, and
the release channels of the nodes that answer.

A node that did not answer in time (or refused the connection) is *down*: operations skip it
while the other nodes can still make a quorum, so a paused or dead minority node costs them
nothing. It is not tried again by an operation: once the breaker's period is up, the next
operation starts a probe (a PING on a connection of its own) in a thread, and the node is
used again as soon as a probe is answered, so its recovery is noticed without anyone paying
a timeout for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from ..waiting import AnyWaiter, CompositeHub, Confirmation, PubSubHub
from .redis import RedisBackend

logger = logging.getLogger("django_redlock")

#: A down node is probed again (in the background) this long after it last failed.
BREAKER_SECONDS = 1.0


class Health:
    """The nodes that are down, the nodes this process has a working connection to, probes."""

    def __init__(self, size: int, breaker: float = BREAKER_SECONDS) -> None:
        self.size = size
        self.breaker = breaker
        self._mutex = threading.Lock()
        self._forget()

    def _forget(self) -> None:
        self._pid = os.getpid()
        self._down: dict[int, float] = {}  # node -> when it last failed (or a probe did)
        self._probing: set[int] = set()
        self._warm: set[int] = set()  # nodes whose pool had a working connection last time

    def check_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's knowledge is stale
            self._mutex = threading.Lock()
            self._forget()

    def down(self) -> set[int]:
        return set(self._down) if self._down else set()

    def is_down(self, i: int) -> bool:
        return i in self._down

    def warm(self, i: int) -> bool:
        """Whether taking a connection from node i's pool is unlikely to need a connect (a
        connect to a paused node waits for its timeout: those go to a thread)."""
        return i in self._warm

    def answered(self, i: int) -> None:
        if i in self._warm and i not in self._down:
            return  # nothing to change (the common case: no lock taken)
        with self._mutex:
            self._down.pop(i, None)
            self._warm.add(i)

    def failed(self, i: int) -> None:
        with self._mutex:
            self._down[i] = time.monotonic()
            self._warm.discard(i)

    def dropped(self, i: int) -> None:
        """A connection of node i was closed: the next one must connect first."""
        with self._mutex:
            self._warm.discard(i)

    def due(self) -> list[int]:
        """The down nodes to probe now (each marked as being probed)."""
        if not self._down:
            return []
        now = time.monotonic()
        with self._mutex:
            due = [i for i, at in self._down.items()
                   if now - at >= self.breaker and i not in self._probing]  # fmt: skip
            self._probing.update(due)
        return due

    def probed(self, i: int, ok: bool) -> None:
        with self._mutex:
            self._probing.discard(i)
            if ok:
                self._down.pop(i, None)
                self._warm.add(i)
            elif i in self._down:
                self._down[i] = time.monotonic()


def probe(
    health: Health, i: int, node: RedisBackend, before_up: Callable[[int], None] | None = None
) -> None:
    """PING node i on a connection of its pool (any reply, even an error, means it is back);
    run in a thread of its own: on a paused node it waits for the node's timeouts.
    ``before_up(i)`` runs once it answered, before the node counts as up again (the writes
    owed to it: see redlock_io); raising, the node stays down."""
    pool = node.client.connection_pool
    ok = False
    try:
        connection = pool.get_connection()
    except Exception:
        health.probed(i, False)
        return
    try:
        connection.send_command("PING", check_health=False)
        with contextlib.suppress(ResponseError):  # an answer all the same (no PING rights)
            connection.read_response()
        ok = True
    except Exception:
        connection.disconnect()
    finally:
        pool.release(connection)
        if ok and before_up is not None:
            try:
                before_up(i)
            except Exception:
                ok = False
        health.probed(i, ok)


def start_probes(
    health: Health, nodes: list[RedisBackend], before_up: Callable[[int], None] | None = None
) -> None:
    for i in health.due():
        threading.Thread(
            target=probe, args=(health, i, nodes[i], before_up), name="redlock-probe",
            daemon=True,
        ).start()  # fmt: skip


class NodeHub(PubSubHub):
    """A node's release channel. A node that is down wakes nobody when its connection fails:
    the releases it misses are heard on the other nodes (any majority of them publishes)."""

    failure_is_unheard = True

    def __init__(self, node: RedisBackend, quiet: Callable[[], bool]) -> None:
        super().__init__(node.client.pubsub, node.socket_timeout, node.inbox_prefix)
        self._quiet = quiet

    def notify_all(self) -> None:
        if not self._quiet():
            super().notify_all()


class QuorumHub(CompositeHub):
    """Waiters listen on the nodes that answer: subscribing on a paused node would wait for
    its confirmation (or for a connect) that never comes."""

    def __init__(
        self, hubs: list[Any], confirm_timeout: float, usable: Callable[[], set[int]]
    ) -> None:
        super().__init__(hubs, confirm_timeout)
        self._usable = usable

    def join(
        self, channel: str, waiter: AnyWaiter, by_id: bool = False, lock: str = ""
    ) -> list[Confirmation]:
        usable = self._usable()
        hubs = [hub for i, hub in enumerate(self.hubs) if i in usable]
        return self.join_hubs(hubs, channel, waiter, by_id, lock)
