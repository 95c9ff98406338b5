"""Sentinel's max_connections gate (the pool's path: a tracer, a retry option) and close(),
with real servers the suite starts."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from django_redlock import lock, locks
from django_redlock.testing import RedisServer

from .test_sentinel import sentinel_alias


def _traced(monkeypatch: pytest.MonkeyPatch, hold: threading.Event) -> None:
    """A tracer's wrapper on redis-py's commands (Sentry, ddtrace, OTel install one): the
    pool's path. Commands of threads named "busy*" wait for ``hold`` (a slow caller)."""
    own = redis.Redis.execute_command

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("busy"):
            hold.wait(10)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)


def test_busy_callers_never_hold_up_the_watchdog_s_renewals(
    sentinel_group: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every max_connections permit taken by a caller (mid-command) while a hold's TTL runs:
    its renewals waited for a permit a socket timeout per try, and the hold expired on a
    healthy master while its owner held it."""
    hold = threading.Event()
    _traced(monkeypatch, hold)
    master = sentinel_group[0]
    with sentinel_alias(sentinel_group, socket_timeout=0.5, max_connections=1):
        backend = locks["s"]
        held = lock(name, using="s", ttl=1.0)
        assert held.acquire(blocking=False)
        busy = threading.Thread(
            target=lambda: lock(f"{name}:busy", using="s").acquire(blocking=False),
            name="busy-caller", daemon=True,
        )  # fmt: skip
        busy.start()  # it takes the one permit, and keeps it while its command waits
        try:
            lowest = 1000
            started = time.monotonic()
            while time.monotonic() - started < 2.5:  # the TTL, more than twice over
                lowest = min(lowest, master.client().pttl(backend.key(name)))
                time.sleep(0.05)
        finally:
            hold.set()
            busy.join(5)
        assert lowest > 0, f"the held lock's key expired (PTTL {lowest})"
        assert held.owned()  # (a caller: asked once the permit is free)
        held.release()
        backend.close()
