"""8 processes contending for one lock (bench/contender.py), the libraries taking turns."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from bench.harness import (
    CONTENDED_ROUNDS,
    CONTENDERS,
    HERE,
    ROOT,
    median_summary,
    redis_seconds,
    summarise,
)


def contended(results: dict[str, Any], url: str, hold: float, libs: list[str], key: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    seconds = 2.5
    runs: dict[str, list[dict[str, Any]]] = {lib: [] for lib in libs}
    for round_ in range(CONTENDED_ROUNDS):
        for lib in libs:
            start = f"start:{key}:{lib}:{round_}"
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "contender.py"),
                        "--lib",
                        lib,
                        "--url",
                        url,
                        "--name",
                        f"c:{key}:{lib}:{round_}",
                        "--start",
                        start,
                        "--seconds",
                        str(seconds),
                        "--hold",
                        str(hold),
                        "--contenders",
                        str(CONTENDERS),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
                for _ in range(CONTENDERS)
            ]
            time.sleep(1.5)  # every process imported and connected
            used = redis_seconds(client)
            client.set(start, 1)
            outputs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
            used = redis_seconds(client) - used  # the run, and the contenders' wait to finish
            summary = summarise(outputs, seconds)
            acquisitions = sum(len(out["spans"]) for out in outputs)
            summary["redis_cpu_us_per_acquisition"] = used / max(acquisitions, 1) * 1e6
            runs[lib].append(summary)
    results[key] = {lib: median_summary(values) for lib, values in runs.items()}
