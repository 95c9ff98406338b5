"""Review wai4 3-5: what the hand-back marker of test_handed_back_tries.py must also cover, and
must not: a read (its token is its owner's, taken again: only the owner's older reads are
refused), lock_all's one-script take, and compat's ``token=`` (a caller's own token, tried
again: never locked out)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.scripts import script
from tests.support.proxy import LossyProxy

from .test_handed_back_tries import TTL, Interrupt, proxied

pytestmark = pytest.mark.django_db(transaction=False)

__all__ = ["proxied"]  # the fixture, shared


def _interrupted_on_the_wire(proxy: LossyProxy, sha: bytes, call: Callable[[], object]) -> None:
    """``call()`` with its request held back on the wire, interrupted (a signal handler that
    raises) while it waits for the reply: its clean-up runs before the request lands."""

    def interrupt(*_: Any) -> None:
        raise Interrupt()

    previous = signal.signal(signal.SIGALRM, interrupt)
    proxy.delay_from(sha)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(Interrupt):
            call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert proxy.delayed.is_set()


def test_a_read_s_one_off_try_interrupted_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str
) -> None:
    """A read's token is its owner's: its hand-back marks the owner's reads sent before it
    (ordered), so the late read takes nothing, and the owner's next read and write work."""
    from django_redlock.locking.rwlock import read_write_lock

    proxy, late, direct = proxied
    rw = read_write_lock(name, using=late, ttl=TTL)
    _interrupted_on_the_wire(
        proxy, script("permit_acquire").sha.encode(),
        lambda: rw.read(auto_renew=False).acquire(blocking=False),
    )  # fmt: skip
    proxy.let_go()  # the server runs the late read now
    time.sleep(0.3)
    assert read_write_lock(name, using=direct).holders() == [], "a read held by nobody"
    writer = read_write_lock(name, using=direct, ttl=TTL).write(auto_renew=False)
    assert writer.acquire(blocking=False)
    writer.release()
    # The same owner (this thread) reads and writes again at once: not refused.
    reader = rw.read(auto_renew=False)
    assert reader.acquire(blocking=False)
    reader.release()
    own = rw.write(auto_renew=False)
    assert own.acquire(blocking=False)
    own.release()


def test_a_read_s_reentry_interrupted_on_the_wire_adds_no_level(
    proxied: tuple[LossyProxy, str, str], name: str
) -> None:
    """Holding a read, the owner's re-entry is interrupted on the wire: when it lands, the
    read's count is not raised, so the owner's one release frees the read."""
    from django_redlock.locking.rwlock import read_write_lock

    proxy, late, direct = proxied
    rw = read_write_lock(name, using=late, ttl=TTL)
    outer = rw.read(auto_renew=False)
    assert outer.acquire(blocking=False)
    _interrupted_on_the_wire(
        proxy, script("permit_acquire").sha.encode(),
        lambda: rw.read(auto_renew=False).acquire(blocking=False),
    )  # fmt: skip
    proxy.let_go()
    time.sleep(0.3)
    outer.release()
    assert read_write_lock(name, using=direct).holders() == [], "a read level held by nobody"


def test_lock_all_s_take_interrupted_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str
) -> None:
    from django_redlock import lock_all

    proxy, late, direct = proxied
    names = [f"{name}-a", f"{name}-b"]
    _interrupted_on_the_wire(
        proxy, script("acquire_all").sha.encode(),
        lambda: lock_all(*names, using=late, ttl=TTL).acquire(blocking=False),
    )  # fmt: skip
    proxy.let_go()  # the server runs the late take now
    time.sleep(0.3)
    for each in names:
        newcomer = lock(each, using=direct, ttl=TTL, auto_renew=False)
        assert not newcomer.locked(), "the late take was granted: held by nobody for its TTL"
    again = lock_all(*names, using=late, ttl=TTL)
    assert again.acquire(blocking=False)
    again.release()


def test_lock_all_s_waiter_cancelled_while_asleep_leaves_no_marker(
    proxied: tuple[LossyProxy, str, str], name: str
) -> None:
    """No try on the wire (the waiter slept, answered): its give-back marks nothing."""
    from django_redlock import lock_all

    _, late, direct = proxied
    names = [f"{name}-a", f"{name}-b"]
    holder = lock(names[1], using=direct, ttl=TTL)
    assert holder.acquire()

    async def main() -> None:
        task = asyncio.ensure_future(lock_all(*names, using=late, ttl=TTL).aacquire(timeout=25))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    holder.release()
    assert list(locks["direct"].client.scan_iter(match="*:b:*")) == []


def test_compat_token_of_the_caller_s_own_is_not_locked_out_by_an_interrupted_try(
    proxied: tuple[LossyProxy, str, str], name: str
) -> None:
    """redis-py's ``token=``: a caller's token is tried again; an interrupted try must not
    refuse the free lock to it afterwards (nor leave the lock to nobody once it is tried)."""
    import redis

    from django_redlock.compat import RedisPyLock

    proxy, _, direct = proxied
    client = redis.Redis.from_url(proxy.url, socket_timeout=3.0)
    try:
        lk = client.lock(name, timeout=TTL, lock_class=RedisPyLock)
        _interrupted_on_the_wire(
            proxy, script("acquire").sha.encode(),
            lambda: lk.acquire(token="worker-1", blocking=False),
        )  # fmt: skip
        proxy.let_go()
        time.sleep(0.3)
        # The late try may have taken it for the token: the token's next acquire finds it.
        started = time.monotonic()
        assert lk.acquire(token="worker-1", blocking=True, blocking_timeout=2)
        assert time.monotonic() - started < 1
        lk.release()
        assert not lock(name, using=direct).locked()
        assert lk.acquire(token="worker-1", blocking=False)
        lk.release()
    finally:
        client.close()


def test_lock_all_s_woken_waiter_cancelled_with_its_take_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str
) -> None:
    from django_redlock import lock_all

    proxy, late, direct = proxied
    names = [f"{name}-a", f"{name}-b"]
    holder = lock(names[1], using=direct, ttl=TTL)
    assert holder.acquire()

    async def main() -> None:
        task = asyncio.ensure_future(lock_all(*names, using=late, ttl=TTL).aacquire(timeout=25))
        await asyncio.sleep(0.5)
        proxy.delay_from(script("acquire_all").sha.encode())
        await asyncio.to_thread(holder.release)
        deadline = time.monotonic() + 5
        while not proxy.delayed.is_set():
            assert time.monotonic() < deadline, "no take was held back"
            await asyncio.sleep(0.01)
        task.cancel()  # its clean-up leaves and gives the set back, on other connections
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    proxy.let_go()
    time.sleep(0.3)
    for each in names:
        assert not lock(each, using=direct).locked(), "the late take was granted: held by nobody"
