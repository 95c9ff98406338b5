"""A Redlock's round trips to its nodes: one fan-out that stops waiting once it can decide.

Every node is sent its request at once, then the replies are read as they come. As soon as
the replies in hand decide the operation (``Fan.decided``), the nodes still silent get a
grace (as long again as the decision took, at least GRACE) and are then left behind: a
paused node costs nothing once a majority has answered.

A connection left with unread replies (a *straggler*) is never given to another request. It
stays in its thread's *lane* to that node: the thread's next request to the node is written
behind it on the same connection, so a node runs one thread's requests in the order they were
made (a clean-up release never overtakes the acquire it undoes, nor a retried acquire the
clean-up). Across threads there is no such order (a lock released by another thread than
the one that took it may overtake a straggling grant on a node): what is left then is a
grant on a minority of nodes, which expires at its TTL. A request written behind a lane is
due when the lane's oldest unread reply is: a node that has not answered for the node
timeout is down, whichever request noticed. A drainer thread reads the replies nobody waits
for and keeps the connection for the next fan-out, or closes it once the oldest is overdue
(the node is then down, see :mod:`.redlock_health`). A node whose lane is overdue is skipped
while the other nodes can make a quorum without it; a late grant left there expires at its
TTL. A release or an acquire's undo must reach every node all the same (a hold left on a
node would outlive the release by its TTL, and a few such nodes refuse the free lock): its
fan-out writes to slow nodes too, without waiting for them, and a node skipped as down, or
not connected in time, is owed the write (:class:`Debts`). A node not connected yet is
connected in a thread (a connect to a paused node waits for
its timeout): every request that finds that connect under way waits for it, never counting
the node unasked.

The fan-outs make their connections themselves, with their node pool's settings, and never
take one from redis-py's pool: its checkout and return are not safe against an interrupt
(one landing inside them leaks a pooled connection for good, and with it, in time, the
node). A connection of ours that an interrupt leaves unreferenced is closed when it is
collected, and nothing counts it. Who owns a connection (:mod:`.owners`): exactly one of

* **nobody** (written as ``owners.POOL``): made and not yet handed on, or closed;
* the **kept** deque of its node (given back by a fan-out, taken by the next one);
* one **request**: a fan-out's in-flight set, from its checkout until the connection goes
  back to the kept deque, to a lane, or is closed;
* one **lane**: the :class:`Flight` entry of a thread's backlog to a node (unread replies).
  The entry itself is the owner, not the lanes: an entry an interrupt left behind names a
  connection it can never own again, whoever has that connection object later;
* a **reader**, a drainer thread while it reads one lane;
* a **connector**, a connect in progress, until a waiting request claims the connection
  (or, when none waits any more, it is kept).

Every move fills the new owner's structure, then commits with one store on the connection
(``owners.move``), then empties the old structure; a structure hands out only entries it
owns (under its lock), and a clean-up (``except BaseException``) closes only what its owner
still owns. An exception at any line, an interrupt or a time limit included, thus leaves
each connection with one owner: never in two requests' hands, never released twice. (Between
a take and the store that records it, an asynchronous exception can leave a connection with
no structure: it is closed when collected, never shared.) The locks are plain locks, the
threads are started without waiting for them, and every wait has a deadline: a thread that
dies at any line (an asynchronous exception) holds nobody for longer than a node timeout.
The suite runs with ``DJANGO_REDLOCK_CHECK_OWNERS=1``: any move or use by a non-owner raises.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import functools
import logging
import math
import os
import select
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from .. import acl
from ..exceptions import BackendUnavailable
from ..scripts import Call, teach
from ..wire import new_connection, node_of, pack_many, socket_or_none, stream_of, tag_node
from . import owners
from .base import Op
from .node_stream import NOT_YET, Watch, stream_for
from .owners import POOL, Owner
from .redis import UNAVAILABLE, RedisBackend
from .redlock_health import Health, start_probes

logger = logging.getLogger("django_redlock")

Replies = list[Any]  # per node: the parsed reply, the exception it raised, or PENDING

#: Once decided, the nodes still silent are waited for as long again, and at least this.
GRACE = 0.002
#: A node whose oldest unread reply is older than this (a quarter of the node timeout, at
#: most 50 ms) counts as slow: asked only when the others cannot make a quorum.
SLOW_SHARE, SLOW_MAX = 0.25, 0.05
#: A lane with this many unread replies counts as slow however young they are.
LANE_MAX = 64
#: Connections per node kept between fan-outs (see checkout()); more are closed.
KEPT = 64
#: How often a fan-out looks whether a connect in a thread has finished.
CONNECT_POLL = 0.001
#: The drainer looks for lanes left since it started waiting at least this often: a reply
#: on a healthy node is read within it, whatever a paused node's lane waits for.
DRAIN_POLL = 0.002
#: An idle drainer wakes this often (its heartbeat: one that stopped is replaced).
DRAIN_IDLE = 0.5
#: At most this many writes owed per node (the newest are dropped: a hold left by a release
#: that never arrives expires at its TTL, as before). The newest, as the oldest are likely
#: the ones for holds the node took before it stopped answering; a release owed since then
#: is mostly for a hold taken without it.
OWED_MAX = 1000
#: How often the debt collector looks whether a node owed writes answers again.
OWED_POLL = 0.1
#: At most this many holds remembered as burnt (see ``Debts.burn``): the oldest are
#: forgotten first (a Lock retries its token at once, or never).
BURNT_MAX = 10_000


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING: Any = _Pending()  # a node asked whose reply has not come yet


class Unasked(BackendUnavailable):
    """A node not asked: down (the breaker) or slow, while the others could decide."""


class Unawaited(BackendUnavailable):
    """A node asked, whose reply was not waited for: the others decided."""


class Voidable(Op[int]):
    """A write of a lock's key and token every node must get, which a later try with the
    same token makes ``void`` (see :meth:`Debts.supersede`): never sent after that. An
    acquire's undo, and a release once owed (:func:`_voidable`)."""

    void = False


class Undo(Voidable):
    """An acquire's undo on one node: a release of its key and token (a script call whose
    first key is the lock's key, whose first argument is the token). ``answered``: the
    node answered the acquire it undoes (it ran there): owed, it is owed as a release,
    which the collector sends (see :class:`Debts`)."""

    answered = False


def _hold_of(op: Op[Any]) -> tuple[str, Any] | None:
    """The lock key and token a script call names (its first key and first argument)."""
    call = op.request
    if isinstance(call, Call) and call.keys and call.args:
        return call.keys[0], call.args[0]
    return None


class Fan(list[Any]):
    """A step of a Redlock operation: an op per node (None: that node has none).

    ``decided(replies)`` tells whether the replies so far (PENDING for those to come, an
    exception for a node that failed) decide the operation; None: every reply is waited for.
    ``complete``: the nodes skipped as down or slow are asked too once the nodes asked can
    no longer make a quorum of answers (one failed, or is slow to answer), within the same
    node timeout; and when the replies still do not decide it (or, with no ``decided``,
    fewer than a quorum answered), in a second phase: a release that needs a node's vote
    gets it, and an acquire beside a node skipped since its pause is not refused while
    that node and the others make a majority.
    ``owed`` ("release", "undo"): a node not sent its op (skipped as down or slow, or still
    being connected when the others decided) is owed it, and gets it later (:class:`Debts`):
    a release decided without a node still reaches it, or its hold there would outlive the
    release by its whole TTL, and enough such nodes would refuse a free lock.
    ``enough(replies)``: whether, undecided, the replies may stop the wait once the nodes
    still silent count as slow (``NodeIO.slow_after`` since the requests went out), or at
    once (with the grace) when one of them is still being connected (a connect not done when
    the others answered is likely one to a paused node, and its vote would need a handshake
    first). An acquire whose votes split waits that long for a vote it needs, then gives up
    (it is retried), instead of holding its grants for a paused node's timeout.
    """

    def __init__(
        self,
        ops: Any,
        decided: Callable[[Replies], bool] | None = None,
        complete: bool = False,
        enough: Callable[[Replies], bool] | None = None,
        owed: str = "",
        regrant: bool = False,
    ) -> None:
        super().__init__(ops)
        self.decided = decided
        self.complete = complete
        self.enough = enough
        #: "release" or "undo": a write every node must get, asked or not (see ``Debts``).
        self.owed = owed
        #: An acquire whose token may be an earlier try's: that try's undos are void.
        self.regrant = regrant
        #: (Set by the plan.) The nodes skipped as down or slow, which a ``complete`` fan
        #: may still ask; not those where an undo of the token is under way (``busy``).
        self.late: list[int] = []
        self.busy: set[int] = set()
        #: The nodes to be sent their op that no Flight carries yet (asyncio: whose task has
        #: not started) and nobody owes: owed should an exception leave the fan-out. Every
        #: node from the start: the moment the fan-out exists its write is decided, and an
        #: interrupt before the plan ran (or within it) must not leave a node neither sent
        #: nor owed (its hold outlived the release by its TTL).
        self.unsent: set[int] = {i for i, op in enumerate(ops) if op is not None}
        #: Each node's reply (the plan fills it): the fan-out's clean-up reads it.
        self.replies: Replies = []


def answered(reply: Any) -> bool:
    return reply is not PENDING and not isinstance(reply, BaseException)


@dataclass(eq=False, slots=True)
class Flight:
    """A connection with requests written and replies unread: ``skip`` of earlier requests
    (left behind by an earlier fan-out), then ``count`` of this one."""

    connection: Any
    stream: Any  # the connection's (node_stream)
    skip: int
    count: int
    since: float  # when the request of the oldest unread reply was sent
    sent: float  # when this request was sent
    raw: list[Any] = field(default_factory=list)
    #: The writes every node must get (releases, undos) among the unread replies, in order:
    #: [first reply's position, replies, op, kind, replies read]. A position counts from
    #: this Flight's first unread reply. One whose replies are all read is moved to ``read``.
    owed: list[list[Any]] = field(default_factory=list)
    read: list[tuple[Op[Any], str, list[Any]]] = field(default_factory=list)
    got: int = 0  # replies read by this Flight

    @property
    def unread(self) -> int:
        return self.skip + self.count - len(self.raw)

    def carry(self, lane: Flight) -> None:
        """Take over ``lane``'s owed writes still unread (this Flight reads on from it)."""
        for entry in lane.owed:
            entry[0] -= lane.got
        self.owed, lane.owed = lane.owed + self.owed, []
        self.read, lane.read = lane.read + self.read, []

    def note(self, at: int, count: int, op: Op[Any], kind: str) -> None:
        self.owed.append([at, count, op, kind, []])

    def note_debts(self, debts: list[tuple[Op[Any], str]]) -> list[tuple[Any, ...]]:
        """Note ``debts``, to be written first (after the replies left behind): their
        commands, in order."""
        commands: list[tuple[Any, ...]] = []
        for op, kind in debts:
            sent = _commands(op.request)
            self.note(self.skip, len(sent), op, kind)
            self.skip += len(sent)
            commands += sent
        return commands

    def _seen(self, reply: Any) -> None:
        at = self.got
        self.got += 1
        if self.owed and self.owed[0][0] <= at:
            entry = self.owed[0]
            entry[4].append(reply)
            if len(entry[4]) >= entry[1]:
                self.owed.pop(0)
                self.read.append((entry[2], entry[3], entry[4]))

    def deadline(self, timeout: float) -> float:
        return self.since + timeout

    def read_ready(self, reader: Any) -> bool:
        """Read the replies that have come; True once this request's are all in."""
        owners.using(self.connection, reader)
        next_reply, raw = self.stream.next_reply, self.raw
        while self.skip:
            if (reply := next_reply()) is NOT_YET:
                return False
            self._seen(reply)
            self.skip -= 1
            if not self.skip:
                self.since = self.sent
        while len(raw) < self.count:
            if (reply := next_reply()) is NOT_YET:
                return False
            self._seen(reply)
            raw.append(reply)
        return True


class Lanes:
    """Stragglers, by node and thread, and the drainer that reads what nobody waits for.

    Each lane's entry owns its connection: the :class:`Flight` itself is written on the
    connection as its owner. An entry an interrupt left behind (its move never committed, or
    its connection taken and the entry not yet removed) is stale, and stays so whatever
    becomes of the connection object later: another entry that holds the same connection is
    another owner. The drainer reads one lane as its own ``reader``.

    Interrupts: the locks here are plain ``threading.Lock`` (a ``with`` on one cannot leave
    it held, unlike a ``Condition``'s, whose ``__enter__`` is Python), the drainer is woken by
    a released lock (``_bell``), threads are started without waiting for them to run, and
    every wait is bounded: a drainer killed by an asynchronous exception, or one that never
    ran, is replaced once its heartbeat is stale.
    """

    def __init__(self, io: NodeIO) -> None:
        self._io = io
        self._lock = threading.Lock()
        self._bell = threading.Lock()  # held: nothing new; released: a lane was left
        self._bell.acquire()
        self._flights: dict[tuple[int, int], Flight] = {}
        self._reading: set[tuple[int, int]] = set()
        self._drainer: object | None = None  # the current drainer's token
        self._beat = 0.0  # when it last looked
        self._closed = False

    def take(self, i: int, me: Owner, into: dict[int, Flight]) -> Flight | None:
        """This thread's lane to node i, now ``me``'s, and ``into[i]`` (recorded before the
        lanes forget it: its unread writes are never in neither); None when there is none,
        or it is stale, or the drainer has been reading it for a node timeout (then it stays
        the drainer's, and this request takes another connection)."""
        key = (i, threading.get_ident())
        deadline = None
        while True:
            with self._lock:
                if key not in self._reading:
                    flight = self._flights.get(key)
                    if flight is None:
                        return None
                    taken = owners.owns(flight.connection, flight) and owners.move(
                        flight.connection, flight, me
                    )
                    if taken:
                        into[i] = flight
                    del self._flights[key]  # (left behind by an interrupt: stale)
                    return flight if taken else None
            if deadline is None:
                deadline = time.monotonic() + self._io.timeout
            elif time.monotonic() >= deadline:
                return None
            time.sleep(DRAIN_POLL / 4)

    def leave(self, i: int, flight: Flight, me: Owner) -> None:
        """``flight``'s connection, ``me``'s, becomes this thread's lane to node i."""
        key = (i, threading.get_ident())
        with self._lock:
            old = self._flights.get(key)
            if old is not None and old is not flight:  # (one the drainer kept meanwhile)
                self._io.owe_back(i, old, unread=True)  # before it is in no record
            self._flights[key] = flight
            owners.move(flight.connection, me, flight)
            closed = self._closed
        if old is not None and old is not flight:  # (its writes owed above)
            self._io.drop(i, old.connection, old)
        if closed:
            self._io.drop(i, flight.connection, flight)
            return
        self._ring()
        self.watch()

    def watch(self) -> None:
        """Start a drainer when there are lanes and none runs (or its heartbeat is stale)."""
        if not self._flights or self._closed:
            return
        now = time.monotonic()
        with self._lock:
            if self._drainer is not None and now - self._beat < self._stale_after():
                return
            token = self._drainer = object()
            self._beat = now
        _thread.start_new_thread(self._drain, (token,))

    def _stale_after(self) -> float:
        return 2 * self._io.timeout + 2 * DRAIN_IDLE

    def _ring(self) -> None:
        with contextlib.suppress(RuntimeError):  # rung already
            self._bell.release()

    @property
    def busy(self) -> bool:
        return bool(self._flights)

    def slow(self, now: float, after: float) -> set[int]:
        with self._lock:
            return {i for (i, _), f in self._flights.items()
                    if now - f.since > after or f.unread >= LANE_MAX}  # fmt: skip

    def forget(self) -> None:
        """After a fork: the parent's connections and thread are not ours."""
        self._lock = threading.Lock()
        self._bell = threading.Lock()
        self._bell.acquire()
        self._flights, self._reading, self._drainer = {}, set(), None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            flights, self._flights = self._flights, {}
        self._ring()
        for (i, _), flight in flights.items():
            # Its writes unread, never to be read now: each may still run late (Debts.burn).
            unread = [entry[2] for entry in flight.owed]
            self._io.debts.burn(i, unread)
            self._io.debts.settled(i, unread)  # burnt first: never in neither
            self._io.drop(i, flight.connection, flight)

    def _drain(self, token: object) -> None:
        reader = Owner("reader")
        while self._drainer is token and not self._closed:
            self._beat = time.monotonic()
            try:
                self._drain_once(reader)
            except Exception:  # never dies with lanes left to read: log, go on
                logger.exception("django_redlock: the Redlock drainer failed; going on")
                time.sleep(DRAIN_POLL)

    def _drain_once(self, reader: Owner) -> None:
        timeout = self._io.timeout
        with self._lock:
            flights = dict(self._flights)
        if not flights:
            self._bell.acquire(timeout=DRAIN_IDLE)  # until a lane is left, or a heartbeat
            return
        now = time.monotonic()
        until = min([f.deadline(timeout) for f in flights.values()] + [now + DRAIN_POLL])
        ready = readable({k: f.connection for k, f in flights.items()}, until)
        now = time.monotonic()
        for key, seen in flights.items():
            if key in ready or now >= seen.deadline(timeout):
                self._settle(key, seen, now, timeout, reader)

    def _settle(
        self, key: tuple[int, int], seen: Flight, now: float, timeout: float, reader: Owner
    ) -> None:
        connection = seen.connection
        with self._lock:
            if self._flights.get(key) is not seen:
                return  # its thread took it meanwhile
            if not owners.owns(connection, seen):
                del self._flights[key]  # stale
                return
            self._reading.add(key)
            owners.move(connection, seen, reader)
            del self._flights[key]
        keep = False
        i = key[0]
        try:
            if seen.read_ready(reader):
                self._io.give_back(i, connection, reader)
                self._io.owe_back(i, seen)
            elif now >= seen.deadline(timeout):
                self._io.drop(i, connection, reader)
                self._io.health.failed(i)
                self._io.owe_back(i, seen, unread=True)  # a paused node frees what it read
            else:
                keep = True
                self._io.owe_back(i, seen)
        except Exception:  # a connection error, or a reply that cannot be parsed
            self._io.drop(i, connection, reader)
            self._io.health.failed(i)
            self._io.owe_back(i, seen, unread=True)
        finally:
            with self._lock:
                self._reading.discard(key)
                if keep and not self._closed and key not in self._flights:
                    self._flights[key] = seen
                    owners.move(connection, reader, seen)
            self._io.drop(i, connection, reader)  # still the reader's: not kept, interrupted


def _void(op: Op[Any]) -> bool:
    return isinstance(op, Voidable) and op.void


def _voidable(op: Op[Any]) -> Op[Any]:
    """``op``, owed: a release of a key and token is made :class:`Voidable`. The rule: a
    try with token T voids every write of T owed and not sent yet, as it voids undos. A
    release of T gets no answer (a hand-back, a release) and the Lock keeps T for its next
    try; the probe or the collector, which send on a connection of their own, may take it
    off the books and write it after that try's grant, deleting it (two holders). Void, it
    is not needed: the try's grant on the node IS the old hold (``ours already``), the
    try's release frees it, and a try that fails owes its own undo there."""
    if isinstance(op, Voidable) or _hold_of(op) is None:
        return op
    return Voidable(op.name, op.request, op.parse, op.deadline)


@dataclass(eq=False, slots=True)
class _Write:
    """A node's write every node must get (a release, an undo) in an asyncio task's hands,
    and whether it is owed already (by the task, or by :meth:`NodeIO._owe_orphans`)."""

    i: int
    op: Op[Any]
    kind: str
    owed: bool = False


@dataclass(eq=False, slots=True)
class _Paying:
    """Node i's debts an asyncio request took off the books to pay first (``owed``), from
    ``at`` on not proven paid, and whether they are owed again already (``done``)."""

    i: int
    owed: list[tuple[Op[Any], str]] = field(default_factory=list)
    at: int = 0
    done: bool = False


@dataclass(eq=False, slots=True)
class Debt:
    op: Op[Any]
    undo: bool  # an acquire's undo: its token may be tried again (see Debts)


def _debt(op: Op[Any], undo: bool) -> Debt:
    """``op`` owed; as an undo (``undo``) only while the acquire it undoes may be unanswered:
    one the node answered ran, nothing of it is left for the collector's send to overtake."""
    return Debt(op, undo and not (isinstance(op, Undo) and op.answered))


class Debts:
    """The writes owed to each node: releases (and acquires' undos) the other nodes decided
    without it. Each goes out with the next request to the node, before it on the same
    connection (so a later request, from any thread, never overtakes it), or, when the node
    is down, from the probe that finds it back, before it counts as up (no request is sent
    to it before then, unless a quorum needs it). A release of a node that answers but is
    slow is sent by the collector thread once the node is no longer slow; an undo is not
    sent that way: the acquire it undoes may still be unanswered on this thread's lane
    (the collector's connection could overtake it), or be tried again with its token. Once
    a reply of the undo was read, that acquire had run, and a retry makes the undo void
    before the collector could send it (:meth:`start`): it is owed as a release then
    (:meth:`NodeIO.owe_back`); and so is, wherever it is owed, one whose acquire the node
    answered (``Undo.answered``: an asyncio undo cancelled by asyncio.run's shutdown was
    owed as an undo, no next request came, and the hold stayed on the node to its TTL).
    One written whose reply does not prove it ran is owed again (:meth:`NodeIO.owe_back`):
    a node in CLIENT PAUSE frees what it read when the overdue connection is closed, a busy
    one answers BUSY. But closing a connection does not recall what was written on it (a
    retransmission, a slow network, a proxy deliver it later): one written and never
    answered may still run at any later time, so its token is burnt there (:meth:`burn`):
    never granted on that node again.
    Sent twice, a release deletes nothing more (its token is gone). Lost with the process:
    the hold on that node then expires at its TTL, as before.

    An undo never deletes a later try's grant of the same token (the next try of a Lock
    whose try got no answer reuses its token, and the node's "ours already" refreshes the
    hold): a fan-out of that try makes the earlier undos of its key and token void
    (:meth:`supersede`), before anything of it is sent; a void undo is dropped wherever it
    is owed, and never owed again (the retry re-grants or refreshes that hold, and its own
    failure owes its own undo). A release, once owed, is voided the same way
    (:func:`_voidable`: the hand-back or release of a Lock that keeps its token for its next
    try). One already written to a node and not answered yet (another request carried it,
    on another connection: the node may run it after the try's grant) keeps the try from
    that node: not asked, as if slow; once its reply will never be read, its token is
    burnt, and the Lock's next try takes a new one. Both drivers pay a node's debts
    before their request to it (the asyncio one waits for their replies first: its
    connections are not the threads')."""

    def __init__(self, io: NodeIO) -> None:
        self._io = io
        self._lock = threading.Lock()
        self._owed: list[deque[Debt]] = [deque() for _ in io.nodes]
        self._collector: object | None = None
        self._beat = 0.0
        #: The undos (and releases owed) not yet void that may still be sent (owed, or
        #: written and unanswered): gone once nothing refers to them.
        self._undos: weakref.WeakSet[Voidable] = weakref.WeakSet()
        #: Per node, the voidable writes written to it whose reply has not been read.
        self._sending: list[weakref.WeakSet[Voidable]] = [weakref.WeakSet() for _ in io.nodes]
        #: Per node, the holds (key, token) a write of which may still run there at any later
        #: time: its bytes may have left, and its reply will never be read (see :meth:`burn`).
        self._burnt: list[dict[tuple[str, Any], None]] = [{} for _ in io.nodes]
        #: Per node, debts taken off the books to be paid, their replies not read yet.
        self._paying = [0] * len(io.nodes)

    def sending(self, i: int, ops: Iterable[Op[Any]]) -> None:
        """``ops`` are being written to node i (their replies are awaited)."""
        undos = [op for op in ops if isinstance(op, Voidable)]
        if undos:
            with self._lock:
                self._sending[i].update(undos)

    def take_sending(
        self, i: int, flight: Flight, own: Op[Any] | None = None
    ) -> list[tuple[Any, ...]]:
        """Node i's debts (not void), noted in ``flight`` (to be written ahead of its request)
        and then taken off the books, and, with ``own``, marked as being written in the same
        step: a retry's :meth:`supersede` finds each undo either owed (made void, dropped) or
        under way (the node not asked). Returns their commands. Noted first: an exception
        between leaves one in both (sent twice at worst), never in neither."""
        if not self._owed[i] and not isinstance(own, Voidable):
            return []  # the common case: no lock taken
        with self._lock:
            owed = self._owed[i]
            taken = [(d.op, "undo" if d.undo else "release") for d in owed if not _void(d.op)]
            commands = flight.note_debts(taken)
            owed.clear()
            undos = [op for op, _ in taken if isinstance(op, Voidable)]
            if isinstance(own, Voidable):
                undos.append(own)
            self._sending[i].update(undos)
        return commands

    def start(self, i: int, op: Op[Any]) -> bool:
        """``op`` is about to be written to node i: False if it is a void undo (not to be
        sent), else marked under way, in one step with the check (see :meth:`take_sending`)."""
        if not isinstance(op, Voidable):
            return True
        with self._lock:
            if op.void:
                return False
            self._sending[i].add(op)
        return True

    def settled(self, i: int, ops: Iterable[Op[Any]]) -> None:
        """``ops``' replies from node i are read (or will never be): no longer in flight."""
        undos = [op for op in ops if isinstance(op, Voidable)]
        if undos:
            with self._lock:
                for op in undos:
                    self._sending[i].discard(op)

    def track(self, fan: Fan) -> None:
        """An undo fan-out's ops may be sent later (owed, or straggling): a retry voids them."""
        with self._lock:
            for op in fan:
                if isinstance(op, Voidable):
                    self._undos.add(op)

    def supersede(self, fan: Fan) -> set[int]:
        """``fan`` (an acquire) may re-grant the holds of its keys and tokens: the undos (and
        releases owed) of those not sent yet are void, and dropped from the books. Returns the
        nodes where one is written and not answered yet: not to be asked."""
        if not self._undos and not any(self._sending) and not any(self._burnt):
            return set()
        holds = {_hold_of(op) for op in fan if op is not None}
        with self._lock:
            # Where a write of it may still land (:meth:`burn`), the try is never asked: a
            # grant there could be deleted at any time. (A Lock's next acquire takes a new
            # token instead, :meth:`reusable`; the tries of one wait keep theirs.)
            burnt = {i for i, hold in enumerate(self._burnt) if holds & hold.keys()}
            for op in list(self._undos):
                if _hold_of(op) in holds:
                    op.void = True
                    self._undos.discard(op)
            for owed in self._owed:
                if any(_void(d.op) for d in owed):
                    kept = [d for d in owed if not _void(d.op)]
                    owed.clear()
                    owed.extend(kept)
            return burnt | {
                i
                for i, sending in enumerate(self._sending)
                if any(_hold_of(op) in holds for op in sending)
            }

    def burn(self, i: int, ops: Iterable[Op[Any]]) -> None:
        """``ops`` were written to node i (or their write begun) and their replies will never
        be read (the connection closed, the wait given up): each may still run there at any
        later time. TCP delivers what was written before the close (a retransmission, a slow
        network, a proxy), and the node runs it whenever it comes, after any request on
        another connection. So its token is never granted on node i again: a try of it
        would be deleted there by the late write (two holders). A Lock asks
        :meth:`reusable` before it retries a token, and takes a new one instead; a try that
        does not (the next of the same wait) is kept from node i (:meth:`supersede`).
        Voiding an owed copy stays safe: a write not sent deletes nothing."""
        holds = [hold for op in ops if (hold := _hold_of(op)) is not None]
        if holds:
            with self._lock:
                burnt = self._burnt[i]
                for hold in holds:
                    burnt[hold] = None
                while len(burnt) > BURNT_MAX:
                    del burnt[next(iter(burnt))]

    def reusable(self, token: str) -> bool:
        """Whether a try may use ``token`` again: no write of it may still land late."""
        if not any(self._burnt):
            return True
        with self._lock:
            return not any(t == token for burnt in self._burnt for _, t in burnt)

    def owe(self, i: int, op: Op[Any], kind: str) -> None:
        if _void(op):
            return
        with self._lock:
            owed = self._owed[i]
            owed.append(self._book(op, kind == "undo"))
            while len(owed) > OWED_MAX:
                owed.pop()
        self.collect()

    def _book(self, op: Op[Any], undo: bool) -> Debt:
        """``op`` owed (under the lock): made voidable, and voided by a retry of its token
        from now on (see :func:`_voidable`)."""
        op = _voidable(op)
        if isinstance(op, Voidable):
            self._undos.add(op)
        return _debt(op, undo)

    def owes(self, i: int) -> bool:
        return bool(self._owed[i])

    def take_kinds(self, i: int, into: list[tuple[Op[Any], str]]) -> None:
        """Node i's debts with their kinds, put in ``into`` and then taken off the books
        (an exception between leaves one in both, never in neither)."""
        owed = self._owed[i]
        if not owed:
            return
        with self._lock:
            into += [(d.op, "undo" if d.undo else "release") for d in owed if not _void(d.op)]
            owed.clear()

    def reowe(self, i: int, items: list[tuple[Op[Any], str]]) -> None:
        """Writes sent whose reply did not prove they ran: owed again, ahead of newer ones."""
        items = [(op, kind) for op, kind in items if not _void(op)]
        if not items:
            return
        with self._lock:
            owed = self._owed[i]
            owed.extendleft(self._book(op, kind == "undo") for op, kind in reversed(items))
            while len(owed) > OWED_MAX:
                owed.pop()
        self.collect()

    def take(self, i: int, undo: bool = True) -> list[Op[Any]]:
        """Node i's debts (``undo`` False: its releases only), taken off the books."""
        owed = self._owed[i]
        if not owed:
            return []
        with self._lock:
            taken = [d.op for d in owed if (undo or not d.undo) and not _void(d.op)]
            kept = [d for d in owed if not undo and d.undo and not _void(d.op)]
            owed.clear()
            owed.extend(kept)
        return taken

    def restore(self, i: int, ops: list[Op[Any]], undo: bool) -> None:
        """Debts taken whose send failed: owed again, ahead of the newer ones."""
        ops = [op for op in ops if not _void(op)]
        if ops:
            with self._lock:
                self._owed[i].extendleft(self._book(op, undo) for op in reversed(ops))
            self.collect()

    @property
    def any(self) -> bool:
        return any(self._owed)

    def pay_before_up(self, i: int) -> None:
        """The probe found node i back: send its debts before it counts as up. Raises
        (the node stays down) when one gets no answer."""
        self._pay_owed(i, True)

    def _pay_owed(self, i: int, undo: bool) -> None:
        """Take node i's debts and pay them, counted as paying from before the take to after
        a failure owed them again: :meth:`unpaid` never sees them in neither state."""
        with self._lock:
            self._paying[i] += 1
        try:
            self._pay(i, self.take(i, undo), undo)
        finally:
            with self._lock:
                self._paying[i] -= 1

    def unpaid(self) -> list[int]:
        """The nodes with a write still owed, or being paid (no reply read yet)."""
        with self._lock:
            return [i for i, owed in enumerate(self._owed) if owed or self._paying[i]]

    def _pay(self, i: int, ops: list[Op[Any]], undo: bool) -> None:
        """Send ``ops`` to node i in order. No answer: the rest are owed again, and the
        BackendUnavailable is raised. Any other error (a refusal) drops that one: asked
        again, the node would refuse it again."""
        for n, op in enumerate(ops):
            if not self.start(i, op):
                continue
            try:
                self._io.nodes[i].execute(op)
            except BackendUnavailable:
                self.burn(i, [op])  # maybe written: may still run (first: never neither)
                self.restore(i, ops[n:], undo)
                raise
            except Exception as exc:
                logger.debug("django_redlock: a write owed to node %d failed: %s", i, exc)
            except BaseException:
                self.burn(i, [op])
                self.restore(i, ops[n:], undo)
                raise
            finally:
                self.settled(i, [op])

    def _payable(self) -> bool:
        """Whether the collector has something to pay: a release owed, or anything owed to a
        node down (its probe pays it). An undo owed to a node that is up is not: it waits
        for this process's next request to the node (the collector's connection could
        overtake the acquire it undoes), and polling for it would never end."""
        down = self._io.health.is_down
        return any(
            owed and (down(i) or any(not d.undo for d in list(owed)))
            for i, owed in enumerate(self._owed)
        )

    def collect(self) -> None:
        """Start the collector when it has debts to pay and none runs (or it stopped
        beating). Asked at every fan-out: a node that went down with an undo owed is then
        probed."""
        if self.any and self._payable():
            self.watch()

    def watch(self) -> None:
        """Start the collector if none runs (or it stopped beating): it runs while debts are
        owed, or asyncio writes are open (``NodeIO._open``: their loop may be closed with
        them pending, :meth:`NodeIO.owe_closed_loops`)."""
        now = time.monotonic()
        with self._lock:
            if self._collector is not None and now - self._beat < 2 * self._io.timeout + 1:
                return
            token = self._collector = object()
            self._beat = now
        _thread.start_new_thread(self._collect, (token,))

    def _collect(self, token: object) -> None:
        io = self._io
        while self._collector is token:
            self._beat = time.monotonic()
            with self._lock:
                if not self._payable() and not io.open_writes:
                    self._collector = None  # restarted by the next debt it can pay
                    return
            try:
                io.owe_closed_loops()  # owed now, paid below (or by the probe)
                start_probes(io.health, io.nodes, self.pay_before_up)  # no request may come
                slow = io.slow(time.monotonic(), io.slow_after)
                for i in range(len(io.nodes)):
                    if self._owed[i] and not io.health.is_down(i) and i not in slow:
                        with contextlib.suppress(BackendUnavailable):
                            self._pay_owed(i, False)
            except Exception:  # never dies with debts owed: log, go on
                logger.exception("django_redlock: the Redlock debt collector failed; going on")
            time.sleep(OWED_POLL)

    def close(self) -> None:
        """The backend closes: what is still owed is dropped (those holds expire at their
        TTL), and the collector stops. What is burnt, or being written, is kept: the backend
        and its Locks (with their kept tokens) stay in use, and a write on the wire runs
        whether or not the client closed (a retry granted its token would be deleted by it:
        two holders). A write under way settles or burns itself; a lane's is burnt as the
        lanes close (:meth:`Lanes.close`)."""
        with self._lock:
            for owed in self._owed:
                owed.clear()
            self._collector = None

    def forget(self) -> None:
        """After a fork: the parent's debts are its own to pay."""
        self._lock = threading.Lock()
        self._owed = [deque() for _ in self._io.nodes]
        self._collector = None
        self._sending = [weakref.WeakSet() for _ in self._io.nodes]
        self._burnt = [{} for _ in self._io.nodes]
        self._paying = [0] * len(self._io.nodes)


class Connector:
    """A connect to node i in a thread: a connect to a paused node waits for its timeouts.

    Every request that finds it under way joins it (``join``), starts its thread if nobody
    has (``start``: the request that made it may have been interrupted first), and waits for
    it until ``deadline``; the first to ``claim`` the connection sends on it, the others take
    one of their own then (the node just answered). Once no request waits (``leave``), an
    unclaimed connection is kept for the next fan-out. A thread that dies before it finishes
    (an asynchronous exception) leaves its waiters to their deadline, and the next request
    after it starts another connect.
    """

    def __init__(self, io: NodeIO, i: int) -> None:
        self._io, self.i = io, i
        self._mutex = threading.Lock()
        self._waiters: set[Owner] = set()
        self._started = False
        self.finished = False
        self.connection: Any = None
        self.error: BaseException | None = None
        # Waited for this long at most: a connect, then the handshake's reply (a thread that
        # died, or hangs, must not hold its waiters for ever). Counted from when its thread
        # starts to run: a starved process's threads start late, and that time is not the
        # node's; one that has not started in twice that (killed first) is given up.
        self._budget = io.connect_timeout + io.timeout
        self.deadline = time.monotonic() + 2 * self._budget

    def start(self) -> None:
        """Start the connect's thread, once (not waiting for it to run: a thread killed
        before it signals would hold ``Thread.start()`` for ever)."""
        with self._mutex:
            if self._started:
                return
            self._started = True
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        connection: Any = None
        error: BaseException | None = None
        self.deadline = time.monotonic() + self._budget
        try:
            connection = self._io.connect(self.i, self)
        except BaseException as exc:
            error = exc
        finally:
            self._finish(connection, error)

    def _finish(self, connection: Any, error: BaseException | None) -> None:
        if connection is not None:
            self._io.health.answered(self.i)
        else:
            self._io.health.failed(self.i)
        self._io.forget_connector(self)
        with self._mutex:
            self.connection, self.error, self.finished = connection, error, True
            orphan = not self._waiters
        if orphan:
            self._keep()

    def join(self, me: Owner) -> None:
        with self._mutex:
            self._waiters.add(me)

    def claim(self, me: Owner) -> Any:
        """The connection, now ``me``'s; None if another request claimed it, or it failed."""
        with self._mutex:
            connection = self.connection
            if connection is not None and owners.owns(connection, self):
                owners.move(connection, self, me)
                return connection
        return None

    def leave(self, me: Owner) -> None:
        with self._mutex:
            self._waiters.discard(me)
            orphan = self.finished and not self._waiters
        if orphan:
            self._keep()

    def _keep(self) -> None:
        """Nobody waits for it: an unclaimed connection is kept for the next fan-out."""
        connection = self.connection
        if connection is not None and owners.owns(connection, self):
            self._io.give_back(self.i, connection, self)


class NodeIO:
    """The fan-outs of one Redlock backend (both drivers), its lanes and connects."""

    def __init__(self, nodes: list[RedisBackend], quorum: int) -> None:
        self.nodes = nodes
        self.quorum = quorum
        self.health = Health(len(nodes))
        self.lanes = Lanes(self)
        self.debts = Debts(self)
        self._mutex = threading.Lock()
        self._connectors: dict[int, Connector] = {}
        self._tasks: dict[int, dict[asyncio.Task[Any], float]] = {}  # stragglers, asyncio
        #: asyncio: what a fan-out or a node's task holds of the writes every node must get,
        #: with its loop and how to owe it (see _owe_orphans). No lock: single dict steps.
        #: What running coroutines hold (see _opened): their loop, the owe, since when.
        self._open: dict[object, tuple[asyncio.AbstractEventLoop, Callable[[], None], float]] = {}
        #: asyncio: clean-ups of coroutines closed by the collector, run by the next
        #: fan-out (see _later).
        self._deferred: deque[Callable[[], None]] = deque()
        self._pid = os.getpid()
        self._new_kept()
        # The nodes' options are fixed once the backend is made (read once: they are
        # looked at several times per request).
        options = nodes[0].client_options(None)
        #: A node that has not answered for this long is down, whichever request noticed.
        self.timeout = float(options["socket_timeout"])
        self.connect_timeout = float(options.get("socket_connect_timeout") or self.timeout)
        #: A node whose oldest unread reply is older than this counts as slow.
        self.slow_after = min(self.timeout * SLOW_SHARE, SLOW_MAX)

    def _new_kept(self) -> None:
        # Each deque owns the connections in it (checked under its node's lock).
        self._kept: list[deque[Any]] = [deque() for _ in self.nodes]
        self._kept_locks = [threading.Lock() for _ in self.nodes]

    def pool(self, i: int) -> Any:
        return self.nodes[i].client.connection_pool

    def connect(self, i: int, me: Any) -> Any:
        """A new connection to node i, connected, ``me``'s. Made with its pool's settings,
        but not the pool's: redis-py's checkout and return are not safe against an
        interrupt (one landing inside them leaks a connection from the pool for good), so
        the fan-outs own theirs from the start. One an interrupt leaves unreferenced is
        closed when it is collected; nothing counts it."""
        pool = self.pool(i)
        connection = new_connection(pool)
        tag_node(connection, i)  # for a clean-up that finds it in me.held
        owners.move(connection, POOL, me)
        try:
            connection.connect()
            stream_for(connection)
        except BaseException:
            self.drop(i, connection, me, failed=False)
            raise
        return connection

    def checkout(self, i: int, me: Owner) -> Any:
        """A connection to node i, ``me``'s: one a fan-out gave back (kept), else a new one
        (see :meth:`connect`). A kept one the server closed meanwhile is replaced."""
        while (connection := self._kept_one(i, me)) is not None:
            try:
                if stream_of(connection).idle():
                    return connection
            except Exception:
                pass
            self.drop(i, connection, me, failed=False)
        return self.connect(i, me)

    def _kept_one(self, i: int, me: Owner) -> Any:
        """A connection to node i a fan-out gave back, now ``me``'s (not checked: the server
        may have closed it since); None when none is kept."""
        kept = self._kept[i]
        with self._kept_locks[i]:
            while kept:
                connection = kept.pop()
                if owners.owns(connection, kept):  # else stale: an interrupted give-back
                    owners.move(connection, kept, me)
                    return connection
        return None

    def give_back(self, i: int, connection: Any, me: Any) -> None:
        """Kept for the next fan-out (closed when KEPT are kept already)."""
        kept = self._kept[i]
        if len(kept) < KEPT:
            with self._kept_locks[i]:
                kept.append(connection)
                owners.move(connection, me, kept)
        else:
            self.drop(i, connection, me, failed=False)
        self.health.answered(i)

    def drop(self, i: int, connection: Any, me: Any, failed: bool = True) -> None:
        """Close a connection ``me`` owns (a reply may still be on its way: never reuse it);
        nothing when ``me`` no longer owns it."""
        if not owners.owns(connection, me) or not owners.move(connection, me, POOL):
            return
        if failed:
            self.health.dropped(i)
        connection.disconnect()

    def forget_connector(self, connector: Connector) -> None:
        with self._mutex:
            if self._connectors.get(connector.i) is connector:
                del self._connectors[connector.i]

    def _check_fork(self) -> None:
        self.health.check_fork()
        if self._pid != os.getpid():  # a forked child: the parent's connections are not ours
            self._pid = os.getpid()
            self.lanes.forget()
            self.debts.forget()
            self._mutex = threading.Lock()
            self._connectors, self._tasks, self._open = {}, {}, {}
            self._deferred = deque()
            self._new_kept()  # copies of the parent's sockets

    def usable(self) -> set[int]:
        """The nodes worth listening on for releases: up and answering. A waiter must hear
        some node of any majority, so when too few are, those slow to answer are added, and
        those whose connection was dropped (not down: an interrupted request's; the hub
        joins them in a thread, and the wait fails within its timeout if a quorum does not
        confirm)."""
        self._check_fork()
        down = self.health.down()
        up = {i for i in range(len(self.nodes)) if i not in down and self.health.warm(i)}
        if len(up) < self.quorum:
            up = {i for i in range(len(self.nodes)) if i not in down}
        quick = up - self.slow(time.monotonic(), self.slow_after)
        return quick if len(quick) > len(self.nodes) - self.quorum else up

    def slow(self, now: float, after: float) -> set[int]:
        """Nodes with a lane (or an asyncio straggler) older than ``after``. A node being
        connected is not slow: a request waits for its connect."""
        if not (self._tasks or self.lanes.busy):
            return set()
        slow = set()
        with self._mutex:
            for i, tasks in list(self._tasks.items()):
                for task, since in list(tasks.items()):
                    loop = task.get_loop()
                    if loop.is_closed() or (
                        now - since > self.timeout and not loop.is_running()
                    ):  # never done, or not before its idle loop runs again: forgotten
                        del tasks[task]
                    elif now - since > after:
                        slow.add(i)
                if not tasks:
                    del self._tasks[i]
        return self.lanes.slow(now, after) | slow

    def _skipping(self) -> set[int]:
        """Down and slow nodes, while the others can make a quorum; else only the down ones
        while the others can; else none (a quorum needs them: they are tried)."""
        down = self.health.down()
        slow = self.slow(time.monotonic(), self.slow_after)
        size = len(self.nodes)
        if size - len(down | slow) >= self.quorum:
            return down | slow
        if size - len(down) >= self.quorum:
            return down
        return set()

    def _unasked(self, i: int, op: Op[Any], why: str = "") -> Unasked:
        if not why:
            why = "down (no answer lately)" if self.health.is_down(i) else "slow to answer"
        return Unasked(f"lock {op.name!r}: node {self.nodes[i].alias!r} was not asked: {why}")

    def _unawaited(self, i: int, op: Op[Any]) -> Unawaited:
        return Unawaited(
            f"lock {op.name!r}: node {self.nodes[i].alias!r} had not answered when the"
            " others decided"
        )

    def _settled(self, fan: Fan, replies: Replies) -> bool:
        if fan.decided is not None:
            return fan.decided(replies)
        return sum(1 for r in replies if answered(r)) >= self.quorum

    def _plan(self, fan: Fan) -> list[int]:
        """Fills ``fan.replies``; returns the nodes to ask. Each node stays in ``fan.unsent``
        until it is owed its write, or (``complete``) its reply says it was skipped."""
        self._check_fork()
        self._owe_orphans()
        start_probes(self.health, self.nodes, self.debts.pay_before_up)
        self.lanes.watch()  # a drainer an interrupt killed is replaced
        self.debts.collect()  # a collector an interrupt killed is replaced
        # Before anything is sent: an undo owed must not follow it, nor one under way (on
        # another connection) run after it.
        busy = self.debts.supersede(fan) if fan.regrant else set()
        if fan.owed == "undo":
            self.debts.track(fan)
        skipping = self._skipping()
        if fan.owed:  # a slow node is written to all the same (not waited for): in order
            skipping &= self.health.down()
        replies = fan.replies
        asked = []
        for i, op in enumerate(fan):
            if op is None:
                replies.append(None)
            elif i in skipping or i in busy:
                why = "an undo of its token is under way there" if i in busy else ""
                replies.append(self._unasked(i, op, why))
                if i in busy:  # never asked: the undo could run after this request
                    fan.busy.add(i)
                elif fan.complete:
                    fan.late.append(i)
                if not fan.complete:  # else owed once phase two is known not to ask it
                    self._unsent(fan, i)
                else:  # its Unasked reply owes it on an exception (_owe_unsent)
                    fan.unsent.discard(i)
            else:
                replies.append(PENDING)
                asked.append(i)
        return asked

    def owe_back(
        self, i: int, flight: Flight, unread: bool = False, retried: Op[Any] | None = None
    ) -> None:
        """The writes every node must get among ``flight``'s replies read whose reply does
        not prove they ran (BUSY, LOADING, ...: refused for now), and, ``unread``, those
        whose reply will never be read (its connection is closed: a node in CLIENT PAUSE,
        or BUSY, frees what it read and did not run): owed again, ahead of newer debts.
        ``retried``: the request's own op, about to be parsed; a NOSCRIPT reply to it is
        not owed, as :meth:`_parsed` sends it again itself (owed too, it ran twice, and
        the second release found its token gone: "lost").
        An undo among those read is owed again as a release, which the collector sends: it
        ran after the acquire it undoes (that came first on its connection, or was answered
        before), and a retry of its token still makes it void first. Owed as an undo, it
        waited for this process's next request to the node (none may come: an undo answered
        NOSCRIPT by a node that forgot the scripts left the hold there to its TTL)."""
        again = [
            (op, "release")
            for op, _, got in flight.read
            if not self._ran(i, got)
            and not (op is retried and any(isinstance(r, NoScriptError) for r in got))
        ]
        done = [op for op, _, _ in flight.read]
        if unread:
            # Written, never to be read: each may still run at any later time (TCP delivers
            # what was written before the close), so its token is burnt (Debts.burn). Not
            # "as if a closed connection's request could never run".
            self.debts.burn(i, [entry[2] for entry in flight.owed])
            again += [(entry[2], entry[3]) for entry in flight.owed]
            done += [entry[2] for entry in flight.owed]
        # Owed before the Flight forgets them: an exception between owes them twice (sent
        # twice, a release deletes nothing more), never not at all.
        if again:
            self.debts.reowe(i, again)
        if done:
            self.debts.settled(i, done)
        flight.read.clear()
        if unread:
            flight.owed.clear()

    def _ran(self, i: int, replies: list[Any]) -> bool:
        for reply in replies:
            if isinstance(reply, NoScriptError) or (
                isinstance(reply, Exception) and not isinstance(reply, ResponseError)
            ):
                return False
            if isinstance(reply, ResponseError) and acl.first_refused([reply]) is None:
                refusal = self.nodes[i].server_error("", reply)
                if isinstance(refusal, BackendUnavailable):  # for now: asked again, it may run
                    return False
        return True

    def _unsent(self, fan: Fan, i: int) -> None:
        """Node i was not sent ``fan``'s op: owed it, if the op must reach every node."""
        if fan.owed:
            self.debts.owe(i, fan[i], fan.owed)
        fan.unsent.discard(i)  # (after: an exception between owes it twice, never not at all)

    def _second(self, fan: Fan, replies: Replies) -> list[int]:
        """Phase two of a ``complete`` fan-out: the skipped nodes, when they are needed;
        else they are owed the op. Owed only now, never before: a probe finding the node
        back would pay the debt while phase two sent the op too, and the second reply
        ("token gone") would turn a release into a loss."""
        if not fan.complete:
            return []
        skipped = [
            i for i, reply in enumerate(replies) if isinstance(reply, Unasked) and i not in fan.busy
        ]
        if self._settled(fan, replies):
            self._owe_skipped(fan, replies)
            return []
        for i in skipped:
            fan.unsent.add(i)
            replies[i] = PENDING
        return skipped

    def _owe_skipped(self, fan: Fan, replies: Replies) -> None:
        """A ``complete`` fan-out's skipped nodes are owed its op (phase two will not ask
        them: settled without them, or the first phase raised)."""
        if fan.complete:
            for i, reply in enumerate(replies):
                if isinstance(reply, Unasked):
                    self._unsent(fan, i)

    def _owe_unsent(self, fan: Fan, replies: Replies) -> None:
        """An exception leaves the fan-out (either phase): the skipped nodes, and those it
        was about to send to (``fan.unsent``: being connected, asked late, asked in phase
        two), are owed its op. Those written to are owed by ``_ask``'s clean-up."""
        skipped = {i for i, r in enumerate(replies) if isinstance(r, Unasked)}
        for i in sorted((skipped if fan.complete else set()) | set(fan.unsent)):
            self._unsent(fan, i)

    def _late(self, fan: Fan, replies: Replies, slow: bool) -> list[int]:
        """The skipped nodes a ``complete`` fan-out asks now: those not asked yet, once the
        nodes asked cannot make a quorum of answers (``slow``: those still silent count as
        not answering). A node is skipped only while the others can still make a quorum:
        one skipped since it paused, answering again before its breaker's second is up,
        is asked when another node's pause leaves the others short, within the same
        deadline (else a healthy majority was reported unreachable)."""
        if not fan.late:
            return []
        late = [i for i in fan.late if isinstance(replies[i], Unasked)]
        if not late:
            return []
        got = sum(1 for r in replies if r is not None and answered(r))
        if not slow:
            got += replies.count(PENDING)
        return late if got < self.quorum else []

    # -- threads -----------------------------------------------------------------------------

    # The rule for a write every node must get (a release, an undo): from the moment the
    # fan-out exists until each node's write is sent or owed, an exception at any line (a
    # second one during the clean-up included) leaves every node's write either sent or
    # owed. Hence: the plan runs inside the try; a record is written before the one it
    # replaces is cleared (a node stays in ``fan.unsent`` until a Flight notes it or it is
    # owed; a debt is noted in the Flight before the books drop it; a Flight's writes are
    # owed again before it forgets them); and each clean-up that owes goes on, inline,
    # after another interrupt (one at a helper's own entry would escape its loop).

    def fan_out(self, fan: Fan) -> Replies:
        try:
            asked = self._plan(fan)
            self._ask(fan, asked, fan.replies)
            again = self._second(fan, fan.replies)
            if again:
                self._ask(fan, again, fan.replies)
        except BaseException:
            for _ in range(100):
                try:
                    self._owe_unsent(fan, fan.replies)
                    break
                except BaseException:  # another interrupt: again (the first is raised)
                    continue
            raise
        return fan.replies

    def _ask(self, fan: Fan, indexes: list[int], replies: Replies) -> None:
        """One request to each of ``indexes``. ``me`` owns its connections (``me.held``) from
        their checkout until each goes back (kept), to a lane, or is closed; on any
        exception, those it still owns are closed."""
        me = Owner("request")
        flights: dict[int, Flight] = {}
        connecting: dict[int, Connector] = {}
        lanes: dict[int, Flight] = {}  # taken: their writes are ours until a Flight carries them
        started = time.monotonic()
        try:
            kept: list[tuple[int, Any]] = []
            for i in indexes:
                self.nodes[i].round_trips += 1
                lane = self.lanes.take(i, me, lanes)
                if lane is not None:
                    self._send(fan, i, lane.connection, lane, flights, replies, me)
                elif not self.health.warm(i):
                    connecting[i] = self._connector(i, me)
                elif (connection := self._kept_one(i, me)) is not None:
                    kept.append((i, connection))  # sent on below, once seen open
                else:
                    # In a thread: a connect (its handshake) to a node paused since it last
                    # answered waits for the timeout, and the nodes after it would wait too.
                    connecting[i] = self._connector(i, me)
            watch = Watch()  # polls the kept connections now, and every connection later
            if kept:
                closed = watch.busy({i: stream_of(connection) for i, connection in kept})
                for i, connection in kept:
                    if i in closed:  # by the server meanwhile (a restart, a timeout)
                        self.drop(i, connection, me, failed=False)
                        connecting[i] = self._connector(i, me)
                    else:
                        self._send(fan, i, connection, None, flights, replies, me)
            self._collect(fan, flights, connecting, replies, started, me, watch, lanes)
        except BaseException:
            # Every flight owed back, whatever interrupts it (each owe_back idempotent: a
            # flight owed back is empty, a lane a Flight carries too), then the connections
            # closed: a node in CLIENT PAUSE drops what it has not run.
            for _ in range(100):
                try:
                    for i, flight in [*lanes.items(), *flights.items()]:
                        self.owe_back(i, flight, unread=True)
                    break
                except BaseException:  # another interrupt: again (the first is raised)
                    continue
            self._abandon(me, connecting)
            raise

    def _ask_late(
        self,
        fan: Fan,
        late: list[int],
        flights: dict[int, Flight],
        connecting: dict[int, Connector],
        replies: Replies,
        me: Owner,
        lanes: dict[int, Flight],
    ) -> None:
        """Send ``fan``'s op to the skipped nodes ``late`` from within its collection: on
        this thread's lane to the node, else on a connection made in a thread (a node
        skipped as down has none it knows to work)."""
        for i in late:
            fan.unsent.add(i)  # first: from here on, an exception owes it (fan_out)
            replies[i] = PENDING
            self.nodes[i].round_trips += 1
            lane = self.lanes.take(i, me, lanes)
            if lane is not None:
                self._send(fan, i, lane.connection, lane, flights, replies, me)
            else:
                connecting[i] = self._connector(i, me)

    def _abandon(self, me: Owner, connecting: dict[int, Connector]) -> None:
        """Close what ``me`` still owns, whatever line the exception hit, and leave the
        connects it waited for. Another interrupt meanwhile does not stop the clean-up: it
        starts again (each step is idempotent), and the first exception is the one raised."""
        for _ in range(100):
            try:
                while me.held:
                    connection = next(iter(me.held))
                    self.drop(node_of(connection), connection, me)
                    me.held.discard(connection)  # dropped, or someone else's since
                for connector in list(connecting.values()):
                    connector.leave(me)
                return
            except BaseException:  # an interrupt in the clean-up itself: go on
                continue

    def _send_new(
        self,
        fan: Fan,
        i: int,
        flights: dict[int, Flight],
        replies: Replies,
        me: Owner,
        take: Callable[[int, Owner], Any] | None = None,
    ) -> None:
        """Send on a connection to node i made now (its node answered lately), or taken by
        ``take`` (:meth:`checkout`: a kept one first)."""
        try:
            connection = (take or self.connect)(i, me)
        except UNAVAILABLE as exc:
            self.health.failed(i)
            replies[i] = _unavailable(self.nodes[i], fan[i], exc)
            self._unsent(fan, i)
            return
        self._send(fan, i, connection, None, flights, replies, me)

    def _connector(self, i: int, me: Owner) -> Connector:
        """The connect to node i under way (one is started if none is), joined by ``me``.
        Its thread is started outside the mutex, by every request that joins it (once)."""
        with self._mutex:
            connector = self._connectors.get(i)
            if connector is None or time.monotonic() >= connector.deadline:  # none, or hung
                connector = self._connectors[i] = Connector(self, i)
            connector.join(me)
        connector.start()
        return connector

    def _send(
        self,
        fan: Fan,
        i: int,
        connection: Any,
        lane: Flight | None,
        flights: dict[int, Flight],
        replies: Replies,
        me: Owner,
    ) -> None:
        now = time.monotonic()
        if lane is None:  # recorded first: from here on, the clean-up finds it
            flight = flights[i] = Flight(connection, stream_of(connection), 0, 0, now, now)
        else:
            flight = flights[i] = Flight(connection, lane.stream, lane.unread, 0, lane.since, now)
            flight.carry(lane)
        commands = _commands(fan[i].request)
        flight.count = len(commands)
        # What node i is owed goes first, on this connection: nothing sent after it
        # overtakes it. Its replies are read and dropped, as a lane's earlier ones. Not to
        # a node still down: a connection dropped when it went down may hold requests the
        # node has not read yet (the acquire a release undoes), and this one could overtake
        # them; its probe pays once the node answers (after those).
        own = fan[i] if fan.owed == "undo" else None  # under way until owe_back settles it
        if self.health.is_down(i):
            debts = []
            if own is not None:
                self.debts.sending(i, [own])
        else:
            debts = self.debts.take_sending(i, flight, own)
        commands = debts + commands
        if fan.owed:  # a reply that does not prove it ran leaves it owed (see owe_back)
            flight.note(flight.skip, flight.count, fan[i], fan.owed)
        fan.unsent.discard(i)  # the Flight carries it now (_ask's clean-up owes it back)
        owners.using(connection, me)
        try:
            flight.stream.send(b"".join(pack_many(connection, commands)))
        except UNAVAILABLE as exc:
            self.owe_back(i, flight, unread=True)  # first: then nothing left to forget
            self.drop(i, connection, me)
            del flights[i]
            self.health.failed(i)
            replies[i] = _unavailable(self.nodes[i], fan[i], exc)
            return
        # Its timeout counts from the write, not from before it: this thread may have
        # stalled in between (a full GC), and a reply asked for just now is not overdue.
        flight.sent = time.monotonic()
        if lane is None:
            flight.since = flight.sent

    def _connected(
        self,
        fan: Fan,
        i: int,
        connector: Connector,
        flights: dict[int, Flight],
        replies: Replies,
        me: Owner,
    ) -> None:
        """A connect ``me`` waited for has finished: send on it, or on one of our own."""
        connection = connector.claim(me)
        if connection is not None:
            self._send(fan, i, connection, None, flights, replies, me)
        connector.leave(me)
        if connection is None and connector.error is None:
            # Another request claimed it: the node just answered, connect too.
            self._send_new(fan, i, flights, replies, me, self.checkout)
        elif connection is None:
            replies[i] = _unavailable(self.nodes[i], fan[i], connector.error)
            self._unsent(fan, i)

    def _collect(
        self,
        fan: Fan,
        flights: dict[int, Flight],
        connecting: dict[int, Connector],
        replies: Replies,
        started: float,
        me: Owner,
        watch: Watch,
        lanes: dict[int, Flight],
    ) -> None:
        timeout = self.timeout
        grace_end = math.inf
        patience = None if fan.enough is None else started + self.slow_after
        slow_at = started + self.slow_after  # the nodes still silent then count as slow
        late_until: dict[int, float] = {}  # skipped nodes asked late: within our deadline
        stalled: dict[int, float] = {}  # connects found past their deadline: until when
        ready: set[int] = set()
        changed = True  # a reply came (or a node failed) since decided() was last asked
        while True:
            for i, connector in list(connecting.items()) if connecting else ():
                if connector.finished:
                    self._connected(fan, i, connector, flights, replies, me)
                    del connecting[i]
                    changed = True
                    if i in flights and i in late_until:
                        until = max(late_until[i], stalled.get(i, 0.0))
                        flights[i].since = min(flights[i].since, until - timeout)
                elif (now := time.monotonic()) >= (
                    due := min(connector.deadline, late_until.get(i, math.inf))
                ):
                    # Time this process did not run (a full GC, CPU starvation) is not the
                    # node's: its connect's thread did not run either. Found past its
                    # deadline by that long, it gets as long again (a node timeout at most),
                    # as an overdue reply is read before its node counts as silent.
                    until_stalled = stalled.setdefault(i, now + min(now - due, timeout))
                    if now < until_stalled:
                        continue
                    connector.leave(me)
                    del connecting[i]
                    self.health.failed(i)
                    error = TimeoutError("the connect did not finish in time")
                    replies[i] = _unavailable(self.nodes[i], fan[i], error)
                    self._unsent(fan, i)
                    changed = True
            now = time.monotonic()
            for i, flight in list(flights.items()):
                overdue = now >= flight.since + timeout
                if not (i in ready or overdue):
                    continue
                changed = True
                try:  # overdue: what has come is read all the same (this thread may have slept)
                    done = flight.read_ready(me)
                except Exception as exc:  # a connection error, or a reply it cannot parse
                    self.owe_back(i, flight, unread=True)  # first: then nothing to forget
                    self.drop(i, flight.connection, me)
                    del flights[i]
                    self.health.failed(i)
                    replies[i] = _unavailable(self.nodes[i], fan[i], exc)
                    continue
                self.owe_back(i, flight, not done and overdue, fan[i] if done else None)
                if done:
                    self.give_back(i, flight.connection, me)
                    del flights[i]
                    replies[i] = self._parsed(i, fan[i], flight.raw, fan.owed)
                elif overdue:
                    self.drop(i, flight.connection, me)
                    del flights[i]
                    self.health.failed(i)
                    error = TimeoutError(f"no answer within {timeout:g} s")
                    replies[i] = _unavailable(self.nodes[i], fan[i], error)
            now = time.monotonic()
            late = self._late(fan, replies, now >= slow_at) if fan.late else []
            if late:
                until_late = max(started + timeout, now + self.slow_after)
                for i in late:
                    late_until[i] = until_late
                self._ask_late(fan, late, flights, connecting, replies, me, lanes)
                for i in late:
                    if i in flights:  # overdue by our deadline, not one of its own
                        flights[i].since = min(flights[i].since, until_late - timeout)
                grace_end, changed = math.inf, True
            if grace_end == math.inf and fan.decided is not None and changed:
                changed = False
                enough = fan.enough is not None and fan.enough(replies)
                if fan.decided(replies) or (enough and connecting):
                    grace_end = now + max(GRACE, now - started)
                elif enough and patience is not None:
                    grace_end = max(now, patience)
            if (not flights and not connecting) or now >= grace_end:
                break
            until = min(
                min([f.since for f in flights.values()], default=math.inf) + timeout, grace_end
            )
            if patience is not None and grace_end == math.inf and now < patience:
                until = min(until, patience)
            if fan.late and now < slow_at:
                until = min(until, slow_at)
            if connecting:
                until = min(until, now + CONNECT_POLL)
            waiting = {i: f.stream for i, f in flights.items()}
            ready = watch.wait(waiting, until - time.monotonic())
        for i, flight in list(flights.items()):
            self.lanes.leave(i, flight, me)
            del flights[i]
            replies[i] = self._unawaited(i, fan[i])
        for i, connector in list(connecting.items()):
            connector.leave(me)
            del connecting[i]
            replies[i] = self._unawaited(i, fan[i])
            self._unsent(fan, i)  # still connecting: never written

    def _parsed(self, i: int, op: Op[Any], raw: list[Any], owed: str = "") -> Any:
        if len(raw) == 1 and not isinstance(raw[0], Exception) and not isinstance(op.request, list):
            try:  # one reply, no error: the common case
                return op.parse(raw[0])
            except Exception as exc:
                return exc
        refused = acl.first_refused(raw)
        if refused is not None:  # this node's user may not: say what it lacks
            return self.nodes[i].refusal_error(op.name, refused)
        if any(isinstance(r, NoScriptError) for r in raw):
            # This node forgot the scripts: teach it and ask again, on its own. Taught
            # first: asked at once, it answered NOSCRIPT again (a script call more).
            try:
                requests = op.request if isinstance(op.request, list) else [op.request]
                try:
                    teach(self.nodes[i].client, requests)
                except UNAVAILABLE as exc:  # the op did not run: as its own no answer
                    raise _unavailable(self.nodes[i], op, exc) from exc
                except Exception:  # refused (an ACL): the op's own call says so
                    pass
                return self.nodes[i].execute(op)
            except BackendUnavailable as exc:
                if owed:  # not proven to have run: the node is owed it
                    self.debts.owe(i, op, owed)
                return exc
            except Exception as exc:
                return exc
        error = next((r for r in raw if isinstance(r, ResponseError)), None)
        if error is not None:  # BUSY, OOM, ...: this node's refusal, never parsed as a reply
            return self.nodes[i].server_error(op.name, error)  # (bool(error) is True)
        try:
            return op.parse(raw if isinstance(op.request, list) else raw[0])
        except Exception as exc:
            return exc

    # -- asyncio -----------------------------------------------------------------------------

    # The rule above fan_out, with a task per node: a node stays in ``fan.unsent`` (owed by
    # afan_out's clean-up should an exception leave it) until its task's first line, inside
    # the task's own handler, takes it off; from there the task owes the node's write on any
    # exception that leaves it (an interrupt at any line, its cancellation, the GeneratorExit
    # of a loop closed without running it again), unless a task it sends behind owes it
    # instead. A task cancelled before its first step runs none of its code: its node is
    # still in ``fan.unsent``; one that starts after the fan-out owed its node sends nothing.
    # A loop closed with tasks pending never runs them again: what a fan-out or a task holds
    # is registered (``_open``) and owed by the next fan-out once its loop is closed; and a
    # clean-up the garbage collector runs (GeneratorExit) takes no lock: deferred (_later).

    async def afan_out(self, fan: Fan) -> Replies:
        try:  # (the rule above fan_out)
            if fan.owed:  # (its id: the entry refers to it, so no other fan has it meanwhile)
                self._opened(functools.partial(self._owe_unsent, fan, fan.replies), id(fan))
            asked = self._plan(fan)
            await self._aask(fan, asked, fan.replies)
            again = self._second(fan, fan.replies)
            if again:
                await self._aask(fan, again, fan.replies)
        except BaseException as exc:
            for _ in range(100):
                try:
                    self._later(exc, functools.partial(self._owe_unsent, fan, fan.replies))
                    break
                except BaseException:  # another interrupt: again (the first is raised)
                    continue
            raise
        finally:
            if fan.owed:
                self._closed(id(fan))
        return fan.replies

    async def _aask(self, fan: Fan, indexes: list[int], replies: Replies) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        tasks: dict[asyncio.Task[Any], int] = {}
        waiting: set[asyncio.Task[Any]] = set()
        grace_end: float | None = None
        patience = None if fan.enough is None else started + self.slow_after
        slow_at = started + self.slow_after
        try:
            for i in indexes:  # each stays in fan.unsent until its task starts
                task = loop.create_task(self._anode(fan, i))
                tasks[task] = i
                waiting.add(task)
            while True:
                # Asked before each wait, the first too (as _collect does): a fan-out decided
                # before any reply (an undo not waited for) waits its grace, not a node.
                now = time.monotonic()
                late = self._late(fan, replies, now >= slow_at) if fan.late else []
                for i in late:  # (as _collect: the nodes asked cannot make a quorum)
                    fan.unsent.add(i)  # first: until its task starts, the fan-out owes it
                    replies[i] = PENDING
                    self.nodes[i].round_trips += 1
                    task = loop.create_task(self._anode(fan, i))
                    tasks[task] = i
                    waiting.add(task)
                    grace_end = None
                if not waiting:
                    break
                if grace_end is None and fan.decided is not None:
                    if fan.decided(replies):
                        grace_end = now + max(GRACE, now - started)
                    elif patience is not None and fan.enough is not None and fan.enough(replies):
                        grace_end = max(now, patience)
                if grace_end is not None and now >= grace_end:
                    break
                until = grace_end
                if until is None and patience is not None and now < patience:
                    until = patience
                if fan.late and now < slow_at:
                    until = slow_at if until is None else min(until, slow_at)
                timeout = None if until is None else max(0.0, until - now)
                done, waiting = await asyncio.wait(
                    waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    replies[tasks[task]] = task.result()
        finally:
            # (Closed by the collector: no lock taken; afan_out's clean-up, deferred, owes
            # the nodes still in fan.unsent.)
            closing = isinstance(sys.exc_info()[1], GeneratorExit)
            for task in () if closing else waiting:  # they go on; the next request waits
                i = tasks[task]
                if i in fan.unsent:  # not started yet (its loop may never run it): owed now
                    self._unsent(fan, i)
                replies[i] = self._unawaited(i, fan[i])
                self._straggling(i, task, started)

    def _task_done(self, i: int, task: asyncio.Task[Any]) -> None:
        with self._mutex:
            tasks = self._tasks.get(i, {})
            tasks.pop(task, None)
            if not tasks:
                self._tasks.pop(i, None)

    def _opened(self, owe: Callable[[], None], key: object) -> None:
        """``owe`` owes what the running coroutine holds should its loop close before it
        ends (see :meth:`_owe_orphans`), until :meth:`_closed` forgets ``key``. No lock (the
        collector may close a coroutine while this thread holds one): one dict store."""
        self._open[key] = (asyncio.get_running_loop(), owe, time.monotonic())

    def _closed(self, key: object) -> None:
        self._open.pop(key, None)

    @property
    def open_writes(self) -> bool:
        return bool(self._open)

    def _later(self, exc: BaseException, clean_up: Callable[[], None]) -> None:
        """A coroutine's clean-up, now, or deferred to the next fan-out when the collector
        closes it (GeneratorExit): it may do so at any allocation of this thread, while it
        holds one of our plain locks, which the clean-up would wait for for ever."""
        if isinstance(exc, GeneratorExit):
            self._deferred.append(clean_up)
        else:
            clean_up()

    def _owe_orphans(self) -> None:
        """Run the deferred clean-ups (:meth:`_later`), and owe what the coroutines of a
        closed loop held. asyncio.run's shutdown cut short (a second interrupt as it cancels
        the tasks, or one a task re-raises then) closes the loop with tasks that never run
        again: their clean-up runs only once they are collected, if ever (the closed loop is
        still referenced), and their writes would wait for it. Owed first, then forgotten
        (an interrupt between: twice at worst)."""
        while self._deferred:
            try:
                clean_up = self._deferred.popleft()
            except IndexError:  # another thread took the last
                break
            self._run_clean_up(clean_up)
        self.owe_closed_loops()

    def owe_closed_loops(self) -> None:
        """Owe what the coroutines of a closed loop held (see :meth:`_owe_orphans`); the debt
        collector calls it too (:meth:`Debts.watch`). And what those of an idle loop held
        for longer than a node timeout: a loop kept between jobs (``run_until_complete()``
        each, never closed) or dropped without ``close()`` runs them only when it runs
        again, if ever, and a release queued behind a straggler would wait for that (the
        released hold stayed on the node). Owed, the write is the collector's (or the
        probe's) to send; the task finds it owed (``_Write.owed``) and skips it, and a
        write it may have begun is burnt (it may land as well: sent twice, a release
        deletes nothing more)."""
        if not self._open:
            return
        idle_since = time.monotonic() - self.timeout
        for key, (loop, owe, since) in list(self._open.items()):
            if loop.is_closed() or (since < idle_since and not loop.is_running()):
                self._run_clean_up(owe)
                self._closed(key)

    def _run_clean_up(self, clean_up: Callable[[], None]) -> None:
        for _ in range(100):
            try:
                clean_up()
                return
            except BaseException:  # another interrupt: again (the first is raised)
                continue

    def _owe_write(self, write: _Write, settle: bool = False) -> None:
        """A task's clean-up: node i is owed the write (once, whoever else owes it: the task
        it sent behind, :meth:`_owe_orphans`), whatever else interrupts it (the first
        exception is the one raised)."""
        for _ in range(100):
            try:
                if not write.owed:
                    self.debts.burn(write.i, [write.op])  # maybe begun (or later): may land late
                    self.debts.owe(write.i, write.op, write.kind)
                    write.owed = True
                if settle:
                    self.debts.settled(write.i, [write.op])
                self._closed(write)
                return
            except BaseException:  # another interrupt: again
                continue

    async def _anode(self, fan: Fan, i: int) -> Any:
        """Node i's request of ``fan``, in a task of its own: owes the node its write (if
        ``fan.owed``) should an exception leave it once started (the rule above afan_out)."""
        behind: list[bool] = []  # filled once a task sending behind earlier ones owes it
        write: _Write | None = None
        try:
            if i not in fan.unsent:  # the fan-out owed it before this task ever ran
                return self._unawaited(i, fan[i])
            if fan.owed:  # noted before it leaves fan.unsent: never in neither
                write = _Write(i, fan[i], fan.owed)
                self._opened(functools.partial(self._owe_write, write), write)
            fan.unsent.discard(i)
            reply = await self._anode_send(i, fan[i], fan.owed, write, behind)
        except BaseException as exc:
            if write is not None and not behind:
                self._later(exc, functools.partial(self._owe_write, write))
            raise
        if write is not None and not behind:
            self._closed(write)  # answered, or owed already
        return reply

    async def _anode_send(
        self, i: int, op: Op[Any], owed: str, write: _Write | None, behind: list[bool]
    ) -> Any:
        loop = asyncio.get_running_loop()
        with self._mutex:
            earlier = [t for t in self._tasks.get(i, {}) if t.get_loop() is loop]
        if not earlier:
            return await self._asend(i, op, owed)
        # In order: a request never overtakes one left behind on this node. Waited for one
        # node timeout at most (one after another, stragglers cost a timeout each): a
        # release or an undo goes on behind them in the background (never lost, never
        # overtaking them, and what comes next waits for it in turn); any other request is
        # not sent to a node that has not answered them by then, or that they found down.
        if write is not None:
            task = loop.create_task(self._abehind(earlier, write, behind))
            self._straggling(i, task, time.monotonic())
            await asyncio.wait([task], timeout=self.timeout)
            return task.result() if task.done() else self._unawaited(i, op)
        await asyncio.wait(earlier, timeout=self.timeout)
        if all(t.done() for t in earlier) and not self.health.is_down(i):
            return await self._asend(i, op, owed)
        why = "down" if self.health.is_down(i) else "its earlier requests unanswered"
        return _unavailable(self.nodes[i], op, why)

    async def _abehind(
        self, earlier: list[asyncio.Task[Any]], write: _Write, started: list[bool]
    ) -> Any:
        """``write``, a write every node must get, sent once ``earlier`` are done (each ends
        within a node timeout or two). To a node they found down it is owed instead: paid
        before the node counts as up again (Debts). Owed on any exception, from its first
        line (``started``: the task that made it owes it until then)."""
        try:
            started.append(True)
            i, op = write.i, write.op
            self.debts.sending(i, [op])  # queued: a retry of its token does not ask node i
            await asyncio.wait(earlier)
            self.debts.settled(i, [op])  # _asend marks it again (unless void meanwhile)
            if write.owed:  # by the collector, its loop idle meanwhile: the debt is sent
                self._closed(write)
                return self._unasked(i, op, "owed while its loop was idle")
            if self.health.is_down(i):
                self._owe_write(write)
                return _unavailable(self.nodes[i], op, "down")
            reply = await self._asend(i, op, write.kind)
        except BaseException as exc:  # owed first, then no longer under way (never neither)
            self._later(exc, functools.partial(self._owe_write, write, True))
            raise
        self._closed(write)  # answered, or owed already
        return reply

    def _straggling(self, i: int, task: asyncio.Task[Any], since: float) -> None:
        """``task``, a request to node i nobody waits for: the node's next one waits for it."""
        if task.get_loop().is_closed():  # never runs again (its writes: _owe_orphans)
            return
        with self._mutex:
            self._tasks.setdefault(i, {})[task] = since
        task.add_done_callback(functools.partial(self._task_done, i))
        # The caller's loop may be closed without running this task again (the plain
        # ``run_until_complete(); close()``, not asyncio.run, which cancels it): what it
        # holds is then owed by the next fan-out, and an idle process makes none. The
        # collector watches ``_open`` meanwhile, and owes it within its poll.
        self.debts.watch()

    async def _asend(self, i: int, op: Op[Any], owed: str) -> Any:
        """``op`` to node i, its debts first. An exception leaving it leaves ``op`` to the
        caller's clean-up (maybe sent: a release sent twice deletes nothing more, a retry
        voids an undo)."""
        if not self.health.is_down(i):  # held back for a node down, as in _send
            failed = await self._apay(i)
            if failed is not None:
                if owed:
                    self.debts.owe(i, op, owed)
                return _unavailable(self.nodes[i], op, failed)
        if not self.debts.start(i, op):  # void (sent behind earlier tasks): not to be sent
            return self._unasked(i, op, "a try of its token was sent meanwhile")
        try:
            reply = await self.nodes[i].aexecute(op)
        except BackendUnavailable as exc:
            self.health.failed(i)
            if owed:  # not proven to have run (no answer, BUSY, ...): the node is owed it
                self.debts.burn(i, [op])  # and it may still run late (Debts.burn)
                self.debts.owe(i, op, owed)
            self.debts.settled(i, [op])
            return exc
        except Exception as exc:
            self.debts.settled(i, [op])
            return exc
        except BaseException as exc:  # interrupted, cancelled, closed: the caller owes it
            # Maybe written: it may still run late (burnt), in the clean-up (which takes no
            # lock when the collector closes this coroutine, see _later).
            self._later(exc, functools.partial(self._gave_up, i, [op] if owed else [], [op]))
            raise
        self.debts.settled(i, [op])
        self.health.answered(i)
        return reply

    def _gave_up(self, i: int, burnt: list[Op[Any]], ops: list[Op[Any]]) -> None:
        """A request to node i whose reply will never be awaited: ``burnt`` may still run
        there late (:meth:`Debts.burn`), and ``ops`` are no longer in flight."""
        self.debts.burn(i, burnt)
        self.debts.settled(i, ops)

    async def _apay(self, i: int) -> BackendUnavailable | None:
        """Send what node i is owed, in order, each answered before the next (and before the
        request that follows: asyncio's connections are not the threads', only waiting for
        the reply keeps the order). No answer: that one and the rest are owed again, the
        error is returned. A refusal drops that one (asked again, it would be refused).
        Taken off the books, they are noted in ``_open`` first: the caller may close its
        loop while one is under way (``run_until_complete(); close()``), and the coroutine
        never resumes; the collector then owes them again (:meth:`owe_closed_loops`)."""
        if not self.debts.owes(i):
            return None  # the common case: nothing owed
        paying = _Paying(i)
        self._opened(functools.partial(self._owe_unpaid, paying), paying)
        try:
            self.debts.take_kinds(i, paying.owed)
            for n, (op, _) in enumerate(paying.owed):
                paying.at = n
                if not self.debts.start(i, op):  # void: a try with its token was sent meanwhile
                    continue
                try:
                    await self.nodes[i].aexecute(op)
                except BackendUnavailable as exc:
                    self.health.failed(i)
                    self._owe_unpaid(paying)  # this one (maybe written: burnt) and the rest
                    return exc
                except Exception as exc:
                    logger.debug("django_redlock: a write owed to node %d failed: %s", i, exc)
                self.debts.settled(i, [op])
            paying.at = len(paying.owed)
        except BaseException as exc:  # cancelled, interrupted: from this one on, not proven paid
            for _ in range(100):
                try:
                    self._later(exc, functools.partial(self._owe_unpaid, paying))
                    break
                except BaseException:  # another interrupt: again (the first is raised)
                    continue
            raise
        self._closed(paying)
        return None

    def _owe_unpaid(self, paying: _Paying) -> None:
        """``paying``'s debts not proven paid: owed again (once, whoever calls it first: the
        coroutine, or the collector for a closed loop), the one under way burnt (maybe
        written, it may still run late) and no longer in flight."""
        for _ in range(100):
            try:
                if not paying.done:
                    rest = paying.owed[paying.at :]
                    self.debts.burn(paying.i, [op for op, _ in rest[:1]])
                    self.debts.reowe(paying.i, rest)
                    paying.done = True
                    self.debts.settled(paying.i, [op for op, _ in rest[:1]])
                self._closed(paying)
                return
            except BaseException:  # another interrupt: again
                continue

    def close(self) -> None:
        """Close the lanes' and the kept connections (those in use close with their fan-out).
        The writes still owed are dropped: their holds expire at their TTL."""
        self.debts.close()
        self.lanes.close()
        self.lanes = Lanes(self)
        closer = Owner("close")
        for i, kept in enumerate(self._kept):
            with self._kept_locks[i]:
                taken = list({id(c): c for c in kept if owners.owns(c, kept)}.values())
                kept.clear()
                for connection in taken:
                    owners.move(connection, kept, closer)
            for connection in taken:
                self.drop(i, connection, closer, failed=False)


def readable(waiting: dict[Any, Any], until: float) -> set[Any]:
    """The keys of ``waiting`` whose connection has something to read, waiting until then
    at most. A connection closed meanwhile counts as ready (reading it says what happened)."""
    fds: dict[int, Any] = {}
    ready = set()
    for key, value in waiting.items():
        sock = socket_or_none(value)
        fd = -1 if sock is None else sock.fileno()  # -1: closed meanwhile
        if fd < 0:
            ready.add(key)
        else:
            fds[fd] = key
    timeout = 0.0 if ready else max(0.0, until - time.monotonic())
    if hasattr(select, "poll"):
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        events = [fd for fd, _ in poller.poll(math.ceil(timeout * 1000))]
    else:  # pragma: no cover - Windows
        events = select.select(list(fds), [], [], timeout)[0]
    return ready | {fds[fd] for fd in events if fd in fds}


def _commands(request: Any) -> list[tuple[Any, ...]]:
    """The wire commands of a node op: one script call, a pipeline of them, or a command."""
    calls = request if isinstance(request, list) else [request]
    return [
        ("EVALSHA", c.script.sha, str(len(c.keys)), *c.keys, *c.args)
        if isinstance(c, Call)
        else tuple(c)
        for c in calls
    ]


def _unavailable(node: RedisBackend, op: Op[Any], exc: object) -> BackendUnavailable:
    return BackendUnavailable(f"lock {op.name!r}: node {node.alias!r} is unavailable: {exc}")
