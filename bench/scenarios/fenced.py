"""Contended purchases on PostgreSQL, 8 processes (bench/fenced_buyer.py): the lock's fenced
transaction (``lock(..., atomic=True)``) against what people do instead, ``select_for_update()``
on the ticket's row; and what the fence check costs a block."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from bench.harness import CONTENDED_ROUNDS, CONTENDERS, ROOT

SECONDS = float(os.environ.get("BENCH_FENCED_SECONDS", "2.5"))  # a turn, as in contended
# Buyers per turn, as in contended; fewer (at least 2 contend) for a quick check of the harness.
BUYERS = int(os.environ.get("BENCH_FENCED_BUYERS", str(CONTENDERS)))
MODES = ("select_for_update", "lock(atomic=True)")
#: One sample of the database's sessions, other than the sampler's own: waiting for a lock
#: (a row another transaction holds), idle in an open transaction (between its statements,
#: or a waiter that holds one), in a transaction at all.
ACTIVITY = """
SELECT count(*) FILTER (WHERE state = 'active' AND wait_event_type = 'Lock'),
       count(*) FILTER (WHERE state LIKE 'idle in transaction%%'),
       count(*) FILTER (WHERE xact_start IS NOT NULL)
FROM pg_stat_activity
WHERE datname = %s AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""


def child(url: str, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "bench.fenced_buyer", "--url", url, "--pg-port", str(port),
            *args]  # fmt: skip


def run_child(url: str, port: int, *args: str) -> str:
    done = subprocess.run(child(url, port, *args), capture_output=True, text=True, cwd=ROOT,
                          timeout=600, check=False)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"bench.fenced_buyer {args[0]} failed: {done.stderr[-3000:]}")
    return done.stdout


class Sampler(threading.Thread):
    """pg_stat_activity every few milliseconds until stopped: the connections busy waiting."""

    def __init__(self, conn: Any, database: str) -> None:
        super().__init__(daemon=True)
        self.conn, self.database = conn, database
        self.samples: list[tuple[int, int, int]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.005):
            row = self.conn.execute(ACTIVITY, [self.database]).fetchone()
            self.samples.append((int(row[0]), int(row[1]), int(row[2])))

    def summary(self) -> dict[str, float]:
        lock_waits = [s[0] for s in self.samples]
        # The brief's measure: connections that wait while holding a transaction open (on a
        # row's lock, or idle in it); the holder between its statements counts too.
        busy = [s[0] + s[1] for s in self.samples]
        in_transaction = [s[2] for s in self.samples]
        return {
            "samples": len(self.samples),
            "waiting_in_transaction_peak": max(busy, default=0),
            "waiting_in_transaction_mean": statistics.fmean(busy) if busy else 0.0,
            "lock_waits_peak": max(lock_waits, default=0),
            "lock_waits_mean": statistics.fmean(lock_waits) if lock_waits else 0.0,
            "in_transaction_peak": max(in_transaction, default=0),
            "in_transaction_mean": statistics.fmean(in_transaction) if in_transaction else 0.0,
        }


def turn(client: Any, conn: Any, url: str, port: int, mode: str, key: str) -> dict[str, Any]:
    """BUYERS (8) buyers of one mode for SECONDS: purchases/s and the sessions meanwhile."""
    args = ["buy", "--mode", mode, "--start", key, "--seconds", str(SECONDS),
            "--buyers", str(BUYERS)]  # fmt: skip
    procs = [
        subprocess.Popen(
            child(url, port, *args, "--buyer", f"{key}.{i}"),
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(BUYERS)
    ]
    deadline = time.monotonic() + 120
    while int(client.get(f"{key}:ready") or 0) < BUYERS:  # imported, connected, warm
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise RuntimeError(f"fenced purchases: the {mode} buyers did not get ready")
        time.sleep(0.05)
    sampler = Sampler(conn, "bench")
    sampler.start()
    client.set(key, 1)
    outputs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    sampler.stopping.set()
    sampler.join()
    purchases = sum(out["purchases"] for out in outputs)
    cpu = sum(out["cpu"] for out in outputs)
    return {
        "per_second": purchases / SECONDS,
        "purchases": purchases,
        "buyer_cpu_us_per_purchase": cpu / max(purchases, 1) * 1e6,
        **sampler.summary(),
    }


def fenced(results: dict[str, Any], url: str) -> None:
    import psycopg
    import redis

    from django_redlock.testing import PostgresServer

    client = redis.Redis.from_url(url)
    with PostgresServer() as pg:
        with psycopg.connect(host=pg.host, port=pg.port, user=pg.user, dbname="postgres",
                             autocommit=True) as admin:  # fmt: skip
            admin.execute("CREATE DATABASE bench")
            version = admin.execute("SHOW server_version").fetchone()[0]
        run_child(url, pg.port, "prepare")
        cost = json.loads(run_child(url, pg.port, "cost"))
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        with psycopg.connect(host=pg.host, port=pg.port, user=pg.user, dbname="bench",
                             autocommit=True) as conn:  # fmt: skip
            stock = conn.execute("SELECT stock FROM bench_ticket").fetchone()[0]
            sales = conn.execute("SELECT count(*) FROM bench_sale").fetchone()[0]
            for round_ in range(CONTENDED_ROUNDS):
                for mode in MODES:
                    key = f"fenced:{round_}:{mode}"
                    runs[mode].append(turn(client, conn, url, pg.port, mode, key))
            # Every purchase sold one seat, once: the stock went down by the sales made.
            sold = stock - conn.execute("SELECT stock FROM bench_ticket").fetchone()[0]
            made = conn.execute("SELECT count(*) FROM bench_sale").fetchone()[0] - sales
    results["fenced"] = {
        **{mode: {k: statistics.median(run[k] for run in values) for k in values[0]}
           for mode, values in runs.items()},
        "ratio": statistics.median(
            b["per_second"] / a["per_second"]
            for a, b in zip(runs[MODES[0]], runs[MODES[1]], strict=True) if a["per_second"]
        ),
        "lost_updates": made - sold,
        "cost": cost,
        "seconds": SECONDS,
        "postgresql": version.split()[0],
    }  # fmt: skip
