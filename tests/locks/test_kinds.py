"""One name is one kind at a time: a lock (plain, reentrant or fair), a semaphore, a
read-write lock. Taking a name held as another kind raises LockError naming both kinds, on
every backend alike, at once: it never grants beside the other kind and never waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import LockError, lock, lock_all, locks, read_write_lock, semaphore

Maker = Callable[[str, str], Any]

KINDS: dict[str, tuple[str, Maker]] = {
    "plain": ("lock", lambda n, a: lock(n, using=a, ttl=10)),
    "reentrant": ("lock", lambda n, a: lock(n, using=a, ttl=10, reentrant=True)),
    "fair": ("lock", lambda n, a: lock(n, using=a, ttl=10, fair=True)),
    "semaphore": ("semaphore", lambda n, a: semaphore(n, 2, using=a, ttl=10)),
    "read": ("rw", lambda n, a: read_write_lock(n, using=a, ttl=10).read()),
    "write": ("rw", lambda n, a: read_write_lock(n, using=a, ttl=10).write()),
}
WORDS = {"lock": "lock", "semaphore": "semaphore", "rw": "read-write lock"}
CLASHES = [
    (held, asking) for held in KINDS for asking in KINDS if KINDS[held][0] != KINDS[asking][0]
]


@pytest.mark.parametrize(("held", "asking"), CLASHES)
def test_a_name_held_as_another_kind_is_an_error(
    alias: str, name: str, held: str, asking: str
) -> None:
    holder = KINDS[held][1](name, alias)
    assert holder.acquire(blocking=False)
    try:
        challenger = KINDS[asking][1](name, alias)
        word = WORDS[KINDS[held][0]]
        with pytest.raises(LockError, match=f"another kind, a {word}"):
            challenger.acquire(blocking=False)
        started = time.monotonic()
        with pytest.raises(LockError, match="one name is one kind at a time"):
            challenger.acquire(timeout=5)  # at once: no silent wait
        assert time.monotonic() - started < 2
        assert not challenger.owned()
        assert holder.owned()
        [info] = [i for i in [holder.backend.inspect(name)] if i is not None]
        assert info.hold_count == 1  # nothing granted beside it
    finally:
        holder.release()
    challenger = KINDS[asking][1](name, alias)
    assert challenger.acquire(blocking=False)  # free again: any kind takes it
    challenger.release()


@pytest.mark.parametrize("held", ["semaphore", "read"])
def test_lock_all_on_a_name_held_as_another_kind(alias: str, name: str, held: str) -> None:
    holder = KINDS[held][1](name, alias)
    assert holder.acquire(blocking=False)
    try:
        together = lock_all(f"{name}:a", name, using=alias)
        with pytest.raises(LockError, match="another kind"), together:
            pass
        assert not lock(f"{name}:a", using=alias).locked()  # nothing kept of the set
    finally:
        holder.release()


def test_expired_leases_do_not_keep_a_lock_out(alias: str, name: str) -> None:
    """A semaphore whose permits all expired (the key still there, with a longer TTL than
    its last live lease) is no holder: a lock takes the name at once."""
    long = semaphore(name, 2, using=alias, ttl=10, auto_renew=False)
    short = semaphore(name, 2, using=alias, ttl=0.2, auto_renew=False)
    assert long.acquire(blocking=False) and short.acquire(blocking=False)
    long.release()
    time.sleep(0.3)
    taker = lock(name, using=alias, ttl=10)
    assert taker.acquire(blocking=False)
    assert taker.owned()
    taker.release()


@pytest.mark.parametrize("shorten", ["release", "extend", "force"])
def test_a_name_whose_leases_ended_is_free_for_every_look(
    alias: str, name: str, shorten: str
) -> None:
    """The longest lease goes (released, extended shorter, force-released) and the rest
    expire: the name's key goes with them, so a lock's locked() and ttl() and the backend's
    is_locked() say free, as LocMem does, instead of seeing a set of expired leases."""
    long = semaphore(name, 2, using=alias, ttl=10, auto_renew=False)
    short = semaphore(name, 2, using=alias, ttl=0.2, auto_renew=False)
    assert long.acquire(blocking=False) and short.acquire(blocking=False)
    if shorten == "release":
        long.release()
    elif shorten == "extend":
        long.extend(0.2)
    else:
        assert locks[alias].force_release(name, token=long.token)
    time.sleep(0.35)
    plain = lock(name, using=alias)
    assert not plain.locked()
    assert plain.ttl() is None
    assert not locks[alias].is_locked(name)


def test_the_asyncio_api_says_the_same(alias: str, name: str) -> None:
    async def clash() -> None:
        holder = semaphore(name, 2, using=alias, ttl=10)
        assert await holder.aacquire(blocking=False)
        try:
            with pytest.raises(LockError, match="another kind, a semaphore"):
                await lock(name, using=alias).aacquire(timeout=5)
            with pytest.raises(LockError, match="another kind, a semaphore"):
                await read_write_lock(name, using=alias).write().aacquire(timeout=5)
        finally:
            await holder.arelease()

    asyncio.run(clash())
