"""A ``lock_all`` client run as its own process by tests/locks/test_lock_all.py:
``python -m tests.support.multi_child --url REDIS ACTION ...``; one line per event on stdout.

* ``contend --names a,b --rounds N --start KEY`` (``--nodes URLS``: on a Redlock quorum of
  them; the counter stays on --url): once KEY exists, N times take every name and check,
  inside, that nobody else is inside (a counter in Redis); says ``DONE <overlaps>
  <outages>`` (errors of the lock service, waited out).
* ``hold --names a,b --ttl S``: take them, say ``HELD <fences>``, wait (to be SIGKILLed).
* ``paused --names a,b --ttl S --when before|inside [--no-renew]`` (PostgreSQL from the
  environment, as tests/support/fenced_child.py): take them, then ("before") say
  ``ACQUIRED``, wait for a line and run the fenced block, or ("inside") run it, say ``INSIDE``
  and wait in it. Says
  ``COMMITTED``, or ``REFUSED <error>``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from .child import say as child_say


def contend(args: argparse.Namespace) -> None:
    from django_redlock import LockError, lock_all, locks

    client = locks["store"].client  # type: ignore[attr-defined]  # the --url server
    while not client.exists(args.start):  # every process starts together
        time.sleep(0.005)
    names = args.names.split(",")
    overlaps = done = outages = 0
    while done < args.rounds:
        ran = False
        try:
            with lock_all(*names, ttl=5, timeout=120):
                overlaps += client.incr(f"{args.start}:inside") != 1
                client.incr(f"{args.start}:total")
                client.decr(f"{args.start}:inside")
                ran = True
        except LockError as exc:  # a Redlock quorum too slow on a loaded machine: again
            outages += 1
            if outages % 20 == 1:
                print(f"outage {outages}: {exc}", file=sys.stderr, flush=True)
            time.sleep(0.05)
        done += ran
    say("DONE", overlaps, outages)


def hold(args: argparse.Namespace) -> None:
    from django_redlock import lock_all

    with lock_all(*args.names.split(","), ttl=args.ttl) as held:
        say("HELD", *held.fences.values())
        sys.stdin.readline()


def paused(args: argparse.Namespace) -> None:
    from django_redlock import LockError, lock_all
    from django_redlock.signals import lock_lost

    from .fenced_child import sell_one

    lock_lost.connect(lambda **kw: say("LOST", kw["lock"].name), weak=False)
    held = lock_all(
        *args.names.split(","), ttl=args.ttl, atomic="default", auto_renew=not args.no_renew
    )
    try:
        if args.when == "before":
            held.acquire()
            say("ACQUIRED", *held.fences.values())
            sys.stdin.readline()
            with held.atomic():
                sell_one("default", 1, "paused")
            with contextlib.suppress(Exception):
                held.release()
        else:
            with held:
                sell_one("default", 1, "paused")
                say("INSIDE", *held.fences.values())
                sys.stdin.readline()
    except LockError as exc:
        say("REFUSED", type(exc).__name__, exc)
        return
    say("COMMITTED")


def say(*words: object) -> None:
    """One whole line (``lock_lost`` speaks from the watchdog's thread: a fresh-clone run read
    ``COMMITTEDLOST pg:a`` from two ``print`` calls interleaved)."""
    child_say(*words)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--nodes", help="a Redlock quorum over these servers (comma-separated)")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("contend")
    p.add_argument("--names", required=True)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--start", required=True)
    p = sub.add_parser("hold")
    p.add_argument("--names", required=True)
    p.add_argument("--ttl", type=float, default=1.0)
    p = sub.add_parser("paused")
    p.add_argument("--names", required=True)
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--when", choices=["before", "inside"], required=True)
    p.add_argument("--no-renew", action="store_true")
    args = parser.parse_args(argv)
    if args.action == "paused":
        from .fenced_child import setup as with_database

        with_database(args.url)
    else:
        from .child import setup

        setup(args.url, "redis", args.nodes)
    {"contend": contend, "hold": hold, "paused": paused}[args.action](args)


if __name__ == "__main__":
    main()
