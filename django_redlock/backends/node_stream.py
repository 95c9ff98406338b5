"""One Redlock fan-out connection as a stream: requests written, replies read as they come,
never waiting on a read. The fan-out polls many connections at once and reads only those
the poll (or its deadline) points at; a read here takes what the socket has and stops.

Two kinds, chosen once per connection, right after its handshake (:func:`stream_for`), and
used alone from then on (the connection's owner is the only one that sends or reads):

* :class:`SocketStream`, on a plain socket: hiredis parses what one non-blocking ``recv``
  brings (no redis-py layer per reply: its readiness poll, its peer-closed check and its
  parser cost more than the reply's round trip).
* :class:`ConnectionStream`, for TLS (an ``SSLSocket`` holds decrypted bytes its descriptor
  does not show, and takes no ``recv`` flags) or without hiredis: redis-py's own
  ``can_read`` and ``read_response``.

A reply is returned as a value, error replies included (what a pipeline does), except an
error redis-py counts as a broken connection (``LOADING`` is ``BusyLoadingError``), which is
raised like a closed socket: the request's node is unavailable and its connection closed.
"""

from __future__ import annotations

import math
import os
import select
import socket
from typing import Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from ..wire import plant_stream, reply_reader, socket_of, socket_or_none, stream_of

#: What :meth:`Stream.next_reply` returns while the next reply has not fully come.
NOT_YET: Any = type("NotYet", (), {"__repr__": lambda self: "NOT_YET"})()
#: Bytes taken from the socket per read.
CHUNK = 65536


class Stream(Protocol):
    def fileno(self) -> int:
        """The socket's descriptor; -1 once closed."""

    def send(self, payload: bytes) -> None:
        """Write ``payload`` whole (blocking, within the socket timeout)."""

    def next_reply(self) -> Any:
        """The next reply if it has come, else NOT_YET; raises on a closed connection."""

    def idle(self) -> bool:
        """Whether the connection is open with nothing to read (fit to send a request on)."""


class SocketStream:
    """A plain socket with a timeout, read through its descriptor: Python keeps such a
    socket non-blocking underneath (and waits on a poll before each ``recv`` to honour the
    timeout), so ``os.read`` on the descriptor takes what has come, or raises at once.
    The descriptor is read only while ``sock`` still has it: only the connection's owner
    closes it, and the owner is the one reading (a number reused by another socket is
    never read)."""

    __slots__ = ("fd", "push", "reader", "sock")

    def __init__(self, sock: socket.socket, reader: Any, push: Any) -> None:
        self.sock, self.fd, self.reader, self.push = sock, sock.fileno(), reader, push

    def send(self, payload: bytes) -> None:
        # Written straight to the descriptor (the socket object would poll for room first);
        # what does not fit now is left to sendall, which waits within the timeout.
        if self.sock.fileno() != self.fd:
            raise RedisConnectionError("the connection was closed")
        try:
            written = os.write(self.fd, payload)
        except (BlockingIOError, InterruptedError):
            written = 0
        if written < len(payload):
            self.sock.sendall(memoryview(payload)[written:])

    def next_reply(self) -> Any:
        reader = self.reader
        while True:
            reply = reader.gets()
            if reply is NOT_YET:
                if self.sock.fileno() != self.fd:
                    raise RedisConnectionError("the connection was closed")
                try:
                    data = os.read(self.fd, CHUNK)
                except (BlockingIOError, InterruptedError):
                    return NOT_YET
                if not data:
                    raise RedisConnectionError("Connection closed by server.")
                reader.feed(data)
            elif self.push is not None and isinstance(reply, self.push):
                continue  # a RESP3 push (nothing we asked for): not a reply
            elif isinstance(reply, RedisConnectionError):
                raise reply
            else:
                return reply

    def fileno(self) -> int:
        return self.fd if self.sock.fileno() == self.fd else -1

    def idle(self) -> bool:
        return not busy([self])


class ConnectionStream:
    __slots__ = ("connection",)

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def send(self, payload: bytes) -> None:
        self.connection.send_packed_command([payload], False)

    def next_reply(self) -> Any:
        connection = self.connection
        if socket_or_none(connection) is None:  # closed (reading would reconnect)
            raise RedisConnectionError("the connection was closed")
        if not connection.can_read(timeout=0):
            return NOT_YET
        try:
            return connection.read_response()
        except ResponseError as exc:
            return exc

    def fileno(self) -> int:
        sock = socket_or_none(self.connection)
        return -1 if sock is None else sock.fileno()

    def idle(self) -> bool:
        try:
            return socket_of(self.connection) is not None and not self.connection.can_read()
        except Exception:
            return False


def stream_for(connection: Any) -> Stream:
    """The stream of a connection that just connected, made once and planted on it."""
    stream = stream_of(connection)
    if stream is None:
        made = reply_reader(connection, NOT_YET)
        if made is None:
            stream = ConnectionStream(connection)
        else:
            sock, reader, push = made
            stream = SocketStream(sock, reader, push)
        plant_stream(connection, stream)
    return stream


def busy(streams: list[Stream]) -> set[int]:
    """The indexes of ``streams`` not idle (closed by the server, or with bytes nobody asked
    for): one poll for all the plain sockets, at once."""
    return Watch().busy(dict(enumerate(streams)))


class Watch:
    """One poll over a fan-out's streams while it waits: each registered once, from when it
    is first waited on until it leaves the set waited on (:meth:`wait` is given the set)."""

    __slots__ = ("_fds", "_poll")

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fds: dict[Any, tuple[int, Stream]] = {}  # key -> what is registered for it

    def busy(self, streams: dict[Any, Stream]) -> set[Any]:
        """:func:`busy`'s keys for ``streams`` (not idle), the plain sockets registered on
        the way for the wait that follows."""
        out = set()
        for key, stream in streams.items():
            if type(stream) is not SocketStream:
                if not stream.idle():
                    out.add(key)
            elif stream.reader.has_data() or (fd := stream.fileno()) < 0:
                out.add(key)
            else:
                self._poll.register(fd, select.POLLIN)
                self._fds[key] = (fd, stream)
        if self._fds:
            by_fd = {fd: key for key, (fd, _) in self._fds.items()}
            out.update(by_fd[fd] for fd, _ in self._poll.poll(0) if fd in by_fd)
        return out

    def wait(self, streams: dict[Any, Stream], timeout: float) -> set[Any]:
        """The keys whose stream has something to read (a closed one counts: reading it
        says what happened), waiting ``timeout`` seconds at most."""
        watched, poll = self._fds, self._poll
        for key in [k for k, (_, s) in watched.items() if streams.get(k) is not s]:
            poll.unregister(watched.pop(key)[0])
        ready = set()
        for key, stream in streams.items():
            if key not in watched:
                fd = stream.fileno()
                if fd < 0:
                    ready.add(key)
                    continue
                poll.register(fd, select.POLLIN)
                watched[key] = (fd, stream)
        if ready:
            timeout = 0.0
        events = poll.poll(math.ceil(max(0.0, timeout) * 1000))
        if not events:
            return ready
        by_fd = {fd: key for key, (fd, _) in watched.items()}
        return ready | {by_fd[fd] for fd, _ in events if fd in by_fd}
