"""A burst of asyncio tasks on a healthy Redlock cluster: each node's connects wait their
turn (a few at a time, redis.py ``AsyncPool``), so a connect's deadline counts from when it
is really tried, not from a queue behind hundreds of others on one event loop; and a node
that does not connect is still reported within about a connect timeout."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from django_redlock import QuorumNotReached, lock, locks
from django_redlock.backends.redis import LOOP_GRACE_MAX
from django_redlock.exceptions import LockError
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias, running_long_since
from .test_redlock_io import alias_at


def test_a_burst_of_tasks_on_fresh_connections_all_acquire(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """100 tasks of a fresh event loop (no connection yet), ``asyncio.gather`` of
    ``aacquire(blocking=False)`` of free names, default options (a 0.1 s connect timeout).
    Before: 30-95 of 100 got QuorumNotReached ("Timeout connecting to server" on every
    node): about 300 connects started at once, each one's 0.1 s counting the time the loop
    spent on all the others. Now every one acquires."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)  # (a node's first 2 s: a new name's fences are lifted)
    with quorum_alias("burst", servers):
        errors: list[BaseException] = []

        async def one(k: int) -> bool:
            try:
                return await lock(f"{name}:{k}", using="burst", ttl=30).aacquire(blocking=False)
            except LockError as exc:
                errors.append(exc)
                return False

        async def burst() -> list[bool]:
            return await asyncio.gather(*(one(k) for k in range(100)))

        started = time.monotonic()
        got = asyncio.run(burst())
        took = time.monotonic() - started
        assert not errors, f"{len(errors)} of 100 failed, the first: {errors[0]}"
        assert all(got), f"{got.count(False)} refused"
        assert took < 10, f"the burst took {took:.1f}s"


@contextlib.contextmanager
def unreachable() -> Iterator[str]:
    """A URL whose connects never complete: a listener whose backlog is full (the kernel
    drops further SYNs, as a host that does not answer)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fill = [socket.create_connection(("127.0.0.1", port))]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for sock in [*fill, listener]:
            sock.close()


def test_nodes_that_do_not_connect_are_still_reported_within_the_connect_timeout(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """Two of three nodes never connect: a lone aacquire on an idle loop is refused within
    about the connect timeout (the loop's grace is for a loop busy elsewhere), and a burst
    of 100 tasks within it and the grace's bound, not one connect timeout after another."""
    server = redis_factory()
    with (
        unreachable() as one,
        unreachable() as two,
        alias_at("unreachable", [server.url, one, two], socket_connect_timeout=0.5),
    ):

        async def one_try(k: int) -> BaseException | bool:
            try:
                return await lock(f"{name}:{k}", using="unreachable").aacquire(blocking=False)
            except LockError as exc:
                return exc

        started = time.monotonic()
        alone = asyncio.run(one_try(-1))
        took = time.monotonic() - started
        assert isinstance(alone, QuorumNotReached), alone
        assert "Timeout connecting" in str(alone), alone
        assert 0.45 < took < 0.5 + 1.0, f"refused after {took:.2f}s"  # (a loaded machine's stalls)

        async def burst() -> list[BaseException | bool]:
            return await asyncio.gather(*(one_try(k) for k in range(100)))

        started = time.monotonic()
        got = asyncio.run(burst())
        took = time.monotonic() - started
        assert all(isinstance(g, QuorumNotReached) for g in got), got
        # Each of a call's waits may get the loop's lateness (LOOP_GRACE_MAX at most): the
        # connects', then the healthy node's undo read (7.9 s beside make test's other files).
        bound = 0.5 + 2 * LOOP_GRACE_MAX + 1
        assert took < bound, f"the burst was refused after {took:.2f}s"


def test_replies_that_came_while_the_loop_was_busy_count(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """Three healthy nodes hold their replies 50 ms (``CLIENT PAUSE``); 10 ms into an
    ``aacquire()`` (then an ``arelease()``) another task blocks the loop for 0.3 s, three
    node timeouts. The replies are in the sockets when the loop runs again. Before: the
    reads' timeouts fired first, QuorumNotReached ("only 0 of 3 nodes answered"), the
    release too though it had deleted the key on every node. Now both answer."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("stalled", servers):
        hold = lock(name, using="stalled", ttl=30, auto_renew=False)

        def replies_late() -> None:
            for server in servers:
                server.client().execute_command("CLIENT", "PAUSE", "50")

        async def stalled(call: Callable[[], Any]) -> Any:
            async def staller() -> None:
                await asyncio.sleep(0.01)
                time.sleep(0.3)  # the loop runs nothing else meanwhile

            replies_late()
            busy = asyncio.create_task(staller())
            try:
                return await call()
            finally:
                await busy

        async def main() -> tuple[bool, list[int]]:
            warm = lock(f"{name}:warm", using="stalled", ttl=30, auto_renew=False)
            assert await warm.aacquire(blocking=False)  # connected, scripts loaded
            await warm.arelease()
            got = await stalled(lambda: hold.aacquire(blocking=False))
            held = [server.client().exists(locks["stalled"].key(name)) for server in servers]
            await stalled(hold.arelease)
            return got, held

        got, held = asyncio.run(main())
        assert got is True and held == [1, 1, 1], (got, held)
        assert not any(server.client().exists(locks["stalled"].key(name)) for server in servers)
