"""exit_bound's rule, on real sockets: an exit that outlives its bound has its connection's
socket shut down (the driver's blocked read ends), again each second while it runs; an exit
that ended, or whose thread is gone, is never cut (a healthy connection in later use)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from django_redlock import exit_bound


class _Wrapper:
    """What the guard reads of Django's connection wrapper: ``connection`` (its raw
    connection, with ``fileno()``) and ``alias``."""

    def __init__(self, sock: socket.socket) -> None:
        self.connection, self.alias = sock, "pair"


def _blocked_read(sock: socket.socket, out: list[Any]) -> threading.Thread:
    def read() -> None:
        started = time.monotonic()
        out.append(sock.recv(1))  # b"" once shut down
        out.append(time.monotonic() - started)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_an_exit_past_its_bound_has_its_socket_shut_down() -> None:
    mine, theirs = socket.socketpair()
    with mine, theirs:
        out: list[Any] = []
        bounded = exit_bound.Exit(_Wrapper(mine), 0.3)
        reader = _blocked_read(mine, out)
        bounded.arm()
        reader.join(5)
        bounded.ended = True
        assert out and out[0] == b"" and 0.25 < out[1] < 3, out


@pytest.mark.parametrize("how", ["ended", "thread gone"])
def test_an_exit_that_ended_or_whose_thread_is_gone_is_never_cut(how: str) -> None:
    mine, theirs = socket.socketpair()
    with mine, theirs:
        made: list[exit_bound.Exit] = []

        def exit_() -> None:
            made.append(exit_bound.Exit(_Wrapper(mine), 0.2))
            made[0].arm()
            made[0].ended = how == "ended"

        thread = threading.Thread(target=exit_)
        thread.start()
        thread.join()
        time.sleep(0.2 + exit_bound.AGAIN + 0.3)  # past the bound, and a look again
        theirs.sendall(b"x")
        assert mine.recv(1) == b"x"  # still open both ways
        mine.sendall(b"y")
        assert theirs.recv(1) == b"y"
