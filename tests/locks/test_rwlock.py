"""Read-write locks: many readers or one writer; waiting writers block new readers; reads
reentrant per owner; no upgrade; on every single-master backend."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import (
    BackendUnavailable,
    LockError,
    LockLost,
    ReadWriteLock,
    locks,
    read_write_lock,
    semaphore,
)

from ..support.proxy import LossyProxy


def test_readers_overlap_writer_excludes(alias: str, name: str) -> None:
    rw = read_write_lock(name, using=alias, ttl=10)
    inside, peak, lock = [0], [0], threading.Lock()
    barrier = threading.Barrier(3)

    def read() -> None:
        with rw.read(timeout=5):
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            barrier.wait(5)  # all three inside at once
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak[0] == 3
    reader = rw.read()
    assert reader.acquire(blocking=False)
    writer = rw.write()
    tried: list[bool] = []
    thread = threading.Thread(target=lambda: tried.append(writer.acquire(blocking=False)))
    thread.start()
    thread.join()
    assert tried == [False]
    assert writer.locked() and not reader.locked()
    reader.release()
    assert writer.acquire(blocking=False)
    other_thread: list[bool] = []
    thread = threading.Thread(target=lambda: other_thread.append(rw.read().acquire(False)))
    thread.start()
    thread.join()
    assert other_thread == [False]
    assert not rw.write().acquire(blocking=False)
    assert [h.kind for h in rw.holders()] == ["write"]
    writer.release()
    assert locks[alias].inspect(name) is None


def test_waiting_writer_blocks_new_readers(alias: str, name: str) -> None:
    rw = read_write_lock(name, using=alias, ttl=10)
    first = rw.read()
    first.acquire()
    events: list[str] = []

    def write() -> None:
        with rw.write(timeout=10):
            events.append("write")
            time.sleep(0.1)
            # Inside the hold: after it, the late reader may get in before this line runs.
            events.append("write done")

    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 5
    while (info := locks[alias].inspect(name)) is None or info.waiters < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    tried: list[bool] = []
    other = threading.Thread(target=lambda: tried.append(rw.read().acquire(blocking=False)))
    other.start()
    other.join()
    assert tried == [False]  # another owner's new read is refused: a writer waits
    again = rw.read()
    assert again.acquire(blocking=False)  # a re-entry is not (it would deadlock the writer)
    again.release()

    def late_read() -> None:
        with rw.read(timeout=10):
            events.append("late read")

    reader = threading.Thread(target=late_read)
    reader.start()
    time.sleep(0.1)
    assert events == []
    first.release()
    writer.join(10)
    reader.join(10)
    assert events == ["write", "write done", "late read"]


def test_interleaved_arrivals_keep_writer_preference(alias: str, name: str) -> None:
    rw = read_write_lock(name, using=alias, ttl=10)
    log: list[tuple[str, int]] = []
    state = {"readers": 0, "writers": 0}
    mutex = threading.Lock()

    def run(kind: str, tag: int) -> None:
        held = rw.write(timeout=20) if kind == "w" else rw.read(timeout=20)
        with held:
            with mutex:
                state["readers" if kind == "r" else "writers"] += 1
                assert state["writers"] <= 1
                assert not (state["writers"] and state["readers"])
                log.append((kind, tag))
            time.sleep(0.2)
            with mutex:
                state["readers" if kind == "r" else "writers"] -= 1

    with rw.write(timeout=5):  # connected, scripts loaded: arrivals are not a connect apart
        pass
    threads = []
    for tag, kind in enumerate("rrwrrwrr"):
        threads.append(threading.Thread(target=run, args=(kind, tag)))
        threads[-1].start()
        time.sleep(0.05)  # arrivals apart by more than a loaded machine's jitter
    for t in threads:
        t.join(30)
    assert len(log) == 8
    # The writer arriving third goes before the readers arriving after it.
    order = [tag for _, tag in log]
    assert order.index(2) < order.index(3) and order.index(2) < order.index(4)


def test_reentrant_reads_and_no_upgrade(alias: str, name: str) -> None:
    rw = read_write_lock(name, using=alias)
    outer = rw.read()
    outer.acquire()
    inner = rw.read()
    assert inner.acquire(blocking=False)
    assert outer.acquire(blocking=False)  # the same object again, reentrant
    assert outer.hold_count() == 3
    (holder,) = rw.holders()
    assert holder.kind == "read" and holder.hold_count == 3
    with pytest.raises(LockError, match="upgrade"):
        rw.write().acquire(timeout=1)
    inner.release()
    outer.release()
    assert outer.owned()
    outer.release()
    assert not outer.owned()
    assert rw.write().acquire(blocking=False)


def test_writer_fences_strictly_increase(alias: str, name: str) -> None:
    rw = read_write_lock(name, using=alias)
    fences = []
    for _ in range(5):
        with rw.write() as held:
            fences.append(held.fence)
        with rw.read():
            pass
    assert fences == sorted(fences) and len(set(fences)) == 5


def test_writer_timeout_lets_readers_in(alias: str, name: str) -> None:
    rw = read_write_lock(name, using=alias)

    def in_thread(call: Callable[[], bool]) -> bool:
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(call()))
        thread.start()
        thread.join(10)
        return result[0]

    with rw.read():
        started = time.monotonic()
        assert not in_thread(lambda: rw.write().acquire(timeout=0.3))
        assert time.monotonic() - started < 2
        # The writer left: other owners' readers are let in again.
        assert in_thread(lambda: rw.read(auto_renew=False).acquire(blocking=False))


def test_kinds_refused_on_redlock() -> None:
    from django.test import override_settings

    config = {
        "default": {"BACKEND": "django_redlock.backends.locmem.LocMemBackend"},
        "quorum": {
            "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
            "LOCATION": ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"],
        },
    }
    with override_settings(DJANGO_REDLOCK=config):
        with pytest.raises(NotImplementedError, match="not a safe semaphore"):
            semaphore("x", 2, using="quorum")
        with pytest.raises(NotImplementedError, match="read-write locks"):
            read_write_lock("x", using="quorum")


def test_reading_under_ones_own_write_is_refused(alias: str, name: str) -> None:
    rw = read_write_lock(name, using=alias)
    with rw.write():
        with pytest.raises(LockError, match="holds the write lock"):
            rw.read().acquire()
        assert not rw.read().acquire(timeout=0.05)  # with a timeout: it just times out


def test_no_keys_left_but_the_fence_counter(redis_alias: str, name: str) -> None:
    rw = read_write_lock(name, using=redis_alias)
    readers = [rw.read() for _ in range(2)]
    readers[0].acquire()
    waiting: list[bool] = []
    writer = threading.Thread(target=lambda: waiting.append(rw.write().acquire(timeout=5)))
    writer.start()
    time.sleep(0.2)
    readers[0].release()
    writer.join(10)
    assert waiting == [True]
    backend = locks[redis_alias]
    writer_held = rw.holders()
    assert [h.kind for h in writer_held] == ["write"]
    backend.force_release(name)
    with rw.read():
        pass
    client = backend.client  # type: ignore[attr-defined]
    keys = {k.decode() for k in client.scan_iter(count=1000) if f"{{{name}}}".encode() in k}
    assert keys == {backend.fence_key(name)}


@pytest.fixture
def lossy(redis_server: Any, name: str) -> Iterator[tuple[ReadWriteLock, LossyProxy]]:
    """A read-write lock reached through a proxy that can lose replies: connected and its
    scripts loaded, so the next reply lost is the next operation's."""
    proxy = LossyProxy(redis_server.port)
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": proxy.url}
    try:
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "lossy": config}):
            rw = read_write_lock(name, using="lossy", ttl=10)
            with rw.read():
                pass
            yield rw, proxy
    finally:
        proxy.close()


def test_a_read_whose_reply_was_lost_does_not_linger(
    lossy: tuple[ReadWriteLock, LossyProxy], name: str
) -> None:
    """A read acquire that went through although its reply was lost: the owner's next
    operation settles its count (0), as a reentrant lock's does. The orphan read must not be
    re-entered and kept alive by the owner's later reads (the same owner token), refusing
    the owner's writes as upgrades and keeping every writer out for as long as it reads."""
    rw, proxy = lossy
    reader = rw.read()
    proxy.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        reader.acquire()  # went through: the server holds a read, we count none
    assert proxy.lost == 1
    assert len(read_write_lock(name, using="redis").holders()) == 1
    again = rw.read()
    assert again.acquire(blocking=False)
    assert again.hold_count() == 1  # settled first: one read, not two
    again.release()
    assert rw.holders() == []  # nothing lingers
    writer = rw.write()
    assert writer.acquire(blocking=False)  # no read left: not an upgrade
    writer.release()


def test_a_write_after_a_read_whose_reply_was_lost(
    lossy: tuple[ReadWriteLock, LossyProxy], name: str
) -> None:
    """The owner's write after such a read is no upgrade: the read it does not hold is
    settled first (freed), not held against it."""
    rw, proxy = lossy
    proxy.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        rw.read().acquire()  # went through: the server holds a read, we count none
    assert len(read_write_lock(name, using="redis").holders()) == 1
    writer = rw.write()
    assert writer.acquire(blocking=False)  # not refused as a read-to-write upgrade
    assert [h.kind for h in rw.holders()] == ["write"]
    writer.release()
    assert rw.holders() == []


def test_a_read_re_entry_after_an_unnoticed_loss_is_lost(alias: str, name: str) -> None:
    reader = read_write_lock(name, using=alias, auto_renew=False).read()
    reader.acquire()
    assert locks[alias].force_release(name)
    with pytest.raises(LockLost, match="before this re-entry"):
        reader.acquire(blocking=False)
    assert locks[alias].inspect(name) is None  # the fresh read was handed back
    with pytest.raises(LockLost):
        reader.release()
    assert reader.acquire(blocking=False)
    reader.release()


def test_a_write_after_a_read_re_entry_whose_reply_was_lost(
    lossy: tuple[ReadWriteLock, LossyProxy], name: str
) -> None:
    """The owner holds a read, re-enters it and the re-entry's reply is lost (the server
    counts 2, the owner 1). Its write then settles the read to 1, in read mode: the read
    lease stays (a write-mode release would delete it whole), and the write is refused as
    the upgrade it is, with the owner's read still held."""
    rw, proxy = lossy
    reader = rw.read()
    assert reader.acquire(blocking=False)
    proxy.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        rw.read().acquire()  # went through: the server counts two reads
    with pytest.raises(LockError, match="upgrade"):
        rw.write().acquire(blocking=False)
    [held] = read_write_lock(name, using="redis").holders()
    assert (held.kind, held.hold_count) == ("read", 1)
    assert reader.owned()
    other = threading.Thread(target=lambda: got.append(rw.write().acquire(blocking=False)))
    got: list[bool] = []
    other.start()
    other.join()
    assert got == [False]  # another thread's writer waits for the read
    reader.release()
    assert rw.holders() == []
