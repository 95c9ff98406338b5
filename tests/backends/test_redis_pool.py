"""Single Redis's (RedisBackend's) connection pool on the pool's path (a tracer, a retry
option) with max_connections: its renewals, and an interrupt in its checkout or give-back,
with the suite's redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from django_redlock import fast_path, lock, locks, wire
from django_redlock.testing import RedisServer

from ..support.line_interrupts import LineInterrupter, every_point, interrupted


@contextmanager
def redis_alias(server: RedisServer, **options: Any) -> Iterator[Any]:
    """Backend "r": single Redis on ``server`` with ``options``, closed after."""
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": options,
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "r": config}):
        backend = locks["r"]
        try:
            yield backend
        finally:
            backend.close()


def _traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracer's pass-through wrapper on redis-py's commands (Sentry, ddtrace, OTel install
    one): commands go through the pool, not the thread's own connection."""
    own = redis.Redis.execute_command

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        return own(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)


def test_busy_callers_never_hold_up_the_watchdog_s_renewals(
    redis_server: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's one connection checked out by a caller while a hold's TTL runs: its
    renewals waited for it a socket timeout per try ("No connection available."), and the
    hold expired on a healthy Redis while its owner held it."""
    _traced(monkeypatch)
    with redis_alias(redis_server, socket_timeout=0.5, max_connections=1) as backend:
        held = lock(name, using="r", ttl=1.0)
        assert held.acquire(blocking=False)
        pool = backend.client.connection_pool
        busy = pool.get_connection()  # a caller mid-command, for the whole test
        try:
            lowest = 1000
            started = time.monotonic()
            while time.monotonic() - started < 2.5:  # the TTL, more than twice over
                lowest = min(lowest, redis_server.client().pttl(backend.key(name)))
                time.sleep(0.05)
        finally:
            pool.release(busy)
        assert lowest > 0, f"the held lock's key expired (PTTL {lowest})"
        assert held.owned()
        held.release()


def _outcome(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _path(where: str) -> set[Any]:
    """The pool's functions of a checkout or a give-back (redis-py's, wire's and fast_path's,
    whichever are there): their lines, and the entries of what they call, are the points."""
    names = (
        ("get_connection", "get", "_handed_over")
        if where == "checkout"
        else ("release", "put", "put_nowait")
    )
    found = set()
    pools = (redis.BlockingConnectionPool, wire.WaitingPool, fast_path.CallPool)
    for cls in (*pools, wire._Slots, fast_path._CallSlots):
        # (CallPool's hand-over hook: its lines run before the queue's record lets go)
        for each in (*names, "_handed_over") if cls is fast_path.CallPool else names:
            function = vars(cls).get(each)
            while function is not None:  # redis-py's own, and its decorators' (deprecated_args)
                found.add(function.__code__)
                function = getattr(function, "__wrapped__", None)
    return found


@pytest.mark.parametrize(
    ("where", "busy"),
    [("checkout", False), ("checkout", True), ("give-back", False)],
    ids=["checkout", "checkout waiting", "give-back"],
)
def test_a_time_limit_anywhere_in_the_pool_loses_no_connection_and_hangs_nothing(
    redis_server: RedisServer,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    busy: bool,
) -> None:
    """An asynchronous exception (a soft time limit's) at each line of the pool's checkout
    (the connection free, or held by a caller that gives it back while the operation waits)
    or give-back, one at a time; then the next operation, at once. redis-py's plain blocking
    pool lost the connection to one after its queue's get() (every later operation "No
    connection available." on a healthy Redis), and its queue's Condition left the queue's
    lock held to one at its ``__exit__``'s entry (every later operation hung). The hand-over
    cleared the thread's record a line before it returned the connection: one there lost it
    until a caller had waited its whole timeout."""
    _traced(monkeypatch)
    with redis_alias(redis_server, socket_timeout=1.0, max_connections=1) as backend:
        assert backend.is_locked(f"{name}:warm") is False
        pool = backend.client.connection_pool
        give_back = redis.BlockingConnectionPool.release.__code__

        def armed(frame: Any) -> bool:  # a give-back: from redis-py's own (ours recorded it)
            return where == "checkout" or frame.f_code is give_back

        def case(tracer: LineInterrupter) -> None:
            caller = None
            if busy:  # it has the connection, and gives it back while the operation waits
                taken = pool.get_connection()
                caller = threading.Timer(0.02, pool.release, (taken,))
                caller.start()
            interrupted(lambda: backend.is_locked(name), tracer)
            if caller is not None:
                caller.join(5)
            cut = tracer.fired
            assert not pool.pool.mutex.locked(), f"cut at {cut}: the pool's queue lock held"
            later: list[Any] = []
            started = time.monotonic()
            check = threading.Thread(
                target=lambda: later.append(_outcome(backend.is_locked, name)), daemon=True
            )
            check.start()
            check.join(3)
            took = time.monotonic() - started
            assert later == [False], f"cut at {cut}: the next operation: {later or 'hangs'}"
            if where == "checkout":  # (a give-back cut as it lists: found by a sweep)
                assert took < 0.5, f"cut at {cut}: the next operation waited {took:.2f}s"
            assert len(pool.pool.queue) == 1, f"cut at {cut}: {len(pool.pool.queue)} of 1 back"

        every_point(case, lambda at: LineInterrupter(at, _path(where), armed))


@pytest.mark.parametrize("where", ["checkout", "give-back"])
def test_a_time_limit_in_the_pool_never_lists_a_connection_another_thread_holds(
    redis_server: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An asynchronous exception at each line of the pool's checkout or give-back, another
    thread checking out as the interrupted one's give-back starts (a thread switch there).
    The queue's record was written a line before the connection left the list (and cleared a
    line after it was listed again): the mutex let go as the exception unwound, the other
    thread took that same connection, and the give-back, not finding it listed, listed it
    again while the other used it; the next checkout got it too (one socket, two holders,
    their replies crossed)."""
    _traced(monkeypatch)
    with redis_alias(redis_server, socket_timeout=0.5, max_connections=2) as backend:
        assert backend.is_locked(f"{name}:warm") is False
        pool = backend.client.connection_pool
        own_give_back = wire.WaitingPool._give_back
        others: list[Any] = []

        def give_back(self: Any, *args: Any) -> None:
            if threading.current_thread() is threading.main_thread() and not others:
                other = threading.Thread(target=lambda: others.append(pool.get_connection()))
                other.start()
                other.join(3)
            own_give_back(self, *args)

        monkeypatch.setattr(wire.WaitingPool, "_give_back", give_back)
        give_back_code = redis.BlockingConnectionPool.release.__code__

        def armed(frame: Any) -> bool:
            return where == "checkout" or frame.f_code is give_back_code

        def case(tracer: LineInterrupter) -> None:
            others.clear()
            interrupted(lambda: backend.is_locked(name), tracer)
            cut = tracer.fired
            for other in others:
                listed = [each for each in pool.pool.queue if each is other]
                assert not listed, f"cut at {cut}: listed while another thread holds it"
                mine = pool.get_connection()
                try:
                    assert mine is not other, f"cut at {cut}: one connection, two holders"
                finally:
                    pool.release(mine)
                    pool.release(other)

        every_point(case, lambda at: LineInterrupter(at, _path(where), armed))


def _first_line_after(code: Any, text: str) -> int:
    lines, first = inspect.getsourcelines(code)
    return next(first + i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("where", ["caller", "release"])
def test_a_connection_lost_between_the_hand_over_and_the_give_back_comes_back(
    redis_server: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An asynchronous exception after the pool handed the connection over and before its
    give-back was recorded: redis-py's ``_execute_command`` holds it in a local only before
    its ``try:`` ("caller"), and so does the release's first line ("release"). With
    max_connections=1 it was lost for good: every later operation on that healthy Redis
    "No connection available.". It comes back once a caller waited its timeout."""
    _traced(monkeypatch)
    with redis_alias(redis_server, socket_timeout=0.5, max_connections=1) as backend:
        assert backend.is_locked(f"{name}:warm") is False
        if where == "caller":
            code = redis.client.Redis._execute_command.__code__
            after = _first_line_after(code, "get_connection(")
        else:
            code = wire.WaitingPool.release.__code__
            after = code.co_firstlineno
        tracer = LineInterrupter(1, {code}, lambda frame: frame.f_lineno > after)
        assert interrupted(lambda: backend.is_locked(name), tracer) is not None
        later: list[Any] = []
        check = threading.Thread(
            target=lambda: later.append(_outcome(backend.is_locked, name)), daemon=True
        )
        check.start()
        check.join(3)
        assert later == [False], f"cut at {tracer.fired}: the next operation: {later or 'hangs'}"
        assert backend.is_locked(name) is False  # at once from then on


def test_a_waiter_gets_the_connection_before_its_giver_takes_it_again(
    redis_server: RedisServer, name: str
) -> None:
    """max_connections=1, a thread that gives the connection back and takes it again at once
    (back to back operations), another waiting for it: the give-back woke the waiter, but the
    giver took the connection again before the waiter ran, every time, and the waiter failed
    at its timeout ("No connection available.") on a healthy Redis. A give-back hands it to
    the first waiter."""
    with redis_alias(redis_server, socket_timeout=0.5, max_connections=1) as backend:
        assert backend.is_locked(f"{name}:warm") is False
        pool = backend.client.connection_pool
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                connection = pool.get_connection()
                time.sleep(0.02)  # its command
                pool.release(connection)

        giver = threading.Thread(target=busy, daemon=True)
        giver.start()
        try:
            time.sleep(0.05)
            started = time.monotonic()
            got = _outcome(pool.get_connection)
            took = time.monotonic() - started
            if not isinstance(got, str):
                pool.release(got)
        finally:
            stop.set()
            giver.join(5)
        assert not isinstance(got, str), f"after {took:.3f}s: {got}"
        assert took < 0.2, f"waited {took:.3f}s behind a busy thread"


def test_a_caller_queued_behind_a_silent_server_errs_within_its_socket_timeout(
    redis_factory: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused server, the pool's two connections held by threads calling back to back (the
    campaign's traced client, seed 2011): a third caller waited for a connection until a
    holder's command timed out, then got that connection, closed, and spent a whole socket
    timeout more in its reconnect's handshake (or its command): BackendUnavailable nearly two
    socket timeouts after its call began (three in the campaign). What is left of its call's
    socket timeout is all a connection handed over closed gets."""
    _traced(monkeypatch)
    server = redis_factory()
    timeout = 0.5
    with redis_alias(server, socket_timeout=timeout, max_connections=2) as backend:
        for _ in range(2):
            assert backend.is_locked(f"{name}:warm") is False
        stop = threading.Event()

        def side(n: int) -> None:
            while not stop.is_set():
                _outcome(backend.is_locked, f"{name}:side{n}")

        sides = [threading.Thread(target=side, args=(n,), daemon=True) for n in range(2)]
        took: list[tuple[str, float, Any]] = []
        server.pause()
        try:
            for each in sides:
                each.start()
            time.sleep(0.05)  # both connections held, each waiting for its reply
            for how in ("locked", "acquire") * 3:
                started = time.monotonic()
                if how == "locked":
                    got = _outcome(backend.is_locked, name)
                else:
                    got = _outcome(lock(name, using="r", ttl=5).acquire, False)
                took.append((how, round(time.monotonic() - started, 3), got))
                time.sleep(0.05)
        finally:
            stop.set()
            server.resume()
            for each in sides:
                each.join(5)
        assert all(str(got).startswith("BackendUnavailable") for _, _, got in took), took
        # The median: one spoilt by a scheduling stall (2 cores, other processes) is no
        # finding; each call took nearly two socket timeouts before.
        times = sorted(t for _, t, _ in took)
        assert times[len(times) // 2] < 1.4 * timeout, took
        assert times[-1] < 2.5 * timeout, took
        assert backend.is_locked(name) is False  # the server back: answered again


def test_an_asyncio_burst_on_a_silent_server_errs_within_about_a_socket_timeout(
    redis_factory: Any, name: str
) -> None:
    """asyncio, a paused server, max_connections=2, 20 tasks of ``aacquire(blocking=False)``:
    each holder's command timed out and its connection, closed, was given back, which
    restarted every queued task's wait (``AsyncPool``'s timeout counts from the last
    give-back). The tasks failed in pairs, the last after ten socket timeouts (5 s for 0.5
    s). A connection given back closed is no progress: every task errs within about two (a
    waiter handed a closed one still spends a socket timeout on it)."""
    server = redis_factory()
    timeout = 0.5
    with redis_alias(
        server, socket_timeout=timeout, socket_connect_timeout=timeout, max_connections=2
    ):

        async def one(k: int, started: float) -> tuple[float, Any]:
            try:
                got: Any = await lock(f"{name}:{k}", using="r", ttl=30).aacquire(blocking=False)
            except Exception as exc:  # what each task got, asserted below
                got = exc
            return time.monotonic() - started, got

        async def burst() -> list[tuple[float, Any]]:
            warm = [lock(f"{name}:w{k}", using="r") for k in range(2)]
            assert all(await asyncio.gather(*(w.aacquire(blocking=False) for w in warm)))
            await asyncio.gather(*(w.arelease() for w in warm))  # both connections made
            server.pause()
            try:
                started = time.monotonic()
                return await asyncio.gather(*(one(k, started) for k in range(20)))
            finally:
                server.resume()

        got = asyncio.run(burst())
    assert all(type(g).__name__ == "BackendUnavailable" for _, g in got), got
    slowest = max(t for t, _ in got)
    # About two socket timeouts, and slack for a loaded machine (the defect took ten).
    assert slowest < 3.5 * timeout, f"the last task erred after {slowest:.2f}s: {got}"


def test_a_caller_handed_a_connection_late_by_a_healthy_busy_pool_gets_its_answer(
    redis_server: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait for a busy pool is not an outage: a connection handed over most of a socket
    timeout into the call, open or closed (its holder's command was reset) still serves
    the caller's command on a server that answers."""
    _traced(monkeypatch)
    timeout = 0.3
    with redis_alias(redis_server, socket_timeout=timeout, max_connections=1) as backend:
        assert backend.is_locked(f"{name}:warm") is False
        pool = backend.client.connection_pool
        for closed in (False, True):
            held = pool.get_connection()

            def give_back(connection: Any = held, closed: bool = closed) -> None:
                time.sleep(timeout - 0.04)
                if closed:
                    connection.disconnect()
                pool.release(connection)

            giver = threading.Thread(target=give_back, daemon=True)
            giver.start()
            got = _outcome(backend.is_locked, name)
            giver.join(5)
            assert got is False, f"closed={closed}: {got}"


def _whole(pool: Any, held: list[Any], cut: str | None) -> None:
    """Every position of ``pool`` a connection or a free slot, its queue's lock free, and
    each of ``held`` still in redis-py's ``_connections`` (what ``disconnect()`` closes)."""
    slots = pool.pool
    assert not slots.mutex.locked(), f"cut at {cut}: the pool's queue lock held"
    for each in slots.items:
        assert type(each) is wire._Slot or isinstance(each, redis.connection.AbstractConnection), (
            f"cut at {cut}: a position holds {each!r}"
        )
    for each in held:
        assert any(c is each for c in pool._connections), f"cut at {cut}: a held one dropped"


def _lost_comes_back(pool: Any, cut: str | None) -> None:
    """Of the pool's two connections, one held and one lost (its holder's reference dropped
    with nothing given back): a checkout gets one all the same, after its one wait."""
    kept = pool.get_connection()
    pool.get_connection()  # lost at once: nothing keeps it
    try:
        again = pool.get_connection()
    except redis.exceptions.ConnectionError as exc:
        raise AssertionError(f"cut at {cut}: a lost connection never came back ({exc})") from exc
    assert again is not kept
    pool.release(again)
    pool.release(kept)
    assert len(pool.pool.queue) == 2, f"cut at {cut}: {len(pool.pool.queue)} of 2 listed"


@pytest.mark.parametrize("lost", [False, True], ids=["both held", "one lost"])
def test_a_time_limit_at_any_line_of_a_sweep_leaves_the_pool_whole(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    """An asynchronous exception at each line of the sweep a waiter runs once it waited its
    whole timeout (the pool's two connections held, or one lost). The sweep set a flag that
    only its last line cleared, and marked each position it looked at (taking the connection
    out of redis-py's ``_connections``) before its ``try:``: one cut left the flag set for
    good (every later sweep returned at once: the next connection lost was lost forever,
    "No connection available." on a healthy Redis), a position marked, a held connection
    out of ``_connections``. Whatever line is cut: the pool whole, and a connection lost
    after it comes back."""
    sweep = wire._Slots.sweep.__code__
    # (the queue's own functions: what the sweep calls of them is part of it)
    watched = {each.__code__ for each in vars(wire._Slots).values() if inspect.isfunction(each)}
    # One landing in a finalizer the sweep's collection ran is ignored (printed); pytest's
    # own hook kept it, and the frames of its traceback the connections they named.
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)

    def case(tracer: LineInterrupter) -> None:
        # (a short wait for the pool: two of them at each of ~100 points)
        pool = wire.WaitingPool(
            max_connections=2, timeout=0.03, host="127.0.0.1", port=redis_server.port,
            socket_timeout=2,
        )  # fmt: skip
        try:
            held = [pool.get_connection()]
            if lost:
                pool.get_connection()  # lost: nothing keeps it
            else:
                held.append(pool.get_connection())

            def checkout() -> None:
                with contextlib.suppress(redis.exceptions.ConnectionError):  # (both held)
                    pool.release(pool.get_connection())  # (found: the lost one's slot)

            interrupted(checkout, tracer)
            _whole(pool, held, tracer.fired)
            for each in held:
                pool.release(each)
            held = []
            _lost_comes_back(pool, tracer.fired)
        finally:
            pool.disconnect()

    every_point(case, lambda at: LineInterrupter(at, watched, lambda f: f.f_code is sweep))


@pytest.mark.parametrize("lost", [False, True], ids=["held", "lost"])
def test_a_sweep_never_runs_a_full_collection(redis_server: RedisServer, lost: bool) -> None:
    """A waiter that waited its whole timeout looks for a connection nobody holds: it ran a
    full ``gc.collect()`` whenever every connection out was still there (always, the pool's
    connections in use), holding the GIL as long as the heap is big (0.4 s for a million
    objects: every thread of the process stopped, each timed-out caller's error that much
    later). It collects the young generations only, and a lost connection (redis-py 8's are
    a cycle with their maintenance handlers, in the oldest generation) still comes back."""
    pool = wire.WaitingPool(
        max_connections=1, timeout=0.1, host="127.0.0.1", port=redis_server.port,
        socket_timeout=2,
    )  # fmt: skip
    generations: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    try:
        held = pool.get_connection()
        if lost:
            held = None  # lost: nothing keeps it
        gc.disable()  # (only the sweep's own collections)
        gc.callbacks.append(seen)
        try:
            got = _outcome(pool.get_connection)
        finally:
            gc.callbacks.remove(seen)
            gc.enable()
        assert 2 not in generations, f"collections run: {generations}"
        if lost:
            assert not isinstance(got, str), got
            pool.release(got)
        else:
            assert isinstance(got, str) and "No connection available" in got, got
            pool.release(held)
    finally:
        pool.disconnect()
