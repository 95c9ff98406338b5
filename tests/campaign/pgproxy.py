"""A TCP proxy in front of the campaign's PostgreSQL (kind ``database``): lost and late COMMIT
replies, and cut connections.

``fault_commit("cut")``: the next COMMIT goes to the server, whose reply is read and then the
client's connection is cut (the server committed; the client never hears so). ``"late"``: the
reply is held ``hold`` seconds (``during()`` run halfway: the harness interrupts the clients
then, as a time limit firing during a slow COMMIT would), then forwarded. ``cut_all()``:
every connection reset. Psycopg sends COMMIT in the simple query protocol: 'Q', the length,
the text.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django_redlock.testing import free_port

COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"


@dataclass
class CommitFault:
    how: str  # "cut" or "late"
    hold: float
    during: Callable[[], None] | None


class _Link:
    def __init__(self) -> None:
        self.commit: CommitFault | None = None  # a COMMIT went up with this fault


class PgProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._mutex = threading.Lock()
        self._fault: CommitFault | None = None
        self.faulted = 0  # COMMIT replies cut or held back so far
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="pgproxy", daemon=True).start()

    def fault_commit(
        self, how: str, hold: float = 0.0, during: Callable[[], None] | None = None
    ) -> None:
        with self._mutex:
            self._fault = CommitFault(how, hold, during)

    def disarm(self) -> None:
        with self._mutex:
            self._fault = None

    def cut_all(self) -> int:
        with self._mutex:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return len(sockets) // 2

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._mutex:
                self._sockets += [client, server]
            link = _Link()
            for args in ((client, server, False, link), (server, client, True, link)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool, link: _Link) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if not replies and COMMIT in data:
                    with self._mutex:  # marked before it goes up: its reply comes after
                        link.commit, self._fault = self._fault, None
                if replies and link.commit is not None:  # the server answered the COMMIT
                    fault, link.commit = link.commit, None
                    with self._mutex:
                        self.faulted += 1
                    # during() halfway: its interrupt lands while the client waits.
                    time.sleep(fault.hold / 2)
                    if fault.during is not None:
                        fault.during()
                    time.sleep(fault.hold / 2)
                    if fault.how == "cut":
                        break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut_all()
