"""Semaphores: at most N holders at once, each permit a lease with its own token, fence and
expiry; on every single-master backend (and refused on Redlock)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from django_redlock import LockLost, LockNotOwned, locks, semaphore
from django_redlock.exceptions import LockError


def test_at_most_limit_holders(alias: str, name: str) -> None:
    sems = [semaphore(name, 3, using=alias, ttl=10) for _ in range(4)]
    assert sems[0].available() == 3
    assert [s.acquire(blocking=False) for s in sems] == [True, True, True, False]
    assert sems[3].available() == 0 and sems[3].locked()
    fences = [s.fence for s in sems[:3]]
    assert all(fences) and fences == sorted(fences) and len(set(fences)) == 3
    assert len({s.token for s in sems[:3]}) == 3
    holders = sems[0].holders()
    assert sorted(h.token or "" for h in holders) == sorted(s.token or "" for s in sems[:3])
    assert {h.kind for h in holders} == {"permit"}
    assert all(h.fence in fences and h.ttl and 0 < h.ttl <= 10 for h in holders)
    assert sems[0].owned() and not sems[3].owned()
    sems[1].release()
    assert sems[0].available() == 1
    assert sems[3].acquire(blocking=False)
    assert sems[3].fence is not None and sems[3].fence > max(fences)
    for s in (sems[0], sems[2], sems[3]):
        s.release()
    assert sems[0].available() == 3 and not sems[0].locked()
    info = locks[alias].inspect(name)
    assert info is None


def test_with_and_decorator(alias: str, name: str) -> None:
    sem = semaphore(name, 2, using=alias, timeout=0)
    with sem as held:
        assert held.fence is not None
        with semaphore(name, 2, using=alias, timeout=0):
            assert sem.available() == 0
    assert sem.available() == 2
    seen: list[int] = []

    @semaphore(name + ":{n}", 1, using=alias, timeout=0)
    def work(n: int) -> int:
        seen.append(semaphore(f"{name}:{n}", 1, using=alias).available())
        return n

    assert work(5) == 5 and seen == [0]


def test_extend_ttl_and_lost(alias: str, name: str) -> None:
    sem = semaphore(name, 2, using=alias, ttl=0.3, auto_renew=False)
    assert sem.acquire()
    sem.extend(5)
    ttl = sem.ttl()
    assert ttl is not None and 4 < ttl <= 5
    sem.extend(0.2)
    time.sleep(0.35)
    assert sem.available() == 2
    with pytest.raises(LockLost):
        sem.release()


def test_watchdog_renews_permits(alias: str, name: str) -> None:
    sem = semaphore(name, 2, using=alias, ttl=0.6)
    plain = semaphore(name, 2, using=alias, ttl=0.6)
    with sem, plain:
        time.sleep(1.5)
        assert sem.owned() and plain.owned()
        assert sem.available() == 0


def test_blocking_waiter_gets_a_released_permit(alias: str, name: str) -> None:
    holder = semaphore(name, 1, using=alias, ttl=30)
    holder.acquire()
    got: list[float] = []

    def wait() -> None:
        with semaphore(name, 1, using=alias, timeout=10):
            got.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got and got[0] - released < 0.5


def test_timeout(alias: str, name: str) -> None:
    holder = semaphore(name, 1, using=alias)
    holder.acquire()
    started = time.monotonic()
    assert not semaphore(name, 1, using=alias).acquire(timeout=0.2)
    assert 0.15 < time.monotonic() - started < 2
    holder.release()


def test_fair_semaphore_in_order(alias: str, name: str) -> None:
    holders = [semaphore(name, 2, using=alias, fair=True) for _ in range(2)]
    for h in holders:
        h.acquire()
    order: list[int] = []

    def wait(tag: int) -> None:
        with semaphore(name, 2, using=alias, fair=True, timeout=10):
            order.append(tag)
            time.sleep(0.05)

    threads = []
    for tag in range(3):
        threads.append(threading.Thread(target=wait, args=(tag,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while (info := locks[alias].inspect(name)) is None or info.waiters < tag + 1:
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.005)  # queued in this order
    # One permit comes free and goes round the queue: FIFO. (Two freed at once may go to the
    # first two waiters in either order: both are within the permits free.)
    holders[0].release()
    for t in threads:
        t.join(10)
    holders[1].release()
    assert order == [0, 1, 2]


def test_async(alias: str, name: str) -> None:
    async def main() -> list[int | None]:
        sem = semaphore(name, 2, using=alias)
        async with sem:
            other = semaphore(name, 2, using=alias)
            assert await other.aacquire(timeout=1)
            assert await sem.aavailable() == 0
            assert not await semaphore(name, 2, using=alias).aacquire(timeout=0.1)
            fences = [sem.fence, other.fence]
            await other.arelease()
            return fences

    assert all(asyncio.run(main()))


def test_lower_limit_keeps_holders(alias: str, name: str) -> None:
    """Changing the limit of a name in use: holders keep their permits, new grants obey
    the limit of the one asking."""
    many = [semaphore(name, 3, using=alias) for _ in range(3)]
    for s in many:
        assert s.acquire(blocking=False)
    low = semaphore(name, 2, using=alias)
    assert not low.acquire(blocking=False)
    many[0].release()
    assert not low.acquire(blocking=False)  # still 2 held: the new limit is reached
    many[1].release()
    assert low.acquire(blocking=False)
    assert all(s.owned() for s in (many[2], low))
    high = semaphore(name, 5, using=alias)
    assert high.acquire(blocking=False)
    for s in (many[2], low, high):  # else the watchdog renews them for the rest of the session
        s.release()


def test_force_release_one_permit_or_all(alias: str, name: str) -> None:
    sems = [semaphore(name, 3, using=alias, auto_renew=False) for _ in range(3)]
    for s in sems:
        s.acquire()
    backend = locks[alias]
    info = backend.inspect(name)
    assert info is not None and info.kind == "semaphore" and info.limit == 3
    assert info.hold_count == 3 and len(info.holders) == 3
    assert backend.force_release(name, sems[0].token)
    assert not sems[0].owned() and sems[1].owned() and sems[2].owned()
    assert backend.force_release(name)
    assert not sems[1].owned() and not sems[2].owned()
    assert backend.inspect(name) is None


def test_kind_clash_is_an_error(alias: str, name: str) -> None:
    from django_redlock import lock

    with lock(name, using=alias), pytest.raises(LockError, match="another kind"):
        semaphore(name, 2, using=alias).acquire(blocking=False)


def test_release_not_held(alias: str, name: str) -> None:
    with pytest.raises(LockNotOwned):
        semaphore(name, 2, using=alias).release()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"limit": True}, TypeError, "limit"),
        ({"limit": 2.0}, TypeError, "limit"),
        ({"limit": "3"}, TypeError, "limit"),
        ({"limit": 0}, ValueError, "limit"),
        ({"limit": -1}, ValueError, "limit"),
        ({"limit": 2, "ttl": 0}, ValueError, "ttl"),
        ({"limit": 2, "timeout": -1}, ValueError, "timeout"),
        ({"limit": 2, "fair": "yes"}, TypeError, "fair"),
        ({"limit": 2, "using": "nope"}, Exception, "nope"),
    ],
)
def test_bad_input_before_any_redis_call(kwargs: dict, error: type, match: str) -> None:
    # "down" is a backend whose Redis does not answer: any call would be BackendUnavailable.
    kwargs = {"using": "down", **kwargs}
    with pytest.raises(error, match=match):
        semaphore("exports", **kwargs)


@pytest.mark.parametrize("bad", ["", 5, "x" * 2000])
def test_bad_names(bad: object) -> None:
    from django_redlock import read_write_lock

    with pytest.raises((TypeError, ValueError)):
        semaphore(bad, 2, using="down")  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError)):
        read_write_lock(bad, using="down")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl"):
        read_write_lock("x", using="down").write(ttl=-1)


def test_threads_never_exceed_the_limit(alias: str, name: str) -> None:
    inside, peak, mutex = [0], [0], threading.Lock()
    fences: list[int] = []

    def work() -> None:
        for _ in range(15):
            with semaphore(name, 3, using=alias, timeout=20) as held:
                with mutex:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
                    fences.append(held.fence or 0)
                time.sleep(0.002)
                with mutex:
                    inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert peak[0] == 3 and len(set(fences)) == len(fences) == 8 * 15
    assert semaphore(name, 3, using=alias).available() == 3


def test_ttl_of_an_expired_permit_is_not_another_holders(alias: str, name: str) -> None:
    """A permit that expired while its object still believes it holds it has no time left:
    ttl() says None, not another holder's time."""
    sem = semaphore(name, 2, using=alias, ttl=0.2, auto_renew=False)
    assert sem.acquire(blocking=False)
    time.sleep(0.3)
    other = semaphore(name, 2, using=alias, ttl=20)
    assert other.acquire(blocking=False)
    assert sem.ttl() is None
    ttl = other.ttl()
    assert ttl is not None and 19 < ttl <= 20
    assert 19 < (semaphore(name, 2, using=alias).ttl() or 0) <= 20  # a non-holder: the name's
    other.release()
