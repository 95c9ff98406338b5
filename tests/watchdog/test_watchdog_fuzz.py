"""A seeded fuzz of the watchdog's rules (django_redlock/renewer.py) on two real redis-servers:
acquires, releases, extends to other TTLs, adoptions, reentrant holds shared by two objects,
Lock objects dropped without release and collected, a server paused (never past a TTL),
asynchronous exceptions thrown into the watchdog's threads. After every step, every hold that
its Lock object reports held has its key on the server with time left, and ``owned()`` says
so; no loss is reported (nothing here may lose a hold); at the end the renewer's tables and
the taken registry are back where they started.

``WATCHDOG_FUZZ_SEED`` picks the seed (printed); ``WATCHDOG_FUZZ_STEPS`` the length.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.conf import settings
from django.test import override_settings

from django_redlock import LockError, lock, read_write_lock
from django_redlock.locking import holds
from django_redlock.renewer import thread_renewer
from django_redlock.signals import lock_lost
from django_redlock.testing import RedisServer

# A pause lasts 0.4 s at most, but its resume is a Timer thread, which a loaded machine runs
# late (seen 0.94 s late beside two CPU burners): TTLs leave room for both.
TTLS = (3.0, 4.0, 6.0)
ALIASES = ("fuzz_a", "fuzz_b")


class Fuzz:
    def __init__(self, rng: random.Random, servers: dict[str, RedisServer], name: str) -> None:
        self.rng, self.servers, self.name = rng, servers, name
        self.held: list[Any] = []  # Lock objects that report a hold
        self.paused: str | None = None
        self.pause_lock = threading.Lock()
        self.injected = 0

    # -- steps ----------------------------------------------------------------------------------

    def acquire(self) -> None:
        alias = self.rng.choice(ALIASES)
        kind = self.rng.choice(("plain", "plain", "reentrant", "read"))
        name = f"{self.name}:{self.rng.randrange(12)}"
        ttl = self.rng.choice(TTLS)
        if kind == "read":
            lk = read_write_lock(name, using=alias, ttl=ttl).read()
        else:
            lk = lock(name, using=alias, ttl=ttl, reentrant=kind == "reentrant")
        with contextlib.suppress(LockError):  # another kind holds the name: fine
            if lk.acquire(blocking=False):
                self.held.append(lk)

    def share(self) -> None:
        """A second object of one reentrant or read hold of this thread: same token."""
        shared = [lk for lk in self.held if lk.reentrant]
        if not shared:
            return
        first = self.rng.choice(shared)
        if first.noun == "lock":
            second = lock(first.name, using=first.using, ttl=first.lock_ttl, reentrant=True)
        else:
            second = read_write_lock(first.name, using=first.using, ttl=first.lock_ttl).read()
        assert second.acquire(blocking=False)
        assert second.token == first.token
        self.held.append(second)

    def adopt(self) -> None:
        """Hand a plain hold to a new object, and drop the old one without releasing."""
        plain = [lk for lk in self.held if not lk.reentrant]
        if not plain:
            return
        old = self.rng.choice(plain)
        new = lock(old.name, using=old.using, ttl=self.rng.choice(TTLS))
        new.adopt(old.token)
        self.held.remove(old)
        self.held.append(new)
        del old
        gc.collect()

    def release(self) -> None:
        if self.held:
            lk = self.held.pop(self.rng.randrange(len(self.held)))
            lk.release()

    def extend(self) -> None:
        if self.held:
            self.rng.choice(self.held).extend(self.rng.choice(TTLS))

    def abandon(self) -> None:
        """Drop a plain hold's object unreleased: it is no longer reported held; it runs out."""
        plain = [lk for lk in self.held if not lk.reentrant]
        if plain:
            self.held.remove(self.rng.choice(plain))
            del plain
            gc.collect()

    def pause(self) -> None:
        with self.pause_lock:
            if self.paused is not None:
                return
            alias = self.paused = self.rng.choice(ALIASES)
        seconds = self.rng.uniform(0.1, 0.4)
        self.servers[alias].pause()

        def resume() -> None:
            with self.pause_lock:
                self.servers[alias].resume()
                self.paused = None

        threading.Timer(seconds, resume).start()

    def inject(self) -> None:
        """An asynchronous exception in a watchdog thread, wherever it is."""
        threads = [t for t in threading.enumerate() if t.name.startswith("redlock-renew")]
        if threads:
            thread = self.rng.choice(threads)
            exc = self.rng.choice((SystemExit, KeyboardInterrupt, RuntimeError))
            ident = ctypes.c_ulong(thread.ident or 0)
            self.injected += ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ident, ctypes.py_object(exc)
            )

    def wait(self) -> None:
        time.sleep(self.rng.uniform(0.02, 0.25))

    # -- the invariant --------------------------------------------------------------------------

    def check(self, step: int, action: str) -> None:
        for lk in self.held:
            token = lk.token
            assert token is not None, (step, action, lk)
            # ttl(): this hold's time left (a lease's own; a lock key's PTTL). Asked while
            # its server is paused, the answer comes after the resume (within a TTL).
            left = lk.ttl()
            assert left is not None and left > 0, (step, action, lk, left, _watched(lk, token))
            assert lk.owned(), (step, action, lk)


def _watched(lk: Any, token: str) -> tuple[Any, ...]:
    """What the watchdog has of a hold, for a failure's message: an entry dropped (a bug)
    or renewals late (a starved process) read differently."""
    with thread_renewer._mutex:
        now = time.monotonic()
        for key, entry in thread_renewer._entries.items():
            if key[1:] == (lk.name, token):
                bucket = entry.bucket
                if bucket is None:
                    return ("entry without bucket", entry.renewal.ttl_ms)
                return (
                    "entry", entry.renewal.ttl_ms, len(entry.locks),
                    f"due in {bucket.due - now:.3f}",
                    f"confirmed for {bucket.confirmed_until - now:.3f}",
                    f"settled {now - bucket.settled_at:.3f} ago", bucket.flying is not None,
                )  # fmt: skip
        pending = any(item[2].token == token for item in thread_renewer._pending)
    return ("no entry", "pending" if pending else "not pending")


@contextlib.contextmanager
def _servers(start: Callable[..., RedisServer]) -> Iterator[dict[str, RedisServer]]:
    servers = {alias: start() for alias in ALIASES}
    configs = {
        alias: {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
        for alias, server in servers.items()
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, **configs}):
        yield servers


def test_watchdog_fuzz(redis_factory: Callable[..., RedisServer], name: str) -> None:
    seed = int(os.environ.get("WATCHDOG_FUZZ_SEED") or random.randrange(1 << 30))
    # 120 steps in make test (about 12 s; a new seed each run): WATCHDOG_FUZZ_STEPS for more.
    steps = int(os.environ.get("WATCHDOG_FUZZ_STEPS") or 120)
    print(f"watchdog fuzz: seed {seed}, {steps} steps")
    rng = random.Random(seed)
    lost: list[tuple[Any, str]] = []

    def on_lost(sender: Any, lock: Any, reason: str, **_: Any) -> None:
        lost.append((lock, reason))

    taken_before = holds.taken_count()
    tables_before = thread_renewer.tables()  # other tests' holds: counted relatively
    lock_lost.connect(on_lost, weak=False)
    try:
        with _servers(redis_factory) as servers:
            fuzz = Fuzz(rng, servers, name)
            actions: list[tuple[Callable[[], None], int]] = [
                (fuzz.acquire, 6), (fuzz.release, 3), (fuzz.extend, 3), (fuzz.share, 2),
                (fuzz.adopt, 2), (fuzz.abandon, 1), (fuzz.pause, 2), (fuzz.inject, 2),
                (fuzz.wait, 4),
            ]  # fmt: skip
            population = [a for a, weight in actions for _ in range(weight)]
            for step in range(steps):
                action = rng.choice(population)
                action()
                fuzz.check(step, action.__name__)
                assert not lost, (seed, step, action.__name__, lost)
            time.sleep(max(TTLS))  # past every TTL: renewed holds still there
            fuzz.check(steps, "the end")
            while fuzz.held:
                fuzz.release()
            assert not lost, (seed, lost)
            print(f"watchdog fuzz: {fuzz.injected} asynchronous exceptions thrown in")
            time.sleep(0.5)
            tables = thread_renewer.tables()
            assert tables["entries"] <= tables_before["entries"], (tables_before, tables)
            assert tables["open"] <= tables_before["open"], (tables_before, tables)
            gc.collect()
            assert holds.taken_count() <= taken_before
    finally:
        lock_lost.disconnect(on_lost)
