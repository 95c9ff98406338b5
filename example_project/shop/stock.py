"""The shop's ticket stock, kept in Redis, sold with a deliberately non-atomic read-modify-write
(the "Buy a ticket" button, under its lock). The oversell experiment sells tickets from the
shop's database: experiment.py."""

from __future__ import annotations

import time
from typing import Any

from django_redlock import lock_all, locks

# The shop's own data, in the locks' Redis database but outside their KEY_PREFIX ("shop").
STOCK_KEY = "demo:tickets:left"
SOLD_KEY = "demo:tickets:sold"
BOX_OFFICE_KEY = "demo:tickets:box-office"  # tickets moved to the box office, off the web
SYNC_RUNS_KEY = "demo:sync:runs"
HANDOFFS_KEY = "demo:handoffs"


def redis() -> Any:
    return locks["default"].client  # type: ignore[attr-defined]


def restock(tickets: int) -> None:
    redis().delete(SOLD_KEY, BOX_OFFICE_KEY)
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


def box_office() -> int:
    return int(redis().get(BOX_OFFICE_KEY) or 0)


def move_to_box_office(count: int) -> int:
    """Move up to ``count`` tickets from the web stock to the box office; how many moved.

    Both stocks are read and written, so both are locked, together: ``tickets`` (what "Buy a
    ticket" sells under) and ``box-office``. ``lock_all`` takes both or neither, in one order
    whatever the caller's, so a move and a sale never wait for each other in a cycle; a busy
    name for 2 s raises LockNotAcquired, and nothing is held then."""
    with lock_all("tickets", "box-office", timeout=2):
        remaining = left()  # read, think, write: safe only under both locks
        moved = min(count, remaining)
        time.sleep(0.002)
        redis().set(STOCK_KEY, remaining - moved)
        redis().set(BOX_OFFICE_KEY, box_office() + moved)
    return moved
