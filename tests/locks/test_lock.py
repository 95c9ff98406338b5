"""The lock's behaviour, run against every backend (RedisBackend, DjangoRedisBackend, LocMem)."""

from __future__ import annotations

import gc
import re
import threading
import time
from typing import Any

import pytest

from django_redlock import (
    LockError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    lock,
    locks,
)
from django_redlock.signals import lock_acquired, lock_lost, lock_released


def test_acquire_release_and_queries(alias: str, name: str) -> None:
    held = lock(name, using=alias, ttl=10)
    assert held.fence is None and not held.locked() and held.ttl() is None
    assert held.acquire()
    assert held.owned() and held.locked()
    ttl = held.ttl()
    assert ttl is not None and 9 < ttl <= 10
    assert isinstance(held.fence, int)
    held.release()
    assert not held.locked() and not held.owned() and held.fence is None


def test_second_holder_is_refused(alias: str, name: str) -> None:
    first, second = lock(name, using=alias), lock(name, using=alias)
    assert first.acquire()
    assert not second.acquire(blocking=False)
    assert not second.acquire(timeout=0)
    assert not second.owned() and second.locked()
    with pytest.raises(LockNotOwned):
        second.release()
    first.release()
    assert second.acquire(blocking=False)
    second.release()


def test_timeout_is_honoured(alias: str, name: str) -> None:
    lock(name, using=alias).acquire()
    waiter = lock(name, using=alias)
    started = time.monotonic()
    assert not waiter.acquire(timeout=0.3)
    waited = time.monotonic() - started
    assert 0.3 <= waited < 0.6


def test_fence_strictly_increases_per_name(alias: str, name: str) -> None:
    fences = []
    for _ in range(5):
        with lock(name, using=alias) as held:
            fences.append(held.fence)
    assert fences == sorted(set(fences)) and len(fences) == 5
    with lock(name + ":other", using=alias) as other:
        # A new name's first fence is the server's clock in ms x 1000: a counter lost with
        # the data starts again above everything handed out before.
        assert other.fence is not None
        assert abs(other.fence / 1000 - time.time() * 1000) < 60_000


def test_context_manager_raises_when_busy(alias: str, name: str) -> None:
    with lock(name, using=alias):
        started = time.monotonic()
        with (
            pytest.raises(LockNotAcquired, match=re.escape(name)),
            lock(name, using=alias, timeout=0.2),
        ):
            pass
        assert time.monotonic() - started >= 0.2
        with pytest.raises(LockNotAcquired), lock(name, using=alias, blocking=False):
            pass


def test_same_object_cannot_acquire_twice(alias: str, name: str) -> None:
    held = lock(name, using=alias)
    held.acquire()
    with pytest.raises(LockError, match="already held"):
        held.acquire(blocking=False)
    held.release()
    with pytest.raises(LockNotOwned):
        held.release()


def test_released_waiter_wakes_at_once(alias: str, name: str) -> None:
    holder, waiter = lock(name, using=alias), lock(name, using=alias)
    holder.acquire()
    woke: list[float] = []

    def wait() -> None:
        assert waiter.acquire(timeout=10)
        woke.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    # Waiting: its registration seen where the backend counts waiters, else the old 0.5 s.
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        info = locks[alias].inspect(name)
        if info is not None and info.waiters >= 1:
            break
        time.sleep(0.01)
    released = time.monotonic()
    holder.release()
    thread.join(5)
    assert woke and woke[0] - released < 1.0  # woken by the release, not the TTL
    assert waiter.fence is not None and holder.fence is None
    waiter.release()


def test_waiter_wakes_at_expiry_without_release(alias: str, name: str) -> None:
    lock(name, using=alias, ttl=0.5, auto_renew=False).acquire()
    waiter = lock(name, using=alias)
    started = time.monotonic()
    assert waiter.acquire(timeout=5)
    assert 0.4 < time.monotonic() - started < 1.0
    waiter.release()


def test_expired_hold_cannot_be_released_or_extended(alias: str, name: str) -> None:
    stale = lock(name, using=alias, ttl=0.2, auto_renew=False)
    stale.acquire()
    time.sleep(0.3)
    fresh = lock(name, using=alias)
    assert fresh.acquire(blocking=False)
    assert fresh.fence is not None and stale.fence is not None
    assert fresh.fence > stale.fence
    assert not stale.owned()
    with pytest.raises(LockNotOwned):
        stale.release()
    with pytest.raises(LockNotOwned):
        stale.extend()
    assert fresh.owned()  # the stale holder left the new hold alone
    fresh.release()


def test_extend_sets_a_new_ttl(alias: str, name: str) -> None:
    held = lock(name, using=alias, ttl=1, auto_renew=False)
    held.acquire()
    held.extend(20)
    ttl = held.ttl()
    assert ttl is not None and ttl > 19
    held.release()


def test_watchdog_keeps_a_hold_through_five_ttls(alias: str, name: str) -> None:
    held = lock(name, using=alias, ttl=0.3)
    held.acquire()
    fence = held.fence
    time.sleep(1.5)
    assert held.owned() and held.fence == fence
    assert not lock(name, using=alias).acquire(blocking=False)
    held.release()


def test_without_watchdog_a_hold_expires(alias: str, name: str) -> None:
    held = lock(name, using=alias, ttl=0.3, auto_renew=False)
    held.acquire()
    time.sleep(0.5)
    assert not held.locked()


def test_max_hold_caps_renewal(alias: str, name: str) -> None:
    held = lock(name, using=alias, ttl=0.3, max_hold=0.4)
    held.acquire()
    time.sleep(0.3)
    assert held.locked()  # still renewed inside the cap
    time.sleep(0.8)
    assert not held.locked()


def test_garbage_collected_lock_stops_renewing(alias: str, name: str) -> None:
    held = lock(name, using=alias, ttl=0.3)
    held.acquire()
    del held
    gc.collect()
    time.sleep(0.6)
    assert not lock(name, using=alias).locked()


def test_loss_is_detected_signalled_and_raised(alias: str, name: str) -> None:
    lost: list[dict[str, Any]] = []

    def on_lost(**kwargs: Any) -> None:
        lost.append(kwargs)

    lock_lost.connect(on_lost)
    try:
        with pytest.raises(LockLost), lock(name, using=alias, ttl=0.3) as held:
            assert locks[alias].force_release(name)
            deadline = time.monotonic() + 2
            while not lost and time.monotonic() < deadline:  # the watchdog's thread sends it
                time.sleep(0.01)
            assert not held.owned() and held.lost is not None
        assert [entry["lock"] for entry in lost] == [held]
        assert "released by someone else" in lost[0]["reason"]
    finally:
        lock_lost.disconnect(on_lost)


def test_body_exception_is_not_masked_by_loss(alias: str, name: str) -> None:
    with pytest.raises(ZeroDivisionError), lock(name, using=alias, auto_renew=False):
        locks[alias].force_release(name)
        1 / 0  # noqa: B018


def test_signals_for_acquire_and_release(alias: str, name: str) -> None:
    events: list[tuple[str, Any]] = []

    def acquired(**kwargs: Any) -> None:
        events.append(("acquired", kwargs["fence"]))

    def released(**kwargs: Any) -> None:
        events.append(("released", kwargs["lock"].name))

    lock_acquired.connect(acquired)
    lock_released.connect(released)
    try:
        with lock(name, using=alias) as held:
            fence = held.fence
    finally:
        lock_acquired.disconnect(acquired)
        lock_released.disconnect(released)
    assert events == [("acquired", fence), ("released", name)]


def test_decorator_names_the_lock_from_bound_arguments(alias: str, name: str) -> None:
    seen: list[bool] = []

    @lock(name + ":{user_id}:{kind}", using=alias, timeout=0)
    def build_report(user_id: int, kind: str = "daily") -> str:
        seen.append(locks[alias].is_locked(f"{name}:{user_id}:{kind}"))
        return f"report {user_id}"

    assert build_report(7) == "report 7"
    assert build_report(user_id=7, kind="daily") == "report 7"
    assert seen == [True, True]
    assert build_report.__name__ == "build_report"
    with lock(f"{name}:7:daily", using=alias), pytest.raises(LockNotAcquired):
        build_report(7)
    assert not locks[alias].is_locked(f"{name}:7:daily")


def test_decorator_template_is_checked_against_the_signature(alias: str) -> None:
    with pytest.raises(ValueError, match="not an argument"):

        @lock("report:{missing}", using=alias)
        def report(user_id: int) -> None: ...


def test_holder_metadata_is_recorded(alias: str, name: str) -> None:
    with lock(name, using=alias) as held:
        fence = held.fence
        info = locks[alias].inspect(name)
    assert info is not None and info.name == name and info.kind == "plain"
    assert info.fence == fence
    assert info.holder["p"] > 0 and info.holder["t"] == threading.current_thread().name
    assert info.acquired_at is not None and info.ttl is not None


def test_many_threads_never_overlap(alias: str, name: str) -> None:
    inside, peak, done = [0], [0], []
    mutex = threading.Lock()

    def worker() -> None:
        for _ in range(20):
            with lock(name, using=alias, ttl=5):
                with mutex:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
                time.sleep(0.0005)
                with mutex:
                    inside[0] -= 1
        done.append(1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(done) == 8 and peak[0] == 1
