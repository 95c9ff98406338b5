"""What the home page's live panel shows, polled every second as JSON."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from typing import Any

from django_redlock import locks
from django_redlock.backends.base import LockInfo

from . import stock

HANDOFFS_KEPT = 8


def who() -> str:
    """This holder, as people say it: the Celery task, or the web thread."""
    from celery import current_task

    request = getattr(current_task, "request", None)
    if request is not None and getattr(request, "id", None):
        return f"task {current_task.name.rsplit('.', 1)[-1]} {request.id[:8]}"
    thread = threading.current_thread().name
    if "process_request_thread" in thread:  # runserver's thread per request
        thread = "web request"
    return f"{thread} · pid {os.getpid()}"


def record_handoff(sender: Any, lock: Any, fence: int | None = None, **kwargs: Any) -> None:
    """lock_acquired: remember who took which lock with which fence, newest first."""
    if lock.using != "default":
        return
    entry = {"name": lock.name, "fence": fence, "who": who(), "at": time.time()}
    with stock.redis().pipeline() as pipe:
        pipe.lpush(stock.HANDOFFS_KEY, json.dumps(entry))
        pipe.ltrim(stock.HANDOFFS_KEY, 0, HANDOFFS_KEPT - 1)
        pipe.execute()


def holder(info: LockInfo, taken_by: dict[tuple[str, str], str]) -> str:
    """Who holds it: the Celery task of a @single_instance hold, else who took this fence
    (a hand-off says which task), else the thread and process the hold records."""
    h = info.holder
    if h.get("k"):
        return f"task {str(h.get('n', '')).rsplit('.', 1)[-1]} {h['k'][:8]}"
    return (
        taken_by.get((info.name, str(info.fence))) or f"{h.get('t', '?')} · pid {h.get('p', '?')}"
    )


def lock_row(info: LockInfo, taken_by: dict[tuple[str, str], str]) -> dict[str, Any]:
    return {
        "name": info.name,
        "kind": info.kind,
        "holder": holder(info, taken_by),
        "ttl": None if info.ttl is None else round(info.ttl, 1),
        "fence": None if info.fence is None else str(info.fence),  # 16 digits: exact as text
        "waiters": info.waiters,
    }


def snapshot() -> dict[str, Any]:
    held = sorted(itertools.islice(locks["default"].iter_locks("*"), 50), key=lambda i: i.name)
    now = time.time()
    handoffs = [json.loads(x) for x in stock.redis().lrange(stock.HANDOFFS_KEY, 0, -1)]
    for entry in handoffs:
        entry["ago"] = round(max(0.0, now - entry.pop("at")), 1)
        entry["fence"] = str(entry["fence"])  # 16 digits: exact in JavaScript as text
    taken_by = {(h["name"], h["fence"]): h["who"] for h in handoffs}
    return {
        "left": stock.left(),
        "locks": [lock_row(i, taken_by) for i in held],
        "handoffs": handoffs,
        "experiment": stock.last_experiment(),
    }
