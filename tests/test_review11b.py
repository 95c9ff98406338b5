"""Outside review of side11 (abandoned waiters' leaves): cases that broke it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from django_redlock import lock, locks
from django_redlock.testing import RedisServer

from .test_faults import _alias


def test_an_interrupt_during_a_fair_waiters_leave_still_leaves_through_the_hub(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    # A waiter interrupted twice (Ctrl-C, then Ctrl-C again while its leave hangs on a paused
    # server) hands its leave to the hub: a wake-up that still comes for its id must run it.
    # The second interrupt lands while the leave's connection is being set up, so the leave
    # never reaches the server: only the hub can take the waiter out of the queue.
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 2.0},
    }
    with _alias("r11b", config):
        backend = locks["r11b"]
        holder = lock(name, using="r11b", ttl=30, auto_renew=False, fair=True)
        took = threading.Thread(target=holder.acquire)
        took.start()
        took.join(10)
        assert holder.locked()
        waiter = lock(name, using="r11b", fair=True)
        client = server.client()
        queue = backend.queue_key(name)
        main = os.getpid()

        def interrupt() -> None:
            until = time.monotonic() + 10
            while not client.exists(queue) and time.monotonic() < until:
                time.sleep(0.01)
            time.sleep(0.1)
            client.client_kill_filter(_type="normal")  # the leave needs a new connection
            server.pause()
            os.kill(main, signal.SIGINT)  # in its sleep: it goes to leave
            time.sleep(0.5)
            os.kill(main, signal.SIGINT)  # while the leave's connection is set up
            time.sleep(0.3)
            server.resume()

        helper = threading.Thread(target=interrupt)
        helper.start()
        try:
            # Kept, as a logger or an error reporter keeps it: its frames stay alive, so
            # nothing of the wait is cleaned up by the garbage collector meanwhile.
            with pytest.raises(KeyboardInterrupt) as interrupted:
                waiter.acquire(timeout=20)
        finally:
            helper.join(30)
            server.resume()
        assert client.llen(queue) == 1  # its leave was never sent
        holder.release()  # wakes the queue's head: the interrupted waiter's id
        until = time.monotonic() + 3
        while client.llen(queue) and time.monotonic() < until:
            time.sleep(0.02)
        assert client.lrange(queue, 0, -1) == [], "the abandoned leave never ran"
        assert interrupted.value is not None
