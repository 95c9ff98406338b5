"""The shop's ticket stock, kept in Redis, sold with a deliberately non-atomic read-modify-write
(the "Buy a ticket" button, under its lock). The oversell experiment sells tickets from the
shop's database: experiment.py."""

from __future__ import annotations

import time
from typing import Any

from django_redlock import locks

# The shop's own data, in the locks' Redis database but outside their KEY_PREFIX ("shop").
STOCK_KEY = "demo:tickets:left"
SOLD_KEY = "demo:tickets:sold"
SYNC_RUNS_KEY = "demo:sync:runs"
HANDOFFS_KEY = "demo:handoffs"


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
