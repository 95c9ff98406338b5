"""``make bench``: django-redlock against the Python anchors, side by side, on the same Redis.

Starts its own redis-servers (1, and 5 for the quorum), runs every scenario for every library
interleaved over rounds (A B C A B C ...), and writes medians, ratios and the targets met or
missed to bench/results.json (every figure, the one source the docs quote from: see
bench/figures.py) and, made from it, bench/README.md, with a plot in bench/results.png. Absolute figures on a shared
machine are noise; the ratios measured in the same run are the result.

``BENCH_ONLY=<scenario>`` (part of a step's title, e.g. ``watchdog``) runs only the steps
whose title contains it and prints their figures, writing nothing: a quick side run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python bench/run.py: the project's root, for `bench.`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import HERE, redis_servers, setup
from bench.report import environment, plot, without_samples, write_report
from bench.scenarios.admin_listing import admin_listing
from bench.scenarios.asyncio_contention import asyncio_contention
from bench.scenarios.celery_overhead import celery_overhead
from bench.scenarios.contended import contended
from bench.scenarios.fenced import fenced
from bench.scenarios.floor import floor
from bench.scenarios.lock_all import lock_all_scenario
from bench.scenarios.memory import memory
from bench.scenarios.observability import observability
from bench.scenarios.quorum import quorum
from bench.scenarios.redis_cpu import redis_cpu
from bench.scenarios.semaphores import semaphores
from bench.scenarios.skewed_clocks import skewed_clocks
from bench.scenarios.uncontended import uncontended
from bench.scenarios.watchdog import watchdog


def main() -> None:
    started = time.monotonic()
    with redis_servers() as (single, nodes):
        setup(single.url, [n.url for n in nodes])
        results: dict[str, Any] = {}
        steps: list[tuple[str, Callable[[], None]]] = [
            ("uncontended", lambda: uncontended(results)),
            ("uncontended floor", lambda: floor(results)),
            ("redis cpu", lambda: redis_cpu(results)),
            ("quorum", lambda: quorum(results, [n.url for n in nodes], single.url)),
            ("contended, zero hold", lambda: contended(
                results, single.url, 0.0,
                ["ours", "ours-fair", "redis-py", "python-redis-lock", "pottery"], "contended_zero")),
            ("contended, 10 ms hold", lambda: contended(
                results, single.url, 0.01, ["ours", "ours-fair", "redis-py", "python-redis-lock"],
                "contended_10ms")),
            ("watchdog", lambda: watchdog(results)),
            ("asyncio", lambda: asyncio_contention(results)),
            ("memory", lambda: memory(results, single.url)),
            ("admin listing", lambda: admin_listing(results)),
            ("celery", lambda: celery_overhead(results)),
            ("semaphore", lambda: semaphores(results, single.url)),
            ("contended semaphore", lambda: contended(
                results, single.url, 0.01, ["ours-semaphore", "sorted-set-semaphore"],
                "semaphore_10ms")),
            ("fenced purchases", lambda: fenced(results, single.url)),
            ("lock_all", lambda: lock_all_scenario(results)),
            ("skewed clocks", lambda: skewed_clocks(results)),
            # Last: it installs an OpenTelemetry SDK tracer provider, for the process (it
            # cannot be taken back), and every in-process scenario after it would record
            # spans (the semaphore's cycle measured 0.71 x the recipe after it, 0.83 x before).
            ("metrics overhead", lambda: observability(results)),
        ]  # fmt: skip
        only = os.environ.get("BENCH_ONLY")  # e.g. BENCH_ONLY=watchdog: a quick side run
        for title, step in steps:
            if only and only not in title:
                continue
            began = time.monotonic()
            step()
            print(f"bench: {title} done in {time.monotonic() - began:.0f} s", flush=True)
        if only:
            print(json.dumps(without_samples(results), indent=2))
            return
        # The one source of every figure the docs and the README quote (bench/figures.py):
        # the report below is made from this file alone, as `python -m bench.report` remakes it.
        results["run"] = {
            "seconds": round(time.monotonic() - started),
            "environment": environment(single),
        }
        (HERE / "results.json").write_text(json.dumps(without_samples(results), indent=2))
        plot(results)
        text = write_report()
        print(text)


if __name__ == "__main__":
    main()
