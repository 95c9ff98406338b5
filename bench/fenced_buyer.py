"""One process of the fenced-purchases scenario (bench/scenarios/fenced.py), on PostgreSQL:
``python -m bench.fenced_buyer --url REDIS --pg-port PORT ACTION``.

``prepare`` migrates the database and opens the shop (a ticket, and its sales); ``buy`` buys
the ticket for ``--seconds`` once the start key exists, in one of two ways, and prints its
purchases as JSON; ``cost`` prints what the fence check adds to a block (its statements and
its time). The sale is Django code as people write it: read the ticket, ``stock -= 1``,
``save()``, record the sale.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import django
from django.conf import settings

TICKET = 1
STOCK = 10**9  # never sold out: a turn measures purchases, not the end of the stock


def setup(url: str, port: int, database: str) -> None:
    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": database,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "PORT": str(port),
            }
        },
        DJANGO_REDLOCK={
            "default": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url}
        },
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
        USE_TZ=True,
    )
    django.setup()


@functools.cache
def shop() -> tuple[Any, Any]:
    """The shop's models (Ticket, Sale): defined once Django is set up, tables made by
    ``prepare`` (the app label is the bench's own, no app to install)."""
    from django.db import models

    class Ticket(models.Model):
        stock = models.IntegerField()

        class Meta:
            app_label = "bench"
            db_table = "bench_ticket"

    class Sale(models.Model):
        ticket = models.ForeignKey(Ticket, on_delete=models.CASCADE)
        buyer = models.CharField(max_length=40)
        seen = models.IntegerField()

        class Meta:
            app_label = "bench"
            db_table = "bench_sale"

    return Ticket, Sale


def sell(ticket: Any, buyer: str) -> None:
    _, Sale = shop()
    ticket.stock -= 1
    ticket.save(update_fields=["stock"])
    Sale.objects.create(ticket=ticket, buyer=buyer, seen=ticket.stock + 1)


def select_for_update(buyer: str) -> None:
    """What people do without a lock: the row's lock, held until the commit; the others wait
    for it inside their own transactions."""
    from django.db import transaction

    Ticket, _ = shop()
    with transaction.atomic():
        sell(Ticket.objects.select_for_update().get(pk=TICKET), buyer)


def fenced(buyer: str) -> None:
    """The lock's fenced transaction: the others wait in Redis, with no transaction open."""
    from django_redlock import lock

    Ticket, _ = shop()
    with lock(f"ticket:{TICKET}", atomic=True):
        sell(Ticket.objects.get(pk=TICKET), buyer)


MODES = {"select_for_update": select_for_update, "lock(atomic=True)": fenced}


def prepare(args: argparse.Namespace) -> None:
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    Ticket, Sale = shop()
    with connection.schema_editor() as editor:
        editor.create_model(Ticket)
        editor.create_model(Sale)
    Ticket.objects.create(pk=TICKET, stock=STOCK)


def buy(args: argparse.Namespace) -> None:
    """Buy for ``--seconds`` from when the start key appears; the purchases' end times."""
    from django_redlock import locks

    purchase = MODES[args.mode]
    client = locks["default"].client  # type: ignore[attr-defined]
    purchase(f"{args.buyer}.warm")  # connections made, scripts loaded
    client.incr(f"{args.start}:ready")
    while not client.exists(args.start):
        time.sleep(0.002)
    done: list[float] = []
    cpu = time.process_time()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        purchase(args.buyer)
        done.append(time.monotonic())
    cpu = time.process_time() - cpu  # this buyer's CPU while buying (its waits use none)
    # Quiet until every buyer is done: one exiting would give the others its CPU.
    client.incr(f"{args.start}:done")
    while int(client.get(f"{args.start}:done") or 0) < args.buyers:
        time.sleep(0.01)
    print(json.dumps({"purchases": len(done), "done": done, "cpu": cpu}), flush=True)


def paired(plain: Any, fenced: Any, rounds: int, seconds: float) -> dict[str, float]:
    """µs per block of each, and the fence's: the median over ``rounds`` of the difference
    between neighbouring turns (which goes first alternates), so that the machine's load,
    which drifts over seconds on a shared machine, cancels out of each difference."""
    from bench.harness import rate

    plain(), fenced()  # warm up: connections, scripts, the lock's row
    pairs = []
    for turn in range(rounds):
        order = (plain, fenced) if turn % 2 == 0 else (fenced, plain)
        us = {work: 1e6 / rate(work, seconds) for work in order}
        pairs.append((us[plain], us[fenced]))
    return {
        "plain_us": statistics.median(p for p, _ in pairs),
        "fenced_us": statistics.median(f for _, f in pairs),
        "fence_us": statistics.median(f - p for p, f in pairs),
    }


def cost(args: argparse.Namespace) -> None:
    """The fence check's statements per block (what Django sent, against a plain
    ``transaction.atomic()``) and its time: a fenced block against the same lock around a
    plain ``transaction.atomic()``, with one statement in the body (the fence check alone),
    and empty (the check, and the BEGIN and COMMIT an empty plain block never sends)."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from bench.harness import ROUNDS, SECONDS
    from django_redlock import lock

    def statements(block: Any) -> int:
        with CaptureQueriesContext(connection) as captured:
            block()
        return len(captured)

    def fenced_block() -> None:
        with lock("fence-cost:count", atomic=True):
            pass

    def plain_block() -> None:
        with transaction.atomic():
            pass

    first = statements(fenced_block)  # the name's first block: its row is new
    fenced_statements, plain_statements = statements(fenced_block), statements(plain_block)

    def with_select(fence: bool) -> Any:
        def block() -> None:
            if fence:
                with lock("fence-cost:a", atomic=True), connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
            else:
                with lock("fence-cost:b"), transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute("SELECT 1")

        return block

    def empty(fence: bool) -> Any:
        def block() -> None:
            if fence:
                with lock("fence-cost:c", atomic=True):
                    pass
            else:
                with lock("fence-cost:d"), transaction.atomic():
                    pass

        return block

    # Short turns, many of them: 4 x the rounds of the other scenarios, a quarter as long.
    rounds, seconds = 4 * ROUNDS, SECONDS / 4
    select = paired(with_select(False), with_select(True), rounds, seconds)
    bare = paired(empty(False), empty(True), rounds, seconds)
    print(
        json.dumps(
            {
                "statements_per_block": fenced_statements - plain_statements,
                "statements_first_block": first - plain_statements,
                "block_us": {
                    "lock + atomic(), one SELECT": select["plain_us"],
                    "lock(atomic=True), one SELECT": select["fenced_us"],
                    "lock + atomic(), empty": bare["plain_us"],
                    "lock(atomic=True), empty": bare["fenced_us"],
                },
                "fence_us_per_block": select["fence_us"],
                "empty_fenced_block_us_over_plain": bare["fence_us"],
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="the Redis")
    parser.add_argument("--pg-port", type=int, required=True)
    parser.add_argument("--database", default="bench")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("prepare")
    p = sub.add_parser("buy")
    p.add_argument("--mode", choices=list(MODES), required=True)
    p.add_argument("--start", required=True, help="a key whose appearance starts the run")
    p.add_argument("--buyer", required=True)
    p.add_argument("--seconds", type=float, default=2.5)
    p.add_argument("--buyers", type=int, default=8)
    sub.add_parser("cost")
    args = parser.parse_args()
    setup(args.url, args.pg_port, args.database)
    {"prepare": prepare, "buy": buy, "cost": cost}[args.action](args)


if __name__ == "__main__":
    main()
