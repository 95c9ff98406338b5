"""The single-node fast path's connections (django_redlock/fast_path.py): one owner at a time.

A thread's own connection is used by one command at a time, its reconnect included; a
handler that runs in the middle of either gets another connection. A reconnect asks a
Sentinel where the master is. Closing a backend closes every connection it made, at once,
and fails no command in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.test import override_settings
from redis.exceptions import RedisError, ResponseError

from django_redlock import LockError, fast_path, lock, locks
from django_redlock.backends import owners
from django_redlock.testing import RedisServer

from ..conftest import start_sentinel_group, stop_all


@contextmanager
def _alias(alias: str, server: RedisServer, **options: object) -> Iterator[None]:
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
              "OPTIONS": options}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config}):
        yield


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.redis_py
@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_a_handler_that_locks_while_its_thread_reconnects_uses_another_connection(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    # The thread's first command on a backend connects, and the handshake's reply is late
    # (the server is paused). A SIGALRM handler takes a lock then, on the same thread.
    server = redis_factory()
    with _alias("own", server, socket_timeout=10.0, socket_connect_timeout=10.0):
        admin = server.client()
        outcomes: list[tuple[str, object]] = []
        inner = lock(f"{name}:inner", using="own", auto_renew=False)

        def handler(signum: int, frame: object) -> None:
            try:
                outcomes.append(("answer", inner.acquire(blocking=False)))
            except LockError as exc:  # unsure: its token is kept for the next try
                outcomes.append(("lock error", exc))
            except BaseException as exc:
                outcomes.append(("wrong", exc))

        previous = signal.signal(signal.SIGALRM, handler)
        server.pause()
        resume = threading.Timer(1.0, server.resume)
        resume.start()
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            outer = lock(f"{name}:outer", using="own", auto_renew=False)
            try:
                outcomes.append(("outer", outer.acquire(blocking=False)))
            except LockError as exc:
                outcomes.append(("outer", exc))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            resume.join()
            server.resume()
        # The handler's answer (it ran once), then the thread's.
        kinds = [kind for kind, _ in outcomes]
        assert kinds in (["answer", "outer"], ["lock error", "outer"]), outcomes
        assert outcomes[0][1] is not False and outcomes[1][1] is True, outcomes
        # No lock granted to a token nobody knows: the inner lock is its own to take (again,
        # with the token kept, when its answer was unsure).
        assert inner.owned() or inner.acquire(blocking=False)
        assert inner.owned()
        inner.release()
        outer.release()
        assert not admin.keys(locks["own"].key(f"{name}:*"))


def _failover(sentinels: list[RedisServer], to: RedisServer) -> None:
    deadline = time.monotonic() + 30
    while True:  # refused (NOGOODSLAVE) until the sentinel has fresh news of the replica
        try:
            sentinels[0].client().execute_command("SENTINEL", "FAILOVER", "mymaster")
            break
        except ResponseError:
            assert time.monotonic() < deadline, "the sentinel never accepted the failover"
            time.sleep(0.2)
    while to.client().info("replication")["role"] != "master" or any(
        int(s.client().execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")[1])
        != to.port
        for s in sentinels
    ):
        assert time.monotonic() < deadline, "no failover, or not every sentinel knows it"
        time.sleep(0.1)


@pytest.mark.redis_py
def test_a_thread_s_first_command_after_a_failover_goes_to_the_new_master(name: str) -> None:
    group = start_sentinel_group()
    try:
        master, replica = group[0], group[1]
        config = {"BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
                  "LOCATION": [s.url for s in group[2:]],
                  "OPTIONS": {"service_name": "mymaster"}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "s": config}):
            with lock(f"{name}:before", using="s", auto_renew=False):
                pass  # this thread's connection is to the old master now
            _failover(group[2:], to=replica)
            master.kill()  # the old master's port refuses: its socket is closed under us
            after = lock(name, using="s", auto_renew=False)
            assert after.acquire(blocking=False)  # the first try: the sentinels were asked
            assert replica.client().exists(locks["s"].key(name))
            after.release()
    finally:
        stop_all(group)


@pytest.mark.redis_py
def test_a_command_aside_after_a_failover_skips_a_kept_connection_to_the_old_master(
    name: str,
) -> None:
    """A thread that ended after the failover left its connection, still to the old master
    (it ran no command since), to the kept set; a command aside (a handler's, while its
    thread's connection is mid-command) took it as it was, and its take was granted on the
    old master, which takes writes until the sentinels demote it (seconds)."""
    group = start_sentinel_group()
    try:
        old, new = group[0], group[1]
        config = {"BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
                  "LOCATION": [s.url for s in group[2:]],
                  "OPTIONS": {"service_name": "mymaster"}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "s": config}):
            backend, key = locks["s"], locks["s"].key(name)
            # This thread's own connection, made now: the kept one is left for the command aside.
            claim = fast_path._bound(backend.client.connection_pool).claim
            go = threading.Event()

            def earlier() -> None:
                with lock(f"{name}:earlier", using="s", auto_renew=False):
                    pass  # its connection, to the old master
                go.wait(30)  # ... until after the switch: then kept

            thread = threading.Thread(target=earlier)
            thread.start()
            _failover(group[2:], to=new)
            deadline = time.monotonic() + 10
            while backend._master != ("127.0.0.1", new.port):
                assert time.monotonic() < deadline, "the backend never moved"
                time.sleep(0.05)
            go.set()
            thread.join()
            assert old.client().info("replication")["role"] == "master"  # still writable
            assert claim.acquire(False)  # this thread's connection "mid-command": aside
            try:
                held = lock(name, using="s", auto_renew=False)
                assert held.acquire(blocking=False)
            finally:
                claim.release()
            assert (new.client().exists(key), old.client().exists(key)) == (1, 0)
            held.release()
            backend.close()
    finally:
        stop_all(group)


@pytest.mark.redis_py
def test_closing_a_backend_while_threads_run_commands(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    # No command in flight fails, and nothing is left open for the garbage collector to close
    # (it is off): the threads neither keep nor make connections on the closed pool.
    server = redis_factory()
    gc.collect()
    gc.disable()
    try:
        with _alias("own", server):
            admin = server.client()
            clients, descriptors = len(admin.client_list()), _descriptors()
            stop = threading.Event()
            errors: list[BaseException] = []
            cycles = [0] * 6

            def work(i: int) -> None:
                while not stop.is_set():
                    try:
                        with lock(f"{name}:{i}", using="own", auto_renew=False):
                            cycles[i] += 1
                    except BaseException as exc:
                        errors.append(exc)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cycles))]
            for thread in threads:
                thread.start()
            for _ in range(30):
                time.sleep(0.02)
                locks["own"].close()
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            locks["own"].close()
            assert (len(admin.client_list()), _descriptors()) <= (clients, descriptors)
            assert errors == []
            assert all(cycles), cycles
    finally:
        gc.enable()


@pytest.mark.redis_py
def test_the_debug_check_fails_loudly_on_a_second_owner(redis_server: RedisServer) -> None:
    # The suite runs with DJANGO_REDLOCK_CHECK_OWNERS=1: a connection kept twice, or one a
    # command would use while another owner has it, raises instead of mixing replies.
    assert owners.CHECK
    client = locks["default"].client  # type: ignore[attr-defined]
    assert fast_path.command(client, "ECHO", "x") == b"x"
    bound = fast_path._bound(client.connection_pool)
    conn, elsewhere = bound.connection, owners.Owner("elsewhere")
    owners.move(conn, bound.idle, elsewhere)  # as if a bug handed it on
    try:
        with pytest.raises(owners.OwnershipError, match="owned by <owner elsewhere"):
            fast_path.command(client, "ECHO", "y")
        with pytest.raises(owners.OwnershipError):
            fast_path._keep(bound.registry, conn, bound.idle)  # released by a non-owner
    finally:
        owners.move(conn, elsewhere, bound.idle)
    assert not bound.claim.locked()  # given back after the refusal
    assert fast_path.command(client, "ECHO", "z") == b"z"
    assert owners.owns(conn, bound.idle)  # (that one ran on it, not aside)


# 6 s in make test: some 30,000 replies, 70 interrupts and 350 commands run aside by the
# signal handler (where a move inside a move once deadlocked), where it asks for 100, 10, 10.
FUZZ_SECONDS = float(os.environ.get("FAST_PATH_FUZZ_SECONDS", "6"))


_STARTING: set[int] = set()  # threads in Thread.start(), while the fixture below is on


@pytest.fixture
def interruptible(monkeypatch: pytest.MonkeyPatch) -> None:
    """KeyboardInterrupts may be injected (:func:`_interrupt`): a thread starting a thread is
    spared (the new thread has its parent's id until it runs, would get the exception, and
    Thread.start() would wait for it for ever), and an exception that lands in a ``__del__``
    or a thread's last line is counted as dropped, not reported by pytest's hooks (which a
    second one can interrupt)."""
    start = threading.Thread.start

    def starting(thread: threading.Thread) -> None:
        _STARTING.add(threading.get_ident())
        try:
            start(thread)
        finally:
            _STARTING.discard(threading.get_ident())

    monkeypatch.setattr(threading.Thread, "start", starting)
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)


def _interrupt(thread: threading.Thread) -> None:
    """A KeyboardInterrupt in ``thread``, at whatever line it is on."""
    ident = thread.ident
    if ident is None or ident in _STARTING or not thread.is_alive():
        return  # (an ended thread's id may be reused)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt)
    )


def _interrupted(work: Callable[[], None], stop: threading.Event) -> Callable[[], None]:
    """``work`` over and over until ``stop``, through KeyboardInterrupts at any line."""

    def loop() -> None:
        while True:
            try:
                while True:  # (its jump back is inside the try, where one may land too)
                    if stop.is_set():
                        return
                    with contextlib.suppress(KeyboardInterrupt):
                        work()
            except KeyboardInterrupt:  # landed outside work()
                pass

    return loop


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
@pytest.mark.usefixtures("interruptible")
def test_fuzz_pauses_interrupts_and_kills(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """4 threads send commands and take locks while the server is paused 5-150 ms at random
    (replies time out at 100 ms), its clients are killed, and KeyboardInterrupts land in the
    threads at any line; the main thread's SIGALRM handler sends commands in the middle of
    the main thread's own. Every reply is the one to its own request, no unexpected error,
    descriptors bounded, and everything works after."""
    server = redis_factory()
    with _alias("fuzz", server, socket_timeout=0.1, socket_connect_timeout=0.5):
        client = locks["fuzz"].client  # type: ignore[attr-defined]
        admin = server.client(socket_timeout=5)
        gc.collect()
        start_fds, most_fds = _descriptors(), [0]
        stop = threading.Event()
        wrong: list[object] = []
        counts = {"replies": 0, "acquired": 0, "interrupted": 0, "unavailable": 0, "aside": 0}
        expected = (KeyboardInterrupt, LockError, RedisError, OSError)

        def one_round(i: int, rng: random.Random) -> None:
            tag = f"{i}:{rng.random()}"
            choice = rng.random()
            if choice < 0.4:
                reply = fast_path.command(client, "ECHO", tag)
                if reply != tag.encode():
                    wrong.append(("echo", tag, reply))
            elif choice < 0.6:
                replies = fast_path.commands(client, [("ECHO", tag), ("ECHO", tag + "b")])
                if replies != [tag.encode(), (tag + "b").encode()]:
                    wrong.append(("echo many", tag, replies))
            else:
                held = lock(f"{name}:{i}", using="fuzz", ttl=1, auto_renew=False)
                if held.acquire(blocking=False):
                    counts["acquired"] += 1
                    if not held.owned():  # answered: it must agree with the acquire
                        wrong.append(("not owned after acquire", tag))
                    held.release()
            counts["replies"] += 1

        def worker(i: int) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                try:
                    try:
                        one_round(i, rng)
                    except expected as exc:
                        key = "interrupted" if isinstance(exc, KeyboardInterrupt) else "unavailable"
                        counts[key] += 1
                    except BaseException as exc:
                        wrong.append(("raised", repr(exc)))
                except KeyboardInterrupt:  # landed in the handler above
                    counts["interrupted"] += 1

        in_handler = [False]

        def handler(signum: int, frame: object) -> None:
            if in_handler[0]:  # the next alarm came while this one waits for its reply
                return
            in_handler[0] = True
            tag = f"alarm:{time.monotonic()}"
            try:
                reply = fast_path.command(client, "ECHO", tag)
                counts["aside"] += 1
                if reply != tag.encode():
                    wrong.append(("aside echo", tag, reply))
            except (RedisError, OSError):
                pass
            except BaseException as exc:
                wrong.append(("aside raised", repr(exc)))
            finally:
                in_handler[0] = False

        def chaos() -> None:
            rng = random.Random(FUZZ_SECONDS)
            while not stop.is_set():
                action = rng.random()
                if action < 0.35:
                    server.pause()
                    time.sleep(rng.uniform(0.005, 0.150))
                    server.resume()
                elif action < 0.45:
                    with contextlib.suppress(RedisError):
                        admin.client_kill_filter(_type="normal", skipme=True)
                else:
                    _interrupt(rng.choice(workers))
                most_fds[0] = max(most_fds[0], _descriptors())
                time.sleep(rng.uniform(0.005, 0.03))

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in workers:
            thread.start()
        agent = threading.Thread(target=chaos)
        previous = signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.007, 0.007)
        agent.start()
        rng = random.Random(0)
        try:
            ends = time.monotonic() + FUZZ_SECONDS
            while time.monotonic() < ends:  # the main thread's own commands, interrupted
                with contextlib.suppress(RedisError, OSError):
                    tag = f"main:{rng.random()}"
                    reply = fast_path.command(client, "ECHO", tag)
                    if reply != tag.encode():
                        wrong.append(("main echo", tag, reply))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            stop.set()
            agent.join(timeout=30)
            server.resume()
            for thread in workers:
                thread.join(timeout=30)
        assert not agent.is_alive() and not any(thread.is_alive() for thread in workers)
        assert wrong == [], wrong[:5]
        assert counts["replies"] > 100 and counts["interrupted"] > 10 and counts["aside"] > 10
        assert most_fds[0] <= start_fds + 4 + 1 + fast_path.SPARES + 8, (most_fds, start_fds)
        # Everything works after, and closing leaves nothing open.
        for i in range(4):
            with lock(f"{name}:{i}", using="fuzz", ttl=5, auto_renew=False, timeout=5) as held:
                assert held.owned()
        assert fast_path.command(client, "ECHO", "after") == b"after"
        locks["fuzz"].close()
        # A socket put aside by an interrupted thread is closed as its last reference goes.
        deadline = time.monotonic() + 3
        while _descriptors() > start_fds + 1 and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert _descriptors() <= start_fds + 1, (start_fds, _descriptors())
        print(counts)


@pytest.mark.usefixtures("interruptible")
def test_interrupts_never_use_up_a_sentinel_backend_s_connections(
    sentinel_group: list[RedisServer], name: str
) -> None:
    # Lock commands run on each thread's own connection: no permit of max_connections is
    # taken per command, so none is lost when an interrupt lands while it is taken or given
    # back (one lost was a BackendUnavailable "all 1 connections busy" on every later call).
    config = {"BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
              "LOCATION": [s.url for s in sentinel_group[2:]],
              "OPTIONS": {"service_name": "mymaster", "max_connections": 1,
                          "socket_timeout": 0.5}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "s1": config}):
        stop = threading.Event()

        def work() -> None:
            held = lock(name, using="s1", ttl=1, auto_renew=False)
            with contextlib.suppress(LockError):
                if held.acquire(blocking=False):
                    held.release()

        worker = threading.Thread(target=_interrupted(work, stop))
        worker.start()
        try:
            for _ in range(2500):
                time.sleep(random.uniform(0.0005, 0.003))
                _interrupt(worker)
        finally:
            stop.set()
            worker.join(timeout=30)
        # A new client (the gate is the backend's): an interrupt can also break a connection
        # of redis-py's own pools to the sentinels, for good (an AttributeError on each
        # later discovery): not this test's subject.
        locks["s1"].close()
        for i in range(3):
            other = lock(f"{name}:{i}", using="s1", auto_renew=False)
            assert other.acquire(blocking=False)
            other.release()


@pytest.mark.redis_py
def test_an_uncontended_cycle_reaches_the_packer_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every argument of an acquire's and a release's EVALSHA is made as text (the key
    count, the TTL, the wait), so the packer takes them as they are: nothing converted on
    every call, and no number for hiredis to convert (see wire.texts)."""
    from django_redlock import wire

    sent: list[tuple[object, ...]] = []
    pack = wire.pack

    def recording(conn: object, args: tuple[object, ...]) -> object:
        sent.append(args)
        return pack(conn, args)

    monkeypatch.setattr(wire, "pack", recording)
    with lock("fast:text"):
        pass
    with lock("fast:text", blocking=False):
        pass
    scripts = [args for args in sent if args[0] == "EVALSHA"]
    assert len(scripts) >= 4  # and again after a NOSCRIPT, if the server had to load them
    for args in scripts:
        assert all(type(arg) is str for arg in args), args


def test_an_interrupt_at_any_line_of_an_op_leaves_no_deadline_behind(
    redis_server: RedisServer, name: str
) -> None:
    """An op's deadline (its round trips share one socket timeout) is put back as it ends; an
    interrupt between the set and the put back left it standing, and every later command of
    the thread failed at once ("the call's socket timeout ran out"): 50 acquires in a row in
    the fault campaign (seed 1711), every server up. Left behind, it stands no more once its
    call is off the stack (the exception kept alive too: tests/interrupts/
    test_read_deadline_interrupts.py)."""
    from django_redlock.backends.redis import RedisBackend

    from ..support.line_interrupts import LineInterrupter, every_point, interrupted

    watched = {RedisBackend.execute.__code__, fast_path.begin_call.__code__,
               fast_path.end_call.__code__}  # fmt: skip
    runs = iter(range(1000))

    def case(tracer: LineInterrupter) -> None:
        run = next(runs)
        with _alias("left", redis_server, socket_timeout=0.5):
            interrupted(
                lambda: lock(f"{name}:{run}", using="left", ttl=1).acquire(blocking=False),
                tracer,
            )  # (its Interrupt let go here)
            time.sleep(0.6)  # past any deadline that op set
            after = lock(f"{name}:{run}:after", using="left", ttl=1)
            assert after.acquire(blocking=False), tracer.fired
            after.release()

    points = every_point(
        case, lambda at: LineInterrupter(at, watched, lambda frame: frame.f_code in watched)
    )
    assert len(points) > 5, points
