"""What the home page's live panel shows, polled every second as JSON."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from django_redlock import locks
from django_redlock.backends.base import LockInfo
from django_redlock.display import holder_parts, holder_text, holder_title, holds
from django_redlock.identity import holder_meta, parse_holder

from . import experiment, stock

HANDOFFS_KEPT = 8


def _remember(entry: dict[str, Any]) -> None:
    with stock.redis().pipeline() as pipe:
        pipe.lpush(stock.HANDOFFS_KEY, json.dumps({**entry, "at": time.time()}))
        pipe.ltrim(stock.HANDOFFS_KEY, 0, HANDOFFS_KEPT - 1)
        pipe.execute()


def record_handoff(sender: Any, lock: Any, fence: int | None = None, **kwargs: Any) -> None:
    """lock_acquired: who took which lock with which fence, newest first. The holder is the
    one the hold itself records (this thread, or its Celery task): the admin shows the same."""
    if lock.using == "default":
        _remember({"name": lock.name, "fence": fence, "holder": parse_holder(holder_meta())})


def record_skipped(sender: Any, key: str, task_id: str | None, **kwargs: Any) -> None:
    """duplicate_skipped: a @single_instance task that did not run, its lock being held."""
    if kwargs.get("using") != "default" or kwargs.get("redelivered"):
        return
    holder = {**parse_holder(holder_meta()), "k": task_id or "", "n": getattr(sender, "name", "")}
    running = kwargs.get("holder_task_id")
    _remember({"name": key, "fence": None, "holder": holder, "skipped": running or "?"})


def lock_rows(info: LockInfo) -> list[dict[str, Any]]:
    """A row per hold: a lock's own, or each permit of a semaphore (as the admin lists them)."""
    return [
        {
            "name": info.name,
            "kind": kind,
            "holder": holder_text(row.holder),
            "holder_parts": holder_parts(row.holder),  # the same words, on two lines
            "holder_title": holder_title(row.holder),
            "ttl": None if row.ttl is None else round(row.ttl, 1),
            "fence": None if row.fence is None else str(row.fence),  # 16 digits: exact as text
            "waiters": row.waiters,
        }
        for row, kind in holds(info)
    ]


def handoff_row(entry: dict[str, Any], now: float) -> dict[str, Any]:
    row = {
        "name": entry["name"],
        "who": holder_text(entry["holder"]),
        "who_parts": holder_parts(entry["holder"]),
        "who_title": holder_title(entry["holder"]),
        "fence": None if entry["fence"] is None else str(entry["fence"]),  # exact as text
        "ago": round(max(0.0, now - entry["at"]), 1),
    }
    if "skipped" in entry:
        row["skipped"] = str(entry["skipped"])[:8]  # the task that held the lock meanwhile
    return row


def snapshot() -> dict[str, Any]:
    held = sorted(itertools.islice(locks["default"].iter_locks("*"), 50), key=lambda i: i.name)
    now = time.time()
    handoffs = [json.loads(x) for x in stock.redis().lrange(stock.HANDOFFS_KEY, 0, -1)]
    handoffs = [entry for entry in handoffs if "holder" in entry]  # (an older demo's: no)
    # Newest first by fence, not in the order the threads recorded them (two threads that
    # took a lock one after the other may record it the other way round). A fence is at
    # least Redis's clock in ms x 1000: a skipped duplicate, with none, goes by its time.
    handoffs.sort(key=lambda e: e["at"] * 1_000_000 if e["fence"] is None else e["fence"])
    return {
        "left": stock.left(),
        "locks": [row for info in held for row in lock_rows(info)],
        "handoffs": [handoff_row(entry, now) for entry in reversed(handoffs)],
        "experiment": experiment.results(),
    }
