"""A loopback TCP proxy in front of a real redis-server that can lose replies on demand.

``lose_replies(n)``: the next ``n`` replies from the server are swallowed and the client's
connection is cut, after the server has executed the command: the client sees a connection
error for a command that took effect (an unknown outcome), as when a network drops a reply.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from django_redlock.testing import free_port


class LossyProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._mutex = threading.Lock()
        self._to_lose = 0
        self.lost = 0  # replies lost so far
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose_replies(self, count: int = 1) -> None:
        with self._mutex:
            self._to_lose = count

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._mutex:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if replies:
                    with self._mutex:
                        lose = self._to_lose > 0
                        if lose:
                            self._to_lose -= 1
                            self.lost += 1
                    if lose:  # the server did it; the client never hears so
                        break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def cut(self) -> None:
        """Cut every connection open through the proxy (new ones are still accepted)."""
        with self._mutex:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._mutex:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # a pump blocked in recv() holds it open
                with contextlib.suppress(OSError):
                    sock.close()
