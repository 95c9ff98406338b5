"""The single-node fast path's connections (django_redlock/scripts.py): one owner at a time.

A thread's own connection is used by one command at a time, its reconnect included; a
handler that runs in the middle of either gets another connection. A reconnect asks a
Sentinel where the master is. Closing a backend closes every connection it made, at once,
and fails no command in flight.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.test import override_settings
from redis.exceptions import ResponseError

from django_redlock import LockError, lock, locks
from django_redlock.testing import RedisServer

from .conftest import start_sentinel_group, stop_all


@contextmanager
def _alias(alias: str, server: RedisServer, **options: object) -> Iterator[None]:
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
              "OPTIONS": options}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config}):
        yield


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


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
