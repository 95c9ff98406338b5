"""The one module that touches redis-py's internals (and hiredis's packer): each one we rely
on is named here, behind a small function that says why, and what redis-py does there.

No other module of the package says ``_sock``, ``_command_packer``, ``Retry._retries``,
``HiredisRespSerializer`` or the names we plant on redis-py's objects
(``tests/package/test_layers.py`` checks it). Everything here holds on every redis-py the
package supports (setup.cfg's range; ``make test`` runs the newest it allows and the lowest):
``tests/backends/test_wire.py`` checks each assumption on the installed one, so a redis-py
that changed one fails there, by name, instead of as a hang or a mixed-up reply on the fast path.

What we rely on, and why the public API does not do:

* ``Connection._sock``: the connection's socket, ``None`` while not connected (every redis-py
  sets it in ``__init__``, and back to ``None`` in ``disconnect()``). The fast path watches it
  to notice a reconnect, and polls it instead of ``can_read()`` (a third of the cost); the
  Redlock fan-out polls many at once. ``can_read()`` would reconnect a closed one.
* ``Connection._command_packer``: what packs a command into RESP, redis-py's own serializer
  or, with hiredis, ``redis.connection.HiredisRespSerializer``. We replace the latter by one
  that packs only text (:func:`text_packing`), and pack with ``hiredis.pack_command`` directly
  (:func:`pack`, :func:`pack_many`).
* ``Retry._retries``: how many times a connection's commands are retried (5.3 has no public
  getter; ``get_retries()`` came later). Ours retry nothing, which is what lets the fast path
  skip redis-py's per-command wrapper (:func:`bare_execute`).
* ``redis.client.Redis.execute_command``'s code object (its file): how we tell redis-py's own
  wrapper from a tracer's or a subclass's, which must run.
* A pool's and a connection's ``__dict__`` (neither has ``__slots__``): four attributes of
  ours live there (:data:`PLANTED`): the fast path's per-thread connections on a pool, the
  owner of a connection, and a Redlock connection's node and stream.
* ``Connection._parser.parse_error``: how redis-py turns an error reply into its exception
  class (``NoScriptError``, ``BusyLoadingError``...); :func:`reply_reader` gives a hiredis
  reader of ours the same mapping, so a Redlock fan-out reads its replies without redis-py's
  per-reply layers and gets what ``read_response`` would.
* ``RedisCluster.nodes_manager.initialize()``: re-read the cluster's slots now. redis-py up to
  8.1 did it while handling a refused connection; 8.2 only asks for it, run by a later
  command at most once a second (``topology_refresh_min_interval``), so a retry right after
  a failover went to the old master again (:func:`refresh_slots`). ``move_slot(error)``:
  point a slot at the node a ``MOVED`` named (:func:`follow_moved`), for the watchdog's
  renewals, which go straight to each master's connection. ``nodes_manager.nodes_cache``: the
  nodes redis-py knows by name, where a node an ASK named is added if it serves no slot yet
  (:func:`node_at`).
* ``redis.asyncio`` ``ConnectionPool.ensure_connection(connection)``: called on each
  connection the pool hands out, before its command (5.3 to 8.2). A Sentinel pool of ours
  (:class:`AsyncSentinelPool`) closes there a connection to an address that is no longer the
  master, so it connects again, asking the sentinels: redis-py asks them only on a connect.
  Before 7.2, ``get_connection`` called it under the pool's ``_lock`` (an ``asyncio.Lock``),
  with ``get_available_connection()`` and ``release()`` around it: ours does as 7.2 does.
  Our pools also close there one whose socket the server closed while it was idle
  (:func:`closed_while_idle`).
* ``BlockingConnectionPool.get_connection``'s "No connection available." is raised while
  handling the queue's ``queue.Empty`` (its ``__context__``, 6.0 to 8.2): how
  :class:`WaitingPool` tells a wait for a free connection from a failed connect.
* ``BlockingConnectionPool.get_connection`` takes from its ``queue_class`` queue (``pool``)
  with ``get(block=True, timeout=...)``, makes a connection in a free slot with
  ``make_connection()``, and gives back a failed make or connect with ``put_nowait()`` or
  ``release()`` (6.0 to 8.2), and ``release()`` lists a connection again with
  ``put_nowait()``; it and its ``reset()`` look at the queue's list (``pool.queue``), skipping
  free slots by their falsiness (``if conn``; 8.x): how :class:`WaitingPool`'s queue records
  what a thread took or gives back, which redis-py holds in a local only while it calls
  Python functions outside any ``try``. Its ``_connections`` (a list, 5.3 to 8.2): every
  connection it made and has not dropped, whose reference :meth:`_Slots.sweep` lets go of for
  a moment to tell a connection nobody holds (garbage then) from one in use.
* ``redis.asyncio`` ``Connection._writer``: its ``asyncio.StreamWriter`` (None while not
  connected), whose transport gives the socket polled by :func:`closed_while_idle`.
"""

from __future__ import annotations

import collections
import gc
import queue
import select
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any, TypeVar

import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.client
import redis.cluster
import redis.connection
import redis.exceptions
import redis.sentinel
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    import hiredis

T = TypeVar("T")

#: The attributes of ours planted on redis-py's objects (and nothing else is).
POOL_THREADS = "_django_redlock_threads"  # on a ConnectionPool: fast_path.py's registry
OWNER = "_django_redlock_owner"  # on a connection: backends/owners.py's owner
NODE = "_django_redlock_node"  # on a Redlock fan-out's connection: its node's index
STREAM = "_django_redlock_stream"  # on a Redlock fan-out's connection: how it is read
PLANTED = (POOL_THREADS, OWNER, NODE, STREAM)


# -- packing -------------------------------------------------------------------------------

#: redis-py's hiredis-backed packer class (5.3 has it; used when hiredis is installed).
_HiredisPacker: Any = getattr(redis.connection, "HiredisRespSerializer", None)
HIREDIS_PACKS = HIREDIS_AVAILABLE and _HiredisPacker is not None


if HIREDIS_PACKS:

    class TextPacker(_HiredisPacker):
        """redis-py's hiredis packer, handed text only (see :func:`texts`): its handshake
        (``HELLO 3``, ``SELECT 0``) packs numbers too."""

        def pack(self, *args: Any) -> Any:
            return super().pack(*texts(args))

    _PACKER: Any = TextPacker()
    _HIREDIS_TYPES: tuple[type, ...] = (_HiredisPacker, TextPacker)
else:  # pragma: no cover - without hiredis
    _PACKER, _HIREDIS_TYPES = None, ()


def text_packing(conn: Any) -> Any:
    """``conn``, made to pack with hiredis only text (when it packs with hiredis at all),
    its handshake included: ``connect()`` packs its handshake (``HELLO 3``, ``SELECT 0``) with
    the connection's ``_command_packer``, numbers too. Call it before the connection
    connects."""
    if _PACKER is not None and type(conn._command_packer) is _HiredisPacker:
        conn._command_packer = _PACKER
    return conn


def texts(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments as str and bytes only. hiredis 3.5's packer (ours, and redis-py's
    serializer when hiredis is installed) crashes the process (SIGSEGV) when a signal
    handler raises while it converts a number; text it copies without running Python."""
    for a in args:
        if type(a) is not str and type(a) is not bytes:
            return tuple([_text(a) for a in args])
    return args


def _text(value: Any) -> Any:
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is float:
        return repr(value)
    return value  # str, bytes; anything else is the packer's to refuse


def pack(conn: Any, args: tuple[Any, ...]) -> Any:
    """The command in RESP, for ``conn.send_packed_command``: by hiredis straight away when
    the connection packs with it (our arguments are str, bytes and int: nothing for redis-py's
    serializer to convert), else by the connection's own packer. A name with a space
    (``"SCRIPT LOAD"``) is redis-py's to split."""
    args = texts(args)
    if HIREDIS_PACKS and type(conn._command_packer) in _HIREDIS_TYPES and " " not in args[0]:
        return [hiredis.pack_command(args)]
    return conn._command_packer.pack(*args)


def pack_many(conn: Any, commands: Sequence[tuple[Any, ...]]) -> Any:
    """Several commands in RESP, to send at once (a pipeline's packing, without its
    per-argument serializer when hiredis packs)."""
    if HIREDIS_PACKS and type(conn._command_packer) in _HIREDIS_TYPES:
        packed = []
        for command in commands:
            if " " in command[0]:  # "SCRIPT LOAD": redis-py's to split
                break
            packed.append(hiredis.pack_command(texts(command)))
        else:
            return [b"".join(packed)]
    return conn.pack_commands([texts(command) for command in commands])


# -- connections ---------------------------------------------------------------------------


def socket_of(conn: Any) -> Any:
    """``conn``'s socket, None while it is not connected (``Connection._sock``: no public
    name; ``can_read()`` would connect a closed one). Without TLS it is a plain
    ``socket.socket``; with TLS an ``ssl.SSLSocket``, which may hold bytes above the socket
    that polling its descriptor does not see."""
    return conn._sock


def socket_or_none(conn: Any) -> Any:
    """:func:`socket_of`, for an object that may not be a redis-py connection at all."""
    return getattr(conn, "_sock", None)


def new_connection(pool: Any) -> Any:
    """A new connection made like ``pool``'s own (its ``connection_class`` and
    ``connection_kwargs``, what ``pool.make_connection()`` does), not connected, but outside
    the pool: nothing counts it, and no checkout or return (not safe against an interrupt)
    ever runs on it. It packs text only (:func:`text_packing`)."""
    return text_packing(pool.connection_class(**pool.connection_kwargs))


# -- redis-py's per-command wrapper ----------------------------------------------------------

_OWN: list[Any] = []  # redis-py's own Redis.execute_command, once seen


def bare_execute(client: Any, name: str) -> bool:
    """Whether redis-py's wrapper would do nothing but run the command: a plain ``redis.Redis``
    (not a cluster, nor a single-connection client) whose ``execute_command`` is redis-py's own
    (not replaced on the class or the instance by a tracer or a subclass, before or after this
    module was imported), whose connections retry nothing (``Retry._retries`` is 0), for a
    command whose reply redis-py does not parse (no response callback). Only
    ``execute_command`` is looked at: a subclass that changes redis-py's inner methods instead
    is not noticed. What the wrapper does that we then skip: the pool's checkout and return, a
    retry loop, and redis-py 8's operation metrics."""
    execute = type(client).execute_command
    if not (_OWN and execute is _OWN[0]) and not _seen_as_own(execute):
        return False
    retry = client.connection_pool.connection_kwargs.get("retry")
    return (
        client.connection is None
        and "execute_command" not in client.__dict__
        and getattr(retry, "_retries", 1) == 0  # none given: redis-py's default retries
        and name not in client.response_callbacks
    )


def _seen_as_own(execute: Any) -> bool:
    if any(execute is own for own in _OWN):  # not ==: a wrapt proxy equals what it wraps
        return True
    if not _is_redis_pys(execute):
        return False
    _OWN.append(execute)
    return True


def _is_redis_pys(function: Any) -> bool:
    # type(), not isinstance(): a tracer's wrapt proxy claims the class (and the __code__) of
    # the function it wraps.
    code = getattr(function, "__code__", None)
    return (
        type(function) is FunctionType
        and code is not None
        and code.co_name == "execute_command"
        and code.co_filename == redis.client.__file__
    )


# -- what we plant on redis-py's objects -----------------------------------------------------


def pool_threads(pool: Any, make: Callable[[], T]) -> T:
    """The fast path's registry of ``pool`` (planted once: ``make()`` when there is none, a
    losing racer's one dropped)."""
    try:
        return pool._django_redlock_threads
    except AttributeError:
        return pool.__dict__.setdefault(POOL_THREADS, make())


def planted_pool_threads(pool: Any, *, unplant: bool = False) -> Any:
    """``pool``'s registry, None when none was planted; ``unplant``: taken off the pool too
    (the next :func:`pool_threads` plants a new one)."""
    if unplant:
        return pool.__dict__.pop(POOL_THREADS, None)
    return pool.__dict__.get(POOL_THREADS)


def owner_of(conn: Any, default: Any) -> Any:
    """The owner :func:`set_owner` wrote on ``conn``; ``default`` when none was."""
    return getattr(conn, OWNER, default)


def set_owner(conn: Any, owner: Any) -> None:
    """Write ``owner`` on ``conn`` (one attribute store: the commit of an ownership move)."""
    setattr(conn, OWNER, owner)


def tag_node(conn: Any, i: int) -> None:
    """Write on a Redlock fan-out's connection the index of its node."""
    setattr(conn, NODE, i)


def node_of(conn: Any) -> int:
    """The node index :func:`tag_node` wrote on ``conn``."""
    return getattr(conn, NODE)


def plant_stream(conn: Any, stream: Any) -> None:
    """Write on a Redlock fan-out's connection the stream it is read through."""
    setattr(conn, STREAM, stream)


def stream_of(conn: Any) -> Any:
    """The stream :func:`plant_stream` wrote on ``conn``; None when none was."""
    return getattr(conn, STREAM, None)


def reply_reader(conn: Any, not_enough: Any) -> tuple[Any, Any, Any] | None:
    """For a connected connection whose replies we read ourselves from now on: its socket, a
    new hiredis reader that parses replies as redis-py's parser of ``conn`` would (its error
    classes, ``decode_responses``, its encoding errors; ``not_enough`` while a reply is
    incomplete), and hiredis's RESP3 push type (None before hiredis 3.2). None when that
    cannot be: no hiredis, not a plain socket (TLS: an ``SSLSocket`` holds bytes its
    descriptor does not show), or one without a timeout (its descriptor blocks). Call it
    before any reply of ours is read (redis-py's parser then holds nothing unread: the
    handshake's replies were all read)."""
    sock = conn._sock
    if not HIREDIS_AVAILABLE or type(sock) is not socket.socket or sock.gettimeout() is None:
        return None
    encoder = conn.encoder
    options: dict[str, Any] = {
        "protocolError": redis.exceptions.InvalidResponse,
        "replyError": conn._parser.parse_error,
        "errors": encoder.encoding_errors,
        "notEnoughData": not_enough,
    }
    if encoder.decode_responses:
        options["encoding"] = encoder.encoding
    return sock, hiredis.Reader(**options), getattr(hiredis, "PushNotification", None)


def refresh_slots(client: Any, failed: str | None = None) -> None:
    """Re-read which node serves which slot of cluster ``client``, now (a direct
    ``NodesManager.initialize()``: never paced, in redis-py 5.3 to 8.2). Called after a
    refused connect, before the one retry that follows it; and by the watchdog after a
    master's renewals got no answer, with that node's name as ``failed``: asked last (a
    paused node would cost a socket timeout), where redis-py can be told so (8.2)."""
    if failed is not None:
        try:
            client.nodes_manager.initialize(last_failed_node_name=failed)
            return
        except TypeError:  # redis-py before 8.2: no such argument (nothing was sent)
            pass
    client.nodes_manager.initialize()


def follow_moved(client: Any, error: Any) -> None:
    """Point ``error``'s slot (a ``MovedError`` a command got) at the node it names in
    cluster ``client``'s slot cache, as redis-py does for its own commands
    (``NodesManager.move_slot``; before 8.2 ``update_moved_exception``, applied by the next
    ``get_node_from_slot``): the watchdog sends renewals straight to a master's connection,
    outside redis-py's redirect handling."""
    nodes = client.nodes_manager
    if hasattr(nodes, "move_slot"):
        nodes.move_slot(error)
    else:
        nodes.update_moved_exception(error)
        nodes.get_node_from_slot(error.slot_id)


def node_at(client: Any, host: str, port: int) -> Any:
    """Cluster ``client``'s node at ``host``:``port``, added to its nodes if it does not know
    it: a node that serves no slot yet (a new node a slot is being moved to, named by an ASK)
    is in no ``CLUSTER SLOTS`` reply, and redis-py (5.3 to 8.2) then follows an ASK to
    ``None``. Added as ``NodesManager.move_slot`` adds a node a ``MOVED`` names (a primary in
    ``nodes_cache``), without touching the slots; the next read of the slots drops it."""
    nodes = client.nodes_manager
    remap = getattr(nodes, "remap_host_port", None)  # redis-py 5.1+: address remapping
    host, port = remap(host, port) if remap is not None else (host, port)
    node = nodes.get_node(host=host, port=port)
    if node is None:
        node = redis.cluster.ClusterNode(host, port, redis.cluster.PRIMARY)
        node = nodes.nodes_cache.setdefault(node.name, node)  # one step: no lock needed
    return node


def cluster_node_of(client: Any, key: str) -> Any:
    """The primary that serves ``key`` for a cluster ``client`` (``redis.cluster`` or
    ``redis.asyncio.cluster``), as the slot cache says; None for any other client."""
    if isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster)):
        return client.get_node_from_key(key)
    return None


def sentinel_master(pool: Any) -> tuple[str, int]:
    """Where the sentinels say the master of a Sentinel client's ``pool`` is now
    (``SentinelConnectionPool.get_master_address()``, redis-py 5.3 to 8.2: asks them, and
    closes the pool's idle connections when the master moved)."""
    host, port = pool.get_master_address()
    return str(host), int(port)


class SentinelPool(redis.sentinel.SentinelConnectionPool):
    """redis-py's Sentinel pool, its connections moved at checkout to the master the backend
    found or heard announced (``master``, set from another thread: one attribute): an idle
    connection stayed on the old master, which takes writes until the sentinels demote it,
    so a take made right after the announcement was granted there (two holders). Checked
    by the thread that checks it out: never closed under another's command."""

    master: tuple[str, int] | None = None

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        connection: Any = super().get_connection(*args, **kwargs)
        master = self.master
        if master is None or (str(connection.host), int(connection.port)) == master:
            return connection
        try:  # straight there: a sentinel asked first may be the one that is paused
            connection.disconnect()
            connection.connect_to(master)
        except BaseException:
            self.release(connection)
            raise
        return connection


#: A waiter for a pool's free connection looks again this often (a wake-up lost to an
#: interrupt costs this much, not its whole timeout).
SLOTS_POLL = 0.05


class _Slot:
    """A free slot of a :class:`_Slots` queue (redis-py's None: a connection to make there),
    each its own object, so that a give-back can tell whether it is still listed. Falsy as
    None is: redis-py's looks at the queue (``if conn``) skip it."""

    __slots__ = ("__weakref__",)  # (a lost one is probed by a sweep, as a connection)

    def __bool__(self) -> bool:
        return False


class _Probe:
    """A position's stand-in while a sweep looks at its item: a weak reference to the item,
    whether redis-py's ``connections`` listed it (it goes back there too), the pool's count
    of give-backs when it was looked at, and whether :func:`_garbage` called the item lost."""

    __slots__ = ("kept", "listed", "lost", "ref")

    def __init__(self, item: Any, connections: list[Any], listed: int) -> None:
        self.ref = weakref.ref(item)
        self.listed = listed
        self.lost = False
        # (a loop, no generator: a cut in one left its frame, and the item, in the traceback)
        self.kept = False
        for each in connections:
            if each is item:
                self.kept = True


class _Waiter:
    """A thread waiting in :meth:`_Slots.get`: its lock (released by the give-back that hands
    it something) and its box, where that give-back puts the item."""

    __slots__ = ("box", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.box: list[Any] = []


class _Slots(queue.LifoQueue[Any]):
    """A :class:`WaitingPool`'s queue: redis-py's own (last in, first out), served first come,
    first served, that also records what each thread holds of it between the steps redis-py
    runs outside any ``try`` (an exception there, a signal handler's, finds it).

    The invariant, at every point an interrupt can land: each item of the pool (a position in
    ``items``: a connection, or a free slot to make one in) is in at most one place of
    ``queue`` (listed), a waiter's box or a thread's hands, and ``taken[t]`` names an item only
    while it is in thread ``t``'s hands. So a give-back from a record never lists an item
    someone else holds (one connection handed to two threads: their replies crossed). An item
    moves between the list, a box and a record in one line (a C call into one store): an
    interrupt there leaves it nowhere but in ``items``, and a waiter that waited its whole
    timeout finds it (:meth:`sweep`). So does one lost outside (redis-py's ``conn`` local,
    between our hand-over and its give-back).

    No ``Condition``: its methods are Python, and an interrupt at the entry of its
    ``__exit__`` left the queue's lock held (every later checkout hung), one at its
    ``__enter__`` in a give-back lost the connection, one in its ``wait`` left a dead waiter
    that the next give-back woke instead of a live one. Each step is a few C calls under the
    plain lock (held by ``with``: released whatever lands there); a waiter sleeps on a lock
    of its own, and looks again every SLOTS_POLL."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self.items: list[Any] = []  # every item of the pool, a position each
        self.taken: dict[int, Any] = {}  # thread id -> the item in its hands (see above)
        # Give-backs so far (listed or boxed): a sweep's "lost" holds only if none came since
        # it looked, as an item given back and taken meanwhile looked unreachable (_garbage).
        self.listed = 0
        self._waiting: collections.deque[_Waiter] = collections.deque()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """As ``Queue.get``; the item recorded in this thread's hands as it leaves the list
        (or the box a give-back handed it over in). Behind any waiter: a give-back hands its
        item to the first one (a thread that gives back and takes again, or a newcomer, took
        it ahead of the woken waiter, which then waited its whole timeout)."""
        me = threading.get_ident()
        end = None if timeout is None else time.monotonic() + timeout
        waiter = _Waiter()
        try:
            while True:
                with self.mutex:
                    if waiter.box:
                        self.taken[me] = waiter.box.pop()  # one line: handed over to me
                        break
                    if self.queue and (not self._waiting or self._waiting[0] is waiter):
                        self.taken[me] = self.queue.pop()  # one line: out of the list, mine
                        break
                    if waiter not in self._waiting:
                        self._waiting.append(waiter)
                left = SLOTS_POLL if end is None else min(end - time.monotonic(), SLOTS_POLL)
                if not block or left <= 0:
                    raise queue.Empty
                waiter.wake.acquire(timeout=left)
        finally:  # (skipped: its box's item is nobody's, found by a sweep)
            with self.mutex:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                if waiter.box:  # handed over after it gave up: to the next one
                    self._list(waiter.box.pop())
        item = self.taken[me]
        return None if type(item) is _Slot else item

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """As ``Queue.put``, never blocking: ``item`` (in this thread's hands) to the first
        waiter, or listed. None is a slot: the one this thread took (redis-py gives back a
        slot whose connect failed as None), or a new one while the pool has fewer than its
        ``maxsize`` (``Full`` past it)."""
        me = threading.get_ident()
        with self.mutex:
            mine = self.taken.get(me)
            if item is None:
                if type(mine) is _Slot or (mine is not None and mine not in self.queue):
                    item = mine  # its slot (or the connection made in it, never connected)
                elif 0 < self.maxsize <= len(self.items):
                    raise queue.Full
                else:
                    item = _Slot()
                    self.items.append(item)  # a new position (cut here: nobody's, swept)
                    self.taken[me] = item
            elif any(each is item for each in self.queue):
                if mine is item:
                    del self.taken[me]
                return  # listed already (a give-back repeated)
            elif mine is not item:
                self.taken[me] = item  # given back by its holder: in my hands
            # (not _list(self.taken.pop(me)): cut as _list was entered, it was in no store)
            self._hand_on(me)

    def _list(self, item: Any) -> None:
        """``item`` (nobody's: just taken out of a hand or a box) to the first waiter, or
        listed. Under the mutex."""
        self.listed += 1
        if self._waiting:
            waiter = self._waiting.popleft()
            waiter.box.append(item)
            # (not contextlib.suppress: its methods are Python, points an interrupt lands on)
            try:  # noqa: SIM105
                waiter.wake.release()
            except RuntimeError:  # woken already, by its poll's timeout
                pass
        else:
            self.queue.append(item)

    def _hand_on(self, me: int) -> None:
        """As :meth:`_list`, the item in thread ``me``'s hands: it leaves them in the line it
        reaches its place (a cut before: still in them, given back from there). Under the
        mutex."""
        self.listed += 1
        if self._waiting:
            waiter = self._waiting.popleft()  # (a cut after: it polls, queued again)
            waiter.box.append(self.taken.pop(me))  # one line: from my hands to its box
            try:  # noqa: SIM105
                waiter.wake.release()
            except RuntimeError:  # woken already, by its poll's timeout
                pass
        else:
            self.queue.append(self.taken.pop(me))  # one line: from my hands to the list

    def made(self, connection: Any) -> None:
        """``connection`` was made in the slot in this thread's hands: it is that position's
        item, and in this thread's hands (one line: both stores, no call between)."""
        me = threading.get_ident()
        with self.mutex:
            slot = self.taken.get(me)
            if type(slot) is not _Slot:
                return
            for position, each in enumerate(self.items):
                if each is slot:
                    self.items[position] = self.taken[me] = connection
                    return

    def sweep(self, connections: list[Any]) -> bool:
        """Find the items nobody holds (an interrupt between two of their owners' steps lost
        them: a wait then lasted forever, "No connection available." on a healthy Redis), and
        give them back as free slots; whether one was found. An item held is never taken:
        the pool lets go of its own references to each item that is out of the list and of
        every record (its position, redis-py's ``connections``) for a moment, and an item
        that is then garbage (after a collection of the young generations: a traceback can
        keep the frame that held it) was in nobody's hands, nor could come back to any. Any
        other is put back.

        Interrupt-safe at every line: a position looked at holds a :class:`_Probe` (recorded
        here first), which the ``finally`` puts back, once more if that is cut too (each step
        a one-line move, done once). No flag (one left set by a cut stopped every later
        sweep): a sweep puts back every position looked at, its own and any a second cut
        left (one sweeping at the same moment may then find nothing there: a later one does).

        No full collection: one holds the GIL for as long as the heap is big (0.4 s for a
        million objects), every thread of the process stopped, each waiter that timed out
        paying it. A young one, then :func:`_garbage` on each item still there (a redis-py 8
        connection is a cycle with its maintenance handlers, old by then). An item kept only
        by older garbage comes back once Python's own collector freed it, at a later sweep."""
        found = False
        probes: list[_Probe] = []
        try:
            with self.mutex:
                accounted = set(map(id, self.queue)) | set(map(id, _held(self.taken)))
                for position, each in enumerate(self.items):
                    if id(each) in accounted or type(each) is _Probe:
                        continue
                    probe = _Probe(each, connections, self.listed)
                    probes.append(probe)  # (first: the finally puts back what is marked)
                    self.items[position] = probe  # one line: looked at
                    if probe.kept:
                        connections.remove(each)  # (one C call; a cut before: still listed)
                each = None  # (our own reference let go)
            if probes:
                # Young only (0 and 1): what an interrupt's traceback made is there (its
                # frames, the exception), and its cost is theirs, not the heap's.
                gc.collect(1)  # (outside the mutex: a finalizer may give a connection back)
            for p in probes:
                # (redis-py 8's are a cycle, old: no young collection. Lost only if nothing
                # was given back meanwhile: _put_back decides, under the mutex.)
                p.lost = _garbage(p.ref)
        finally:
            try:
                with self.mutex:
                    found = self._put_back(connections)
            finally:  # (cut in the first: each of its steps is done once, this goes on)
                with self.mutex:
                    found = self._put_back(connections) or found
        return found

    def _put_back(self, connections: list[Any]) -> bool:
        """Every position a sweep looked at gets its item back, or a free slot (listed) if
        the item is gone; whether one was. Under the mutex."""
        me = threading.get_ident()
        found = False
        listed = self.listed  # (before this put-back's own give-backs)
        if type(self.taken.get(me)) is _Slot:  # a slot found by a put-back that was cut
            self._hand_on(me)
            found = True
        for position, each in enumerate(self.items):
            if type(each) is not _Probe:
                continue
            item = each.ref()
            # Called lost with no give-back since it was looked at: still out of every store,
            # unreachable. After one, in doubt (given back and taken again, it looked so).
            if item is None or (each.lost and each.listed == listed):
                item = None  # nobody's: a free slot again, through this thread's hands
                self.items[position] = self.taken[me] = _Slot()  # one line: both stores
                self._hand_on(me)
                found = True
                continue
            if each.kept and not any(c is item for c in connections):
                connections.append(item)  # (before its position: a cut between, done once)
            self.items[position] = item
        return found


def _held(taken: dict[int, Any]) -> list[Any]:
    """The items of ``taken``, a snapshot. Its writers (a give-back's record, the hand-over's
    pop) take no mutex, and iterating it while one wrote raised "dictionary changed size
    during iteration" out of a sweep (a collection's finalizers let another thread run). A
    copy is one C call that runs no Python code; retried all the same if it raises."""
    while True:
        try:
            return list(taken.copy().values())
        except RuntimeError:  # pragma: no cover (changed under it: again)
            continue


#: How many objects :func:`_garbage` looks at from one item before it calls the item held.
GARBAGE_SCAN_LIMIT = 20000

#: What :func:`_garbage` does not look into (referenced from everywhere, never an item's own:
#: a reference from one into what it looked at is counted as from outside, so still sound).
_OPAQUE = (type, ModuleType, FunctionType, CodeType, FrameType)


def _garbage(ref: Callable[[], Any]) -> bool:
    """Whether the item ``ref`` names is garbage without a collection: the collector's own
    test, on the objects the item reaches (at most GARBAGE_SCAN_LIMIT) instead of the heap.
    Each one's references from outside them (its reference count, less theirs to it) make it
    a root, and the item is garbage if no root reaches it through them. A reference the
    collector cannot see (C code's) counts as from outside: held. Another thread changing
    them meanwhile (the item given back, then taken: its references moved from inside to
    outside between the counts) can make a held one look garbage: the sweep's verdict holds
    only if no give-back came since it looked (:meth:`_Slots._put_back`)."""
    item = ref()
    if item is None:
        return True
    key = id(item)
    found: dict[int, Any] = {key: item}
    stack = [item]
    item = None
    while stack:
        for each in gc.get_referents(stack.pop()):
            if id(each) in found or not gc.is_tracked(each) or isinstance(each, _OPAQUE):
                continue
            if len(found) >= GARBAGE_SCAN_LIMIT:
                return False
            found[id(each)] = each
            stack.append(each)
    each = None
    # (a temporary list: its references are gone once counted)
    inside = collections.Counter(map(id, gc.get_referents(*found.values())))
    # Ours: ``found``'s and the argument's (getrefcount's ``- 2``).
    roots = [k for k in found if sys.getrefcount(found[k]) - 2 > inside[k]]
    reached = set(roots)
    stack = [found[k] for k in roots]
    while stack:
        for each in gc.get_referents(stack.pop()):
            if id(each) in found and id(each) not in reached:
                reached.add(id(each))
                stack.append(each)
    return key not in reached


def _swept(slots: _Slots, connections: list[Any]) -> bool:
    """``slots.sweep(connections)``; a ``RuntimeError`` of it (a store changed under it by a
    thread that takes no mutex) finds nothing: the caller that waited its timeout is told
    none is free, not given a bare ``RuntimeError`` (no ``LockError`` above)."""
    try:
        return slots.sweep(connections)
    except RuntimeError:
        return False


#: The queue of a :class:`WaitingPool`, for a pool of ours that extends it (its ``get``:
#: ``fast_path.CallPool``'s connects a closed connection by the call's deadline).
SlotsQueue = _Slots


class WaitingPool(redis.BlockingConnectionPool):
    """redis-py's blocking pool, a caller that waited its ``timeout`` for a free connection
    told so with ``MaxConnectionsError`` (a ``ConnectionError``): redis-py (5.3 to 8.2)
    raises a plain ``ConnectionError("No connection available.")``, raised while handling
    the queue's ``Empty`` (its ``__context__``), which its cluster client takes for a failed
    node (the slots read again); 8.x's takes ``MaxConnectionsError`` for what it is, the
    client's own pool exhausted. Nothing was sent either way. Without a ``timeout`` (redis-py
    6.0's cluster client drops that option: its callers waited 20 s) it waits the
    connections' socket timeout.

    And a connection (or a slot) taken from the queue goes back to it when anything raises
    before ``get_connection`` hands it over (see :class:`_Slots`): redis-py calls Python
    functions after its ``pool.get()`` outside any ``try`` (``Queue.get``'s own notify;
    8.x's ``get_pool_name()`` and ``record_connection_count()``; 6.x's
    ``make_connection()``), and one soft time limit landing there lost it for good: with
    ``max_connections=1`` every later call on that healthy master was unavailable. So does
    one given back (``release()``), from its first line until it is listed again: redis-py's
    release is Python too. One lost where only redis-py held it (its ``conn`` local, from
    the hand-over to its ``release``: ``_execute_command``'s lines before its ``try``, or
    after it before the give-back) comes back once a caller waited its whole timeout, when
    nobody holds it (:meth:`_Slots.sweep`). The pool of the Cluster's nodes, single Redis's
    and DjangoRedisBackend's own."""

    def __init__(
        self, max_connections: int = 50, timeout: float | None = None, **kwargs: Any
    ) -> None:
        if timeout is None:
            timeout = kwargs.get("socket_timeout")
        kwargs.setdefault("queue_class", _Slots)
        super().__init__(max_connections=max_connections, timeout=timeout, **kwargs)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        for last in (False, True):
            connection = None
            try:
                connection = super().get_connection(*args, **kwargs)
                # The caller's as it is returned: a line between the two lost it to an interrupt.
                return self._handed_over(connection)
            except BaseException as exc:
                # (``connection``: this thread's, cut in the hand-over after its record went)
                self._give_back(connection)
                if not isinstance(exc, redis.exceptions.ConnectionError) or not isinstance(
                    exc.__context__, queue.Empty
                ):
                    raise
                # Waited the whole timeout: a connection lost to an interrupt where redis-py
                # held it in a local only (nobody's now) comes back, and the wait is tried again.
                slots = self.pool
                if last or not isinstance(slots, _Slots) or not _swept(slots, self._connections):
                    raise redis.exceptions.MaxConnectionsError(str(exc)) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def make_connection(self) -> Any:
        connection = super().make_connection()
        # Made in the slot this thread took: what it gives back now is the connection
        # (before this, the slot: the connection, never connected, is dropped).
        slots = self.pool
        if isinstance(slots, _Slots):
            slots.made(connection)
        return connection

    def release(self, connection: Any) -> None:
        slots = self.pool
        if isinstance(slots, _Slots):
            # Being given back from here on: an exception before it is listed again (redis-py's
            # release is Python: its metrics, a Queue's Condition) gives it back all the same.
            slots.taken[threading.get_ident()] = connection
        try:
            super().release(connection)
        except BaseException:
            self._give_back()
            raise

    def _handed_over(self, connection: Any) -> Any:
        slots = self.pool
        if isinstance(slots, _Slots):
            slots.taken.pop(threading.get_ident(), None)
        return connection

    def _give_back(self, handed: Any = None) -> None:
        """Give back what this thread took from the queue and neither put back nor handed
        over: an exception landed between (redis-py's own give-backs cleared the record); or
        ``handed``, the connection being handed over (in this thread's hands, its record
        cleared a line before the hand-over's end)."""
        slots = self.pool
        me = threading.get_ident()
        if not isinstance(slots, _Slots):
            return
        if me not in slots.taken:
            if handed is None:
                return
            slots.taken[me] = handed  # back in my hands (one line: given back from there)
        taken = slots.taken[me]
        if type(taken) is _Slot:
            slots.put_nowait(taken)  # the slot (clears the record; listed once)
        else:
            self.release(taken)  # as redis-py gives back one whose connect failed


def moved_sync_pool(pool: Any, master: tuple[str, int]) -> None:
    """A Sentinel client's pooled connections go to ``master`` at their next checkout (see
    :class:`SentinelPool`); callable from any thread."""
    if isinstance(pool, SentinelPool):
        pool.master = master
        # Where redis-py's pool believes the master is (SentinelConnectionPoolProxy, 5.3 to
        # 8.2): a connection elsewhere is closed when given back, not kept idle.
        proxy = getattr(pool, "proxy", None)
        if proxy is not None:
            proxy.master_address = master


class AsyncSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool):
    """redis.asyncio's Sentinel pool, its connections moved to the master the backend's
    looker found (``master``, set from its thread: one attribute, read on the loop): a
    pooled connection stayed on the old master, which takes writes until the sentinels
    demote it (seconds), so takes and releases landed there after the switch."""

    master: tuple[str, int] | None = None

    if redis.VERSION < (7, 2):

        async def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
            """As redis-py 7.2's: the connection is connected (or checked) after the pool's
            lock is let go. Before 7.2 the pool connected under its lock: with the master
            paused, each caller waited for the handshakes of all before it, one socket
            timeout each (the fifth of five 4 s, for a 1 s timeout)."""
            async with self._lock:
                connection = self.get_available_connection()
            try:
                await self.ensure_connection(connection)
            except BaseException:
                await self.release(connection)
                raise
            return connection

    async def ensure_connection(self, connection: Any) -> None:
        master = self.master
        if (
            master is not None
            and connection.is_connected
            and (str(connection.host), int(connection.port)) != master
        ):
            await connection.disconnect()  # ours now (checked out): never under a command
        elif closed_while_idle(connection):
            await connection.disconnect(nowait=True)  # (the peer is gone: no close to wait for)
        await super().ensure_connection(connection)


def closed_while_idle(connection: Any) -> bool:
    """Whether the socket of a pooled (idle) ``redis.asyncio`` connection has something to
    read: no reply is due, so it is the server's EOF or reset (CLIENT KILL, its ``timeout``
    setting, a restart, a proxy's idle cut), or bytes no command would read: not to be used.
    The pool's own check sees only what the event loop has read, and a loop that has not run
    since (busy meanwhile, or run once per call) has not read the EOF: the command went out on
    it and failed at once ("Connection closed by server"). One poll(0), as the sync fast
    path's (``fast_path._stale``)."""
    writer = connection._writer  # (no public name)
    sock = None if writer is None else writer.transport.get_extra_info("socket")
    if sock is None:
        return False  # not connected: the pool connects it
    try:
        if not hasattr(select, "poll"):  # (Windows)
            return bool(select.select([sock.fileno()], [], [], 0)[0])
        poller = select.poll()  # (not select(): descriptors past 1024)
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):  # closed meanwhile (fileno -1)
        return True


def moved_async_pool(client: Any, master: tuple[str, int]) -> None:
    """A ``redis.asyncio`` Sentinel client's connections go to ``master`` from their next
    command on (see :class:`AsyncSentinelPool`); callable from any thread."""
    pool = client.connection_pool
    if isinstance(pool, AsyncSentinelPool):
        pool.master = master


def refused_at_connect(exc: BaseException | None) -> bool:
    """Whether redis-py's ``ConnectionError`` ``exc`` is a connection that never opened (the
    server refused it): nothing was sent. redis-py (5.x to 8.2) raises it while handling the
    ``OSError`` of ``connect()``, which is then its ``__context__``."""
    return isinstance(exc, redis.exceptions.ConnectionError) and isinstance(
        exc.__context__, ConnectionRefusedError
    )
