"""Redis memory per held lock: plain, reentrant, and fair with one waiter."""

from __future__ import annotations

import threading
import time
from typing import Any


def memory(results: dict[str, Any], url: str) -> None:
    import redis

    from django_redlock import lock, locks

    client, backend = redis.Redis.from_url(url), locks["default"]

    def usage(name: str) -> int:
        keys = [backend.key(name), backend.fence_key(name), backend.queue_key(name),
                backend.deadlines_key(name)]  # fmt: skip
        return sum(client.memory_usage(k) or 0 for k in keys)

    sizes = {}
    kinds = (
        ("plain", "invoice:42", {}),  # the SPEC's example name: longer names take more
        ("reentrant", "invoice:43", {"reentrant": True}),
        ("fair", "invoice:44", {"fair": True}),
    )
    for kind, name, options in kinds:
        held = lock(name, **options)
        held.acquire()
        waiter = None
        if kind == "fair":  # a fair lock with one waiter queued
            waiter = threading.Thread(target=lambda n=name: lock(n, fair=True).acquire(timeout=3))
            waiter.start()
            time.sleep(0.3)
        sizes[kind] = usage(name)
        held.release()
        if waiter is not None:
            waiter.join()
    results["memory"] = sizes
