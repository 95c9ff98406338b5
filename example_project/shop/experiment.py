"""The oversell experiment, in the shop's database (SQLite by default, PostgreSQL with
``DATABASE_URL``): 8 buyers at once buy 10 tickets each out of 50, three ways.

The sale is the classic read-modify-write of Django code (read the seats left, pay, save one
fewer, record the sale). Each way sells its own row of :class:`~.models.Ticket`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import DatabaseError, connection, connections, transaction
from django.db.models import Count

from django_redlock import lock

from .models import Sale, Ticket

SEATS, BUYERS, ATTEMPTS = 50, 8, 10
PAYMENT = 0.002  # between the read and the write: the payment provider's round trip
GAP = 0.01  # from the lock's release to the commit: the rest of the request

#: (way, label, what it does, in one line)
WAYS = [
    (
        "none",
        "Without a lock",
        "Read, pay, save: two buyers read the same seats left and both sell the last one.",
    ),
    (
        "released",
        "A lock released before the commit",
        "lock() inside transaction.atomic() (ATOMIC_REQUESTS), 10 ms from its release to the"
        " commit: the next buyer reads the seats before the last sale commits.",
    ),
    (
        "atomic",
        "lock(..., atomic=True)",
        "The same request: the fence check waits for the last sale's commit, and the next buyer"
        " reads what it wrote.",
    ),
]
#: SQLite's word on the lock released before the commit (a PostgreSQL database oversells).
SQLITE_REFUSES = (
    'SQLite, one writer at a time, refuses that buyer ("database is locked"), where'
    " PostgreSQL (DATABASE_URL) sells twice."
)


def sell(ticket: int) -> bool:
    """One purchase: read, pay, write; not atomic by itself."""
    seats = Ticket.objects.get(pk=ticket)
    if seats.left <= 0:
        return False
    time.sleep(PAYMENT)
    seats.left -= 1
    seats.save(update_fields=["left"])
    Sale.objects.create(ticket=seats, seen=seats.left + 1)
    return True


def purchase(way: str, ticket: int) -> bool:
    if way == "none":  # Django's default: every statement commits on its own
        return sell(ticket)
    with transaction.atomic():  # the request's transaction
        with lock(f"experiment:{way}", ttl=10, atomic=way == "atomic"):
            sold = sell(ticket)
        time.sleep(GAP)  # the response is rendered, then the transaction commits
    return sold


def run(way: str) -> Ticket:
    """``BUYERS`` threads of ``ATTEMPTS`` purchases each, on a fresh row of ``SEATS`` seats."""
    Ticket.objects.filter(way=way).delete()
    ticket = Ticket.objects.create(way=way, seats=SEATS, left=SEATS)

    def buyer(_: int) -> int:
        failed = 0
        try:
            for _ in range(ATTEMPTS):
                try:
                    purchase(way, ticket.pk)
                except DatabaseError:  # SQLite: "database is locked"
                    failed += 1
        finally:
            connections.close_all()  # this thread's connections
        return failed

    with ThreadPoolExecutor(BUYERS, thread_name_prefix=f"buyer {way}") as pool:
        failed = sum(pool.map(buyer, range(BUYERS)))
    Ticket.objects.filter(pk=ticket.pk).update(failed=failed)
    return ticket


def run_all() -> None:
    for way, *_ in WAYS:
        run(way)


def database() -> str:
    return "SQLite" if connection.vendor == "sqlite" else connection.display_name


def results() -> dict[str, Any] | None:
    """The last run of each way, as the pages show it; None before the first run."""
    found = {t.way: t for t in Ticket.objects.annotate(sold=Count("sales"))}
    if not found:
        return None
    runs = []
    for way, label, explain in WAYS:
        ticket = found.get(way)
        if ticket is None:
            continue
        sold = ticket.sold  # type: ignore[attr-defined]
        if way == "released" and connection.vendor == "sqlite":
            explain = f"{explain} {SQLITE_REFUSES}"
        runs.append({
            "way": way,
            "label": label,
            "explain": explain,
            "seats": ticket.seats,
            "sold": sold,
            "oversold": max(0, sold - ticket.seats),
            "failed": ticket.failed,
        })  # fmt: skip
    return {"database": database(), "buyers": BUYERS, "attempts": ATTEMPTS, "runs": runs}
