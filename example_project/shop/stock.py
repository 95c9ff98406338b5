"""Ticket stock kept in Redis, sold with a deliberately non-atomic read-modify-write."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django_redlock import lock, locks

# The shop's own data, in the locks' Redis database but outside their KEY_PREFIX ("shop").
STOCK_KEY = "demo:tickets:left"
SOLD_KEY = "demo:tickets:sold"
SYNC_RUNS_KEY = "demo:sync:runs"
HANDOFFS_KEY = "demo:handoffs"
EXPERIMENT_KEY = "demo:experiment"


def redis() -> Any:
    return locks["default"].client  # type: ignore[attr-defined]


def restock(tickets: int) -> None:
    redis().delete(SOLD_KEY)
    redis().set(STOCK_KEY, tickets)


def left() -> int:
    return int(redis().get(STOCK_KEY) or 0)


def sell_one() -> bool:
    """Read, think, write: two buyers in the gap both get the same ticket."""
    remaining = left()
    if remaining <= 0:
        return False
    time.sleep(0.002)  # payment provider round trip
    redis().set(STOCK_KEY, remaining - 1)
    redis().incr(SOLD_KEY)
    return True


def sell_one_locked() -> bool:
    with lock("tickets", ttl=10):
        return sell_one()


def run_experiment(tickets: int, buyers: int, attempts: int, locked: bool) -> dict[str, int]:
    """``buyers`` threads each try ``attempts`` purchases of ``tickets`` tickets."""
    restock(tickets)
    sell = sell_one_locked if locked else sell_one

    def buyer() -> int:
        return sum(sell() for _ in range(attempts))

    with ThreadPoolExecutor(buyers, thread_name_prefix="buyer") as pool:
        confirmed = sum(pool.map(lambda _: buyer(), range(buyers)))
    return {"tickets": tickets, "confirmed": confirmed, "oversold": max(0, confirmed - tickets)}


def save_experiment(results: list[tuple[str, dict[str, int]]]) -> None:
    redis().set(EXPERIMENT_KEY, json.dumps(results))


def last_experiment() -> list[tuple[str, dict[str, int]]] | None:
    saved = redis().get(EXPERIMENT_KEY)
    return [(label, result) for label, result in json.loads(saved)] if saved else None
