"""The watchdog renewing 10,000 held locks: its round trips and its thread's CPU."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


def watchdog(results: dict[str, Any]) -> None:
    from django_redlock import lock, locks

    backend = locks["default"]
    held = [lock(f"w:{i}", ttl=3) for i in range(10_000)]
    for each in held:
        each.acquire()
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        """The watchdog's threads: its scheduler and the backend's worker."""
        used = 0.0
        for thread in renewers:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat")
            fields = stat.read_text().rsplit(")", 1)[1]
            utime, stime = fields.split()[11:13]
            used += (int(utime) + int(stime)) / ticks
        return used

    time.sleep(1.5)  # let the first renewals line up
    renewers = [t for t in threading.enumerate() if t.name.startswith("redlock-renew")]
    trips, used, started = backend.round_trips, cpu(), time.monotonic()
    time.sleep(6.0)
    elapsed = time.monotonic() - started
    trips, used = backend.round_trips - trips, cpu() - used
    alive = sum(1 for each in held[::500] if each.owned())
    for each in held:
        each.release()
    period = 1.0  # ttl 3 s / 3
    results["watchdog"] = {
        "round_trips_per_second": trips / elapsed,
        "round_trips_per_100_locks_per_period": trips / elapsed * period / 100,
        "renewer_cpu_percent": used / elapsed * 100,
        "sampled_still_held": f"{alive}/{len(held[::500])}",
    }
