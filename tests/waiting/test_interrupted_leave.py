"""Outside review of side11 (abandoned waiters' leaves): cases that broke it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import lock, lock_all, locks
from django_redlock.testing import RedisServer

from ..locks.test_faults import _alias


@pytest.mark.parametrize("kind", ["fair", "lock_all"])
def test_an_interrupt_during_a_waiters_leave_still_leaves_through_the_hub(
    redis_factory: Callable[..., RedisServer], name: str, kind: str
) -> None:
    # A waiter interrupted twice (Ctrl-C, then Ctrl-C again while its leave hangs on a paused
    # server) hands its leave to the hub: a wake-up that still comes for its id must run it.
    # The second interrupt lands while the leave's connection is being set up, so the leave
    # never reaches the server: only the hub can take the waiter out of the queue.
    server = redis_factory()
    config: dict[str, object] = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 2.0},
    }
    with _alias("r11b", config):
        backend = locks["r11b"]
        holder = lock(name, using="r11b", ttl=30, auto_renew=False, fair=kind == "fair")
        took = threading.Thread(target=holder.acquire)
        took.start()
        took.join(10)
        assert holder.locked()
        if kind == "fair":
            waiter: Any = lock(name, using="r11b", fair=True)
        else:
            waiter = lock_all(name, name + ":other", using="r11b")
        client = server.client()
        queue = backend.queue_key(name) if kind == "fair" else backend.waiting_key(name)

        def registered() -> int:
            return int(client.llen(queue) if kind == "fair" else client.zcard(queue))

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
        assert registered() == 1  # its leave was never sent
        holder.release()  # wakes the queue's head: the interrupted waiter's id
        until = time.monotonic() + 3
        while registered() and time.monotonic() < until:
            time.sleep(0.02)
        assert registered() == 0, "the abandoned leave never ran"
        assert interrupted.value is not None
