"""The ticket shop of the fenced-transaction tests, and a buyer run as its own process:
``python -m tests.support.fenced_child --url REDIS ACTION ...`` (PostgreSQL from the environment
``tests.support.settings`` reads: REDLOCK_TEST_PG_PORT, REDLOCK_TEST_PG_NAME).

The sale is the classic read-modify-write of Django code (``ticket.stock -= 1; save()``), in
plain SQL so that no test app is needed. ``measure`` reproduces the oversell of a lock taken
inside ``transaction.atomic()`` and released before the commit (README: "Locks and database
transactions"); without ``--url`` it starts a PostgreSQL and a redis-server of its own:
``python -m tests.support.fenced_child measure [--atomic] [--gap 0.01] [--runs 5]``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from typing import Any

import django
from django.conf import settings

TABLES = {
    "postgresql": [
        "CREATE TABLE IF NOT EXISTS shop_ticket (id integer PRIMARY KEY, stock integer NOT NULL)",
        "CREATE TABLE IF NOT EXISTS shop_sale (id serial PRIMARY KEY, ticket integer NOT NULL,"
        " buyer text NOT NULL, seen integer NOT NULL)",
    ],
    "sqlite": [
        "CREATE TABLE IF NOT EXISTS shop_ticket (id integer PRIMARY KEY, stock integer NOT NULL)",
        "CREATE TABLE IF NOT EXISTS shop_sale (id integer PRIMARY KEY AUTOINCREMENT,"
        " ticket integer NOT NULL, buyer text NOT NULL, seen integer NOT NULL)",
    ],
}


def open_shop(using: str, ticket: int, stock: int) -> None:
    """Empty shop tables on database ``using``, with one ticket of ``stock`` seats."""
    from django.db import connections

    connection = connections[using]
    if connection.vendor == "sqlite":  # the in-memory test database the docs' pages share:
        close_shop(using)  # their shop app's tables have these names, other columns
    with connection.cursor() as cursor:
        for statement in TABLES[connection.vendor]:
            cursor.execute(statement)
        cursor.execute("DELETE FROM shop_sale")
        cursor.execute("DELETE FROM shop_ticket")
        cursor.execute("INSERT INTO shop_ticket (id, stock) VALUES (%s, %s)", [ticket, stock])


def close_shop(using: str) -> None:
    """Drop the shop tables again: the docs' pages define a ``shop`` app of their own, whose
    tables have these names."""
    from django.db import connections

    with connections[using].cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS shop_sale")
        cursor.execute("DROP TABLE IF EXISTS shop_ticket")


def sales(using: str, ticket: int | None = None) -> list[tuple[str, int]]:
    """(buyer, stock seen) of every sale, in order."""
    from django.db import connections

    with connections[using].cursor() as cursor:
        where = "" if ticket is None else f" WHERE ticket = {int(ticket)}"
        cursor.execute(f"SELECT buyer, seen FROM shop_sale{where} ORDER BY id")
        return [(str(b), int(s)) for b, s in cursor.fetchall()]


def sell_one(using: str, ticket: int, buyer: str, after_read: Any = None) -> bool:
    """Read the stock, and sell a seat if one is left (not atomic by itself)."""
    from django.db import connections

    with connections[using].cursor() as cursor:
        cursor.execute("SELECT stock FROM shop_ticket WHERE id = %s", [ticket])
        stock = int(cursor.fetchone()[0])
        if after_read is not None:
            after_read()
        if stock <= 0:
            return False
        cursor.execute("UPDATE shop_ticket SET stock = %s WHERE id = %s", [stock - 1, ticket])
        cursor.execute(
            "INSERT INTO shop_sale (ticket, buyer, seen) VALUES (%s, %s, %s)",
            [ticket, buyer, stock],
        )
    return True


def purchase(
    using: str, ticket: int, buyer: str, *, atomic: bool, gap: float, backend: str = "default"
) -> bool:
    """One purchase in a view under ATOMIC_REQUESTS: the lock is taken inside the request's
    transaction, and the commit comes ``gap`` seconds after the release (the response)."""
    from django.db import transaction

    from django_redlock import lock

    with transaction.atomic(using=using):
        with lock(f"ticket:{ticket}", ttl=10, using=backend, atomic=using if atomic else None):
            sold = sell_one(using, ticket, buyer)
        time.sleep(gap)
    return sold


_say = threading.Lock()


def say(*words: object) -> None:
    """One whole line (the watchdog thread says LOST while the main thread talks too)."""
    with _say:
        sys.stdout.write(" ".join(map(str, words)) + "\n")
        sys.stdout.flush()


def setup(url: str) -> None:
    from tests.support.settings import DATABASES, redlock_settings

    config = redlock_settings(url)
    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
        # Not the test settings' "down" alias (nobody listens there): its startup warning
        # would be the first line a reader of docs/topics/fencing.md sees.
        DJANGO_REDLOCK={k: v for k, v in config["DJANGO_REDLOCK"].items() if k != "down"},
        CACHES=config["CACHES"],
        DATABASES={"default": DATABASES["postgres"]},
        USE_TZ=True,
    )
    django.setup()


def buy(args: argparse.Namespace) -> None:
    """``--purchases`` purchases, one after the other, once the start key exists."""
    from django_redlock import locks

    client = locks["default"].client  # type: ignore[attr-defined]
    while not client.exists(args.start):  # every buyer starts together
        time.sleep(0.005)
    bought = 0
    for _ in range(args.purchases):
        bought += purchase("default", args.ticket, args.buyer, atomic=args.atomic, gap=args.gap)
    say("BOUGHT", bought)


def paused(args: argparse.Namespace) -> None:
    """Take the lock, say so, and wait for a line; then ("before") run the fenced block, or
    ("inside") run it first and wait in it. Says COMMITTED, or REFUSED with the error."""
    from django_redlock import LockError, lock
    from django_redlock.signals import lock_lost

    lock_lost.connect(lambda **kw: say("LOST", kw["reason"]), weak=False)
    held = lock(args.name, ttl=args.ttl, atomic="default", auto_renew=not args.no_renew)
    try:
        if args.when == "before":
            held.acquire()
            say("ACQUIRED", held.fence)
            sys.stdin.readline()
            with held.atomic():
                sell_one("default", args.ticket, args.buyer)
            with contextlib.suppress(Exception):
                held.release()
        else:
            with held:
                sell_one("default", args.ticket, args.buyer)
                say("INSIDE", held.fence)
                sys.stdin.readline()
    except LockError as exc:
        say("REFUSED", type(exc).__name__, exc)
        return
    say("COMMITTED")


def measure(args: argparse.Namespace) -> None:
    """The issue's measurement: ``--threads`` buyers of ``--purchases`` each, on a ticket of
    ``--tickets`` seats, ``--runs`` times; prints the seats sold per run."""
    results = []
    for run in range(args.runs):
        open_shop("default", 1, args.tickets)
        start = threading.Barrier(args.threads)

        def buyer(tag: str, start: threading.Barrier = start) -> None:
            start.wait()
            for _ in range(args.purchases):
                purchase("default", 1, tag, atomic=args.atomic, gap=args.gap)

        threads = [
            threading.Thread(target=buyer, args=(f"{run}.{i}",)) for i in range(args.threads)
        ]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - began
        results.append(len(sales("default")))
        attempts = args.threads * args.purchases
        say("RUN", run, "sold", results[-1], "of", args.tickets, f"{attempts / elapsed:.0f}/s")
    say("SOLD", *results)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", help="the Redis; measure starts its own servers without it")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("buy")
    p.add_argument("--start", required=True)
    p.add_argument("--ticket", type=int, default=1)
    p.add_argument("--buyer", required=True)
    p.add_argument("--purchases", type=int, default=8)
    p.add_argument("--gap", type=float, default=0.01)
    p.add_argument("--atomic", action="store_true")
    p = sub.add_parser("paused")
    p.add_argument("--name", required=True)
    p.add_argument("--when", choices=["before", "inside"], required=True)
    p.add_argument("--ticket", type=int, default=1)
    p.add_argument("--buyer", default="paused")
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--no-renew", action="store_true")
    p = sub.add_parser("measure")
    p.add_argument("--threads", type=int, default=6)
    p.add_argument("--purchases", type=int, default=4)
    p.add_argument("--tickets", type=int, default=10)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--gap", type=float, default=0.01)
    p.add_argument("--atomic", action="store_true")
    args = parser.parse_args(argv)
    if args.url is None:
        if args.action != "measure":
            parser.error("--url is required")
        with contextlib.ExitStack() as servers:
            args.url = own_servers(servers)
            measure(args)
        return
    setup(args.url)
    {"buy": buy, "paused": paused, "measure": measure}[args.action](args)


def own_servers(servers: contextlib.ExitStack) -> str:
    """A PostgreSQL with a migrated database, and a redis-server (stopped with ``servers``):
    settings configured; the Redis URL."""
    import os

    import psycopg
    from django.core.management import call_command

    from django_redlock.testing import PostgresServer, RedisServer

    pg = servers.enter_context(PostgresServer())
    redis = servers.enter_context(RedisServer())
    with psycopg.connect(
        host=pg.host, port=pg.port, user=pg.user, dbname="postgres", autocommit=True
    ) as conn:
        conn.execute("CREATE DATABASE redlock")
    os.environ.update(REDLOCK_TEST_PG_PORT=str(pg.port), REDLOCK_TEST_PG_NAME="redlock")
    setup(redis.url)
    call_command("migrate", verbosity=0)
    return redis.url


if __name__ == "__main__":
    main()
