"""What the Cluster, Celery and long-TTL kinds share (cluster.py, celery_kind.py, longttl.py):
their report, a client log of JSON lines, and a seeded plan of storms and calms.

These kinds run beside the main harness (harness.py) rather than inside it: their servers,
clients and properties are their own, and their reports answer what test_campaign.py asks
of any report (``ok``, ``summary()``, ``details()``, ``stats``, ``faults``).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .checker import Violation


@dataclass
class KindReport:
    backend: str
    kind: str
    seed: int
    seconds: float
    stats: dict[str, Any]
    faults: Counter[str]
    violations: list[Violation] = field(default_factory=list)
    harness_errors: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the kind's own summary lines
    exclude: str = ""
    started: float = 0.0  # violations' times are shown from here

    @property
    def ok(self) -> bool:
        return not self.violations and not self.harness_errors

    def summary(self) -> str:
        verdict = "PASS" if self.ok else f"FAIL ({len(self.violations)} violations)"
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        by_prop = Counter(v.prop for v in self.violations)
        lines = [
            f"campaign {self.backend}/{self.kind} seed={self.seed} {self.seconds:g}s: {verdict}",
            *self.lines,
            f"  faults: {faults}; {self.stats.get('clients', 0)} client processes",
        ]
        if by_prop:
            lines.append("  violations: " + ", ".join(f"{k} x{v}" for k, v in by_prop.items()))
        lines += [f"  HARNESS ERROR: {e}" for e in self.harness_errors]
        return "\n".join(lines)

    def details(self) -> str:
        shown = [
            f"VIOLATION {v.prop} at {v.t - self.started:.3f} s: {v.message}"
            for v in self.violations[:20]
        ]
        return "\n\n".join(
            [self.summary(), "\n".join(shown),
             f"reproduce: make soak SECONDS={self.seconds:g} SEED={self.seed}"
             f" CAMPAIGN_KIND={self.kind}"
             + (f" CAMPAIGN_EXCLUDE={self.exclude}" if self.exclude else "")]
        )  # fmt: skip


class Log:
    """One JSON line per event, written at once (a SIGKILL loses nothing already logged)."""

    def __init__(self, path: str, client_id: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.client_id = client_id
        self.mutex = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"t": time.time(), "c": self.client_id, "e": event, **fields}
        with self.mutex:
            os.write(self.fd, (json.dumps(record, default=str) + "\n").encode())


def setup_django(backend: str, location: Any, options: dict[str, Any], ttl: float) -> None:
    """A client process's Django: one ``default`` alias, no database, no metrics."""
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DATABASES={},
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
        DJANGO_REDLOCK_METRICS=False,
        DJANGO_REDLOCK={"default": {
            "BACKEND": backend, "LOCATION": location, "OPTIONS": options, "TTL": ttl}},
        USE_TZ=True,
    )  # fmt: skip
    django.setup()


def read_logs(paths: list[Any]) -> list[dict[str, Any]]:
    events = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        events.append(json.loads(line))
                    except ValueError:
                        continue
    return sorted(events, key=lambda e: e["t"])


def storms(
    seed: int, seconds: float, calm: tuple[float, float], storm: tuple[float, float], tail: float
) -> list[tuple[float, float]]:
    """(start, duration) of each storm, seconds from the run's start: calms and storms drawn
    from the seed, the last ``tail`` seconds calm."""
    rng = random.Random(seed * 104729 + 5)
    plan, t = [], rng.uniform(*calm)
    while True:
        length = rng.uniform(*storm)
        if t + length > seconds - tail:
            return plan
        plan.append((t, length))
        t += length + rng.uniform(*calm)


def excluded() -> frozenset[str]:
    return frozenset(filter(None, os.environ.get("CAMPAIGN_EXCLUDE", "").split(",")))
