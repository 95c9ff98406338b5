"""A loopback TCP proxy in front of a real redis-server that can lose replies on demand.

``lose_replies(n)``: the next ``n`` replies from the server are swallowed and the client's
connection is cut, after the server has executed the command: the client sees a connection
error for a command that took effect (an unknown outcome), as when a network drops a reply.

In front of a PostgreSQL, ``fault_commit(...)``: the next COMMIT goes to the server, whose
reply is read and held back (``hold`` seconds, ``during()`` run meanwhile), then either the
client's connection is cut (``"cut"``: the server committed, the client never hears so) or
the reply is forwarded late (``"late"``: time for a signal handler to interrupt the wait).
``disarm()`` takes back a fault no COMMIT met yet; ``cut()`` resets every connection.
``blackhole()``: every connection, open or new, silent both ways (a partition).
``mute_from(marker)``: the first request that contains ``marker`` goes to the server, and
from it on its connection gets no reply, left open (the client's read times out). The
fault campaign's ``database`` kind runs its PostgreSQL behind one (tests/campaign/README.md).
``latency``: every chunk waits this long before it is forwarded, both ways (a round trip
costs twice it, a handshake of several chunks more).
``delay_from(marker)``: the first request that contains ``marker`` is held back (the client's
read times out, and it drops the connection) until ``let_go()`` sends it on to the server, as
a request stuck in a paused server's queue or a retransmission runs after the client's next.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django_redlock.testing import free_port

#: A COMMIT in PostgreSQL's simple query protocol (psycopg and libpq send it so): 'Q', the
#: length (itself included), the text.
COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"


def _subscribes(data: bytes) -> bool:
    """Whether a client's bytes carry a SUBSCRIBE command (not a script that names one)."""
    upper = data.upper()
    return b"\r\nSUBSCRIBE\r\n" in upper and b"EVAL" not in upper and b"SCRIPT" not in upper


@dataclass
class CommitFault:
    how: str  # "cut" or "late"
    hold: float
    during: Callable[[], None] | None
    after: float = 0.0  # held this much longer once during() ran


class _Link:
    """One client connection's state, shared by its two pumps."""

    def __init__(self) -> None:
        self.commit: CommitFault | None = None  # a COMMIT went up with this fault
        self.subscriber = False  # the client sent a SUBSCRIBE
        self.dead = False  # black-holed: nothing passes either way
        self.muted = False  # no reply passes to the client from now on


class LossyProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._mutex = threading.Lock()
        self._to_lose = 0
        self.lost = 0  # replies lost so far
        self._commit_fault: CommitFault | None = None
        self._mute_marker: bytes | None = None
        self._delay_marker: bytes | None = None
        self.delayed = threading.Event()  # a request met the delay marker, held back
        self._let_go = threading.Event()
        self.muted = threading.Event()  # a request met the mute marker
        self.commits_faulted = 0  # COMMIT replies cut or held back so far
        self._sockets: list[socket.socket] = []
        self._links: list[_Link] = []
        self._blackholed = False  # every connection, open or new, silent (see blackhole())
        self._closed = False
        self.latency = 0.0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose_replies(self, count: int = 1) -> None:
        with self._mutex:
            self._to_lose = count

    def fault_commit(
        self, how: str = "cut", hold: float = 0.0, during: Callable[[], None] | None = None,
        after: float = 0.0,
    ) -> None:  # fmt: skip
        """The next COMMIT's reply, once the server sent it: held ``hold`` s, ``during()`` run,
        held ``after`` s more, then cut (``"cut"``) or forwarded (``"late"``)."""
        assert how in ("cut", "late")
        with self._mutex:
            self._commit_fault = CommitFault(how, hold, during, after)

    def mute_from(self, marker: bytes) -> None:
        """The first request containing ``marker``: executed, and no reply to it (nor to any
        later one on its connection) reaches the client; the connection stays open."""
        with self._mutex:
            self._mute_marker = marker

    def delay_from(self, marker: bytes) -> None:
        """The first request containing ``marker`` waits here until :meth:`let_go`."""
        with self._mutex:
            self._delay_marker = marker
            self._let_go.clear()

    def let_go(self) -> None:
        """Send the held-back request on to the server (which runs it), and wait a little for
        that."""
        self._let_go.set()
        time.sleep(0.2)

    def disarm(self) -> None:
        """Take back a COMMIT fault that no COMMIT met yet."""
        with self._mutex:
            self._commit_fault = None

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the server is down: this client is cut, the next may pass
                client.close()
                continue
            with self._mutex:
                self._sockets += [client, server]
            link = _Link()
            with self._mutex:
                link.dead = self._blackholed
                self._links.append(link)
            for args in ((client, server, False, link), (server, client, True, link)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool, link: _Link) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if not replies and _subscribes(data):
                    link.subscriber = True
                if not replies and self._mute_marker is not None:
                    with self._mutex:  # marked before it goes up: its reply comes after
                        if self._mute_marker is not None and self._mute_marker in data:
                            self._mute_marker, link.muted = None, True
                            self.muted.set()
                if link.dead or (replies and link.muted):
                    continue  # dropped silently, the connection left open
                if not replies and COMMIT in data:
                    with self._mutex:  # marked before it goes up: its reply comes after
                        link.commit, self._commit_fault = self._commit_fault, None
                if replies and link.commit is not None:  # the server answered the COMMIT
                    fault, link.commit = link.commit, None
                    with self._mutex:
                        self.commits_faulted += 1
                    time.sleep(fault.hold)
                    if fault.during is not None:
                        fault.during()
                    time.sleep(fault.after)
                    if fault.how == "cut":
                        break
                if replies:
                    with self._mutex:
                        lose = self._to_lose > 0
                        if lose:
                            self._to_lose -= 1
                            self.lost += 1
                    if lose:  # the server did it; the client never hears so
                        break
                if not replies and self._delay_marker is not None:
                    with self._mutex:
                        held = self._delay_marker is not None and self._delay_marker in data
                        if held:
                            self._delay_marker = None
                    if held:
                        self.delayed.set()
                        self._let_go.wait(30)
                if self.latency:
                    time.sleep(self.latency)
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def blackhole_subscribers(self) -> None:
        """Every pub/sub connection open now goes silent both ways without being closed (a
        firewall that forgot an idle flow); the others, and new ones, pass."""
        with self._mutex:
            for link in self._links:
                link.dead = link.dead or link.subscriber

    def blackhole(self) -> None:
        """Every connection, open now or made later, goes silent both ways without being
        closed: the client cut off from the server (its reads time out)."""
        with self._mutex:
            self._blackholed = True
            for link in self._links:
                link.dead = True

    def heal(self) -> None:
        """End a blackhole(): the connections it silenced are cut (their clients connect
        again), new ones pass."""
        with self._mutex:
            self._blackholed = False
        self.cut()

    def cut(self) -> int:
        """Cut every connection open through the proxy (new ones are still accepted); how
        many client connections there were."""
        with self._mutex:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return len(sockets) // 2

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._mutex:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # a pump blocked in recv() holds it open
                with contextlib.suppress(OSError):
                    sock.close()
