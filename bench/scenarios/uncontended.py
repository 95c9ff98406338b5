"""Uncontended acquire+release on one Redis: ours against the raw floor, redis-py's Lock
and python-redis-lock, and our round trips per cycle."""

from __future__ import annotations

import secrets
from typing import Any

from bench.harness import RELEASE_LUA, interleaved, paired


def uncontended(results: dict[str, Any]) -> None:
    import redis
    import redis_lock

    from django_redlock import lock, locks

    backend = locks["default"]
    client = backend.client  # type: ignore[attr-defined]
    plain = redis.Redis.from_url(backend.location)  # type: ignore[arg-type]
    sha = client.script_load(RELEASE_LUA)

    def ours() -> None:
        with lock("u:ours"):
            pass

    def raw() -> None:
        token = secrets.token_urlsafe(16)
        client.set("u:raw", token, nx=True, px=30000)
        client.evalsha(sha, 1, "u:raw", token)

    def redis_py() -> None:
        held = plain.lock("u:redis-py", timeout=30)
        held.acquire()
        held.release()

    def python_redis_lock() -> None:
        held = redis_lock.Lock(plain, "u:prl", expire=30)
        held.acquire()
        held.release()

    before = backend.round_trips
    ours_trips_cycles = 200
    for _ in range(ours_trips_cycles):
        ours()
    trips = (backend.round_trips - before) / ours_trips_cycles
    rates = interleaved({"ours": ours, "raw SET NX PX + EVALSHA": raw, "redis-py Lock": redis_py,
                         "python-redis-lock": python_redis_lock})  # fmt: skip
    # Ours over each anchor, neighbouring short turns paired: steadier on a loaded machine.
    pairs = paired({"ours": ours, "redis-py Lock": redis_py, "raw SET NX PX + EVALSHA": raw},
                   "ours")  # fmt: skip
    results["uncontended"] = {"rates": rates, "round_trips": trips, "paired": pairs}
