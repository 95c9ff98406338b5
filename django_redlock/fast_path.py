"""The single-node fast path: each thread's own connection to a plain ``redis.Redis``'s
server, on which the script layer (:mod:`django_redlock.scripts`) sends its commands
without redis-py's per-command wrapper or a pool checkout when that wrapper would do
nothing (:func:`django_redlock.wire.bare_execute`); through redis-py otherwise.

The fast path's connections: one owner at a time
-------------------------------------------------

On a plain ``redis.Redis`` each thread sends its lock commands on a connection of its own
(:func:`command`). Each such connection has exactly one owner at any time, and only its owner
sends on it, reads from it, connects or closes it:

* the kept set of its pool (``_Registry.spares``): connections ended threads left, in step;
* one thread (``_Bound``), between its commands;
* one command in flight on that thread, its reconnect and handshake included (the thread's
  ``claim`` is held), or the closer of the backend (it holds the claim too);
* a command aside: one that finds its thread's connection claimed (a signal handler, a
  ``__del__``, Celery's soft time limit running in the middle of a command or a reconnect)
  takes a kept connection or makes one, and never touches the claimed one.

Every move is safe whatever exception (``BaseException``: ``KeyboardInterrupt``,
``SoftTimeLimitExceeded``, a signal handler's) lands at any line:

* The claim is taken without waiting (``Lock.acquire(False)``) before any I/O, connecting
  included, and given back in a ``finally``. Cut short between the two (an interrupt right
  after the claim), it stays taken: the thread's commands then all go aside, which is slower,
  never shared.
* ``dirty`` is set before the first byte of a request (or a handshake) and cleared only once
  the whole reply is read: a connection left dirty by an interrupt anywhere in between is
  closed before it is used again, so no reply is ever read by the wrong command.
* A connection enters the kept set only in step, as the last step of a move (``_keep``), and
  leaves it by one atomic ``deque.pop()``: an interrupt before the append leaves it with no
  owner (closed when it is collected), never with two.
* Closing a backend marks its registry closed first, then closes each thread's connection it
  can claim; a command that holds a claim sees the mark after giving the claim back and closes
  its own. Whichever comes second closes it: nothing is left open for the collector.

``DJANGO_REDLOCK_CHECK_OWNERS=1`` (the test suite sets it) writes each move on the connection
(:mod:`django_redlock.backends.owners`) and fails loudly on a move by a non-owner: a
connection kept twice, or used by a command that does not own it.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from types import FrameType
from typing import Any, cast

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import wire
from .backends import owners
from .forks import after_fork_in_child
from .waiters import start_thread
from .wire import bare_execute, socket_of, texts

_until = threading.local()  # .entry: the standing deadline (see begin_call), or None

#: A deadline this close to a command's own socket timeout is left to that timeout: the first
#: round trip of a call needs no bounding (nor its settimeout() calls), only the later ones.
_SLACK = 0.005


class _Late(RedisTimeoutError):
    """No time left of the call's deadline before a command was sent: nothing went out, so
    the connection is still in step (not closed, unlike a time-out while reading)."""


#: A deadline that stands: (when, the frame of the call that set it, the entry it nests in).
_Entry = tuple[float, FrameType, "_Entry | None"]


class CallDeadline:
    """What a call holds while its deadline stands: the entry to put back at its end."""

    __slots__ = ("began", "outer")

    def __init__(self) -> None:
        self.outer: _Entry | None = None
        self.began = False  # (an interrupt before begin_call: end_call puts nothing back)


class answered_by:  # (lower case: used as the context manager function it replaced)
    """This thread's commands on its own connection wait for their replies until
    ``deadline`` (monotonic) at the latest, not a whole socket timeout: a waiter's try ends
    with its hub's PING verdict (see ``PubSubHub.heard_until``). Nested: the earliest. The
    deadline is the calling frame's (not this object's): see :func:`begin_call`."""

    __slots__ = ("call", "deadline")

    def __init__(self, deadline: float) -> None:
        self.call, self.deadline = CallDeadline(), deadline

    def __enter__(self) -> None:
        begin_call(self.call, self.deadline, sys._getframe(1))

    def __exit__(self, *exc_info: object) -> None:
        end_call(self.call)


def begin_call(call: CallDeadline, deadline: float, frame: FrameType | None = None) -> None:
    """Every round trip of this thread's ``call`` (a reconnect's handshake, NOSCRIPT, SCRIPT
    LOAD and the script again, an ACL probe) is answered by ``deadline`` (monotonic), the
    earliest of nested ones: each with a socket timeout of its own, one call took several
    (BUSY after a reconnect, 0.755 s with 0.3). :func:`end_call` puts back what stood before.
    (Not a context manager: it is on every operation's path.)

    The deadline belongs to the calling frame (``frame``, else begin_call's caller) and
    stands only while that frame is running, on this thread's stack. An interrupt in the
    call's ``finally`` skips end_call; the exception's traceback keeps the frame (and
    anything it refers to) alive, for as long as the exception is handled or kept (a log
    record, Celery's retry(exc=exc)): alive is not running, so the entry left behind is
    ignored by the thread's next commands, and dropped by its next call."""
    outer = getattr(_until, "entry", None)
    if outer is not None:
        outer = _running(outer)  # (one step up for a nested call: its outer is its caller)
    call.outer, call.began = outer, True
    if outer is not None and outer[0] <= deadline:
        deadline = outer[0]
    _until.entry = (deadline, frame or sys._getframe(1), outer)  # one store: all or nothing


def end_call(call: CallDeadline) -> None:
    if call.began:
        _until.entry = call.outer


def _running(entry: _Entry | None) -> _Entry | None:
    """The innermost of ``entry`` and those it nests in whose frame is running on this
    thread's stack (None: none is): one whose call ended without :func:`end_call` (cut short
    by an interrupt) stands no more, however long its frame lives on."""
    while entry is not None:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame is entry[1]:
                return entry
            frame = frame.f_back
        entry = entry[2]
    return None


def _left(full: float | None) -> float | None:
    """The time left of this thread's deadline when it is shorter than ``full`` (a command's
    own timeout), else None; raises :class:`_Late` when none is left (nothing sent yet)."""
    entry = getattr(_until, "entry", None)
    if entry is None:
        return None
    left = entry[0] - time.monotonic()
    if full is not None and left >= full - _SLACK:
        return None  # (the common case: no call's frame to look for)
    running = _running(entry)
    if running is not entry:  # left behind by a call cut short: not this command's
        _until.entry = entry = running
        if entry is None:
            return None
        left = entry[0] - time.monotonic()
        if full is not None and left >= full - _SLACK:
            return None
    if left < 0.001:
        raise _Late("Timeout: the call's socket timeout ran out before this command was sent")
    return left


def _bound_reads(conn: Any) -> Any:
    """Shorten the reads of ``conn`` to this thread's deadline, if any: the socket whose
    timeout was changed (put back by :func:`_unbound_reads`), else None."""
    left = _left(getattr(conn, "socket_timeout", None))
    sock = socket_of(conn)
    if left is None or sock is None:
        return None
    sock.settimeout(left)
    return sock


def _unbound_reads(conn: Any, sock: Any) -> None:
    if sock is not None and socket_of(conn) is sock:  # (a closed one is made anew)
        with contextlib.suppress(OSError):
            sock.settimeout(getattr(conn, "socket_timeout", None))


def _connect(conn: Any) -> None:
    """``conn.connect()``, its TCP connect and handshake bounded by this thread's deadline.
    The handshake's replies are read one ``recv`` at a time, each with the whole socket
    timeout (replies in several segments took several), so the socket is shut down at the
    deadline if the handshake is still going; the connect's own timeout is lowered to it."""
    left = _left(None)
    if left is None:
        conn.connect()
        return
    connect_full = conn.socket_connect_timeout
    cut: _Cut | None = None
    try:
        # (An interrupt inside _Cut() leaves its timer running: at worst it shuts the next
        # socket made, an error for that command, never a reply read by the wrong one.)
        cut = _Cut(conn, left)
        conn.socket_connect_timeout = left if connect_full is None else min(connect_full, left)
        conn.connect()
    except (RedisConnectionError, OSError) as exc:
        if cut is not None and cut.fired:
            raise RedisTimeoutError(
                "Timeout connecting: the call's socket timeout ran out in the handshake"
            ) from exc
        raise
    finally:
        if cut is not None:
            cut.done()
        conn.socket_connect_timeout = connect_full
    if cut.fired:  # just after the handshake: the socket is shut, no use to the command
        conn.disconnect()
        raise RedisTimeoutError("Timeout connecting: the call's socket timeout ran out")


class _Cut:
    """Shuts ``conn``'s socket down after ``seconds`` unless :meth:`done` came first: a
    reconnect's handshake in the middle of a read then ends (a closed connection)."""

    __slots__ = ("conn", "fired", "mutex", "over", "timer")

    def __init__(self, conn: Any, seconds: float) -> None:
        self.conn, self.fired, self.over = conn, False, False
        self.mutex = threading.Lock()
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        try:
            start_thread(self.timer)
        except BaseException:  # an interrupt: the timer may run, and nobody would stop it
            self.timer.cancel()
            raise

    def _fire(self) -> None:
        with self.mutex:
            if self.over:
                return
            self.fired = True
            sock = socket_of(self.conn)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def done(self) -> None:
        with self.mutex:
            self.over = True
        self.timer.cancel()


def command(client: Any, *args: Any) -> Any:
    """``client.execute_command(*args)``; on a plain ``redis.Redis``, straight on the calling
    thread's own connection of its pool (see the ownership rule above), skipping redis-py's
    per-command wrapper (a retry loop, which ours are configured not to use, and redis-py 8's
    operation metrics) and the pool's checkout and return on every command. Where that wrapper
    does anything for the client, it is used as before (see :func:`.wire.bare_execute`)."""
    if not bare_execute(client, args[0]):
        return client.execute_command(*texts(args))  # redis-py packs with hiredis too
    return _exchange(client.connection_pool, args, None)


def on_thread_connection(client: Any) -> bool:
    """Whether :func:`command` runs ``client``'s scripts on the calling thread's own
    connection (nothing checked out of its pool)."""
    return bare_execute(client, "EVALSHA")


def commands(client: Any, many: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Several commands sent at once, their replies in order, errors as values: on the
    thread's own connection as :func:`command`, else in a redis-py pipeline."""
    if not all(bare_execute(client, each[0]) for each in many):
        pipe = client.pipeline(transaction=False)
        for each in many:
            pipe.execute_command(*texts(each))
        return list(pipe.execute(raise_on_error=False))
    return cast("list[Any]", _exchange(client.connection_pool, None, many))


def _exchange(
    pool: Any, args: tuple[Any, ...] | None, many: Sequence[tuple[Any, ...]] | None
) -> Any:
    """Send one command (``args``) or several (``many``), and read the replies, on the
    thread's own connection (aside when it is taken)."""
    bound = _bound(pool)
    conn, claim = bound.connection, bound.claim
    if not claim.acquire(False):  # this thread's connection is mid-command (a handler, a
        return _aside(pool, bound.registry, args, many)  # finalizer), or being closed
    try:
        if _CHECK:
            owners.move(conn, bound.idle, bound.flight)
        try:
            poller = bound.poller  # the common case inline: in step, and nothing to read
            if (
                poller is None
                or bound.dirty
                or socket_of(conn) is not bound.socket
                or bound.moves != bound.registry.moves
                or poller.poll(0)
            ):
                _recheck(bound, conn)
            bound.dirty = True  # from the first byte sent until the last reply is read
            bounded = _bound_reads(conn)  # (_Late: no time left, nothing sent)
            try:
                if many is None:
                    conn.send_packed_command(wire.pack(conn, args))  # type: ignore[arg-type]
                    reply = conn.read_response()
                else:
                    conn.send_packed_command(wire.pack_many(conn, many))
                    reply = [_reply(conn) for _ in many]
            finally:
                _unbound_reads(conn, bounded)
        except (ResponseError, _Late):
            bound.dirty = False  # an answer, or nothing sent: the connection is in step
            raise
        except BaseException:
            # No answer, or part of one (a time-out, a reset, an interrupt): a reply may still
            # be on its way, so the socket is never read again (nor if this is cut short:
            # it is still dirty, and the next command's recheck closes it).
            conn.disconnect()
            raise
        bound.dirty = False
        return reply
    finally:
        if _CHECK and owners.owns(conn, bound.flight):  # (not if the move in was refused)
            owners.move(conn, bound.flight, bound.idle)
        claim.release()
        if bound.registry.closed:  # closed meanwhile: the closer may have left this one to us
            _retire(bound)


def _reply(conn: Any) -> Any:
    try:
        return conn.read_response()
    except ResponseError as exc:  # read whole: the connection is in step
        return exc


def _aside(
    pool: Any, registry: _Registry, args: tuple[Any, ...] | None,
    many: Sequence[tuple[Any, ...]] | None,
) -> Any:  # fmt: skip
    """A command while the thread's own connection is taken (a signal handler or a finalizer
    that runs in the middle of a command or a reconnect): on a kept connection, or a new one,
    given back to the kept set only once its reply is read."""
    owner = owners.Owner("command aside") if _CHECK else None
    conn = _spare(registry, owner) or _new(pool, owner)
    clean = False
    try:
        # A kept connection may be to a server the pool's has moved from: kept by a thread
        # that ended after the move without a command since (its check is per command).
        if socket_of(conn) is not None and (_moved_from(registry, conn) or _unusable(conn)):
            conn.disconnect()
        if socket_of(conn) is None:
            conn.connect()  # the connection's own: a Sentinel one asks where the master is
        if many is None:
            conn.send_packed_command(wire.pack(conn, args))  # type: ignore[arg-type]
            reply = conn.read_response()
        else:
            conn.send_packed_command(wire.pack_many(conn, many))
            reply = [_reply(conn) for _ in many]
        clean = True
        return reply
    except ResponseError:
        clean = True
        raise
    finally:
        if clean:
            _keep(registry, conn, owner)
        else:  # a reply (or a handshake's) may be on its way: never kept
            conn.disconnect()


def _moved_from(registry: _Registry, conn: Any) -> bool:
    master = registry.master
    return master is not None and (str(conn.host), int(conn.port)) != master


def _unusable(conn: Any) -> bool:
    try:
        return bool(conn.can_read())
    except (RedisConnectionError, OSError):
        return True


_PID = os.getpid()


@after_fork_in_child
def _new_process() -> None:
    """A forked child's connections are its own: those of the parent's pid are closed, not
    used (see :func:`_leave`, :func:`_spare`, :func:`_bound`)."""
    global _PID
    _PID = os.getpid()


#: Connections of ended threads kept for new threads, per pool: a server that starts a
#: thread per request (runserver, gevent's greenlets) would otherwise connect per request.
SPARES = 16

_CHECK = owners.CHECK


class _Registry:
    """A pool's lock connections: each thread's (``local``), and those kept for new threads
    (``spares``: ``(pid, connection)``, the owner of the connections in it). ``closed``: the
    backend was closed; nothing is kept any more, and each command's connection is closed
    after it."""

    __slots__ = ("__weakref__", "closed", "everyone", "kept", "local", "master", "moves", "spares")

    def __init__(self) -> None:
        # Where the server is now (a Sentinel's master, after a failover: see moved_threads),
        # and how many times it moved: a thread's connection elsewhere is made again.
        self.master: tuple[str, int] | None = None
        self.moves = 0
        self.kept: Any = owners.Owner("kept") if _CHECK else None  # the spares' owner
        self.local = threading.local()
        self.spares: deque[tuple[int, Any]] = deque()
        self.everyone: weakref.WeakSet[_Bound] = weakref.WeakSet()
        self.closed = False


class _Bound:
    """A connection one thread runs its lock commands on, made like the pool's own but kept
    outside it: one per thread however small the pool, and never waiting for a free one.
    When its thread ends (its ``threading.local`` goes, and this with it), the connection is
    kept for the next new thread, or closed when enough are kept.

    ``claim`` is held by whoever uses the connection (a command, its reconnect included, or
    the closer): taken without waiting, so a handler finds it held and goes aside. ``dirty``:
    a reply (a handshake's included) may be due on the socket, which must not be read again.
    """

    __slots__ = (
        "__weakref__", "claim", "connection", "dirty", "flight", "idle", "moves", "pid",
        "poller", "registry", "socket",
    )  # fmt: skip

    def __init__(self, pool: Any, registry: _Registry) -> None:
        self.registry = registry
        self.pid, self.dirty, self.claim = _PID, False, threading.Lock()
        self.moves = -1  # its (perhaps kept) connection's server not checked yet
        self.socket: Any = None  # the socket the poller watches
        self.poller: Any = None
        # Owners as the debug check writes them on the connection: tokens, not this object
        # (a connection referring back to it would make a cycle, freed only by the collector).
        self.idle: Any = owners.Owner("thread") if _CHECK else None
        self.flight: Any = owners.Owner("command in flight") if _CHECK else None
        self.connection: Any = _spare(registry, self.idle) or _new(pool, self.idle)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            _leave(self)


def _new(pool: Any, owner: Any) -> Any:
    connection = wire.new_connection(pool)
    if _CHECK:
        owners.move(connection, owners.POOL, owner)  # made with the pool's settings
    return connection


def _leave(bound: _Bound) -> None:
    """The ended thread's connection: kept for a new thread when it is in step and there is
    room, else closed now (not when the garbage collector gets to it: it is in a cycle)."""
    conn, registry = bound.connection, bound.registry
    if bound.pid != _PID:
        conn.disconnect()  # a forked child's copy: closes the child's, the parent's lives on
    elif bound.dirty or not bound.claim.acquire(False):  # (held: cut short by an interrupt)
        conn.disconnect()
    else:
        _keep(registry, conn, bound.idle)


def _keep(registry: _Registry, conn: Any, owner: Any) -> None:
    """Hand ``conn`` (in step) from ``owner`` to the kept set, or close it."""
    if registry.closed or len(registry.spares) >= SPARES:
        conn.disconnect()
        return
    if _CHECK:
        owners.move(conn, owner, registry.kept)
    registry.spares.append((_PID, conn))
    if registry.closed:  # closed while this was being kept: the closer may have missed it
        _drain(registry)


def _spare(registry: _Registry, owner: Any) -> Any:
    """A connection an ended thread of this process left, if any, now ``owner``'s."""
    while True:
        try:
            pid, connection = registry.spares.pop()
        except IndexError:  # none, or another thread took the last one
            return None
        if pid == _PID:
            if _CHECK:
                owners.move(connection, registry.kept, owner)
            return connection
        connection.disconnect()  # the parent's, copied by a fork: closes this copy only


def _drain(registry: _Registry) -> None:
    while True:
        try:
            _pid, connection = registry.spares.pop()
        except IndexError:
            return
        connection.disconnect()  # each popped by one thread: closed once


def _bound(pool: Any) -> _Bound:
    """The calling thread's connection to ``pool``'s server: made once per thread, not
    checked out of the pool and back on every command. A forked child makes its own
    (closing the parent's copy leaves the parent's socket alone)."""
    registry = wire.pool_threads(pool, _Registry)
    bound: _Bound | None = getattr(registry.local, "bound", None)
    if bound is None or bound.pid != _PID:
        bound = registry.local.bound = _Bound(pool, registry)
        registry.everyone.add(bound)
    return bound


def disconnect_threads(pool: Any, *, pool_lives_on: bool = False) -> None:
    """Close every thread's lock connection to ``pool``'s server, and those kept (the
    backend is closed). A command in flight keeps its connection and closes it when done;
    a late command on this pool connects for itself and closes after (nothing is left for
    the garbage collector). ``pool_lives_on`` (a django-redis cache's pool, used after this
    backend): new commands start afresh instead."""
    registry = wire.planted_pool_threads(pool)
    if registry is None:
        return
    registry.closed = True
    if pool_lives_on:
        wire.planted_pool_threads(pool, unplant=True)
    while True:
        try:
            bounds = list(registry.everyone)
            break
        except RuntimeError:  # a thread added its own meanwhile
            continue
    for bound in bounds:
        if bound.pid == _PID:
            _retire(bound)
    _drain(registry)


def _retire(bound: _Bound) -> None:
    """Close a bound connection of a closed backend, unless a command has it (that command
    closes it when done: it looks after releasing its claim)."""
    if bound.claim.acquire(False):
        try:
            bound.connection.disconnect()
        finally:
            bound.claim.release()


def _recheck(bound: _Bound, conn: Any) -> None:
    """What the pool does at each checkout, under the command's claim: a connection with
    something to read while no reply is due (the server closed it: a restart, CLIENT KILL,
    an idle time-out, a Sentinel's demotion), or a reply due from a command cut short, is
    replaced before a command is sent on it. Connecting is the connection's own
    ``connect()``, not the one send_command does by itself: that one skips a Sentinel
    connection's, which asks the sentinels where the master is now. One poll(0) on a poller
    kept per socket: a third of what redis-py's ``can_read()`` costs."""
    sock = socket_of(conn)
    if sock is not None and (bound.dirty or _elsewhere(bound, conn) or _stale(bound, conn, sock)):
        conn.disconnect()
        sock = None
    if sock is None:
        bound.dirty = True  # the handshake's replies are due until connect() returns
        _connect(conn)
        bound.dirty = False


def _elsewhere(bound: _Bound, conn: Any) -> bool:
    """Whether ``conn`` is connected to a server the pool's has moved from (a Sentinel's old
    master, see :func:`moved_threads`)."""
    registry = bound.registry
    if bound.moves == registry.moves:
        return False
    bound.moves = registry.moves
    return _moved_from(registry, conn)


def moved_threads(pool: Any, master: tuple[str, int]) -> None:
    """``pool``'s server is now at ``master`` (a Sentinel failover): each thread's connection
    to another address is made again before its next command (by its own thread, under its
    claim: never closed under a command), and the kept ones are closed."""
    registry = wire.planted_pool_threads(pool)
    if registry is None:
        return
    registry.master = (str(master[0]), int(master[1]))
    registry.moves += 1
    _drain(registry)


def _stale(bound: _Bound, conn: Any, sock: Any) -> bool:
    if sock is not bound.socket:
        bound.socket, bound.poller = sock, None
        if _POLL and type(sock) is socket.socket:  # not TLS: it may have bytes buffered above
            bound.poller = select.poll()
            bound.poller.register(sock, select.POLLIN)
    try:
        return bool(bound.poller.poll(0)) if bound.poller is not None else conn.can_read()
    except (RedisConnectionError, OSError):
        return True


_POLL = hasattr(select, "poll")


# -- the pool's path, bounded by the call's deadline -----------------------------------------

_checkout = threading.local()  # .late: this thread's checkout connected a closed connection


class CallPool(wire.WaitingPool):
    """Single Redis's pool (:class:`.wire.WaitingPool`), whose checkouts keep to the calling
    thread's deadline (:func:`begin_call`) when the connection they hand over is closed.

    A caller queued for a connection (``max_connections``, every one held by a command the
    silent server did not answer) got one when its holder's command timed out, closed by
    redis-py, then spent a whole socket timeout more reconnecting (its handshake) or in its
    command: BackendUnavailable two socket timeouts after the call began (the campaign's
    seed 2011 saw three), against the one the SPEC allows. So the reconnect of a closed one
    gets only what is left of the call's deadline, and so do the command's reads after it.
    An open connection (its holder's command was answered) is served as before, whatever the
    wait: a wait for a busy pool is not an outage; nor is a connection made in a free slot
    (the first ones, or one a sweep found after the whole wait) bounded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("queue_class", _CallSlots)
        super().__init__(*args, **kwargs)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        _checkout.late = False
        return super().get_connection(*args, **kwargs)

    def _handed_over(self, connection: Any) -> Any:
        # The command's reads shortened to the call's deadline when this checkout connected
        # the connection: after redis-py's own checks (their reads put the socket's timeout
        # back), before the connection leaves the queue's record (_Late, no time left and
        # nothing sent: the pool gives it back).
        if getattr(_checkout, "late", False):
            _checkout.late = False
            _bound_reads(connection)
        return super()._handed_over(connection)


class _CallSlots(wire.SlotsQueue):
    """A :class:`CallPool`'s queue: a closed connection taken from it is connected here, in
    the taking thread's hands (an exception gives it back: ``WaitingPool.get_connection``),
    by the call's deadline (:func:`_connect`); redis-py's connect then finds it connected."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        if item is None:  # a free slot: redis-py makes a connection there
            return None
        sock = socket_of(item)
        if sock is None:  # closed by the holder whose command got no answer (or a reset)
            try:
                _connect(item)
            except BaseException:
                item.disconnect()  # (cut short in its handshake: no reply due may be read)
                raise
            _checkout.late = True
        elif sock.gettimeout() != item.socket_timeout:  # (reads a past checkout shortened)
            sock.settimeout(item.socket_timeout)
        return item
