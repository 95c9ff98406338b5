"""The watchdog's rules (django_redlock/renewer.py), each attacked on real redis-servers: holds
shared by several Lock objects, extends racing a batch in flight, a paused backend beside a
healthy one, a loss reported once, the hold cap, abandoned holds, tables that shrink, a
watchdog thread that is killed, a fork while a Lock's mutex is held."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import Lock, LockLost, LockNotOwned, lock, locks, read_write_lock, semaphore
from django_redlock.backends.base import Renewal
from django_redlock.locking import holds
from django_redlock.renewer import Renewer, thread_renewer
from django_redlock.signals import lock_lost
from django_redlock.testing import RedisServer


@contextlib.contextmanager
def _aliases(**servers: RedisServer) -> Iterator[None]:
    configs = {
        alias: {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
        for alias, server in servers.items()
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, **configs}):
        yield


@contextlib.contextmanager
def _losses() -> Iterator[list[tuple[Any, str]]]:
    seen: list[tuple[Any, str]] = []

    def note(sender: Any, lock: Any, reason: str, **_: Any) -> None:
        seen.append((lock, reason))

    lock_lost.connect(note, weak=False)
    try:
        yield seen
    finally:
        lock_lost.disconnect(note)


def _run_renewer(
    renewer: Renewer, seconds: float, done: Callable[[], bool] = lambda: False
) -> None:
    """Be the runner of a thread-less Renewer for ``seconds`` (or until ``done()``): every
    batch as it falls due."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not done():
        due = renewer._next()
        if isinstance(due, float):
            time.sleep(min(due, 0.02))
            continue
        for bucket, entries, renewals in due:
            started = time.monotonic()
            renewer._settle(bucket, entries, bucket.backend.renew_many(renewals), started)


# -- 1. a token shared by several Lock objects ---------------------------------------------------


def test_a_hold_shared_by_two_objects_stays_renewed_after_the_first_lets_go(name: str) -> None:
    """Two scenes, one wait (each was a test of its own, 3 s each): a reentrant hold taken
    through two objects, the outer one letting go first (out of order); two read holds of
    one thread. Each second object's hold is renewed on."""
    first, second = (lock(f"{name}:re", reentrant=True, ttl=1.0) for _ in range(2))
    assert first.acquire() and second.acquire()
    assert first.token == second.token
    rw = read_write_lock(f"{name}:rw", ttl=1.0)
    first_read, second_read = rw.read(), rw.read()
    assert first_read.acquire() and second_read.acquire()
    assert first_read.token == second_read.token
    time.sleep(0.5)  # the watchdog renews the shared holds by now
    first.release()  # out of order: the outer object lets go first; the inner still holds
    first_read.release()
    time.sleep(2.5)
    assert second.owned(), "the hold ran out while its second object still held it"
    assert (second.ttl() or 0) > 0.3
    assert second_read.owned(), "the read hold ran out while its second object held it"
    second.release()
    assert not second.locked()
    second_read.release()


def test_an_adopted_hold_stays_renewed_and_on_the_adopters_ttl_once_the_old_object_is_gone(
    name: str,
) -> None:
    """Two scenes, one wait (each was a test of its own, 3.3 s and 5.3 s).

    An adopted hold stays renewed when the adopted object is collected (a 2 s TTL: with 1 s,
    a loaded machine's stall, dry run beside soaks, outlasted it).

    adopt() does not set the hold's TTL: the server still has the one the old object's last
    renewal set (1 s). The adopter's TTL (6 s, renewed every 2 s) must be set at once, not
    at its first period, or the key runs out meanwhile."""
    original = lock(f"{name}:kept", ttl=2.0)
    assert original.acquire()
    adopter = lock(f"{name}:kept", ttl=2.0)
    adopter.adopt(original.token)
    short = lock(f"{name}:longer", ttl=1.0)
    assert short.acquire()
    time.sleep(0.5)  # renewed with 1 s by now
    longer = lock(f"{name}:longer", ttl=6.0)
    longer.adopt(short.token)
    del original, short
    gc.collect()
    collected = time.monotonic()
    time.sleep(2.5)  # past the old 1 s; before the longer adopter's first period ends
    assert longer.owned(), "the adopted hold ran out at the old object's TTL"
    assert (longer.ttl() or 0) > 2.0
    longer.release()
    time.sleep(max(0.0, collected + 4.5 - time.monotonic()))  # over two TTLs: renewed
    assert adopter.owned()
    adopter.release()


def test_a_collection_right_after_the_pending_news_were_taken_keeps_the_tokens_entry(
    name: str,
) -> None:
    """The racing order, forced (the scheduler frozen by its mutex): the scheduler takes the
    pending news; the second object of the token appends its own; the first object is
    collected; the sweep runs. The entry is kept, now held by the second object.
    Nothing is renewed while the scheduler is frozen, and the frozen part (an acquire and a
    full collection of a worker process late in make test, at load 13) outlasted a 1 s TTL
    (the hold declared lost): a TTL of 3 s, and the objects from before the test left out of
    the collection (gc.freeze: a 6-million-object heap took 1.8 s to collect)."""
    ttl = 3.0
    gc.freeze()  # before `first`: it must stay collectable
    try:
        first = lock(name, reentrant=True, ttl=ttl)
        acquired = time.monotonic()
        assert first.acquire()
        backend = first.backend
        with thread_renewer._mutex:
            thread_renewer._take_pending()  # the scheduler took the news: the entry exists
            key = (id(backend), name, first.token)
            entry = thread_renewer._entries[key]
            second = lock(name, reentrant=True, ttl=ttl)
            assert second.acquire()  # its news waits in the pending deque
            del first
            gc.collect()
            thread_renewer._sweep_collected()
            assert thread_renewer._entries.get(key) is entry, "the entry was dropped"
            assert list(entry.locks) == [second]
    finally:
        gc.unfreeze()
    time.sleep(max(0.0, acquired + ttl + 0.5 - time.monotonic()))  # past the first TTL
    assert second.owned()
    second.release()


def test_an_exception_while_the_scheduler_takes_a_holds_news_does_not_lose_it(name: str) -> None:
    """An asynchronous exception (KeyboardInterrupt) between taking a hold's news out of the
    pending deque and adding it: the news is taken again next time, the hold renewed."""
    lk = lock(name, ttl=1.0)

    def interrupted(*_: Any) -> bool:
        raise KeyboardInterrupt

    with thread_renewer._mutex:  # the scheduler frozen: this thread takes the news
        assert lk.acquire()
        lk.renewed_by = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            thread_renewer._take_pending()
        del lk.renewed_by  # the class's again
    time.sleep(2.5)
    assert lk.owned(), "the hold's news was dropped: never renewed"
    lk.release()


def test_a_shared_hold_is_renewed_with_its_remaining_objects_ttl_once_one_lets_go(
    name: str,
) -> None:
    """A hold renewed with the TTL of an object that let go: its owner's longer TTL (its
    margin against a stall) was cut to the other object's for as long as it held."""
    long, short = lock(name, reentrant=True, ttl=3.0), lock(name, reentrant=True, ttl=0.6)
    assert long.acquire() and short.acquire()
    time.sleep(0.5)  # renewed with the last TTL set (0.6 s) by now
    short.release()
    time.sleep(1.2)  # 3 s renewed at once, then every 1 s: never under about 2 s left
    left = long.ttl() or 0
    assert left > 1.5, f"renewed with the TTL of the object that let go: {left:.2f} s left"
    long.release()


# -- 2. extend racing a batch in flight ----------------------------------------------------------


def _held_by(renewer: Renewer, name: str, ttl: float) -> Lock:
    """A hold renewed by ``renewer`` (a thread-less one the test runs)."""
    lk = lock(name, ttl=ttl, auto_renew=False)
    assert lk.acquire()
    hold = lk._holds[""]
    hold.renewer = renewer
    renewer.add(lk, Renewal(name, hold.token, round(ttl * 1000)), None)
    return lk


def _batch_due(renewer: Renewer) -> tuple[Any, list[Any], list[Renewal]]:
    time.sleep(0.55)  # a third of the TTL: the batch falls due
    due = renewer._next()
    assert not isinstance(due, float), due
    [batch] = due
    return batch


def test_an_extend_while_a_batch_is_in_flight_is_not_cut_back_by_it(name: str) -> None:
    renewer = Renewer()
    lk = _held_by(renewer, name, 1.5)
    bucket, entries, renewals = _batch_due(renewer)  # taken with the old TTL (1.5 s)
    lk.extend(30)  # lands first...
    started = time.monotonic()
    results = bucket.backend.renew_many(renewals)  # ...then the old batch: 1.5 s left
    renewer._settle(bucket, entries, results, started)
    _run_renewer(renewer, 2.5)  # past the old TTL
    assert (lk.ttl() or 0) > 20, "a batch taken before extend(30) cut its TTL back"
    lk.release()


def test_an_extend_whose_reply_comes_after_a_racing_batch_settled_is_not_cut_back(
    name: str,
) -> None:
    renewer = Renewer()
    lk = _held_by(renewer, name, 1.5)
    bucket, entries, renewals = _batch_due(renewer)
    steps = lk._extend(30)
    op = next(steps)  # the extend is sent
    reply = lk.backend.execute(op)  # and lands
    started = time.monotonic()
    renewer._settle(bucket, entries, bucket.backend.renew_many(renewals), started)  # after it
    with contextlib.suppress(StopIteration):
        steps.send(reply)  # the extend's reply arrives last: it tells the renewer now
    _run_renewer(renewer, 2.5)
    assert (lk.ttl() or 0) > 20
    lk.release()


# -- 3. a paused backend does not starve another -------------------------------------------------


def test_a_paused_backend_does_not_delay_another_backends_renewals(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    slow, healthy = redis_factory(), redis_factory()
    with _aliases(slow=slow, healthy=healthy), _losses() as lost:
        # Several batches on the paused server (TTLs apart), each blocking its socket
        # timeout (2 s) per try; one hold on the healthy server, renewed every 0.33 s.
        paused = [lock(f"{name}:{i}", using="slow", ttl=4.5 + i % 3 / 10) for i in range(300)]
        for each in paused:
            assert each.acquire()
        kept = lock(name, using="healthy", ttl=1.0)
        assert kept.acquire()
        probe = healthy.client()
        key = locks["healthy"].key(name)
        slow.pause()
        lowest, end = 1000, time.monotonic() + 3.0
        try:
            while time.monotonic() < end:
                lowest = min(lowest, probe.pttl(key))
                time.sleep(0.02)
        finally:
            slow.resume()
        print(f"healthy hold's lowest TTL left while the other backend was paused: {lowest} ms")
        assert lowest > 0, "the healthy backend's hold expired while the other was paused"
        assert kept.owned()
        assert all(each.owned() for each in paused[::50])  # 3 s pause, 4.5 s TTL: kept too
        assert not lost
        kept.release()
        for each in paused:
            each.release()


def test_a_slow_log_handler_for_the_overdue_warning_does_not_hold_up_other_renewals(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The paused backend's "could not be renewed" warning goes to logging handlers, which
    may be slow (a network handler): logged under the renewer's mutex, it stopped every
    other backend's renewals and releases while the handler ran."""
    slow, healthy = redis_factory(), redis_factory()
    configs = {
        alias: {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
                "OPTIONS": options}
        for alias, server, options in (
            ("slow", slow, {"socket_timeout": 0.3}),  # overdue (warned) 0.6 s after the pause
            ("healthy", healthy, {}),
        )
    }  # fmt: skip
    called, unblock = threading.Event(), threading.Event()

    class SlowHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "could not be renewed" in record.getMessage():
                called.set()
                unblock.wait(10)  # a log shipper that hangs

    handler = SlowHandler()
    logging.getLogger("django_redlock").addHandler(handler)
    try:
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, **configs}):
            paused = lock(f"{name}:paused", using="slow", ttl=0.6)
            kept = lock(name, using="healthy", ttl=1.0)
            released = lock(f"{name}:released", using="healthy", ttl=1.0)
            assert paused.acquire() and kept.acquire() and released.acquire()
            probe, key = healthy.client(), locks["healthy"].key(name)
            slow.pause()
            try:
                assert called.wait(5), "the overdue warning was never logged"
                lowest, end = 1000, time.monotonic() + 2.0  # two TTLs while it hangs
                while time.monotonic() < end:
                    lowest = min(lowest, probe.pttl(key))
                    time.sleep(0.02)
                started = time.monotonic()
                released.release()
                took = time.monotonic() - started
            finally:
                unblock.set()
                slow.resume()
            assert lowest > 0, "a hanging log handler let another backend's hold expire"
            assert took < 1.0, f"release() waited {took:.2f} s for a log handler"
            assert kept.owned()
            kept.release()
            with contextlib.suppress(LockNotOwned):
                paused.release()
    finally:
        logging.getLogger("django_redlock").removeHandler(handler)


# -- 4. one loss, one lock_lost ------------------------------------------------------------------


def test_a_release_in_flight_while_the_renewer_reports_the_loss_does_not_report_it_again(
    name: str,
) -> None:
    renewer = Renewer()
    lk = _held_by(renewer, name, 1.5)
    locks["redis"].force_release(name)  # gone: the next renewal finds out
    bucket, entries, renewals = _batch_due(renewer)
    steps = lk.release_steps()
    replies: list[Any] = []
    report = lk.mark_lost

    def racing(token: str, reason: str, *later: Any) -> None:
        # The renewer has dropped the hold and is about to tell the object: the release
        # starts now, and gets its answer (the token holds nothing) before the report lands.
        replies.append(lk.backend.execute(next(steps)))
        report(token, reason, *later)

    lk.mark_lost = racing  # type: ignore[method-assign]
    with _losses() as lost:
        started = time.monotonic()
        renewer._settle(bucket, entries, bucket.backend.renew_many(renewals), started)
        assert len(lost) == 1 and replies == [-1]  # the renewer reported it
        with pytest.raises(LockLost):
            steps.send(replies[0])  # the release's answer comes back after the report
    assert len(lost) == 1, lost
    assert lk.lost


# -- 5. the hold cap counts from the acquisition -------------------------------------------------


def test_extend_before_the_cap_does_not_restart_it(name: str) -> None:
    lk = lock(name, ttl=1.0, max_hold=1.5)
    assert lk.acquire()
    time.sleep(1.0)
    lk.extend(ttl=1.1)  # a new TTL; the cap still falls 1.5 s after the acquisition
    time.sleep(2.0)  # 3 s in: capped at 1.5 s, then out at its TTL by 2.6 s at the latest
    assert not lk.owned(), "extend() restarted the hold cap"


def test_extend_after_the_cap_does_not_rearm_it(name: str) -> None:
    lk = lock(name, ttl=1.0, max_hold=1.0)
    assert lk.acquire()
    time.sleep(1.2)  # past the cap: no more renewals; the last one left about 1 s
    lk.extend(ttl=1.0)  # the caller's own extend: 1 s more, and no renewal after it
    time.sleep(1.5)  # out at 2.2 s; renewed again until 2.2 s, it would last until 3.2 s
    assert not lk.owned(), "extend() after the cap started renewing it again"


def _gone_within(lk: Any, seconds: float) -> float | None:
    """When ``lk``'s key ran out (seconds from now), or None if it lasted ``seconds``."""
    probe, key = locks[lk.using].client, lk.backend.key(lk.name)
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not probe.exists(key):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def test_the_cap_holds_again_once_an_uncapped_object_sharing_the_hold_lets_go(name: str) -> None:
    capped = lock(name, reentrant=True, ttl=0.6, max_hold=1.2)
    uncapped = lock(name, reentrant=True, ttl=0.6)
    assert capped.acquire() and uncapped.acquire()
    assert capped.token == uncapped.token
    time.sleep(0.5)  # the renewer has both objects by now: renewed as long as either asks
    uncapped.release()  # the capped object alone: its cap (1.2 s in) holds again
    gone = _gone_within(capped, 3.0)  # capped at 1.2 s, out at its TTL by 1.8 s
    assert gone is not None, "an uncapped object that let go left the hold renewed for good"
    with contextlib.suppress(LockNotOwned):
        capped.release()


def test_a_cap_passed_while_an_uncapped_object_shared_the_hold_ends_it_when_that_lets_go(
    name: str,
) -> None:
    capped = lock(name, reentrant=True, ttl=0.6, max_hold=0.4)
    uncapped = lock(name, reentrant=True, ttl=0.6)
    assert capped.acquire() and uncapped.acquire()
    time.sleep(1.0)  # past the cap: still renewed, the uncapped object asks
    assert capped.owned()
    uncapped.release()
    assert _gone_within(capped, 2.0) is not None, "renewed past its cap after the other let go"
    with contextlib.suppress(LockNotOwned):
        capped.release()


def test_an_adopters_cap_holds_once_the_uncapped_adopted_object_is_collected(name: str) -> None:
    original = lock(name, ttl=0.6)
    assert original.acquire()
    adopter = lock(name, ttl=0.6, max_hold=1.2)
    adopter.adopt(original.token)
    time.sleep(0.3)
    del original
    gc.collect()
    gone = _gone_within(adopter, 3.5)  # capped 1.2 s after the adoption, out by 1.8 s
    assert gone is not None, "the adopter's cap was dropped with the adopted object's"
    with contextlib.suppress(LockNotOwned):
        adopter.release()


# -- 6. an abandoned hold is not taken by its thread any more ------------------------------------


def test_an_abandoned_hold_is_not_counted_as_taken_by_this_thread(name: str) -> None:
    abandoned = lock(name, ttl=0.5)
    assert abandoned.acquire()
    del abandoned  # collected without release: it runs out at its TTL
    gc.collect()
    again = lock(name, ttl=0.5)
    assert again.acquire(timeout=None), "waited for itself"  # no LockError: the name frees
    again.release()


def test_holds_left_by_event_loops_do_not_accumulate(name: str) -> None:
    async def leave_one(i: int) -> None:
        lk = lock(f"{name}:{i}", ttl=0.5)
        assert await lk.aacquire()

    before = holds.taken_count()
    for i in range(50):
        asyncio.run(leave_one(i))
    gc.collect()
    assert holds.taken_count() <= before  # (other tests' abandoned holds may go meanwhile)


# -- 7. the renewer's tables shrink --------------------------------------------------------------


def test_the_renewers_tables_shrink_after_release(name: str) -> None:
    before = thread_renewer.tables()  # other tests' holds may be there: counted relatively
    held = []
    for i in range(200):  # a bucket per distinct TTL, a cap item per capped hold
        each = lock(f"{name}:{i}", ttl=3 + i / 100, max_hold=3600)
        assert each.acquire()
        held.append(each)
    time.sleep(1.5)  # the watchdog took them all in
    assert thread_renewer.tables()["entries"] >= before["entries"] + 200
    for each in held:
        each.release()
    time.sleep(1.5)
    tables = thread_renewer.tables()
    print(before, tables)
    assert tables["entries"] <= before["entries"], tables
    assert tables["open"] <= before["open"], tables
    assert tables["caps"] < before["caps"] + 100, tables
    assert tables["schedule"] < before["schedule"] + 100, tables


# -- the watchdog heals itself ------------------------------------------------------------------


def _inject(thread: threading.Thread, exc: type[BaseException]) -> None:
    ident = thread.ident
    assert ident is not None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc))
    assert done == 1


def test_a_watchdog_thread_killed_by_an_exception_is_healed(name: str) -> None:
    lk = lock(name, ttl=1.5)
    assert lk.acquire()
    time.sleep(0.6)
    for _ in range(3):  # each kills a watchdog thread, wherever it is (asleep: when it wakes)
        for thread in threading.enumerate():
            if thread.name.startswith("redlock-renew"):
                _inject(thread, SystemExit)
        time.sleep(1.2)
    time.sleep(1.5)  # past the TTL since the last kill
    assert lk.owned() and (lk.ttl() or 0) > 0.3
    lk.release()


# The scheduler dies of an exception on purpose: pytest reports that as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_watchdog_scheduler_is_started_again_without_a_new_acquire(name: str) -> None:
    lk = lock(name, ttl=1.5)
    assert lk.acquire()
    time.sleep(0.6)

    class Die(logging.Filter):
        """Fails the scheduler's own exception handler: the thread really ends."""

        def filter(self, record: logging.LogRecord) -> bool:
            if "scheduler failed" in record.getMessage():
                raise SystemExit
            return True

    log = logging.getLogger("django_redlock")
    die = Die()
    log.addFilter(die)
    try:
        [scheduler] = [t for t in threading.enumerate() if t.name == "redlock-renewer"]
        _inject(scheduler, RuntimeError)
        scheduler.join(5)
        assert not scheduler.is_alive()
    finally:
        log.removeFilter(die)
    time.sleep(4.0)  # no acquire, no extend meanwhile: the watchdog must heal by itself
    assert lk.owned() and (lk.ttl() or 0) > 0.3
    lk.release()


def test_a_fork_while_a_locks_mutex_is_held_leaves_the_child_free_to_use_it(name: str) -> None:
    lk = lock(name, ttl=2.0, auto_renew=False)
    with lk._mutex:  # as the watchdog holds it while it reports a loss to this object
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if lk.acquire(timeout=2):
                    lk.release()
                    code = 0
            finally:
                os._exit(code)
    deadline = time.monotonic() + 15
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child deadlocked on the mutex held at the fork")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_release_that_finds_the_hold_lost_reports_it_once_and_frees_the_object(
    name: str,
) -> None:
    lk = lock(name, ttl=1.0)
    assert lk.acquire()
    locks["redis"].force_release(name)
    with _losses() as lost, pytest.raises(LockLost):
        lk.release()
    assert len(lost) == 1
    assert lk.acquire(blocking=False)
    lk.release()
    with pytest.raises(LockNotOwned):
        lk.release()


def test_a_reentrant_hold_is_no_longer_renewed_once_its_thread_ended_unreleased(
    name: str,
) -> None:
    """Two scenes, one wait (each was a test of its own, 4 s each): the hold of a thread
    that ended unreleased is let go; this (live) thread's is still renewed."""
    live = lock(f"{name}:live", reentrant=True, ttl=1.0)
    assert live.acquire()
    taken = time.monotonic()
    lk = lock(name, reentrant=True, ttl=1.0)

    def take_and_leave() -> None:
        assert lk.acquire()  # and never released: nobody else may release it now

    thread = threading.Thread(target=take_and_leave)
    thread.start()
    thread.join()
    time.sleep(0.5)
    assert lk.locked()  # held (renewed, then let go)
    # The owner sweep (2 s), then the TTL (1 s).
    assert _within(3.5, lambda: not lk.locked()), (
        "a dead thread's reentrant hold is renewed for ever"
    )
    assert lk.acquire(blocking=False)  # this thread may take the name now
    lk.release()
    del thread
    time.sleep(max(0.0, taken + 4.0 - time.monotonic()))  # the live thread's: 4 s on
    assert live.owned(), "a live thread's reentrant hold was let go"
    live.release()


def _within(seconds: float, check: Callable[[], bool]) -> bool:
    """Whether ``check()`` comes true within ``seconds`` (looked at every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _orphan_after_extend(lk: Any) -> None:
    """Take ``lk`` in a thread that extends it at once and ends without releasing it. The
    renewer's mutex is held meanwhile, so the scheduler cannot take up the acquire's pending
    news before the extend reaches the renewer (the order a busy process sees often)."""

    def take_extend_leave() -> None:
        with thread_renewer._mutex:
            assert lk.acquire()
            lk.extend()

    thread = threading.Thread(target=take_extend_leave)
    thread.start()
    thread.join()


def test_holds_extended_at_once_are_let_go_when_their_thread_or_task_ends(name: str) -> None:
    """Three scenes, one wait (each was a test of its own, 3.4-4.4 s): a reentrant hold, a
    read hold (kept: a collected object's hold is let go anyway) and an asyncio reentrant
    hold (the extend reaches the renewer before the acquire), each extended at once by a
    thread or task that ends unreleased: each is let go (the owner sweep, 2 s, then the TTL,
    3.3 s, renewed every 1.1 s: its news may wait 1 s; room for a slow box)."""
    lk = lock(f"{name}:re", reentrant=True, ttl=3.3)
    _orphan_after_extend(lk)
    rw = read_write_lock(f"{name}:rw", ttl=3.3)
    reader = rw.read()
    _orphan_after_extend(reader)
    task_lk = lock(f"{name}:task", reentrant=True, ttl=3.3)

    async def take_extend_leave() -> None:
        assert await task_lk.aacquire()
        await task_lk.aextend()

    async def main() -> None:
        with thread_renewer._mutex:  # the extend reaches the renewer before the acquire
            await asyncio.create_task(take_extend_leave())

    asyncio.run(main())
    time.sleep(0.5)
    assert lk.locked()
    assert _within(7.0, lambda: not lk.locked()), (
        "an extended reentrant hold of a dead thread is renewed for ever"
    )
    writer = rw.write()
    assert _within(7.5, lambda: writer.acquire(blocking=False)), (
        "a dead thread's extended read is renewed for ever"
    )
    writer.release()
    assert _within(7.5, lambda: not task_lk.locked()), (
        "an extended reentrant hold of a finished task is renewed for ever"
    )
    del reader


# -- a slow lock_lost receiver, closed backends --------------------------------------------------


def test_a_slow_lock_lost_receiver_does_not_hold_up_other_renewals(
    redis_server: RedisServer, name: str
) -> None:
    gone, healthy = lock(f"{name}:gone", ttl=1.0), lock(f"{name}:healthy", ttl=1.0)
    assert gone.acquire() and healthy.acquire()
    unblock, called = threading.Event(), threading.Event()
    where: list[str] = []

    def page_someone(sender: Any, lock: Any, reason: str, **_: Any) -> None:
        if lock is gone:
            where.append(threading.current_thread().name)
            called.set()
            unblock.wait(10)  # an alerting call that hangs

    lock_lost.connect(page_someone, weak=False)
    try:
        locks["redis"].force_release(gone.name)
        assert called.wait(5), "the loss was never declared"
        assert gone.token is None and gone.lost  # decided before the receiver returns
        probe, key = redis_server.client(), locks["redis"].key(healthy.name)
        lowest, end = 1000, time.monotonic() + 2.5  # 2.5 TTLs while the receiver hangs
        while time.monotonic() < end:
            lowest = min(lowest, probe.pttl(key))
            time.sleep(0.02)
        assert lowest > 0, "a hanging lock_lost receiver let another hold expire"
        assert healthy.owned()
    finally:
        unblock.set()
        lock_lost.disconnect(page_someone)
    assert where == ["redlock-notify"]
    healthy.release()


def test_a_closed_backends_watchdog_worker_ends_promptly(redis_server: RedisServer) -> None:
    def workers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("redlock-renew closing")]

    for i in range(5):
        with _aliases(**{f"closing{i}": redis_server}):
            with lock(f"closing-{i}", using=f"closing{i}", ttl=0.6):
                time.sleep(0.35)  # renewed once (every 0.2 s): the alias has a worker
            assert f"redlock-renew closing{i}" in workers()
        # leaving the override closed the backend
    end = time.monotonic() + 5.0
    while workers() and time.monotonic() < end:
        time.sleep(0.05)
    assert not workers(), "a closed backend's watchdog worker lingers for WORKER_IDLE"


def test_a_lock_lost_receiver_raising_systemexit_does_not_stop_later_declarations(
    name: str,
) -> None:
    first, second = lock(f"{name}:1", ttl=0.6), lock(f"{name}:2", ttl=0.6)
    seen: list[str] = []

    def receiver(sender: Any, lock: Any, reason: str, **_: Any) -> None:
        seen.append(lock.name)
        if lock is first:
            raise SystemExit  # send_robust lets a BaseException through: the notifier goes on

    lock_lost.connect(receiver, weak=False)
    try:
        for each in (first, second):
            assert each.acquire()
            locks["redis"].force_release(each.name)
            end = time.monotonic() + 5.0
            while each.name not in seen and time.monotonic() < end:
                time.sleep(0.02)
    finally:
        lock_lost.disconnect(receiver)
    assert seen == [first.name, second.name]


# -- a loss decided but not yet declared when an exception lands ---------------------------------


class _Interrupt(BaseException):
    """An asynchronous exception (a signal handler's) in a watchdog thread."""


def _settle_interrupted_at(renewer: Renewer, point: int, ttl: float) -> tuple[bool, str]:
    """Settle the batch that finds the hold gone, with an exception raised at the
    ``point``-th line of Renewer._settle (the worker then heals, as ThreadRenewer's does):
    whether it fired, and where."""
    until = time.monotonic() + 5
    while isinstance(due := renewer._next(), float):  # a third of the TTL: the batch is due
        assert time.monotonic() < until, due
        time.sleep(due)
    [(bucket, entries, renewals)] = due
    results = bucket.backend.renew_many(renewals)
    code, seen, where = Renewer._settle.__code__, [0], [""]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            seen[0] += 1
            if seen[0] == point:
                where[0] = f"_settle:{frame.f_lineno}"
                raise _Interrupt(where[0])
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        renewer._settle(bucket, entries, results, time.monotonic())
    except _Interrupt:
        renewer._heal(threading.current_thread())
    finally:
        sys.settrace(None)
    return bool(where[0]), where[0]


def test_an_exception_in_settle_after_a_loss_was_decided_still_declares_it(name: str) -> None:
    """At every line of Renewer._settle: the renewal found the token gone; wherever the
    exception lands, the object learns it lost the hold (token None, ``lost`` set) and
    lock_lost fires once, at the latest after the heal and one more renewal period."""
    failed = []
    ttl = 0.3  # force-released at once: the TTL sets only the renewal period, and the time
    for point in itertools.count(1):
        renewer = Renewer()
        lk = _held_by(renewer, f"{name}:{point}", ttl)
        locks["redis"].force_release(lk.name)  # gone: the next renewal finds out
        with _losses() as lost:
            fired, where = _settle_interrupted_at(renewer, point, ttl)
            if not fired:
                break  # past the last line: every line was tried
            # The next period, if the loss was not decided yet: done early once the object
            # was told and the renewer holds nothing (nothing left that could tell it again:
            # this Renewer declares in its settle, at once).
            _run_renewer(
                renewer,
                ttl * 0.8,
                lambda: lk.lost is not None and not len(renewer) and not renewer._losses,  # noqa: B023
            )
            mine = [each for each, _ in lost if each is lk]
        if lk.token is not None or lk.lost is None or len(mine) != 1:
            failed.append(f"{where}: token={lk.token} lost={lk.lost!r} signals={len(mine)}")
        assert len(renewer) == 0, where
    assert point > 10, point  # the lines of _settle were seen
    assert not failed, "\n".join(failed)


def test_lock_lost_fires_once_for_each_object_sharing_the_lost_hold(name: str) -> None:
    """Two objects of one reentrant owner share a hold (one token): each reported it held,
    each is told it lost it (its own lock_lost, once), as each would be by owned()."""
    first, second = (lock(name, reentrant=True, ttl=0.6) for _ in range(2))
    with _losses() as lost:
        assert first.acquire() and second.acquire()
        assert first.token == second.token
        locks["redis"].force_release(name)
        end = time.monotonic() + 5.0
        while len(lost) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.5)  # a third signal would come by now
    assert sorted(map(id, (each for each, _ in lost))) == sorted([id(first), id(second)])
    assert first.lost and second.lost and first.token is None and second.token is None


# -- a hand-over to another process: the old holder's renewals never cut the adopter's TTL ------


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_hand_over_to_a_process_with_a_longer_ttl_is_not_cut_short_by_the_old_holder(
    kind: str, name: str, child: Callable[..., Any]
) -> None:
    """Process A holds with a 1 s TTL, renewed every 0.33 s; this process adopts its token
    with 10 s (renewed every 3.3 s); A renews on for a second, then lets go of its object
    without releasing it (a hand-over). A renewal of A's after the adopt must not cut the
    adopter's time back to 1 s: the hold lasts while the adopter reports it held."""
    if kind == "lock":
        old = child("hold", "--name", name, "--ttl", "1.0")
        adopter: Any = lock(name, ttl=10.0)
    else:
        old = child("lease", "--name", name, "--kind", "sem", "--ttl", "1.0")
        adopter = semaphore(name, 1, ttl=10.0)
    old.expect("ACQUIRED", timeout=10)
    old.send("token")
    token = old.expect("TOKEN", timeout=10).split()[-1]
    adopter.adopt(token)
    time.sleep(1.0)  # A renews about three times after the adopt
    old.send("drop")
    old.expect("DROPPED", timeout=10)
    end = time.monotonic() + 1.8  # past A's last 1 s; before the adopter's first renewal
    while time.monotonic() < end:
        assert adopter.owned(), "the adopted hold ran out at the old holder's TTL"
        time.sleep(0.1)
    assert adopter.lost is None
    adopter.release()


def _renewal_never_shortens(held: Any, alias: str) -> None:
    backend, name = locks[alias], held.name
    assert held.acquire()
    assert backend.renew_many([Renewal(name, held.token, 1000)]) == [True]
    assert held.ttl() > 5, "a renewal with a shorter TTL cut the hold's time short"
    assert backend.renew_many([Renewal(name, held.token, 20000)]) == [True]
    assert held.ttl() > 15, "a renewal with a longer TTL did not lengthen it"
    held.extend(1)  # an extend sets its TTL exactly, shorter too
    assert 0 < held.ttl() <= 1
    held.release()


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_renewal_never_shortens_a_hold_and_an_extend_sets_its_ttl(
    alias: str, kind: str, name: str
) -> None:
    if kind == "lock":
        held: Any = lock(name, using=alias, ttl=10, auto_renew=False)
    else:
        held = semaphore(name, 1, using=alias, ttl=10, auto_renew=False)
    _renewal_never_shortens(held, alias)


def test_a_redlock_renewal_never_shortens_a_hold_and_an_extend_sets_its_ttl(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    servers = [redis_factory() for _ in range(3)]
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in servers],
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "quorum": config}):
        _renewal_never_shortens(lock(name, using="quorum", ttl=10, auto_renew=False), "quorum")


def test_a_long_hold_keeps_one_watch_per_object_holding_it(name: str) -> None:
    """Under one long reentrant hold, objects that join its renewal (an extend) and leave it
    (released, or collected while holding) leave no weak reference behind in the renewer's
    entry."""

    def watches_become(count: int) -> int:
        deadline = time.monotonic() + 3
        while thread_renewer.tables()["watches"] != count and time.monotonic() < deadline:
            time.sleep(0.05)
        return thread_renewer.tables()["watches"]

    before = thread_renewer.tables()["watches"]  # other tests' holds: counted relatively
    outer = lock(name, reentrant=True, ttl=10)
    assert outer.acquire()
    try:
        for _ in range(3):
            nested = [lock(name, reentrant=True, ttl=10) for _ in range(40)]
            for each in nested:
                assert each.acquire()
                each.extend()  # joins the owner's entry in the renewer
            assert watches_become(before + 41) == before + 41  # the renewer took them in
            for each in nested:
                each.release()
            assert watches_become(before + 1) == before + 1
        for _ in range(40):
            each = lock(name, reentrant=True, ttl=10)
            assert each.acquire()
            each.extend()  # then collected while holding (the next one replaces it)
        del each
        gc.collect()
        assert watches_become(before + 1) == before + 1
        assert outer.owned()
    finally:
        outer.release()


# -- an extend to a shorter TTL whose reply is lost (review wdc2, 1) ------------------------------


@pytest.mark.parametrize("asyncio_", [False, True], ids=["sync", "async"])
def test_a_shorter_extend_whose_reply_is_lost_is_renewed_on_its_ttl(
    redis_server: RedisServer, name: str, asyncio_: bool
) -> None:
    """Redis ran extend(1) and its reply was lost: the watchdog renews at once and on the
    1 s schedule, so the hold does not run out under its object (no second holder)."""
    from django_redlock import BackendUnavailable

    from ..support.proxy import LossyProxy

    proxy = LossyProxy(redis_server.port)
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": proxy.url}
    try:
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "lossy": config}):
            lk = lock(name, using="lossy", ttl=30)  # next renewal 10 s away
            assert lk.acquire()

            async def aextend() -> None:
                await lk.aextend(30)  # connected, the script loaded: the extend's reply is lost
                proxy.lose_replies(1)
                await lk.aextend(1)

            with pytest.raises(BackendUnavailable):
                if asyncio_:
                    asyncio.run(aextend())
                else:
                    lk.extend(30)
                    proxy.lose_replies(1)
                    lk.extend(1)
            assert proxy.lost == 1
            assert redis_server.client().pttl(locks["redis"].key(name)) <= 1000  # it ran
            other = lock(name, using="redis", ttl=30)
            deadline = time.monotonic() + 2.5  # past the 1 s the server may have left
            while time.monotonic() < deadline:
                assert not other.acquire(blocking=False), "another client took the name"
                time.sleep(0.05)
            assert lk.lost is None
            lk.release()
            locks["lossy"].close()
    finally:
        proxy.close()


def _nobody_else_takes(name: str, seconds: float = 2.5) -> None:
    other = lock(name, using="redis", ttl=30)
    deadline = time.monotonic() + seconds  # past the 1 s the server may have left
    while time.monotonic() < deadline:
        assert not other.acquire(blocking=False), "another client took the name"
        time.sleep(0.05)


def test_a_shorter_reentry_whose_reply_is_lost_keeps_the_hold_renewed(
    redis_server: RedisServer, name: str
) -> None:
    """B re-enters A's reentrant hold with ttl=1, Redis runs it and the reply is lost: A's
    hold is renewed at once and on the 1 s schedule (review wdc2, 2)."""
    from django_redlock import BackendUnavailable

    from ..support.proxy import LossyProxy

    proxy = LossyProxy(redis_server.port)
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": proxy.url}
    try:
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "lossy": config}):
            a = lock(name, using="lossy", ttl=30, reentrant=True)
            b = lock(name, using="lossy", ttl=1, reentrant=True)
            assert a.acquire()
            proxy.lose_replies(1)
            with pytest.raises(BackendUnavailable):
                b.acquire()
            assert proxy.lost == 1
            assert redis_server.client().pttl(locks["redis"].key(name)) <= 1000  # it ran
            _nobody_else_takes(name)
            assert a.lost is None
            del b
            a.release()
            locks["lossy"].close()
    finally:
        proxy.close()


def test_an_adopt_whose_extend_reply_is_lost_keeps_the_old_holders_hold_renewed(
    name: str,
) -> None:
    """adopt()'s extend (ttl=1) runs and its reply is lost: the old holder's hold, renewed in
    this process with ttl=30, is renewed at once and on the 1 s schedule (review wdc2, 2)."""
    from django_redlock import BackendUnavailable

    old = lock(name, ttl=30)
    assert old.acquire()
    new = lock(name, ttl=1)
    steps = new._adopt(old.token)
    op = next(steps)  # the fence
    op = steps.send(new.backend.execute(op))  # the extend: it runs...
    new.backend.execute(op)
    with pytest.raises(BackendUnavailable):  # ...and its reply is lost
        steps.throw(BackendUnavailable("reply lost (test)", timed_out=True))
    assert (old.ttl() or 0) <= 1
    _nobody_else_takes(name)
    assert old.lost is None
    old.release()


# -- review wdc3: news that comes late or in another order than Redis ran its commands ----------


def _nobody_takes(names: list[str], seconds: float) -> None:
    others = [lock(each, using="redis", ttl=30) for each in names]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for other in others:
            assert not other.acquire(blocking=False), f"another client took {other.name!r}"
        time.sleep(0.05)


def test_two_extends_whose_news_comes_in_another_order_than_redis_ran_them(name: str) -> None:
    """Two extends of one hold (ttl 10), extend(1) run last by Redis (the server has 1 s). Its
    news comes first and extend(10)'s last (a thread descheduled between its reply and the
    renewer): the watchdog renews at once. Or extend(10)'s news comes first and extend(1)'s
    answer is held past its 1 s: the hold is renewed on the 1 s schedule while that extend
    is on its way. Either way it does not run out under its object (review wdc3, 1). (TTLs
    apart: holds of one TTL taken together are renewed in one batch, at once for either.)"""
    late, held = f"{name}:late-news", f"{name}:held-reply"
    one, other = lock(late, ttl=10), lock(held, ttl=8)
    assert one.acquire() and other.acquire()
    first = one._extend(10)
    reply = one.backend.execute(next(first))  # A's extend(10) runs...
    one.extend(1)  # ...then B's extend(1), whose news comes first
    short, long = other._extend(1.2), other._extend(8)
    op_short, op_long = next(short), next(long)  # both sent
    reply_long = other.backend.execute(op_long)
    reply_short = other.backend.execute(op_short)  # run last: the server has 1.2 s
    with contextlib.suppress(StopIteration):
        long.send(reply_long)  # extend(8)'s news first
    with contextlib.suppress(StopIteration):
        first.send(reply)  # A's news, last
    assert (one.ttl() or 0) <= 10 and (other.ttl() or 0) <= 1.2
    _nobody_takes([late, held], 2.0)  # extend(1.2)'s answer still on its way
    with contextlib.suppress(StopIteration):
        short.send(reply_short)
    assert one.lost is None and other.lost is None
    one.release()
    other.release()


def test_a_capped_objects_extend_or_reentry_after_its_cap_is_followed_by_the_shared_hold(
    name: str,
) -> None:
    """Past its cap, A sets a 1 s TTL on a hold B (uncapped, ttl 6) shares: by extend(1), or by
    a re-entry with its ttl of 1 s. The watchdog follows that TTL for B's sake: the hold does
    not run out under B (review wdc3, 2)."""
    extending, reentering = f"{name}:extend", f"{name}:reenter"
    a = lock(extending, ttl=6, max_hold=0.3, reentrant=True)
    b = lock(extending, ttl=6, reentrant=True)
    c = lock(reentering, ttl=1, max_hold=0.3, reentrant=True)
    d = lock(reentering, ttl=6, reentrant=True)  # re-enters: the server has 6 s, then c's 1 s
    assert a.acquire() and b.acquire() and c.acquire() and d.acquire()
    time.sleep(0.5)  # past both caps; the 6 s schedule's first renewal 2 s in
    a.extend(1)
    assert c.acquire()
    _nobody_takes([extending, reentering], 2.2)
    assert b.lost is None and d.lost is None
    for each in (c, c, d, a, b):
        each.release()


def test_a_hold_or_a_new_ttl_is_dated_from_the_commands_send_not_its_late_answer(
    name: str,
) -> None:
    """A take (ttl 2.4 s) and an extend(1.5) whose answers come late (1.7 s and 1 s, within the
    socket timeout): the first renewal is due a third of the TTL after the send, at once
    here, not after the key ran out (review wdc3, 3)."""
    taken, extended = f"{name}:take", f"{name}:extend"
    lk = lock(taken, ttl=2.4)
    steps = lk._acquire(False, None)
    op = next(steps)  # the take is sent...
    reply = lk.backend.execute(op)  # ...and runs
    other = lock(extended, ttl=10)
    assert other.acquire()
    late = other._extend(1.5)
    reply_2 = other.backend.execute(next(late))
    time.sleep(1.0)  # both answers on their way
    with contextlib.suppress(StopIteration):
        late.send(reply_2)
    time.sleep(0.7)
    with contextlib.suppress(StopIteration):
        steps.send(reply)
    assert lk.owned()
    _nobody_takes([taken, extended], 2.5)
    assert lk.lost is None and other.lost is None
    lk.release()
    other.release()


# -- review wdc4: TTLs set by commands whose objects let go, or whose answers are on their way --


def test_a_shorter_nested_reentry_that_leaves_at_once_is_followed_by_the_outer_hold(
    name: str,
) -> None:
    """An outer reentrant hold (ttl 10) and a nested ``with`` through another object with
    ttl 1.2 that leaves at once, or a nested object dropped while it holds: the re-entry cut
    the key to 1.2 s. Its news reaches the renewer after the object let go, and is acted on
    all the same: the hold is renewed at once (review wdc4, 2)."""
    left, dropped = f"{name}:left", f"{name}:dropped"
    outer, other = lock(left, reentrant=True, ttl=10), lock(dropped, reentrant=True, ttl=10)
    assert outer.acquire() and other.acquire()
    with lock(left, reentrant=True, ttl=1.2):
        pass
    lock(dropped, reentrant=True, ttl=1.2).acquire()  # an abandoned level
    gc.collect()
    _nobody_takes([left, dropped], 2.0)
    assert outer.lost is None and other.lost is None
    outer.release()
    other.release()


def test_a_shorter_reentry_adopt_or_read_on_its_way_keeps_the_hold_renewed(name: str) -> None:
    """Holds with ttl 10. Through another object, a re-entry, an adopt() and a second read()
    with ttl 1.2 run at once, and their answers are held 1.6 s (within the socket timeout):
    while they are on their way, the holds are renewed on the 1.2 s schedule, as an extend's
    is (review wdc4, 1)."""
    reentered, adopted, read = f"{name}:reentry", f"{name}:adopt", f"{name}:read"
    a = lock(reentered, reentrant=True, ttl=10)
    old = lock(adopted, ttl=10)
    outer = read_write_lock(read, ttl=10).read()
    assert a.acquire() and old.acquire() and outer.acquire()
    b = lock(reentered, reentrant=True, ttl=1.2)
    new = lock(adopted, ttl=1.2)
    inner = read_write_lock(read, ttl=1.2).read()
    taking, reading = b._acquire(False, None), inner._acquire(False, None)
    adopting = new._adopt(old.token)
    op_adopt = adopting.send(new.backend.execute(next(adopting)))  # the fence, then the extend
    replies = [
        (taking, b.backend.execute(next(taking))),
        (reading, inner.backend.execute(next(reading))),
        (adopting, new.backend.execute(op_adopt)),
    ]
    assert (a.ttl() or 0) <= 1.2 and (old.ttl() or 0) <= 1.2  # they ran
    wrote: list[bool] = []

    def write() -> None:  # another thread: this one holds reads
        writer = read_write_lock(read, ttl=30).write()
        while time.monotonic() < deadline and not wrote:
            if writer.acquire(blocking=False):
                wrote.append(True)
            time.sleep(0.05)

    deadline = time.monotonic() + 1.6  # the answers on their way
    writing = threading.Thread(target=write)
    writing.start()
    _nobody_takes([reentered, adopted], 1.6)
    writing.join()
    assert not wrote, "a writer got in beside the reads"
    results = []
    for steps, reply in replies:
        try:
            steps.send(reply)
        except StopIteration as done:
            results.append(done.value)
    assert results == [True, True, None]
    assert a.lost is None and old.lost is None and outer.lost is None
    for each in (b, a, inner, outer, new):
        each.release()
