"""What an operator needs in an incident, per backend: is it up (and how fast), how many
locks are held and waited for, and how many holds were lost lately. Used by the admin's
"Lock health" summary and ``manage.py redlock top``."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .backends.base import BaseLockBackend, LockInfo

LOST_WINDOW = timedelta(hours=1)


@dataclass
class Health:
    alias: str
    up: bool
    latency_ms: float | None = None  # one PING (the slowest node's, on Redlock)
    detail: str = ""  # why it is down, or "3/3 nodes", "in process"
    held: int = 0  # locks on the page shown (a SCAN page: never a count of every lock)
    holds: int = 0  # their holds: a semaphore's permits, a read-write lock's readers, each one
    waiting: int = 0
    longest_wait: float | None = None
    lost: int = 0  # holds lost in the last hour (lock incidents)
    more: bool = False  # the backend has more pages than the one counted
    counted: bool = False  # held and waiting were counted (the backend was paged)

    @property
    def status(self) -> str:
        return "up" if self.up else "down"


def _ping(client: Any) -> float:
    started = time.perf_counter()
    client.ping()
    return (time.perf_counter() - started) * 1000


def ping(backend: BaseLockBackend) -> Health:
    """One PING per server of the backend (never a lock operation)."""
    alias = backend.alias
    nodes: Sequence[Any] | None = getattr(backend, "nodes", None)
    if nodes is not None:  # Redlock: up while a majority answers
        latencies, errors = [], []
        for node in nodes:
            try:
                latencies.append(_ping(node.client))
            except Exception as exc:
                errors.append(str(exc))
        quorum = getattr(backend, "quorum", len(nodes) // 2 + 1)
        detail = f"{len(latencies)}/{len(nodes)} nodes"
        if errors:
            detail += f"; {errors[0]}"
        return Health(alias, len(latencies) >= quorum, max(latencies, default=None), detail)
    if not hasattr(type(backend), "client"):  # LocMem: this process
        return Health(alias, True, None, "in process")
    try:
        return Health(alias, True, _ping(backend.client))  # type: ignore[attr-defined]
    except Exception as exc:
        return Health(alias, False, None, str(exc) or type(exc).__name__)


def lost_recently(names: Iterable[tuple[str, str]] | None = None) -> dict[tuple[str, str], int]:
    """Holds lost in the last hour, from the lock incidents: (backend, name) -> count, for
    the given locks only (one query); ``names=None``: per backend, as (backend, "")."""
    from django.db.models import Count
    from django.utils import timezone

    from .models import LockIncident

    recent = LockIncident.objects.filter(kind="lost", created_at__gte=timezone.now() - LOST_WINDOW)
    if names is None:
        rows = recent.values("backend").annotate(n=Count("id"))
        return {(row["backend"], ""): row["n"] for row in rows}
    wanted = set(names)
    if not wanted:
        return {}
    rows = (
        recent.filter(name__in={name for _, name in wanted})
        .values("backend", "name")
        .annotate(n=Count("id"))
    )
    return {
        (row["backend"], row["name"]): row["n"]
        for row in rows
        if (row["backend"], row["name"]) in wanted
    }


def summarise(health: Health, found: Sequence[LockInfo]) -> Health:
    """Count a page of the backend's held locks into its health line."""
    health.counted = True
    health.held = len(found)
    health.holds = sum(len(info.holders) or 1 for info in found)
    health.waiting = sum(info.waiters for info in found)
    waits = [info.longest_wait for info in found if info.longest_wait is not None]
    health.longest_wait = max(waits, default=None)
    return health


def contention_order(info: LockInfo) -> tuple[float, float, float]:
    """Most contended first: most waiters, then the longest wait, then the oldest hold."""
    age = info.acquired_at.timestamp() if info.acquired_at else float("inf")
    return (-info.waiters, -(info.longest_wait or 0.0), age)
