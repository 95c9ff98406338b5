"""Redlock beside a clogged node: ``python bench/clogged.py [--rounds N]``.

The ticket sale of issue 22: 5 processes sell 150 tickets through a 5-node Redlock (each sale
a non-atomic read-modify-write of a separate Redis, made safe by the lock), with the quorum
healthy, with one node killed, with one node SIGSTOPped for the whole sale, and with one
killed plus one paused (3 of 5 left). Prints the seconds each sale took, from the start
signal to the last ticket (median of the rounds, the scenarios taking turns), and the
longest single acquire a seller waited.

A seller is ``python bench/clogged.py sell NODE_URLS STORE_URL`` (one process each, so
every process meets the paused node with its own breaker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

SELLERS = 5
TICKETS = 150
SCENARIOS = ("healthy", "one killed", "one paused", "one killed, one paused")


def sell(node_urls: list[str], store_url: str) -> None:
    import django
    import redis
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django_redlock"],
        DJANGO_REDLOCK={
            "default": {
                "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
                "LOCATION": node_urls,
            }
        },
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
        DJANGO_REDLOCK_METRICS=False,
    )
    django.setup()
    from django_redlock import LockError, lock

    store = redis.Redis.from_url(store_url)
    while not store.exists("go"):  # every seller starts at once
        time.sleep(0.005)
    sold = errors = 0
    worst = 0.0
    kinds: dict[str, str] = {}
    while True:
        started = time.monotonic()
        try:
            with lock("tickets", ttl=5, timeout=30) as held:
                worst = max(worst, time.monotonic() - started)
                assert held.fence is not None
                left = int(store.get("stock") or 0)
                if left <= 0:
                    break
                store.set("stock", left - 1)
                store.rpush("sold", left)
                sold += 1
        except LockError as exc:
            errors += 1
            kinds.setdefault(type(exc).__name__, str(exc)[:300])
            time.sleep(0.05)
    done = {"sold": sold, "errors": errors, "worst": worst, "kinds": kinds, "at": time.time()}
    print(json.dumps(done), flush=True)


def sale(scenario: str) -> dict[str, Any]:
    from django_redlock.testing import RedisServer

    nodes = [RedisServer().start() for _ in range(5)]
    store = RedisServer().start()
    try:
        client = store.client()
        client.set("stock", TICKETS)
        urls = ",".join(node.url for node in nodes)
        sellers = [
            subprocess.Popen(
                [sys.executable, __file__, "sell", urls, store.url],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(SELLERS)
        ]
        time.sleep(1.5)  # every seller imported Django and waits for "go"
        if "killed" in scenario:
            nodes[0].kill()
        if "paused" in scenario:
            nodes[1].pause()
        started = time.time()
        client.set("go", 1)
        results = [json.loads(seller.communicate(timeout=600)[0]) for seller in sellers]
        elapsed = max(r["at"] for r in results) - started  # the sale, not the processes' exit
        ledger = sorted(int(t) for t in client.lrange("sold", 0, -1))
        assert ledger == list(range(1, TICKETS + 1)), "oversold or lost tickets"
        for result in results:
            for kind, message in result["kinds"].items():
                print(f"  {scenario}: {kind}: {message}", file=sys.stderr, flush=True)
        return {
            "seconds": elapsed,
            "worst_wait": max(r["worst"] for r in results),
            "errors": sum(r["errors"] for r in results),
        }
    finally:
        for node in nodes:
            node.stop()  # resumes a paused one first
        store.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=SCENARIOS)
    args = parser.parse_args()
    scenarios = [args.only] if args.only else list(SCENARIOS)
    runs: dict[str, list[dict[str, Any]]] = {scenario: [] for scenario in scenarios}
    for _ in range(args.rounds):  # the scenarios take turns: a load spike hits them alike
        for scenario in scenarios:
            runs[scenario].append(sale(scenario))
    for scenario in scenarios:
        seconds = statistics.median(r["seconds"] for r in runs[scenario])
        print(
            f"{scenario:<24} {seconds:6.2f} s (runs: "
            + ", ".join(f"{r['seconds']:.2f}" for r in runs[scenario])
            + f"); longest acquire {max(r['worst_wait'] for r in runs[scenario]):.2f} s;"
            f" lock errors {sum(r['errors'] for r in runs[scenario])}",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sell":
        sell(sys.argv[2].split(","), sys.argv[3])
    else:
        main()
