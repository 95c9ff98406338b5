"""What a Redlock knows of its nodes' health, per process: the breaker and its probes, and
the release channels of the nodes that answer.

A node that did not answer in time (or refused the connection) is *down*: operations skip it
while the other nodes can still make a quorum, so a paused or dead minority node costs them
nothing. It is tried again by an operation only when the nodes it asked fall short of a
quorum (see redlock_io's ``Fan.complete``): once the breaker's period is up, the next
operation starts a probe (a PING on a connection of its own) in a thread, and the node is
used again as soon as a probe is answered, so its recovery is noticed without anyone paying
a timeout for it. A waiter's node whose PING is slow to answer has the down nodes probed at
once (``NodeHub.ping_slow``): the waiters join them before that node's silence counts.
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

from ..waiters import start_thread
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
        self._listeners: list[Callable[[int], None]] = []  # told when a down node is back
        self._forget()

    def on_up(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(i)`` whenever node i, down or not warm (its connection dropped),
        answers again (on the thread that heard it, an operation's or a probe's: the
        listener must not wait)."""
        self._listeners.append(listener)

    def _back(self, i: int) -> None:
        for listener in self._listeners:
            try:
                listener(i)
            except Exception as exc:  # a listener's failure never fails the operation
                logger.debug("redlock: telling that node %d is back failed: %s", i, exc)

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
            back = self._down.pop(i, None) is not None or i not in self._warm
            self._warm.add(i)
        if back:  # warm again too: a waiter that left it out (see NodeIO.usable) joins it
            self._back(i)

    def failed(self, i: int) -> None:
        with self._mutex:
            self._down[i] = time.monotonic()
            self._warm.discard(i)

    def dropped(self, i: int) -> None:
        """A connection of node i was closed: the next one must connect first."""
        with self._mutex:
            self._warm.discard(i)

    def due(self, now_too: bool = False) -> list[int]:
        """The down nodes to probe now (each marked as being probed); ``now_too``: those
        whose breaker's period is not up yet too (another node falls silent)."""
        if not self._down:
            return []
        now = time.monotonic()
        wait = 0.0 if now_too else self.breaker
        with self._mutex:
            due = [i for i, at in self._down.items()
                   if now - at >= wait and i not in self._probing]  # fmt: skip
            self._probing.update(due)
        return due

    def probed(self, i: int, ok: bool) -> None:
        back = False
        with self._mutex:
            self._probing.discard(i)
            if ok:
                back = self._down.pop(i, None) is not None
                self._warm.add(i)
            elif i in self._down:
                self._down[i] = time.monotonic()
        if back:
            self._back(i)


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
    health: Health,
    nodes: list[RedisBackend],
    before_up: Callable[[int], None] | None = None,
    now_too: bool = False,
) -> None:
    """Probe the down nodes whose breaker's period is up (``now_too``: every down node
    not being probed), each in a thread."""
    for i in health.due(now_too):
        start_thread(threading.Thread(
            target=probe, args=(health, i, nodes[i], before_up), name="redlock-probe",
            daemon=True,
        ))  # fmt: skip


class NodeHub(PubSubHub):
    """A node's release channel. A node that is down wakes nobody when its connection fails:
    the releases it misses are heard on the other nodes (any majority of them publishes)."""

    failure_is_unheard = True

    def __init__(
        self,
        node: RedisBackend,
        quiet: Callable[[], bool],
        ping_slow: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(node.client.pubsub, node.socket_timeout, node.inbox_prefix)
        self._quiet = quiet
        #: A PING slow to answer: the nodes the waiters skipped as down are probed at
        #: once, and joined once they answer (QuorumHub.node_up), before this one's
        #: silence is declared: a node skipped is not left out while the others fall short.
        self.ping_slow = ping_slow

    def notify_all(self) -> None:
        if not self._quiet():
            super().notify_all()


class _Partial:
    """A waiter that has not joined every node's hub yet."""

    __slots__ = ("by_id", "channel", "claimed", "joined", "lock", "waiter")

    def __init__(self, channel: str, waiter: AnyWaiter, by_id: bool, lock: str) -> None:
        self.channel, self.waiter, self.by_id, self.lock = channel, waiter, by_id, lock
        self.claimed: set[int] = set()  # nodes being joined, or joined
        self.joined: set[int] = set()


class _Enough(Confirmation):
    """Set once ``needed`` of the nodes joined confirmed their subscriptions, or once that
    can no longer be (nodes whose join failed outright, a refused connect: the try then
    says what answers, at once). A node that does not answer stays open: the set-up's
    deadline then ends the wait (see QuorumHub)."""

    def __init__(self, needed: int, nodes: int) -> None:
        super().__init__()
        self._count = threading.Lock()
        self.needed, self.confirmed_nodes, self.open = needed, 0, nodes
        self._check()

    def track(self, confirmations: list[Confirmation]) -> None:
        """A node joined: ``confirmations`` (none: nothing subscribed there) to wait for."""
        if not confirmations:
            self.failed()
            return
        left = [len(confirmations)]

        def one() -> None:
            error = next((c.error for c in confirmations if c.error is not None), None)
            if error is not None:  # refused (an ACL): the wait raises it
                self.fail(error)
                return
            with self._count:
                left[0] -= 1
                if left[0]:
                    return
                self.confirmed_nodes += 1
            self._check()

        for confirmed in confirmations:
            confirmed.then(one)

    def failed(self) -> None:
        with self._count:
            self.open -= 1
        self._check()

    def _check(self) -> None:
        with self._count:
            done = self.confirmed_nodes >= self.needed or self.open < self.needed
        if done:
            self.set()


class QuorumHub(CompositeHub):
    """Waiters listen on the nodes that answer: subscribing on a paused node would wait for
    its confirmation (or for a connect) that never comes. A node that comes back while they
    wait (:meth:`node_up`) is joined then: otherwise their count of silent nodes would stay
    measured against the nodes of their start, and one more pause among those would end the
    wait while a majority answers.

    A wait's set-up and its try share one node timeout. The set-up waits for a quorum of
    confirmations, not for every node's (a node paused since it last answered would hold it
    for its timeout); a node that needs a connect first (its handshake waits for a paused
    node's timeout) is joined in a thread, not in turn in the caller's. Fewer than a quorum
    confirmed within the timeout: the wait raises (its try would wait for the same nodes)."""

    confirm_needed = True  # a quorum's: see _Enough

    def __init__(
        self, hubs: list[Any], confirm_timeout: float, usable: Callable[[], set[int]]
    ) -> None:
        super().__init__(hubs, confirm_timeout)
        self._usable = usable
        self._pid = os.getpid()
        self._partial_mutex = threading.Lock()
        self._partial: dict[tuple[str, AnyWaiter], _Partial] = {}

    def unconfirmed_error(self, alias: str, lock: str) -> str:
        return (
            f"lock {lock!r}: backend {alias!r}: too few nodes confirmed the wait's"
            f" subscription within {self.confirm_timeout:g} s for a quorum"
        )

    def join(
        self, channel: str, waiter: AnyWaiter, by_id: bool = False, lock: str = ""
    ) -> list[Confirmation]:
        entry = _Partial(channel, waiter, by_id, lock)
        with self._partial_mutex:
            self._check_fork()
            # Registered first: a node back from now on is joined by node_up, one back
            # before is in the usable set.
            self._partial[(channel, waiter)] = entry
        usable = self._usable()  # (not under the mutex: node_up comes from the I/O's threads)
        with self._partial_mutex:
            todo = [i for i in sorted(usable) if i not in entry.claimed]
            entry.claimed.update(todo)
        enough = _Enough(min(len(self.hubs) // 2 + 1, len(todo)), len(todo))
        for i in todo:
            if not self.hubs[i].joins_at_once():
                self._start(self._join_late, i, [entry], enough)
                continue
            try:
                confirmations = self.hubs[i].join(channel, waiter, by_id, lock)
            except Exception as exc:  # a node that is down wakes nobody; the others do
                logger.debug("redlock: watching %s on node %d failed: %s", channel, i, exc)
                with self._partial_mutex:
                    entry.claimed.discard(i)
                enough.failed()
            else:
                self._joined(entry, i)
                enough.track(confirmations)
        with self._partial_mutex:
            if not entry.joined:  # (else set by _joined)
                waiter.unheard_limit = self.unheard_limit(0)
        return [enough]

    def _joined(self, entry: _Partial, i: int) -> bool:
        """Count node i as joined by ``entry``'s waiter; False if the waiter left."""
        with self._partial_mutex:
            key = (entry.channel, entry.waiter)
            if self._partial.get(key) is not entry:
                return False
            entry.joined.add(i)
            entry.waiter.unheard_limit = self.unheard_limit(len(entry.joined))
            if len(entry.joined) == len(self.hubs):
                del self._partial[key]
            return True

    def node_up(self, i: int) -> None:
        """Node i answers again: the waiters that did not join it join it now (in a thread:
        this runs on the thread that heard the node)."""
        with self._partial_mutex:
            self._check_fork()
            entries = [e for e in self._partial.values() if i not in e.claimed]
            for entry in entries:
                entry.claimed.add(i)
        if entries:
            self._start(self._join_late, i, entries, None)

    def _start(
        self, join: Callable[..., None], i: int, entries: list[_Partial], enough: _Enough | None
    ) -> None:
        """Join node i's hub for ``entries`` in a thread (a connect may wait for a paused
        node's timeout)."""
        try:
            start_thread(threading.Thread(
                target=join, args=(i, entries, enough), name="redlock-join", daemon=True
            ))  # fmt: skip
        except Exception as exc:  # no thread to be had: they stay on the nodes they have
            logger.debug("redlock: joining node %d's waiters not started: %s", i, exc)
            with self._partial_mutex:
                for entry in entries:
                    entry.claimed.discard(i)
            if enough is not None:
                enough.failed()

    def _join_late(self, i: int, entries: list[_Partial], enough: _Enough | None) -> None:
        hub = self.hubs[i]
        for entry in entries:
            try:
                confirmations = hub.join(entry.channel, entry.waiter, entry.by_id, entry.lock)
            except Exception as exc:
                logger.debug("redlock: watching %s on node %d failed: %s", entry.channel, i, exc)
                with self._partial_mutex:
                    entry.claimed.discard(i)
                if enough is not None:
                    enough.failed()
                continue
            if not self._joined(entry, i):  # it left meanwhile: not left registered here
                hub.leave(entry.channel, entry.waiter)
                if enough is not None:
                    enough.failed()
            elif enough is not None:
                enough.track(confirmations)

    def leave(self, channel: str, waiter: AnyWaiter) -> None:
        with self._partial_mutex:
            self._partial.pop((channel, waiter), None)
        super().leave(channel, waiter)

    def _check_fork(self) -> None:
        """(Under the mutex.) A forked child has none of the parent's waiters."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._partial = {}
