"""Uncontended cycles on the Redlock quorum of 5 nodes: ours against pottery's Redlock, and
the floor of any Python client on the same machine: the cycle's two commands sent to every
node at once on plain sockets, replies parsed by hiredis, no lock logic (raw N=5), and the
same on one node (raw single). raw N=5 / raw single bounds what ours N=5 / ours single can be
here: each node is a redis-server woken twice per cycle, on the same cores as the client."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from bench.harness import RELEASE_LUA, interleaved


def _command(*parts: str | bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def raw_fan_out(urls: list[str], key: str) -> Callable[[], None]:
    """A cycle: SET NX PX on every node, then the compare-and-delete script on every node;
    each step sends to all nodes before reading any reply (the replies wait in the kernel)."""
    import hiredis

    nodes = []
    for url in urls:
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname, parts.port or 6379))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nodes.append((sock, hiredis.Reader()))
    shas = [_ask(sock, reader, _command("SCRIPT", "LOAD", RELEASE_LUA)) for sock, reader in nodes]

    def step(requests: list[bytes]) -> None:
        for (sock, _), request in zip(nodes, requests, strict=True):
            sock.sendall(request)
        for sock, reader in nodes:
            while (reply := reader.gets()) is False:
                reader.feed(sock.recv(65536))
            assert not isinstance(reply, hiredis.ReplyError), reply

    def cycle() -> None:
        token = secrets.token_urlsafe(16)
        step([_command("SET", key, token, "NX", "PX", "30000")] * len(nodes))
        step([_command("EVALSHA", sha, "1", key, token) for sha in shas])

    return cycle


def _ask(sock: socket.socket, reader: Any, request: bytes) -> Any:
    sock.sendall(request)
    while (reply := reader.gets()) is False:
        reader.feed(sock.recv(65536))
    return reply


def quorum(results: dict[str, Any], node_urls: list[str], single_url: str) -> None:
    import redis
    from pottery import Redlock

    from django_redlock import lock

    masters = {redis.Redis.from_url(url) for url in node_urls}

    def ours() -> None:
        with lock("q:ours", using="quorum"):
            pass

    def pottery() -> None:
        held = Redlock(key="q:pottery", masters=masters, auto_release_time=30)
        held.acquire()
        held.release()

    def ours_single() -> None:
        with lock("q:single"):
            pass

    cases = {
        "ours Redlock N=5": ours,
        "pottery Redlock N=5": pottery,
        "ours single node": ours_single,
        "raw N=5": raw_fan_out(node_urls, "q:raw"),
        "raw single node": raw_fan_out([single_url], "q:raw1"),
    }
    results["quorum"] = interleaved(cases)
