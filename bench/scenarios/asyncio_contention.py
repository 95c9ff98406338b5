"""200 asyncio tasks on one lock: ours against redis-py's asyncio Lock."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.harness import percentile


def asyncio_contention(results: dict[str, Any]) -> None:
    import redis.asyncio

    from django_redlock import lock, locks

    url = str(locks["default"].location)

    async def run(make: Callable[[], Any], ours: bool = False) -> dict[str, float]:
        waits: list[float] = []

        async def task() -> None:
            held = make()
            asked = time.monotonic()
            await (held.aacquire() if ours else held.acquire())
            waits.append(time.monotonic() - asked)
            await (held.arelease() if ours else held.release())

        started = time.monotonic()
        await asyncio.gather(*(task() for _ in range(200)))
        elapsed = time.monotonic() - started
        return {"per_second": 200 / elapsed, "p99_wait_ms": percentile(waits, 0.99) * 1000}

    async def redis_py() -> dict[str, float]:
        client = redis.asyncio.Redis.from_url(url, max_connections=300)
        try:
            return await run(lambda: client.lock("a:redis-py", timeout=30))
        finally:
            await client.aclose()

    rounds: dict[str, list[dict[str, float]]] = {"ours": [], "redis-py asyncio Lock": []}
    for _ in range(3):
        rounds["ours"].append(asyncio.run(run(lambda: lock("a:ours", ttl=30), ours=True)))
        rounds["redis-py asyncio Lock"].append(asyncio.run(redis_py()))
    results["asyncio"] = {
        lib: {k: statistics.median(r[k] for r in values) for k in values[0]}
        for lib, values in rounds.items()
    }
