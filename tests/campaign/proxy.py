"""A small loopback TCP proxy between lock clients and one redis-server, that loses replies.

Every client connection gets its own upstream connection and two pump threads. Faults, set
by the nemesis at any moment:

* ``latency``: every chunk waits this long before it is forwarded (both ways);
* ``black_hole(seconds)``: nothing is forwarded either way until then; what was read waits
  (like TCP retransmitting into a partition) and goes through afterwards if both ends are
  still connected, so a request can reach Redis after its client gave up;
* ``lose_replies(n)``: the next ``n`` replies to a script call (``EVALSHA``/``EVAL``) are
  dropped and their connection cut: Redis executed the call, the client sees a connection
  error. That is the unknown outcome clients must never mistake for "no";
* ``reset()``: cut every open connection at once (subscriptions included);
* ``hold_back(up, seconds)``: the next script call's request (``up``) or reply held back
  ``seconds`` on its own connection, then forwarded (a retransmission; the clients' own wire
  in the ``wire`` move, moves.py): the rest of that connection waits behind it, as TCP's order
  makes it, and every other connection flows.

While the upstream server is down, new connections are accepted and closed at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass
class HoldBack:
    """One script call's request (``up``) or reply held back ``seconds``: when (``t0``), and
    when it went on (``t1``; None while held, or when its connection was gone by then)."""

    up: bool
    seconds: float
    on_hold: Callable[[HoldBack], None] | None = None
    t0: float | None = None
    t1: float | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class _Link:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.script_pending = False  # a script call went up and its reply has not come back
        self.closed = False
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int, name: str = "proxy") -> None:
        self.upstream_port = upstream_port
        self.name = name
        self.latency = 0.0
        self.black_hole_until = 0.0
        self._lose = 0
        self.lost_replies = 0  # replies actually lost (for the report)
        self._held: HoldBack | None = None  # armed: the next script call's to hold back
        self._links: set[_Link] = set()
        self._mutex = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = int(self._listener.getsockname()[1])
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- faults ------------------------------------------------------------------------------

    def black_hole(self, seconds: float) -> None:
        self.black_hole_until = time.monotonic() + seconds

    def lose_replies(self, count: int) -> None:
        with self._mutex:
            self._lose += count

    def heal(self) -> None:
        self.latency = 0.0
        self.black_hole_until = 0.0
        with self._mutex:
            self._lose = 0

    def reset(self) -> int:
        with self._mutex:
            links = list(self._links)
        for link in links:
            link.close()
        return len(links)

    def hold_back(
        self, up: bool, seconds: float, on_hold: Callable[[HoldBack], None] | None = None
    ) -> HoldBack:
        """Arm: the next script call (its request, or its reply) is held back ``seconds``;
        ``on_hold`` is called (in the proxy's thread) as it starts to be."""
        held = HoldBack(up, seconds, on_hold)
        with self._mutex:
            self._held = held
        return held

    def disarm(self, held: HoldBack) -> bool:
        """Disarm ``held`` if nothing took it yet: whether it was still armed."""
        with self._mutex:
            if self._held is held:
                self._held = None
                return True
        return False

    def _take_held(self, up: bool) -> HoldBack | None:
        with self._mutex:
            held = self._held
            if held is None or held.up != up:
                return None
            self._held = None
        held.t0 = time.time()
        if held.on_hold is not None:
            held.on_hold(held)
        return held

    def _take_loss(self) -> bool:
        with self._mutex:
            if self._lose > 0:
                self._lose -= 1
                self.lost_replies += 1
                return True
        return False

    # -- forwarding --------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=1)
                upstream.settimeout(None)
            except OSError:
                with contextlib.suppress(OSError):
                    client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, upstream)
            with self._mutex:
                self._links.add(link)
            for up in (True, False):
                threading.Thread(target=self._pump, args=(link, up), daemon=True).start()

    def _hold(self, link: _Link) -> None:
        """Wait out latency and black holes before forwarding a chunk."""
        if self.latency:
            time.sleep(self.latency)
        while not link.closed and time.monotonic() < self.black_hole_until:
            time.sleep(min(0.02, max(0.0, self.black_hole_until - time.monotonic())))

    def _pump(self, link: _Link, up: bool) -> None:
        source, sink = (link.client, link.upstream) if up else (link.upstream, link.client)
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                self._hold(link)
                held = None
                if up:
                    if b"EVAL" in data:  # EVAL and EVALSHA, as redis-py spells them
                        link.script_pending = True
                        held = self._take_held(True)
                elif link.script_pending:
                    link.script_pending = False
                    if self._take_loss():
                        break  # the reply never reaches the client: cut the connection
                    held = self._take_held(False)
                if held is not None:
                    try:
                        time.sleep(held.seconds)  # the rest of this connection waits behind
                        sink.sendall(data)
                        held.t1 = time.time()
                    finally:
                        held.done.set()
                    continue
                sink.sendall(data)
        except OSError:
            pass
        finally:
            link.close()
            with self._mutex:
                self._links.discard(link)

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.reset()
