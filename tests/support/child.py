"""A lock client run as its own process by the tests: ``python -m tests.support.child ACTION ...``.

It prints one line per event (``ACQUIRED <fence>``, ``LOST``, ...) and takes commands on stdin,
so tests can pause, kill and question a real holder.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import signal
import sys
import threading
import time
from typing import Any

import django
from django.conf import settings


def setup(url: str, backend: str, nodes: str | None = None) -> None:
    from tests.support.settings import redlock_settings

    config = redlock_settings(url)
    aliases = config["DJANGO_REDLOCK"]
    assert isinstance(aliases, dict)
    chosen = aliases.get(backend, aliases["redis"])
    if backend == "cluster":  # --url: any node of a Redis Cluster
        chosen = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend", "LOCATION": url}
    elif backend == "sentinel":  # --nodes: the sentinels' URLs
        chosen = {
            "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
            "LOCATION": (nodes or "").split(","),
            "OPTIONS": {"service_name": "mymaster"},
        }
        nodes = None
    if nodes:  # a Redlock quorum over these servers
        chosen = {
            "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
            "LOCATION": nodes.split(","),
        }
    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},  # no database in these processes
        DJANGO_REDLOCK={"default": chosen, "store": aliases["redis"]},
        CACHES=config["CACHES"],
        USE_TZ=True,
    )
    django.setup()


_said = threading.Lock()


def say(*words: object) -> None:
    """One whole line per event: ``lock_lost`` receivers speak from the watchdog's notifier
    thread, and ``print`` writes each word separately."""
    line = " ".join(map(str, words)) + "\n"
    with _said:
        sys.stdout.write(line)
        sys.stdout.flush()


def sell(args: argparse.Namespace) -> None:
    """The classic ticket sale: a non-atomic read-modify-write, made safe by the lock.

    An outage of the lock service (too few Redlock nodes) is waited out, as a real shop would.
    """
    from django_redlock import LockError, lock, locks

    client = locks["store"].client  # type: ignore[attr-defined]
    sold = outages = 0
    say("READY")  # the sale opens when the stock is put in: every seller starts at once
    while client.get(args.stock) is None:
        time.sleep(0.01)
    while True:
        try:
            with lock(args.name, ttl=5):
                left = int(client.get(args.stock))
                if left <= 0:
                    break
                time.sleep(0.0005)  # widen the race window the lock must close
                client.set(args.stock, left - 1)
                client.rpush(args.ledger, left)
                sold += 1
        except LockError as exc:  # Redlock: too few nodes; or lost at release after the sale
            outages += 1
            if outages % 50 == 1:
                print(f"outage {outages}: {exc}", file=sys.stderr, flush=True)
            time.sleep(0.05)
    say("SOLD", sold, outages)


def serve(box: list[Any]) -> None:
    """Answer the commands on stdin about the hold in ``box``, its only reference."""
    from django_redlock import LockError

    for line in sys.stdin:
        command = line.strip()
        if command == "release":
            try:
                box[0].release()
                say("RELEASED")
            except LockError as exc:
                say("NOT_OWNED", type(exc).__name__)
        elif command == "owned":
            say("OWNED", box[0].owned())
        elif command == "token":
            say("TOKEN", box[0].token)
        elif command == "drop":  # let go of the object, unreleased (a hand-over's end)
            box.clear()
            gc.collect()
            say("DROPPED")
        elif command == "exit":
            return


def hold(args: argparse.Namespace) -> None:
    from django_redlock import lock
    from django_redlock.signals import lock_lost

    lock_lost.connect(lambda **kw: say("LOST", kw["reason"]), weak=False)
    held = lock(args.name, ttl=args.ttl, auto_renew=not args.no_renew)
    held.acquire()
    say("ACQUIRED", held.fence)
    box = [held]
    del held  # the box's is the only reference: "drop" lets go of it
    serve(box)


def queue(args: argparse.Namespace) -> None:
    """Wait in a lock's queue; on our turn, note our tag in Redis, hold briefly, release."""
    from django_redlock import lock, locks

    client = locks["default"].client  # type: ignore[attr-defined]
    held = lock(args.name, ttl=5, fair=args.fair)
    say("WAITING")
    if held.acquire(timeout=args.timeout):
        client.rpush(args.order, args.tag)
        time.sleep(args.hold)
        held.release()
        say("DONE")
    else:
        say("TIMEOUT")


def contend(args: argparse.Namespace) -> None:
    """Take the lock ``rounds`` times as fast as possible; report the longest wait."""
    from django_redlock import lock, locks

    client = locks["default"].client  # type: ignore[attr-defined]
    while not client.exists(args.start):  # all contenders start together
        time.sleep(0.005)
    worst = 0.0
    for _ in range(args.rounds):
        started = time.monotonic()
        with lock(args.name, ttl=5, fair=args.fair):
            worst = max(worst, time.monotonic() - started)
            time.sleep(args.hold)
    say("WORST", worst)


def sem_cycles(args: argparse.Namespace) -> None:
    """Take a permit ``rounds`` times; count the holders in Redis while holding."""
    from django_redlock import locks, semaphore

    client = locks["store"].client  # type: ignore[attr-defined]
    while not client.exists(args.start):  # all contenders start together
        time.sleep(0.005)
    for _ in range(args.rounds):
        with semaphore(args.name, args.limit, ttl=5) as held:
            now = client.incr(f"{args.name}:now")
            client.rpush(f"{args.name}:peaks", now)
            free = held.available()
            if not 0 <= free <= args.limit - 1:
                client.rpush(f"{args.name}:bad", f"available {free} while holding")
            client.rpush(f"{args.name}:fences", held.fence or 0)
            time.sleep(args.hold)
            client.decr(f"{args.name}:now")
    say("DONE")


def lease(args: argparse.Namespace) -> None:
    """Hold a permit (or a read or write lock), wait for commands; or wait for one, then
    hold it (``--wait``), saying when it came (wall clock, to compare with the test's)."""
    from django_redlock import read_write_lock, semaphore
    from django_redlock.signals import lock_lost

    lock_lost.connect(lambda **kw: say("LOST", kw["reason"]), weak=False)
    renew = not args.no_renew
    if args.kind == "sem":
        held: Any = semaphore(args.name, args.limit, ttl=args.ttl, auto_renew=renew)
    else:
        rw = read_write_lock(args.name, ttl=args.ttl, auto_renew=renew)
        held = rw.read() if args.kind == "read" else rw.write()
    say("WAITING")
    if not held.acquire(timeout=args.timeout):
        say("TIMEOUT")
        return
    say("ACQUIRED", held.fence, time.time())
    box = [held]
    del held  # the box's is the only reference: "drop" lets go of it
    serve(box)


def lead(args: argparse.Namespace) -> None:
    """A leader candidate: ``LEADING <fence>`` once it leads, ``LOST <reason>`` when
    leadership ends; ``resign`` on stdin leaves the block, ``exit`` ends the process
    (``--in-thread``: leading from a daemon thread, which exit leaves in its block)."""
    from django_redlock import leader

    commands: list[str] = []
    arrived = threading.Event()

    def read() -> None:
        for line in sys.stdin:
            commands.append(line.strip())
            arrived.set()

    threading.Thread(target=read, daemon=True).start()

    def campaign() -> None:
        with leader(args.name, ttl=args.ttl) as term:
            say("LEADING", term.fence)
            if args.work:  # 5 ms steps of work, term.lost looked at before each
                last_false = 0.0
                while True:
                    until = time.monotonic() + 0.005
                    while time.monotonic() < until:
                        pass
                    looked = time.monotonic()
                    if term.lost.is_set():
                        break
                    last_false = looked
                say("LOST", term.reason)
                say("LAST_FALSE", last_false)  # the last look that said "leading"
            while not term.lost.is_set() and "resign" not in commands:
                arrived.wait(0.01)
                arrived.clear()
            if term.lost.is_set():
                say("LOST", term.reason)
        say("RESIGNED")

    say("CAMPAIGNING")
    if args.in_thread:  # "exit" ends the process cleanly, the daemon thread still leading
        threading.Thread(target=campaign, daemon=True).start()
    else:
        campaign()
    while "exit" not in commands:
        arrived.wait(0.1)
        arrived.clear()


def who(args: argparse.Namespace) -> None:
    """``LEADER <host> <pid> <fence>`` from current_leader(), or ``NOBODY``."""
    import socket

    from django_redlock import current_leader

    now = current_leader(args.name)
    if now is None:
        say("NOBODY")
    else:
        say("LEADER", now.host == socket.gethostname(), now.pid, now.fence)


def main() -> None:
    # The test that waits too long for a line asks for every thread's stack (conftest.Child).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--backend", default="redis")
    parser.add_argument("--nodes", help="comma-separated Redis URLs of a Redlock quorum")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("sell")
    p.add_argument("--name", required=True)
    p.add_argument("--stock", required=True)
    p.add_argument("--ledger", required=True)
    p = sub.add_parser("hold")
    p.add_argument("--name", required=True)
    p.add_argument("--ttl", type=float, default=30.0)
    p.add_argument("--no-renew", action="store_true")
    p = sub.add_parser("queue")
    p.add_argument("--name", required=True)
    p.add_argument("--order", required=True)
    p.add_argument("--tag", required=True)
    # Long: tests start waiters one after the other (slowly on a loaded machine) and a first
    # waiter that gave up meanwhile would leave the queue short.
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--hold", type=float, default=0.02)
    p.add_argument("--fair", action="store_true")
    p = sub.add_parser("contend")
    p.add_argument("--name", required=True)
    p.add_argument("--start", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--hold", type=float, default=0.01)
    p.add_argument("--fair", action="store_true")
    p = sub.add_parser("sem_cycles")
    p.add_argument("--name", required=True)
    p.add_argument("--start", required=True)
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--hold", type=float, default=0.005)
    p = sub.add_parser("lease")
    p.add_argument("--name", required=True)
    p.add_argument("--kind", choices=["sem", "read", "write"], default="sem")
    p.add_argument("--limit", type=int, default=1)
    p.add_argument("--ttl", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--no-renew", action="store_true")
    p = sub.add_parser("lead")
    p.add_argument("--name", required=True)
    p.add_argument("--ttl", type=float, default=3.0)
    p.add_argument("--in-thread", action="store_true", help="lead from a daemon thread")
    p.add_argument("--work", action="store_true", help="busy steps until term.lost")
    p = sub.add_parser("who")
    p.add_argument("--name", required=True)
    args = parser.parse_args()
    setup(args.url, args.backend, args.nodes)
    actions = {"sell": sell, "hold": hold, "queue": queue, "contend": contend,
               "sem_cycles": sem_cycles, "lease": lease, "lead": lead, "who": who}  # fmt: skip
    actions[args.action](args)


if __name__ == "__main__":
    main()
