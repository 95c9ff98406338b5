"""A Redlock fan-out connection's stream (backends/node_stream.py) on a real redis-server:
replies read without ever waiting, a server that is paused, closes the connection or sends
a reply in pieces, and the one poll that tells which connections a fan-out can reuse."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from django_redlock import wire
from django_redlock.backends.node_stream import (
    NOT_YET,
    ConnectionStream,
    SocketStream,
    Stream,
    Watch,
    busy,
    stream_for,
)
from django_redlock.testing import RedisServer


@pytest.fixture
def connect(redis_server: RedisServer) -> Iterator[Callable[..., object]]:
    made: list[object] = []

    def make(**options: object) -> object:
        options.setdefault("socket_timeout", 2)
        pool = redis.Redis.from_url(redis_server.url, **options).connection_pool
        conn = wire.new_connection(pool)
        conn.connect()
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.disconnect()  # type: ignore[attr-defined]


def ask(stream: Stream, conn: object, *command: str) -> None:
    stream.send(b"".join(wire.pack_many(conn, [command])))


def reply(stream: Stream, within: float = 2.0) -> object:
    deadline = time.monotonic() + within
    while (got := stream.next_reply()) is NOT_YET:
        assert time.monotonic() < deadline, "no reply"
        time.sleep(0.001)
    return got


def test_a_plain_socket_is_read_by_hiredis_and_tls_or_no_timeout_by_redis_py(
    connect: Callable[..., object],
) -> None:
    assert type(stream_for(connect())) is SocketStream
    assert type(stream_for(connect(socket_timeout=None))) is ConnectionStream
    conn = connect()
    assert stream_for(conn) is stream_for(conn)  # made once, planted on the connection


@pytest.mark.parametrize("timeout", [2, None])
def test_replies_come_back_in_order_errors_as_values(
    connect: Callable[..., object], timeout: float | None
) -> None:
    conn = connect(socket_timeout=timeout)
    stream = stream_for(conn)
    ask(stream, conn, "SET", "ns:k", "v")
    ask(stream, conn, "EVALSHA", "0" * 40, "0")
    ask(stream, conn, "GET", "ns:k")
    assert reply(stream) in (True, b"OK")
    assert isinstance(reply(stream), NoScriptError)
    assert reply(stream) == b"v"
    assert stream.next_reply() is NOT_YET
    assert stream.idle()


def test_nothing_come_is_not_yet_at_once_on_a_paused_server(
    redis_factory: Callable[..., RedisServer],
) -> None:
    server = redis_factory()
    pool = redis.Redis.from_url(server.url, socket_timeout=2).connection_pool
    conn = wire.new_connection(pool)
    conn.connect()
    stream = stream_for(conn)
    server.pause()
    try:
        ask(stream, conn, "PING")
        started = time.monotonic()
        for _ in range(100):
            assert stream.next_reply() is NOT_YET
        assert time.monotonic() - started < 0.5  # never waits (2 s socket timeout)
        assert busy([stream]) == set()  # nothing to read yet: but it has a request out
    finally:
        server.resume()
    assert reply(stream) in (True, b"PONG")
    conn.disconnect()


def test_a_reply_in_many_pieces_is_read_whole(connect: Callable[..., object]) -> None:
    conn = connect()
    stream = stream_for(conn)
    big = "x" * 3_000_000  # many reads of 64 KiB
    ask(stream, conn, "SET", "ns:big", big)
    assert reply(stream) in (True, b"OK")
    ask(stream, conn, "GET", "ns:big")
    ask(stream, conn, "PING")
    assert reply(stream, 5) == big.encode()
    assert reply(stream) in (True, b"PONG")


def test_a_connection_the_server_closed_is_busy_and_raises_when_read(
    connect: Callable[..., object], redis_server: RedisServer
) -> None:
    conn, other = connect(), connect()
    stream, spare = stream_for(conn), stream_for(other)
    ask(stream, conn, "CLIENT", "ID")
    client_id = reply(stream)
    assert busy([spare, stream]) == set()
    redis.Redis.from_url(redis_server.url).client_kill_filter(_id=client_id)
    deadline = time.monotonic() + 2
    while busy([spare, stream]) != {1}:
        assert time.monotonic() < deadline
    assert not stream.idle() and spare.idle()
    with pytest.raises(RedisConnectionError):
        reply(stream)


def test_a_closed_connection_is_never_read_or_written_through_its_old_descriptor(
    connect: Callable[..., object],
) -> None:
    """Its descriptor number may be another socket's by now."""
    conn = connect()
    stream = stream_for(conn)
    conn.disconnect()  # type: ignore[attr-defined]
    fresh = connect()  # likely the same descriptor number
    assert stream.fileno() == -1
    assert busy([stream]) == {0}
    with pytest.raises(RedisConnectionError):
        stream.next_reply()
    with pytest.raises(RedisConnectionError):
        ask(stream, conn, "PING")
    other = stream_for(fresh)
    ask(other, fresh, "PING")
    assert reply(other) in (True, b"PONG")  # nothing of it was taken


def test_a_watch_sees_what_has_come_and_forgets_what_left(
    connect: Callable[..., object],
) -> None:
    conns = [connect() for _ in range(3)]
    streams = [stream_for(c) for c in conns]
    watch = Watch()
    waiting = {i: s for i, s in enumerate(streams)}
    assert watch.wait(waiting, 0.05) == set()
    ask(streams[1], conns[1], "PING")
    deadline = time.monotonic() + 2
    while (ready := watch.wait(waiting, 0.1)) != {1}:
        assert time.monotonic() < deadline and ready == set()
    assert reply(streams[1]) in (True, b"PONG")
    del waiting[1]
    ask(streams[1], conns[1], "PING")  # no longer waited on: not seen
    assert watch.wait(waiting, 0.05) == set()
    conns[2].disconnect()  # type: ignore[attr-defined]
    del waiting[2]
    waiting[2] = streams[2]  # closed: ready at once (reading it says what happened)
    watch = Watch()
    assert watch.wait(waiting, 1.0) == {2}
