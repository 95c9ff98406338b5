"""Uncontended cycles on the Redlock quorum of 5 nodes: ours against pottery's Redlock."""

from __future__ import annotations

from typing import Any

from bench.harness import interleaved


def quorum(results: dict[str, Any], node_urls: list[str]) -> None:
    import redis
    from pottery import Redlock

    from django_redlock import lock

    masters = {redis.Redis.from_url(url) for url in node_urls}

    def ours() -> None:
        with lock("q:ours", using="quorum"):
            pass

    def pottery() -> None:
        held = Redlock(key="q:pottery", masters=masters, auto_release_time=30)
        held.acquire()
        held.release()

    def ours_single() -> None:
        with lock("q:single"):
            pass

    results["quorum"] = interleaved(
        {"ours Redlock N=5": ours, "pottery Redlock N=5": pottery, "ours single node": ours_single}
    )
