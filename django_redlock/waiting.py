"""Waking waiters the moment a lock is freed, without polling: the hubs on Redis's pub/sub.

A waiter registers with the hub, re-tries once, then sleeps until it is woken or the holder's
remaining TTL runs out, whichever comes first. It is woken either by its own id, which a
release sends to its process's inbox channel (fair locks; plain locks on backends that wake
one waiter), or by a message on the lock's release channel that every waiter of the lock
hears. All waiters of a backend in one process, threads and asyncio tasks alike, share one
hub (for Redis, a :class:`PubSubHub`: one pub/sub connection read by one daemon thread,
subscribed to the inbox once for the life of the process; asyncio waiters are woken
thread-safely on their loop; on Redis 7+ Cluster, a :class:`ShardedPubSubHub`). The waiters
and the in-process hub contract are :mod:`~django_redlock.waiters`.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import wire
from .forks import after_fork_in_child
from .identity import process_id
from .waiters import (
    SETUP_FAILURES,
    AnyWaiter,
    AsyncWaiter,
    CompositeHub,
    Confirmation,
    ReleaseHub,
    StandBys,
    Waiter,
    start_thread,
)

# The in-process part (django_redlock.waiters) was in this module: its names stay here too.
__all__ = [
    "AnyWaiter",
    "AsyncWaiter",
    "CompositeHub",
    "Confirmation",
    "PubSubHub",
    "ReleaseHub",
    "ShardedPubSubHub",
    "Waiter",
]

logger = logging.getLogger("django_redlock")

_pubsub_hubs: weakref.WeakSet[PubSubHub] = weakref.WeakSet()


def _unanswered(exc: Exception) -> Confirmation | None:
    """A subscribe that failed: a time-out (the server did not answer the connect's
    handshake) is a confirmation that never comes, so the wait raises instead of trying
    (its try would wait another socket timeout); any other failure, nothing to wait for."""
    return Confirmation() if isinstance(exc, (RedisTimeoutError, TimeoutError)) else None


class _Liveness:
    """Whether a pub/sub connection's server still answers, while someone waits on it.

    A waiter sleeps without asking the server anything, and a paused server (SIGSTOP, a
    stalled network) sends nothing that could wake it. So while any waiter listens, the
    reader PINGs after a quarter of the socket timeout without hearing from the server (a
    healthy connection's messages count: one PING per connection, not per waiter, and
    none while nobody waits); a socket timeout without hearing anything (the PING's answer
    included) makes the waiters' wait raise: within one socket timeout of the last thing
    heard, so of the moment the server stopped (SPEC). A reply (any message) clears it.
    ``on_slow`` is called once per PING still unanswered after a quarter of the timeout (a
    quorum's hub asks then the nodes its waiters skipped: within the PING's deadline, see
    redlock_health)."""

    SHARE = 0.25  # of the socket timeout: silence before a PING, and a PING's slowness

    __slots__ = ("heard_at", "on_slow", "ping_at", "slow_told", "timeout")

    def __init__(self, timeout: float, on_slow: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        self.heard_at = time.monotonic()
        self.ping_at: float | None = None  # a PING awaits its answer since
        self.on_slow = on_slow
        self.slow_told = False

    def heard(self) -> None:
        self.heard_at, self.ping_at = time.monotonic(), None

    def _verdict_at(self, ping_at: float) -> float:
        # One socket timeout after the last thing heard; a PING sent late (the reader was
        # kept from running) still gets a quarter of one for its answer.
        return max(self.heard_at + self.timeout, ping_at + self.timeout * self.SHARE)

    def verdict_due(self) -> float:
        """The earliest the verdict can come if nothing more is heard (monotonic)."""
        ping_at = self.ping_at
        return self._verdict_at(time.monotonic() if ping_at is None else ping_at)

    def step(self, pubsub: Any, waiting: Callable[[], bool]) -> tuple[float, bool]:
        """PING if due; returns how long to read for, and whether the server just went
        silent (nothing heard for the socket timeout: a new round starts). ``waiting``
        (whether anyone listens here) is asked only when a PING or the verdict is due."""
        now = time.monotonic()
        if self.ping_at is None:
            due = self.heard_at + self.timeout * self.SHARE
            if now < due:
                return min(1.0, due - now), False
        elif now < (verdict := self._verdict_at(self.ping_at)):
            if self.on_slow is not None and not self.slow_told:
                slow_at = self.ping_at + self.timeout * self.SHARE
                if now < slow_at:
                    return min(1.0, slow_at - now), False
                self.slow_told = True
                self.on_slow()
            return min(1.0, verdict - now), False
        if not waiting() or not getattr(pubsub, "subscribed", False):
            # Nobody to tell (or no subscription, whose connection would not read the
            # PONG): no PING, and the silence starts over.
            self.heard_at, self.ping_at = now, None
            return min(1.0, self.timeout * self.SHARE), False
        if self.ping_at is None:
            pubsub.ping()
            self.ping_at, self.slow_told = now, False
            first = self.timeout * self.SHARE if self.on_slow else self._verdict_at(now) - now
            return min(1.0, first), False
        self.heard_at, self.ping_at = now, None
        return min(1.0, self.timeout * self.SHARE), True


class _Sending:
    """A channel's send lock, and how many threads hold or wait for it."""

    __slots__ = ("closing", "lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.closing = False  # its holder found the channel settled: no further look


class PubSubHub(ReleaseHub):
    """One pub/sub connection per backend per process, read by one daemon thread."""

    #: Whether a failed connection counts against the waiters as a silent server (until it
    #: is heard again): a quorum's node (a killed node wakes nobody, and the waiters' try
    #: still gets a majority's answer). Not one server: its waiters look again at once,
    #: and their try says whether it is back (a restart's reset is not an outage).
    failure_is_unheard = False

    def __init__(
        self,
        make_pubsub: Callable[[], Any],
        confirm_timeout: float,
        inbox_prefix: str,
        refused: Callable[[BaseException], BaseException | None] = lambda exc: None,
    ) -> None:
        super().__init__()
        self._make_pubsub = make_pubsub
        #: The error to raise for a reader's error that is a refusal (an ACL's), else None.
        self._refused = refused
        self.confirm_timeout = confirm_timeout
        self._inbox_prefix = inbox_prefix
        self._inbox: str | None = None  # subscribed once, for the life of the process
        self._pubsub: Any = None
        self._thread: threading.Thread | None = None
        self._reading: Any = None  # the connection the reader reads (close() takes it away)
        self._confirmed: dict[str, Confirmation] = {}
        # Each channel's subscription, kept in step with its waiters (_sync): the channels
        # last decided subscribed, the send locks of channels being sent for, and the
        # channels whose last send was cut short (what the server has is unknown).
        self._subscribed: set[str] = set()
        self._sending: dict[str, _Sending] = {}
        self._doubtful: set[str] = set()
        # Channels forgotten unsent while unheard (_send_unsubscribe): unsubscribed once the
        # server is heard again.
        self._forgotten: set[str] = set()
        self._closed = False
        self._silent = False  # declared unheard, and nothing heard since
        self._alive: _Liveness | None = None  # the reader's, while it reads
        self._first_send = threading.Lock()  # see _send_first
        _pubsub_hubs.add(self)

    def join(
        self, channel: str, waiter: AnyWaiter, by_id: bool = False, lock: str = ""
    ) -> list[Confirmation]:
        confirmations = super().join(channel, waiter, by_id, lock)
        if self.failure_is_unheard and self._silent:
            # A quorum's node already unheard counts against a waiter that joins (one woken
            # to try, say): the verdict is not declared again.
            waiter.unheard.add(self)
        return confirmations

    def joins_at_once(self) -> bool:
        # Connected: a subscribe only writes. Else it connects first, and a connect's
        # handshake with a paused server waits for the socket timeout.
        pubsub = self._pubsub
        return pubsub is not None and _connected(pubsub)

    def unread(self) -> bool:
        sock = wire.socket_or_none(getattr(self._pubsub, "connection", None))
        try:
            return sock is not None and bool(select.select([sock], [], [], 0)[0])
        except (OSError, ValueError):  # closed meanwhile
            return False

    def _subscribe(self, channel: str, first: bool) -> Confirmation | None:
        # ``first`` is not trusted: the last waiter's leave may not have sent its unsubscribe
        # yet (_sync sends what the waiters need, in order, whoever comes first).
        failed = self._sync(channel)
        if failed is not None:
            return _unanswered(failed)
        with self._mutex:  # decided subscribed by now (by us or another joiner)
            # Only once the server confirmed can a re-try not miss the release message.
            return self._confirmed.get(channel)

    def _wanted(self, channel: str) -> bool:
        """Whether ``channel`` has waiters here (under the mutex)."""
        return bool(self._waiters.get(channel))

    def _settled(self, channel: str) -> bool:
        """Whether the last subscribe or unsubscribe decided for ``channel`` is what its
        waiters want, and was sent whole (under the mutex)."""
        wanted = self._wanted(channel)
        return wanted == (channel in self._subscribed) and channel not in self._doubtful

    def _sync(self, channel: str, wait: bool = True) -> Exception | None:
        """Subscribe or unsubscribe ``channel`` if its waiters want it otherwise than last
        decided; returns a subscribe's failure, if one failed.

        Each joiner and last leaver calls it after changing the waiters, and the sends for a
        channel go out one at a time, each decided under the channel's send lock: so they
        reach the server in the order decided, and the last one is what the waiters want
        now. (Decided under the mutex alone and sent outside it, a leave's unsubscribe could
        follow a join's subscribe and leave the joiner deaf to the release.) The holder of
        the send lock looks again after each send until settled, so a leaver
        (``wait=False``) that finds it held, its last look still to come, leaves its change
        to the holder instead of waiting for a send to a paused server. A joiner that finds
        a subscribe decided already waits for nobody: it waits for its confirmation. A send
        cut short (an interrupt) leaves the channel in doubt: the next sync sends again."""
        with self._mutex:
            if self._settled(channel):
                return None
            sending = self._sending.get(channel)
            if sending is None:
                sending = self._sending[channel] = _Sending()
            elif not wait and sending.lock.locked() and not sending.closing:
                return None  # its holder's last look (under this mutex) is still to come
            sending.users += 1
        try:
            with sending.lock:
                failed: Exception | None = None
                while True:
                    sent = False
                    try:
                        with self._mutex:
                            sending.closing = self._settled(channel)
                            if sending.closing:
                                sent = True
                                return failed
                            wanted = self._wanted(channel)
                            self._doubtful.discard(channel)  # this send settles it
                            if wanted:
                                self._subscribed.add(channel)
                                self._confirmed.setdefault(channel, Confirmation())
                            else:  # a later subscribe's confirmation is its own
                                self._subscribed.discard(channel)
                                self._confirmed.pop(channel, None)
                        failed = None
                        if wanted:
                            failed = self._send_subscribe(channel)
                        else:
                            self._send_unsubscribe(channel)
                        sent = True
                    finally:
                        if not sent:
                            with self._mutex:
                                self._doubtful.add(channel)
        finally:
            with self._mutex:  # (cut short, the entry stays: a few bytes, no harm)
                sending.users -= 1
                if not sending.users and self._sending.get(channel) is sending:
                    del self._sending[channel]

    def _send_first(self, pubsub: Any, send: Callable[[str], object], channel: str) -> None:
        """``send(channel)``, one at a time while ``pubsub`` has no connection yet.

        redis-py's PubSub takes its connection on its first command, looking for none
        outside its lock: two first commands at once (waiters of two locks joining a fresh
        hub) took a connection each, and the subscription sent on the one it did not keep
        was read by nobody: never confirmed, no release heard, subscribed there for good."""
        if getattr(pubsub, "connection", None) is not None:
            send(channel)
            return
        with self._first_send:
            send(channel)

    def _send_subscribe(self, channel: str) -> Exception | None:
        with self._mutex:
            pubsub = self._ensure_started()
        try:
            self._send_first(pubsub, pubsub.subscribe, channel)
        except SETUP_FAILURES as exc:  # the reader reconnects; waiters fall back to TTL waits
            logger.debug("redlock: subscribe to %s failed: %s", channel, exc)
            return exc
        return None

    def _subscribe_inbox(self) -> Confirmation | None:
        # The inbox counts as subscribed only once the SUBSCRIBE went out whole: anything
        # that stops this before (an interrupt at any line, at the entry of any function
        # called, inside redis-py's send) undoes the mark, so the next waiter subscribes
        # again (marked, every later waiter of the process would wait on a deaf inbox).
        inbox = f"{self._inbox_prefix}{process_id()}"
        confirmed = Confirmation()
        marked = sent = False
        try:
            with self._mutex:
                if self._inbox is not None:
                    return self._confirmed.get(self._inbox)
                self._inbox, self._confirmed[inbox], marked = inbox, confirmed, True
                pubsub = self._ensure_started()
            self._send_first(pubsub, pubsub.subscribe, inbox)
            sent = True
        except SETUP_FAILURES as exc:  # as in _subscribe; the next waiter subscribes again
            logger.debug("redlock: subscribe to %s failed: %s", inbox, exc)
            return _unanswered(exc)
        finally:
            if marked and not sent:
                with self._mutex:
                    if self._inbox == inbox and self._confirmed.get(inbox) is confirmed:
                        self._inbox = None
                        del self._confirmed[inbox]
        return confirmed

    def _unsubscribe(self, channel: str) -> None:
        # Unsubscribed only if nobody joined since (a waiter woken by id: never subscribed);
        # not waiting for a send under way (to a paused server, say): its sender does it.
        self._sync(channel, wait=False)

    def _send_unsubscribe(self, channel: str) -> None:
        pubsub = self._pubsub
        if pubsub is not None and (self._silent or not _connected(pubsub)):
            # Unheard (its connection dropped or failed): no subscription left on the
            # server, and sending would reconnect here, waiting for a server that may not
            # answer. Forgotten, so the reader's reconnect does not subscribe it again.
            # But the reader may have connected again already (a paused server's kernel
            # accepts) with redis-py's re-SUBSCRIBE waiting there, to run once the server
            # answers: so it is unsubscribed once the server is heard (_unsubscribe_forgotten).
            if self._silent:  # (cleared when heard: only an unheard hub keeps them)
                self._forgotten.add(channel)
            with contextlib.suppress(AttributeError):  # (not Exception: a time limit comes out)
                pubsub.channels.pop(channel, None)
        elif pubsub is not None:
            try:
                pubsub.unsubscribe(channel)
            except SETUP_FAILURES as exc:
                logger.debug("redlock: unsubscribe from %s failed: %s", channel, exc)

    def moved(self) -> None:
        """The server moved (a Sentinel switch): the connection is shut down, the reader
        connects again (to where the pool says the server is now) and subscribes there, and
        every waiter looks again once that is heard. Subscribed on the old address, it heard
        no release made at the new one."""
        with self._mutex:
            pubsub = self._pubsub
        if pubsub is None:
            return
        self._silent = True  # what is heard next (the new subscriptions) wakes every waiter
        sock = wire.socket_or_none(getattr(pubsub, "connection", None))
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (closed by the reader: never under its read)
        self.notify_all()

    def _ensure_started(self) -> Any:
        if self._closed:
            # A join on a closed hub (its waiter moves to the backend's next hub) starts no
            # connection and no reader: nobody would read its confirmation.
            raise RuntimeError("the hub is closed")
        if self._pubsub is None:
            self._pubsub = self._make_pubsub()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._read_forever, name="redlock-pubsub", daemon=True
            )
            start_thread(self._thread)
        return self._pubsub

    def _read_forever(self) -> None:
        pubsub = self._pubsub
        try:
            self._read_until_closed(pubsub)
        finally:
            # close() took the connection away while get_message() read it, and redis-py's
            # failure callback connected it again (handed back to the pool by then): closed
            # here, not left to the garbage collector.
            connection = getattr(pubsub, "connection", None) or self._reading
            if self._closed and connection is not None:
                with contextlib.suppress(Exception):
                    connection.disconnect()

    #: Called on the reader's thread (it must not wait) when its PING has had no answer
    #: for a quarter of the timeout; None: nothing to do then.
    ping_slow: Callable[[], None] | None = None

    def heard_until(self) -> float | None:
        """A waiter's try ends by its hub's PING verdict: one socket timeout from the moment
        the server stopped, whatever step (SPEC). The try goes on another connection, whose
        full socket timeout, started after the stop, would end up to twice that after it;
        and a verdict that comes while the waiter is in its try would never reach it (it is
        told only when it sleeps). None: no verdict to come (no reader)."""
        alive = self._alive
        return None if alive is None or self._closed else alive.verdict_due()

    def _read_until_closed(self, pubsub: Any) -> None:
        alive = self._alive = _Liveness(self.confirm_timeout, self.ping_slow)
        while not self._closed:
            self._reading = getattr(pubsub, "connection", None) or self._reading
            try:
                wait, silent = alive.step(pubsub, lambda: bool(self._waiters))
                if silent:
                    self._silent = True
                    self.declare_unheard()
                    # The server may be fine and only this connection dead (a firewall
                    # dropped the idle flow): dropped, the next read reconnects, and a
                    # reconnect that works is heard (its subscriptions' confirmations).
                    _drop_connection(pubsub)
                    continue
                message = pubsub.get_message(timeout=wait)
            except Exception as exc:
                if self._closed:
                    return
                refused = self._refused(exc)
                if refused is not None:
                    self._refuse(pubsub, refused)
                    return
                logger.debug("redlock: pub/sub connection failed: %s", exc)
                was_silent = self._silent
                # A connection killed on a node that answers (CLIENT KILL, a proxy's restart)
                # was connected again by redis-py: not unheard. Only a failed reconnect is.
                if self.failure_is_unheard and not self._silent and not _connected(pubsub):
                    self._silent = True
                    self.declare_unheard()
                if isinstance(exc, ResponseError):
                    self.refused_for_now = (time.monotonic(), str(exc))
                    # A refusal for now (BUSY: a long script) of a SUBSCRIBE, the first or
                    # redis-py's re-subscribe after a reconnect: redis-py counts the channel
                    # as subscribed, and its confirmation would never come. Dropped, the
                    # next read connects again and subscribes every channel that still has
                    # waiters (on_connect), until the server takes it; each confirmation
                    # pending meanwhile is then set.
                    _drop_connection(pubsub)
                if not was_silent:  # (an unheard server's failed reconnects: told already)
                    # A release may have been missed: let every waiter look again.
                    self.notify_all()
                threading.Event().wait(0.1)
                continue
            if message is not None:
                alive.heard()
                if self._silent:
                    self._silent = False
                    self.declare_heard()
                    self._unsubscribe_forgotten()
                    self.notify_all()  # a release may have been missed meanwhile
                self._handle_read(message)

    def _unsubscribe_forgotten(self) -> None:
        """(The reader, once the server is heard again.) The channels forgotten while it was
        unheard and still unwanted are unsubscribed: sent behind any re-SUBSCRIBE queued on
        this connection, in step with the joiners (_sync; never waiting for a send)."""
        with self._mutex:
            forgotten, self._forgotten = self._forgotten, set()
            stray = [c for c in forgotten if not self._wanted(c) and c not in self._subscribed]
            self._doubtful.update(stray)  # what the server has is unknown: sent again
        for channel in stray:
            self._sync(channel, wait=False)

    def _refuse(self, pubsub: Any, error: BaseException) -> None:
        """The server refused a subscription (the user lacks SUBSCRIBE, or the channels): the
        waiters whose subscriptions wait raise ``error``, the others look again, and the next
        waiter starts a new connection (which subscribes if the ACL was fixed meanwhile)."""
        with self._mutex:
            pending, self._confirmed = list(self._confirmed.values()), {}
            self._subscribed.clear()  # the next waiter of each channel subscribes anew
            self._inbox = None
            if self._pubsub is pubsub:
                self._pubsub, self._thread = None, None
        for confirmed in pending:
            confirmed.fail(error)
        self.notify_all()
        with contextlib.suppress(Exception):
            pubsub.close()

    def _is_inbox(self, channel: str) -> bool:
        return channel == self._inbox

    def _handle_read(self, message: dict[str, Any]) -> None:
        """(A reader.) :meth:`_handle`, whatever it raises: a failed wake-up must not end
        the only reader (every later wait would last its holder's TTL). No signal handler
        runs on a reader's thread, so nothing caught here is an interrupt."""
        try:
            self._handle(message)
        except Exception:
            logger.exception("redlock: a pub/sub message could not be handled")

    def _handle(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        if isinstance(channel, bytes):
            channel = channel.decode()
        if message["type"] in ("message", "smessage"):
            if self._is_inbox(channel):  # addressed to one waiter, by its id
                data = message["data"]
                self.hear(data.decode() if isinstance(data, bytes) else data)
            else:
                self.notify(channel)
        elif message["type"] in ("subscribe", "ssubscribe"):
            with self._mutex:
                confirmed = self._confirmed.get(channel)
                stray = message["type"] == "subscribe" and self._stray(channel)
                if stray:
                    self._doubtful.add(channel)  # what the server has is not what is wanted
            if confirmed is not None:
                confirmed.set()
            if stray:
                self._sync(channel, wait=False)

    def _stray(self, channel: str) -> bool:
        """(Under the mutex.) Whether the server confirmed a subscription nobody here wants:
        redis-py subscribes again, at each reconnect, every channel whose unsubscribe the
        server has not confirmed yet (one sent to a paused server, say), and nothing else
        would ever unsubscribe it there. Inboxes are the process's for good: never stray."""
        if self._inbox_prefix and channel.startswith(self._inbox_prefix):
            return False
        return not self._wanted(channel) and channel not in self._subscribed

    def close(self) -> None:
        self._closed = True
        pubsub, self._pubsub = self._pubsub, None
        thread, self._thread = self._thread, None
        if pubsub is not None:
            _stop_reader(pubsub, thread, self.confirm_timeout)
        self._end_confirmations()
        super().close()

    def _end_confirmations(self) -> None:
        """A wait being set up on a closed hub waits for no confirmation (nobody reads it
        any more, and a healthy server would be reported silent): it goes on at once, and
        its watch moves to the backend's next hub (steps.py's _Watching). A join that comes
        later is refused (_ensure_started)."""
        with self._mutex:
            pending = list(self._confirmed.values())
        for confirmed in pending:
            confirmed.set()

    def _forget_after_fork(self) -> None:
        # The reader thread does not exist in a forked child, and the parent's socket must
        # not be shared: start from nothing.
        _close_inherited(self._pubsub)
        self._pubsub = None
        self._thread = None
        self._reading = None
        self._inbox = None  # the child has a process id of its own
        self._silent = False
        self._mutex = threading.Lock()
        self._waiters = {}
        self._abandoned = {}  # the parent's ids: its inbox, never heard here
        self._abandoned_at = {}
        self._standing_by = StandBys(self.notify)  # (the parent's thread is not here)
        self._confirmed = {}
        self._subscribed = set()
        self._sending = {}
        self._doubtful = set()
        self._forgotten = set()
        self._first_send = threading.Lock()


def _connected(pubsub: Any) -> bool:
    """Whether ``pubsub``'s connection has a socket (after a failure: redis-py's reconnect
    worked, so the server answered its handshake)."""
    return wire.socket_or_none(getattr(pubsub, "connection", None)) is not None


def _drop_connection(pubsub: Any) -> None:
    """Disconnect ``pubsub``'s connection: its next read connects again and subscribes its
    channels again (redis-py's connect callback)."""
    connection = getattr(pubsub, "connection", None)
    if connection is not None:
        with contextlib.suppress(Exception):
            connection.disconnect()


def _stop_reader(pubsub: Any, thread: threading.Thread | None, timeout: float) -> None:
    """Close ``pubsub`` once its reader ``thread`` has stopped reading it.

    A reader whose read fails reconnects its connection (redis-py's failure callback, even
    with no retries left) before it sees the hub closed: had the connection been closed and
    handed back to the pool first, that reconnect would come after the backend disconnected
    the pool, and the socket would be left for the garbage collector. So its socket is shut
    down (the reader wakes at once), the reader is awaited (for at most ``timeout``: a
    reconnect to a paused server), and only then is the pub/sub closed."""
    sock = wire.socket_or_none(getattr(pubsub, "connection", None))
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    # A reader with no channel subscribed waits in redis-py's get_message() for a
    # subscription, not on the socket: woken too, its read then fails at once.
    subscribed = getattr(pubsub, "subscribed_event", None)
    if isinstance(subscribed, threading.Event):
        subscribed.set()
    if thread is not None and thread is not threading.current_thread():
        # (Never started: an interrupt at its start(); a later waiter started another.)
        with contextlib.suppress(RuntimeError):
            thread.join(timeout)
    with contextlib.suppress(Exception):
        pubsub.close()


class _Shard:
    """One node's pub/sub connection, read by its own daemon thread."""

    __slots__ = ("pubsub", "thread", "unsubscribing")

    def __init__(self, pubsub: Any, thread: threading.Thread) -> None:
        self.pubsub, self.thread = pubsub, thread
        #: Our SUNSUBSCRIBEs whose replies are not read yet, per channel: such a reply is
        #: no slot move, even if the channel was subscribed again here meanwhile.
        self.unsubscribing: dict[str, int] = {}


def _count_off(counts: dict[str, int], channel: str) -> bool:
    """Take one off ``channel``'s count; whether there was one."""
    left = counts.get(channel, 0)
    if left > 1:
        counts[channel] = left - 1
    elif left:
        del counts[channel]
    return left > 0


class ShardedPubSubHub(PubSubHub):
    """Sharded pub/sub on a Redis 7+ cluster: ``SSUBSCRIBE`` on the node that owns the
    lock's slot, so a release's ``SPUBLISH`` stays on that shard instead of crossing the
    cluster bus.

    A shard channel must hash to the slot of the script's keys: the release channel does
    (``{name}:released``), and the per-process inbox becomes one per lock and process
    (``inbox_of(lock)``), subscribed while some waiter of this process waits by id on that
    lock. Each node with a subscription gets a connection and a reader thread of its own, so a
    wake-up on any node is read at once (redis-py's round-robin ``get_sharded_message`` would
    block on one node while another has the message). When a slot moves (migration,
    failover), the server unsubscribes its channels or the connection fails: the channels
    are subscribed again where the slot now lives, then every waiter looks again (nobody is
    woken into an outage); waiters also re-check on their timer, as everywhere.
    """

    def __init__(
        self,
        cluster: Any,
        confirm_timeout: float,
        inbox_of: Callable[[str], str],
        refused: Callable[[BaseException], BaseException | None] = lambda exc: None,
    ) -> None:
        super().__init__(lambda: None, confirm_timeout, "", refused)
        self._cluster = cluster
        self._inbox_of = inbox_of
        self._shards: dict[str, _Shard] = {}  # node name -> its pub/sub and reader
        self._node_of: dict[str, str] = {}  # subscribed channel -> node name
        self._inboxes: dict[str, int] = {}  # per-lock inbox -> waiters by id on it
        self._inbox_by_waiter: dict[str, str] = {}  # waiter id -> its inbox

    # -- subscriptions -----------------------------------------------------------------------

    def _wanted(self, channel: str) -> bool:
        return bool(self._waiters.get(channel)) or self._inboxes.get(channel, 0) > 0

    def _send_subscribe(self, channel: str) -> Exception | None:
        return self._ssubscribe(channel)

    def _join(
        self, channel: str, waiter: AnyWaiter, by_id: bool, lock: str = ""
    ) -> Confirmation | None:
        if not by_id:
            return super()._join(channel, waiter, by_id, lock)
        inbox = self._inbox_of(lock)
        with self._mutex:
            self._waiters.setdefault(channel, {})[waiter] = None
            self._inbox_by_waiter[channel] = inbox
            self._inboxes[inbox] = self._inboxes.get(inbox, 0) + 1
        return self._subscribe(inbox, True)

    def _leave(self, channel: str, waiter: AnyWaiter) -> None:
        super()._leave(channel, waiter)
        with self._mutex:
            inbox = self._inbox_by_waiter.pop(channel, None)
            if inbox is None:
                return
            left = self._inboxes.get(inbox, 1) - 1
            if left > 0:
                self._inboxes[inbox] = left
                return
            self._inboxes.pop(inbox, None)
        self._unsubscribe(inbox)

    def _ssubscribe(self, channel: str) -> Exception | None:
        """Subscribe ``channel`` on the node of its slot: None, or what failed."""
        try:
            node = self._cluster.get_node_from_key(channel)
            with self._mutex:
                if self._closed:
                    return RuntimeError("the hub is closed")
                shard = self._shard(node)
                self._node_of[channel] = node.name
            self._send_first(shard.pubsub, shard.pubsub.ssubscribe, channel)
        except SETUP_FAILURES as exc:  # the channel's waiters fall back to their timer
            logger.debug("redlock: ssubscribe to %s failed: %s", channel, exc)
            return exc
        return None

    def _send_unsubscribe(self, channel: str) -> None:
        with self._mutex:
            name = self._node_of.pop(channel, None)
            shard = self._shards.get(name) if name is not None else None
            if shard is not None:
                shard.unsubscribing[channel] = shard.unsubscribing.get(channel, 0) + 1
        if shard is not None:
            try:
                self._send_first(shard.pubsub, shard.pubsub.sunsubscribe, channel)
            except SETUP_FAILURES as exc:
                logger.debug("redlock: sunsubscribe from %s failed: %s", channel, exc)
                with self._mutex:
                    _count_off(shard.unsubscribing, channel)

    def _shard(self, node: Any) -> _Shard:
        """The node's connection and reader, started if need be (called under the mutex)."""
        shard = self._shards.get(node.name)
        if shard is None or not shard.thread.is_alive():
            pubsub = self._cluster.get_redis_connection(node).pubsub()
            thread = threading.Thread(
                target=self._read_shard,
                args=(node.name, pubsub),
                name="redlock-spubsub",
                daemon=True,
            )
            shard = self._shards[node.name] = _Shard(pubsub, thread)
            start_thread(thread)
        return shard

    # -- reading -----------------------------------------------------------------------------

    def _is_inbox(self, channel: str) -> bool:
        return channel in self._inboxes

    def _read_shard(self, name: str, pubsub: Any) -> None:
        seen: list[Any] = []
        try:
            self._read_shard_until_closed(name, pubsub, seen)
        finally:  # as PubSubHub._read_forever: what a reconnect opened after close()
            connection = getattr(pubsub, "connection", None) or (seen[0] if seen else None)
            if self._closed and connection is not None:
                with contextlib.suppress(Exception):
                    connection.disconnect()

    def _listened_on(self, name: str) -> bool:
        with self._mutex:
            return bool(self._waiters_on(name))

    def _waiters_on(self, name: str) -> list[AnyWaiter]:
        """The waiters listening on node ``name`` (under the mutex)."""
        return [
            waiter
            for channel, group in self._waiters.items()
            if self._node_of.get(self._inbox_by_waiter.get(channel, channel)) == name
            for waiter in group
        ]

    def _read_shard_until_closed(self, name: str, pubsub: Any, seen: list[Any]) -> None:
        failures = 0
        alive = _Liveness(self.confirm_timeout)
        silent = False  # declared unheard, and nothing heard since
        while not self._closed:
            shard = self._shards.get(name)
            if shard is None or shard.pubsub is not pubsub:
                return  # closed, or replaced by a new connection to the node
            if (connection := getattr(pubsub, "connection", None)) is not None:
                seen[:] = [connection]
            try:
                wait, went_silent = alive.step(pubsub, lambda: self._listened_on(name))
                if went_silent:
                    silent = True
                    with self._mutex:
                        waiters = self._waiters_on(name)
                    self.declare_unheard(waiters)
                message = pubsub.get_message(timeout=wait)
            except Exception as exc:
                if self._closed:
                    return
                refused = self._refused(exc)
                if refused is not None:
                    self._refuse_shard(name, pubsub, refused)
                    return
                logger.debug("redlock: sharded pub/sub connection to %s failed: %s", name, exc)
                with self._mutex:  # replies lost with the connection
                    shard.unsubscribing.clear()
                # Waiters look again once their channels are subscribed again, here
                # (reconnected) or on the slot's new owner (_moved).
                failures += 1
                unreachable = not _connected(pubsub)  # redis-py's reconnect failed too
                if isinstance(exc, ResponseError):  # BUSY to a (re-)SSUBSCRIBE: as PubSubHub
                    self.refused_for_now = (time.monotonic(), str(exc))
                    _drop_connection(pubsub)
                self._moved(name)
                if unreachable and failures == 1:
                    # A killed node: its waiters (the channels still here) try at once, and
                    # their try says whether the slot has an answering owner; no PING could
                    # go unanswered on a connection that cannot be made.
                    self._wake_on(name)
                with self._mutex:
                    if name not in self._node_of.values():  # nothing left here: stop
                        if self._shards.get(name) is shard:
                            del self._shards[name]
                        with contextlib.suppress(Exception):
                            pubsub.close()
                        return
                threading.Event().wait(min(0.1 * 2**failures, 1.0))
                continue
            if failures:  # reconnected and subscribed again: a release may have been missed
                failures = 0
                self.notify_all()
            if message is None:
                continue
            alive.heard()
            if silent:
                silent = False
                with self._mutex:
                    waiters = self._waiters_on(name)
                self.declare_heard(waiters)
            if message["type"] == "sunsubscribe":
                channel = message["channel"]
                channel = channel.decode() if isinstance(channel, bytes) else channel
                with self._mutex:
                    # The reply to our own SUNSUBSCRIBE (a leave) is no move, even with the
                    # channel subscribed here again since (a waiter joined at once).
                    dropped = not _count_off(shard.unsubscribing, channel)
                    dropped = dropped and self._node_of.get(channel) == name
                if dropped:  # the server dropped it: its slot moved away from this node
                    self._moved(name, channel)
                continue
            self._handle_read(message)

    def _wake_on(self, name: str) -> None:
        with self._mutex:
            waiters = self._waiters_on(name)
        for waiter in waiters:
            waiter.baton = True
            waiter.wake()

    def _refuse_shard(self, name: str, pubsub: Any, error: BaseException) -> None:
        """The node refused a subscription (an ACL): as :meth:`PubSubHub._refuse`, for the
        channels on that node; the next waiter on one of them subscribes anew."""
        with self._mutex:
            channels = [c for c, n in self._node_of.items() if n == name]
            pending = [self._confirmed.pop(c) for c in channels if c in self._confirmed]
            for channel in channels:
                self._subscribed.discard(channel)  # its next waiter subscribes anew
                self._node_of.pop(channel, None)
                self._inboxes.pop(channel, None)
            shard = self._shards.get(name)
            if shard is not None and shard.pubsub is pubsub:
                del self._shards[name]
        for confirmed in pending:
            confirmed.fail(error)
        self.notify_all()
        with contextlib.suppress(Exception):
            pubsub.close()

    def _moved(self, name: str, only: str | None = None) -> None:
        """A node failed, or gave ``only``'s slot away: the channels it carried are subscribed
        again on whichever node owns their slot now, then every waiter looks again (a release
        may have been missed meanwhile)."""
        with self._mutex:
            channels = [c for c, n in self._node_of.items() if n == name and only in (None, c)]
        with contextlib.suppress(Exception):
            self._cluster.nodes_manager.initialize()  # the slot map may be stale
        moved = False
        for channel in channels:
            node = None
            with contextlib.suppress(Exception):
                node = self._cluster.get_node_from_key(channel)
            if node is not None and (node.name != name or only is not None):
                with self._mutex:
                    self._node_of.pop(channel, None)
                moved = self._ssubscribe(channel) is None or moved
        if moved or only is not None:
            self.notify_all()

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        with self._mutex:
            shards, self._shards = list(self._shards.values()), {}
        for shard in shards:
            _stop_reader(shard.pubsub, shard.thread, self.confirm_timeout)
        self._end_confirmations()
        ReleaseHub.close(self)

    def _forget_after_fork(self) -> None:
        super()._forget_after_fork()
        for shard in list(self._shards.values()):
            _close_inherited(shard.pubsub)
        self._shards = {}
        self._node_of = {}
        self._inboxes = {}
        self._inbox_by_waiter = {}


def _close_inherited(pubsub: Any) -> None:
    """In a forked child: close its copy of the parent's pub/sub socket. Left open, the
    server kept counting the subscription after the parent died (a release's PUBLISH or
    SPUBLISH counted a dead waiter as listening, the next waiter slept until the TTL), and a
    close() in the child that shut it down cut the parent's. The descriptor only: no
    shutdown (it would end the parent's connection too), no I/O, no lock."""
    sock = wire.socket_or_none(getattr(pubsub, "connection", None))
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()


def _after_fork_in_child() -> None:
    for hub in list(_pubsub_hubs):
        hub._forget_after_fork()


after_fork_in_child(_after_fork_in_child)
