"""One contending process of the contended benchmarks: takes a lock as often as it can for
--seconds, holding it --hold seconds, and prints JSON: its acquire/release times (the machine's
monotonic clock, shared by all processes), its waits, and the Redis commands it sent."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import redis
import redis.connection

SENT = [0]  # Redis commands this process sent: single ones, and each one of a pipeline
_send_command = redis.connection.AbstractConnection.send_command
_pack_commands = redis.connection.AbstractConnection.pack_commands


def _counted_send(self: Any, *args: Any, **kwargs: Any) -> None:
    SENT[0] += 1
    _send_command(self, *args, **kwargs)


def _counted_pack(self: Any, commands: Any) -> Any:
    commands = list(commands)
    SENT[0] += len(commands)
    return _pack_commands(self, commands)


redis.connection.AbstractConnection.send_command = _counted_send  # type: ignore[method-assign]
redis.connection.AbstractConnection.pack_commands = _counted_pack  # type: ignore[method-assign]


def _count_direct() -> None:
    """Our lock commands go out packed by django_redlock.wire itself, past send_command."""
    from django_redlock import wire

    pack = wire.pack

    def counted(conn: Any, args: Any) -> Any:
        SENT[0] += 1
        return pack(conn, args)

    wire.pack = counted


_count_direct()


SEMAPHORE_LIMIT = 3  # the semaphore scenarios: at most 3 holders


def make_lock(lib: str, url: str, name: str) -> Any:
    """An object with acquire() and release() for each library, blocking, 30 s TTL."""
    if lib in ("ours", "ours-fair", "ours-semaphore"):
        import django
        from django.conf import settings

        if not settings.configured:
            settings.configure(
                INSTALLED_APPS=["django_redlock"],
                DJANGO_REDLOCK={"default": {"BACKEND": "django_redlock.backends.redis.RedisBackend",
                                            "LOCATION": url}},
                DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
            )  # fmt: skip
            django.setup()
        from django_redlock import lock, semaphore

        if lib == "ours-semaphore":
            return lambda: semaphore(name, SEMAPHORE_LIMIT, ttl=30)
        return lambda: lock(name, ttl=30, fair=lib == "ours-fair")
    client = redis.Redis.from_url(url)
    if lib == "sorted-set-semaphore":  # the hand-rolled recipe: polls every 10 ms
        from sorted_set_semaphore import SortedSetSemaphore

        return lambda: SortedSetSemaphore(client, name, SEMAPHORE_LIMIT)
    if lib == "redis-py":
        return lambda: client.lock(name, timeout=30)  # polls every 0.1 s (its default)
    if lib == "python-redis-lock":
        import redis_lock

        return lambda: redis_lock.Lock(client, name, expire=30)  # waits on BLPOP
    if lib == "pottery":
        from pottery import Redlock

        return lambda: Redlock(key=name, masters={client}, auto_release_time=30)
    raise SystemExit(f"unknown library {lib}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--start", required=True, help="a key whose appearance starts the run")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--contenders", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    new_lock = make_lock(args.lib, args.url, args.name)
    starter = redis.Redis.from_url(args.url)
    while not starter.exists(args.start):
        time.sleep(0.002)
    SENT[0] = 0
    spans, waits = [], []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        held = new_lock()
        asked = time.monotonic()
        held.acquire()
        got = time.monotonic()
        if args.hold:
            time.sleep(args.hold)
        released = time.monotonic()
        held.release()
        spans.append((got, released))
        waits.append(got - asked)
    sent = SENT[0]
    # Stay quiet until every contender is done: processes exiting (and printing) while the
    # others still contend would take CPU from them and lengthen their last waits.
    starter.incr(f"{args.start}:done")
    while int(starter.get(f"{args.start}:done") or 0) < args.contenders:
        time.sleep(0.01)
    print(json.dumps({"spans": spans, "waits": waits, "sent": sent}), flush=True)


if __name__ == "__main__":
    main()
