"""What django_redlock.wire relies on in redis-py, checked on the installed one: a redis-py
that changed one of these fails here, by name (see wire.py's docstring for why each is used).
"""

from __future__ import annotations

import inspect
import socket
import sys
import threading
import weakref
from typing import Any

import pytest
import redis
import redis.connection
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE

from django_redlock import fast_path, locks, wire
from django_redlock.testing import RedisServer


def pool_of(server: RedisServer) -> redis.ConnectionPool:
    return redis.Redis.from_url(server.url, socket_timeout=2).connection_pool


def test_a_connections_socket_is_none_until_connected_and_after_a_disconnect(
    redis_server: RedisServer,
) -> None:
    conn = wire.new_connection(pool_of(redis_server))
    assert wire.socket_of(conn) is None
    conn.connect()
    try:
        assert type(wire.socket_of(conn)) is socket.socket  # plain TCP: polled directly
        assert wire.socket_or_none(conn) is wire.socket_of(conn)
    finally:
        conn.disconnect()
    assert wire.socket_of(conn) is None
    assert wire.socket_or_none(object()) is None


def test_a_new_connection_is_made_like_the_pools_and_outside_it(
    redis_server: RedisServer,
) -> None:
    pool = pool_of(redis_server)
    conn = wire.new_connection(pool)
    assert type(conn) is pool.connection_class
    assert (conn.host, conn.port, conn.socket_timeout) == (
        pool.connection_kwargs["host"], pool.connection_kwargs["port"], 2
    )  # fmt: skip
    conn.connect()
    try:
        conn.send_command("PING")
        assert conn.read_response() in (b"PONG", "PONG", True)
    finally:
        conn.disconnect()
    assert pool._created_connections == 0  # nothing counted in the pool


def test_with_hiredis_connections_pack_with_redis_pys_hiredis_packer_and_ours_text_only(
    redis_server: RedisServer,
) -> None:
    assert HIREDIS_AVAILABLE  # setup.cfg installs redis[hiredis]
    pool = pool_of(redis_server)
    plain = pool.make_connection()
    assert type(plain._command_packer) is redis.connection.HiredisRespSerializer
    assert wire.HIREDIS_PACKS
    ours = wire.new_connection(pool)
    assert type(ours._command_packer) is wire.TextPacker
    # Numbers are packed as their text: the same bytes either way.
    assert ours._command_packer.pack("SET", "k", 12, 1.5) == plain._command_packer.pack(
        "SET", "k", "12", repr(1.5)
    )


def test_our_packing_is_redis_pys_byte_for_byte(redis_server: RedisServer) -> None:
    conn = wire.new_connection(pool_of(redis_server))
    args = ("EVALSHA", "a" * 40, 2, "k", "k:f", "tok", 2000, 1.25)
    own = b"".join(conn.pack_command(*wire.texts(args)))
    assert b"".join(wire.pack(conn, args)) == own
    assert b"".join(wire.pack_many(conn, [args, ("PING",)])) == own + b"".join(
        conn.pack_command("PING")
    )
    # A two-word command name is redis-py's to split.
    script = b"".join(wire.pack(conn, ("SCRIPT LOAD", "return 1")))
    assert script == b"".join(conn.pack_command("SCRIPT", "LOAD", "return 1"))


def test_texts_turns_numbers_into_text_and_leaves_text_alone() -> None:
    args = ("a", b"b")
    assert wire.texts(args) is args
    assert wire.texts(("a", 7, 0.5)) == ("a", "7", "0.5")


@pytest.mark.parametrize("retries", [0, 2])
def test_a_retry_keeps_its_count_where_bare_execute_reads_it(
    redis_server: RedisServer, retries: int
) -> None:
    retry = Retry(NoBackoff(), retries)
    assert retry._retries == retries
    if hasattr(retry, "get_retries"):  # newer redis-py (not 5.3)
        assert retry.get_retries() == retries
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2, retry=retry)
    assert wire.bare_execute(client, "EVALSHA") is (retries == 0)


def test_redis_pys_own_execute_command_is_told_from_a_subclass_s(
    redis_server: RedisServer,
) -> None:
    code = redis.Redis.execute_command.__code__
    assert (code.co_name, code.co_filename) == ("execute_command", redis.client.__file__)
    plain = redis.Redis.from_url(redis_server.url, retry=Retry(NoBackoff(), 0))
    assert wire.bare_execute(plain, "EVALSHA")
    assert not wire.bare_execute(plain, "PING")  # a reply redis-py parses

    class Traced(redis.Redis):
        def execute_command(self, *args: object, **options: object) -> object:
            return super().execute_command(*args, **options)

    traced = Traced.from_url(redis_server.url, retry=Retry(NoBackoff(), 0))
    assert not wire.bare_execute(traced, "EVALSHA")
    single = redis.Redis.from_url(
        redis_server.url, retry=Retry(NoBackoff(), 0), single_connection_client=True
    )
    try:
        assert not wire.bare_execute(single, "EVALSHA")
    finally:
        single.close()


def test_our_attributes_plant_on_a_pool_and_a_connection(redis_server: RedisServer) -> None:
    pool = pool_of(redis_server)
    assert wire.planted_pool_threads(pool) is None
    first = wire.pool_threads(pool, list)
    assert wire.pool_threads(pool, list) is first  # planted once
    assert wire.planted_pool_threads(pool, unplant=True) is first
    assert wire.planted_pool_threads(pool) is None
    conn = wire.new_connection(pool)
    assert wire.owner_of(conn, "nobody") == "nobody"
    wire.set_owner(conn, "me")
    wire.tag_node(conn, 2)
    assert (wire.owner_of(conn, "nobody"), wire.node_of(conn)) == ("me", 2)
    assert {wire.OWNER, wire.NODE} <= set(vars(conn))  # a plain attribute of the connection


def test_the_backends_fast_path_runs_on_what_wire_plants(redis_server: RedisServer) -> None:
    client = locks["default"].client  # type: ignore[attr-defined]
    assert fast_path.command(client, "ECHO", "x") == b"x"
    registry = wire.planted_pool_threads(client.connection_pool)
    assert registry is not None and registry.local.bound.connection is not None


@pytest.mark.parametrize("decode", [False, True])
def test_our_reply_reader_parses_what_redis_pys_parser_would(
    redis_server: RedisServer, decode: bool
) -> None:
    """A Redlock fan-out reads its replies with a hiredis reader of ours (node_stream): the
    same values, and an error reply as the same redis-py exception, as read_response()."""
    pool = redis.Redis.from_url(
        redis_server.url, socket_timeout=2, decode_responses=decode
    ).connection_pool
    ours, theirs = wire.new_connection(pool), wire.new_connection(pool)
    ours.connect()
    theirs.connect()
    try:
        incomplete = object()
        made = wire.reply_reader(ours, incomplete)
        assert made is not None
        sock, reader, push = made
        assert sock is wire.socket_of(ours)
        assert push is not None  # hiredis >= 3.2
        commands = [
            ("SET", "w:k", "v"), ("GET", "w:k"), ("GET", "w:missing"), ("STRLEN", "w:k"),
            ("EVALSHA", "0" * 40, "0"), ("HGETALL", "w:nohash"), ("NOSUCHCOMMAND",),
            ("EVAL", "return {1, 'two', {3}}", "0"),
        ]  # fmt: skip
        expected = []
        for command in commands:
            theirs.send_command(*command)
            try:
                expected.append(theirs.read_response())
            except redis.exceptions.ResponseError as exc:
                expected.append(exc)
        sock.sendall(b"".join(wire.pack_many(ours, commands)))
        got: list[object] = []
        while len(got) < len(commands):
            reply = reader.gets()
            if reply is incomplete:
                reader.feed(sock.recv(65536))
            else:
                got.append(reply)
        for mine, redis_pys in zip(got, expected, strict=True):
            if isinstance(redis_pys, Exception):
                assert type(mine) is type(redis_pys) and str(mine) == str(redis_pys)
            else:
                assert mine == redis_pys
        assert type(got[4]) is redis.exceptions.NoScriptError
    finally:
        ours.disconnect()
        theirs.disconnect()


def test_no_reply_reader_for_a_socket_without_a_timeout(redis_server: RedisServer) -> None:
    """Its descriptor blocks: reading it straight would wait (node_stream falls back to
    redis-py's own reading)."""
    pool = redis.Redis.from_url(redis_server.url, socket_timeout=None).connection_pool
    conn = wire.new_connection(pool)
    conn.connect()
    try:
        assert wire.reply_reader(conn, None) is None
    finally:
        conn.disconnect()


def test_a_refused_connect_is_told_from_a_cut_connection(redis_server: RedisServer) -> None:
    # What RedisClusterBackend.execute retries: a connect the server refused (nothing sent).
    with socket.socket() as probe:  # a free port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    refused = redis.Redis(port=port, socket_connect_timeout=1)
    with pytest.raises(redis.exceptions.ConnectionError) as caught:
        refused.ping()
    assert wire.refused_at_connect(caught.value)
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    killer = threading.Timer(
        0.3, lambda: redis_server.client().client_kill_filter(_type="normal", skipme=True)
    )
    killer.start()
    with pytest.raises(redis.exceptions.ConnectionError) as cut:
        client.blpop(["wire-test-nothing"], timeout=4)  # cut by the server after it was sent
    killer.join()
    assert not wire.refused_at_connect(cut.value)


def _slot_queries(nodes: list[RedisServer]) -> int:
    stats = [node.client().info("commandstats") for node in nodes]
    return sum(
        s.get(k, {}).get("calls", 0) for s in stats for k in ("cmdstat_cluster|slots",
                                                             "cmdstat_cluster|shards")
    )  # fmt: skip


def test_refresh_slots_reads_the_cluster_s_slots_again_at_once(
    cluster_nodes: list[RedisServer],
) -> None:
    # redis-py 8.2 paces the refresh a refused connect asks for (once a second): the retry
    # after a failover needs the slots read now, whatever the last refresh was.
    client = redis.cluster.RedisCluster.from_url(cluster_nodes[0].url)
    try:
        before = _slot_queries(cluster_nodes)
        wire.refresh_slots(client)
        wire.refresh_slots(client)
        assert _slot_queries(cluster_nodes) >= before + 2
        assert client.ping()
    finally:
        client.close()


def test_a_failed_pub_sub_read_may_reconnect_and_a_close_after_it_closes_that(
    redis_server: RedisServer,
) -> None:
    # Why waiting's hub waits for its reader before closing the pub/sub (_stop_reader): the
    # reader's failed read may reconnect the connection (redis-py 8's failure callback does,
    # even with no retries left; 5.3's did not), which must not happen after the pool was
    # disconnected. A close after the read has ended leaves nothing connected.
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2, retry=Retry(NoBackoff(), 0))
    pubsub = client.pubsub()
    try:
        pubsub.subscribe("wire-test")
        assert pubsub.get_message(timeout=2)["type"] == "subscribe"
        conn = pubsub.connection
        wire.socket_of(conn).shutdown(socket.SHUT_RDWR)
        with pytest.raises(redis.exceptions.ConnectionError):
            pubsub.get_message(timeout=1)
        if redis.VERSION >= (8,):
            assert wire.socket_of(conn) is not None  # connected again, by the failed read
        pubsub.close()
        assert wire.socket_of(conn) is None
    finally:
        pubsub.close()
        client.close()


def test_an_asyncio_pool_checks_each_connection_it_hands_out(redis_server: RedisServer) -> None:
    """AsyncSentinelPool moves a connection to the new master in ensure_connection: the
    pool must call it on every connection it hands out, a pooled one included."""
    import asyncio

    import redis.asyncio

    seen: list[object] = []

    class Pool(redis.asyncio.ConnectionPool):
        async def ensure_connection(self, connection: object) -> None:
            seen.append(connection)
            await super().ensure_connection(connection)  # type: ignore[arg-type]

    async def main() -> None:
        client = redis.asyncio.Redis(connection_pool=Pool.from_url(redis_server.url))
        await client.ping()
        await client.ping()  # the pooled connection, handed out again
        await client.aclose(close_connection_pool=True)

    asyncio.run(main())
    assert len(seen) == 2 and seen[0] is seen[1]


def test_an_idle_asyncio_connection_the_server_closed_is_seen_on_its_socket(
    redis_server: RedisServer,
) -> None:
    """closed_while_idle reads an asyncio connection's socket through ``_writer`` (its
    StreamWriter): nothing to read on an open idle one, the EOF on one the server closed
    before the event loop ran again; an unconnected one is left to the pool."""
    import asyncio
    import time

    import redis.asyncio

    admin = redis_server.client()

    async def main() -> list[bool]:
        connection = redis.asyncio.Connection(port=redis_server.port)
        seen = [wire.closed_while_idle(connection)]
        await connection.connect()
        await connection.send_command("CLIENT", "ID")
        own = await connection.read_response()
        seen.append(wire.closed_while_idle(connection))
        admin.execute_command("CLIENT", "KILL", "ID", own)
        time.sleep(0.05)  # (the loop does not run: the EOF is not read by it)
        seen.append(wire.closed_while_idle(connection))
        await connection.disconnect()
        return seen

    assert asyncio.run(main()) == [False, False, True]


def test_an_asyncio_sentinel_pool_connects_outside_its_lock() -> None:
    """redis-py before 7.2 connected (and checked) a connection under the asyncio pool's
    lock: with the master paused, calls connected one after the other, a socket timeout each
    (4 s for the fifth of five, with a 1 s timeout). AsyncSentinelPool lets the lock go
    first, on every redis-py."""
    import asyncio

    held: list[bool] = []

    class Pool(wire.AsyncSentinelPool):
        async def ensure_connection(self, connection: object) -> None:
            held.append(self._lock.locked())  # (connects nothing: no server needed)

    async def main() -> None:
        pool = Pool("mymaster", sentinel_manager=None)
        connection = await pool.get_connection()
        await pool.release(connection)

    asyncio.run(main())
    assert held == [False]


def test_a_sentinel_pool_moves_a_connection_to_the_master_at_checkout(
    redis_server: RedisServer, redis_factory: Any
) -> None:
    """SentinelPool: once told where the master is (an announced switch), a pooled
    connection elsewhere is connected there at its next checkout, straight (no sentinel is
    asked), and redis-py's pool then counts it as its own (kept idle when given back)."""
    old = redis_factory()

    class Sentinels:  # where the sentinels said the master was, when the pool connected
        def discover_master(self, service_name: str) -> tuple[str, int]:
            return ("127.0.0.1", old.port)

    pool = wire.SentinelPool("mymaster", Sentinels())
    connection = pool.get_connection()
    assert connection.port == old.port
    pool.release(connection)
    wire.moved_sync_pool(pool, ("127.0.0.1", redis_server.port))
    connection = pool.get_connection()
    assert (connection.host, int(connection.port)) == ("127.0.0.1", redis_server.port)
    connection.send_command("PING")
    assert connection.read_response() in (b"PONG", "PONG")
    pool.release(connection)
    assert pool.get_connection() is connection  # kept
    pool.disconnect()


class _Interrupt(BaseException):
    """A signal handler's exception (a soft time limit's, Ctrl-C's)."""


def _run_by_the_collector(frame: Any) -> bool:
    """A finalizer's frame or one below it (a ``__del__``, a weak reference's callback): the
    garbage collector runs them at any allocation, not the checkout."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            return True
        frame = frame.f_back
    return False


def _checkout_interrupted_at(pool: Any, at: int) -> str | None:
    """``pool.get_connection()`` with an :class:`_Interrupt` raised at the ``at``-th function
    entry under it (where CPython runs a pending signal handler): where it landed, None when
    the checkout returned (its connection then given back)."""
    seen, fired = [0], []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and not _run_by_the_collector(frame):
            seen[0] += 1
            if seen[0] == at:
                fired.append(f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]})")
                raise _Interrupt(fired[0])

    sys.settrace(tracer)
    try:
        connection = pool.get_connection()
    except _Interrupt:
        return fired[0]
    finally:
        sys.settrace(None)
    pool.release(connection)
    return None


@pytest.mark.parametrize("idle", [True, False], ids=["idle connection", "slot to connect in"])
def test_a_waiting_pool_gets_back_what_an_interrupted_checkout_took(
    redis_server: RedisServer, idle: bool
) -> None:
    """WaitingPool (a Cluster's node pools with max_connections): an exception at any function
    entry of a checkout (a soft time limit's) leaves the connection, or the slot to make one
    in, back in the pool, once. redis-py's get_connection calls Python functions after the
    queue's get() outside any try (Queue.get's notify; 8.x's get_pool_name(); 6.x's
    make_connection()): one lost there was, with max_connections=1, a BackendUnavailable
    ("No connection available.") on every later call on that healthy master."""
    pool = wire.WaitingPool(
        max_connections=1, timeout=0.05, host="127.0.0.1", port=redis_server.port,
        socket_timeout=2,
    )  # fmt: skip
    points: list[str] = []
    try:
        for at in range(1, 5000):
            if idle:
                pool.release(pool.get_connection())  # an idle connected one in the queue
            else:
                pool.disconnect()
                pool.reset()  # the queue's one slot, no connection made yet
            fired = _checkout_interrupted_at(pool, at)
            slots = list(pool.pool.queue)
            assert len(slots) == 1, f"interrupted at {fired}: {len(slots)} of 1 slots back"
            if fired is None:
                break
            points.append(fired)
        else:
            raise AssertionError(f"no checkout returned: {points[-5:]}")
        assert len(points) > 5, points
        connection = pool.get_connection()  # at once: the one connection is free
        connection.send_command("PING")
        assert connection.read_response() in (b"PONG", "PONG")
        pool.release(connection)
    finally:
        pool.disconnect()


def _line_of(function: Any, text: str) -> int:
    """The line number of the first line of ``function`` that contains ``text``."""
    source, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(source) if text in line)


def test_a_connection_given_back_and_taken_during_a_sweep_s_check_is_not_called_lost(
    redis_server: RedisServer,
) -> None:
    """Review x4, 3. ``max_connections=2``, both held; a caller waits its timeout and sweeps.
    Between ``_garbage``'s count of the references from inside and its read of the reference
    counts, the holder of one gives it back (into the queue: inside) and another thread
    takes it (its locals: outside). It looked unreachable: the sweep listed a free slot in
    its place and dropped it from ``_connections``; three connections were out at once and
    ``disconnect()`` left its socket open. The thread switches are forced at those lines,
    as the interpreter may make them at any bytecode. Now a give-back since the sweep looked
    makes it keep the item."""
    pool = wire.WaitingPool(
        max_connections=2, host=redis_server.host, port=redis_server.port, socket_timeout=0.3
    )
    events = {k: threading.Event() for k in ("held", "give", "given", "take", "taken", "end")}
    got: dict[str, Any] = {}

    def holder() -> None:
        connection = pool.get_connection()
        got["c2"] = id(connection)
        events["held"].set()
        events["give"].wait(5)
        pool.release(connection)
        connection = None
        events["given"].set()

    def taker() -> None:
        events["take"].wait(5)
        connection = pool.get_connection()
        got["taker"] = weakref.ref(connection)  # (a strong one would make it held: a root)
        events["taken"].set()
        events["end"].wait(5)
        pool.release(connection)

    kept = pool.get_connection()
    threads = [threading.Thread(target=f, daemon=True) for f in (holder, taker)]
    for each in threads:
        each.start()
    assert events["held"].wait(5)
    code = wire._garbage.__code__
    count_inside = _line_of(wire._garbage, "inside = collections")
    count_roots = _line_of(wire._garbage, "roots = [k")

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_locals.get("key") == got["c2"]:
            if frame.f_lineno == count_inside and not events["give"].is_set():
                events["give"].set()
                events["given"].wait(5)
            if frame.f_lineno == count_roots and not events["take"].is_set():
                events["take"].set()
                events["taken"].wait(5)
        return local

    sys.settrace(lambda f, e, a: local if f.f_code is code else None)
    try:
        mine = pool.get_connection()
    except redis.exceptions.ConnectionError:
        mine = None  # both held: none free
    finally:
        sys.settrace(None)
    try:
        assert events["taken"].is_set(), "the schedule was not forced"
        taken = got["taker"]()
        assert id(taken) == got["c2"]
        out = {id(c) for c in (kept, taken, mine) if c is not None}
        assert len(out) <= 2, f"{len(out)} connections out at once (max_connections=2)"
        assert any(c is taken for c in pool._connections), "a held connection dropped"
    finally:
        if mine is not None:
            pool.release(mine)
        events["end"].set()
        for each in threads:
            each.join(5)
        pool.release(kept)
    assert len(pool.pool.queue) == 2, f"{len(pool.pool.queue)} listed for 2 positions"
    pool.disconnect()


class _WrittenWhileRead(dict[int, Any]):
    """A pool's records that another thread writes while they are iterated (what a
    collection's finalizers on the reading line let happen: their writers take no mutex)."""

    def values(self) -> Any:  # type: ignore[override]
        def written_meanwhile() -> Any:
            values = iter(dict.values(self))
            self[-1 - len(self)] = None  # (a give-back's record, the iterator there)
            yield from values  # RuntimeError: dictionary changed size during iteration

        return written_meanwhile()


def test_a_record_written_while_a_sweep_reads_the_records_raises_nothing(
    redis_server: RedisServer,
) -> None:
    """Review x4, 4. A sweep read the threads' records (``taken``) under the mutex, and
    their writers (a give-back's record, the hand-over's pop) take none: a collection on that
    line ran finalizers, another thread wrote one, and ``RuntimeError: dictionary changed
    size during iteration`` came out of ``get_connection``. Forced here with records whose
    iteration sees a write (a test double of the dict, not of Redis): the caller that waited
    its timeout is told none is free, not given a ``RuntimeError``."""
    pool = wire.WaitingPool(
        max_connections=1, host=redis_server.host, port=redis_server.port, socket_timeout=0.2
    )
    slots = pool.pool
    assert isinstance(slots, wire._Slots)
    held = pool.get_connection()
    records = _WrittenWhileRead(slots.taken)
    slots.taken = records
    try:
        with pytest.raises(redis.exceptions.MaxConnectionsError):
            pool.get_connection()
    finally:
        for key in [k for k in records if k < 0]:
            del records[key]
        pool.release(held)
        pool.disconnect()


class _Cut(Exception):
    """A soft time limit (an exception a signal handler raises)."""


def test_a_time_limit_as_a_give_back_enters_a_callee_loses_no_connection(
    redis_server: RedisServer,
) -> None:
    """Review x4, 2. ``max_connections=1``; a soft time limit lands on the first line of a
    function the give-back's ``_Slots.put`` calls (CPython runs signal handlers at a
    function's entry), each one in turn. ``put`` took the connection out of its record and
    passed it to ``_list``: cut there, it was in no store, and, the exception kept (a
    logging handler, a result store), every later checkout waited its timeout and failed.
    Now the move is one line of the callee (``_hand_on``): cut before it, the record gives
    it back."""
    pool = wire.WaitingPool(
        max_connections=1, host=redis_server.host, port=redis_server.port, socket_timeout=0.3
    )
    put = wire._Slots.put.__code__
    cuts: list[str] = []
    for nth in range(10):
        entered: list[str] = []

        def local(
            frame: Any, event: str, arg: Any, entered: list[str] = entered, nth: int = nth
        ) -> Any:
            if event == "line" and len(entered) == nth + 1 and frame.f_back.f_code is put:
                entered.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                raise _Cut(entered[-1])
            return local

        def tracer(frame: Any, event: str, arg: Any, entered: list[str] = entered) -> Any:
            back = frame.f_back
            if back is None or back.f_code is not put:
                return None
            entered.append(frame.f_code.co_name)
            return local

        connection = pool.get_connection()
        sys.settrace(tracer)
        try:
            pool.release(connection)
        except _Cut as exc:
            kept: Any = exc  # (its traceback keeps the callee's frame, as a kept one does)
        else:
            kept = None
        finally:
            sys.settrace(None)
        connection = None
        if kept is None:
            break
        cuts.append(str(kept))
        try:
            again = pool.get_connection()
        except redis.exceptions.ConnectionError as exc:
            raise AssertionError(f"cut at {kept}: the connection was lost ({exc})") from exc
        pool.release(again)
        assert len(pool.pool.queue) == 1, kept
        del kept
    assert any(cut.startswith(("_list", "_hand_on")) for cut in cuts), cuts
    pool.disconnect()
