"""A try delayed on the wire (a retransmission: the proxy holds it back) while its caller is
cancelled, interrupted or its loop closed: the clean-up's leave and hand-back go out on other
connections and reach the server first, with nothing to release yet; then the try lands. The
server must not grant it: nobody would hold, renew or release that hold, and the lock would be
taken by no one for its whole TTL while every waiter starves (review wai2, 3). A hand-back
of a token not held leaves a marker that refuses the token's late try."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.exceptions import BackendUnavailable
from django_redlock.locking import finisher
from django_redlock.scripts import register, script
from django_redlock.testing import RedisServer
from tests.support.proxy import LossyProxy

pytestmark = pytest.mark.django_db(transaction=False)

TTL = 30  # long enough that a hold left to it fails the check below by far


class Interrupt(Exception):
    """A signal handler's exception (Celery's soft time limit)."""


@pytest.fixture
def proxied(redis_factory: Callable[..., RedisServer]) -> Iterator[tuple[LossyProxy, str, str]]:
    """A Redis behind a proxy that can hold a request back: the alias "late" through it (3 s
    socket timeout: the delay outlasts no read), "direct" not, and the proxy. "hasty": through
    it too, with a 0.3 s socket timeout (a held-back try times out)."""
    from django.conf import settings
    from django.test import override_settings

    server = redis_factory()
    proxy = LossyProxy(server.port)
    late = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": proxy.url,
        "OPTIONS": {"socket_timeout": 3.0},
    }
    direct = {**late, "LOCATION": server.url, "OPTIONS": {}}
    hasty = {**late, "OPTIONS": {"socket_timeout": 0.3}}
    aliases = {**settings.DJANGO_REDLOCK, "late": late, "direct": direct, "hasty": hasty}
    try:
        with override_settings(DJANGO_REDLOCK=aliases):
            register(locks["direct"].client)  # the server knows the scripts: no NOSCRIPT
            yield proxy, "late", "direct"
            locks["late"].close()
            locks["direct"].close()
            locks["hasty"].close()
    finally:
        proxy.let_go()  # a test that failed early must not leave a pump waiting
        proxy.close()


def _until_delayed(proxy: LossyProxy) -> None:
    assert proxy.delayed.wait(5), "no try was held back"


async def _auntil_delayed(proxy: LossyProxy) -> None:
    deadline = time.monotonic() + 5
    while not proxy.delayed.is_set():
        assert time.monotonic() < deadline, "no try was held back"
        await asyncio.sleep(0.01)


def _lands_and_is_refused(proxy: LossyProxy, name: str, direct: str) -> None:
    """The held-back try lands after the clean-up: the lock must be free for a newcomer."""
    proxy.let_go()  # the server runs the late try now
    newcomer = lock(name, using=direct, ttl=TTL, fair=False, auto_renew=False)
    assert not newcomer.locked(), "the late try was granted: held by nobody for its TTL"
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def _release_then(proxy: LossyProxy, holder: Any, then: Callable[[], None]) -> threading.Thread:
    """In a thread: once the waiter waits, hold back the next try (the woken waiter's),
    release the holder, and once the try is held back, ``then()``."""

    def run() -> None:
        time.sleep(0.5)  # the waiter registered (or queued) and sleeps
        proxy.delay_from(script("acquire").sha.encode())
        holder.release()
        if proxy.delayed.wait(5):
            then()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_woken_waiter_cancelled_with_its_try_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str, fair: bool
) -> None:
    proxy, late, direct = proxied
    holder = lock(name, using=direct, ttl=TTL, fair=fair)
    assert holder.acquire()

    async def main() -> None:
        waiter = lock(name, using=late, ttl=TTL, fair=fair)
        task = asyncio.ensure_future(waiter.aacquire(timeout=25))
        await asyncio.sleep(0.5)
        proxy.delay_from(script("acquire").sha.encode())
        await asyncio.to_thread(holder.release)
        await _auntil_delayed(proxy)
        task.cancel()  # its clean-up leaves and hands the token back, on other connections
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _lands_and_is_refused(proxy, name, direct)


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_woken_waiter_whose_loop_closes_with_its_try_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str, fair: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, late, direct = proxied
    # redis-py's command, closed off its loop, cannot disconnect ("no running event loop"):
    # redis-py's to clean up, not what this test looks at.
    monkeypatch.setattr(sys, "unraisablehook", lambda _: None)
    holder = lock(name, using=direct, ttl=TTL, fair=fair)
    assert holder.acquire()
    loop = asyncio.new_event_loop()
    coro = lock(name, using=late, ttl=TTL, fair=fair).aacquire(timeout=25)
    task = loop.create_task(coro)
    loop.run_until_complete(asyncio.sleep(0.5))
    proxy.delay_from(script("acquire").sha.encode())
    releasing = threading.Thread(target=holder.release)
    releasing.start()
    loop.run_until_complete(_auntil_delayed(proxy))
    releasing.join()
    assert not task.done()
    task._log_destroy_pending = False  # left pending on purpose
    loop.close()
    coro.close()  # its clean-up goes to the finisher
    del task, coro, loop
    gc.collect()  # now, not inside some later test's line
    assert finisher.wait_finished(5)
    _lands_and_is_refused(proxy, name, direct)


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_woken_waiter_interrupted_with_its_try_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str, fair: bool
) -> None:
    proxy, late, direct = proxied
    holder = lock(name, using=direct, ttl=TTL, fair=fair)
    assert holder.acquire()

    def interrupt(*_: Any) -> None:
        raise Interrupt()

    previous = signal.signal(signal.SIGALRM, interrupt)
    thread = _release_then(proxy, holder, lambda: signal.setitimer(signal.ITIMER_REAL, 0.1))
    try:
        with pytest.raises(Interrupt):
            lock(name, using=late, ttl=TTL, fair=fair).acquire(timeout=25)
    finally:
        thread.join()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    _lands_and_is_refused(proxy, name, direct)


@pytest.mark.parametrize(
    "fair,reentrant", [(False, False), (True, False), (False, True)],
    ids=["plain", "fair", "reentrant"],
)  # fmt: skip
def test_a_one_off_try_interrupted_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str, fair: bool, reentrant: bool
) -> None:
    proxy, late, direct = proxied

    def interrupt(*_: Any) -> None:
        raise Interrupt()

    previous = signal.signal(signal.SIGALRM, interrupt)
    proxy.delay_from(script("acquire").sha.encode())
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(Interrupt):
            lock(name, using=late, ttl=TTL, fair=fair, reentrant=reentrant).acquire(blocking=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert proxy.delayed.is_set()
    _lands_and_is_refused(proxy, name, direct)


@pytest.mark.parametrize("kind", ["semaphore", "write"])
def test_a_lease_s_one_off_try_interrupted_on_the_wire_leaves_nothing_held(
    proxied: tuple[LossyProxy, str, str], name: str, kind: str
) -> None:
    """A permit's or a write's: the permit (the whole name, for a write) was nobody's for the
    lease's TTL. (A read's token is its owner's: refused by number: test_handed_back_kinds.py.)"""
    from django_redlock.locking.rwlock import read_write_lock
    from django_redlock.locking.semaphore import semaphore

    proxy, late, direct = proxied

    def make(alias: str) -> Any:
        if kind == "semaphore":
            return semaphore(name, 1, using=alias, ttl=TTL, auto_renew=False)
        return read_write_lock(name, using=alias, ttl=TTL).write(auto_renew=False)

    def interrupt(*_: Any) -> None:
        raise Interrupt()

    previous = signal.signal(signal.SIGALRM, interrupt)
    proxy.delay_from(script("permit_acquire").sha.encode())
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(Interrupt):
            make(late).acquire(blocking=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert proxy.delayed.is_set()
    proxy.let_go()  # the server runs the late try now
    newcomer = make(direct)
    assert newcomer.acquire(blocking=False), "the late try was granted: held by nobody"
    newcomer.release()


def _make(kind: str, name: str, alias: str) -> Any:
    from django_redlock.locking.rwlock import read_write_lock
    from django_redlock.locking.semaphore import semaphore

    if kind == "semaphore":
        return semaphore(name, 1, using=alias, ttl=TTL, auto_renew=False)
    if kind == "write":
        return read_write_lock(name, using=alias, ttl=TTL).write(auto_renew=False)
    return lock(name, using=alias, ttl=TTL, fair=kind == "fair", auto_renew=False)


@pytest.mark.parametrize("kind", ["plain", "fair", "semaphore", "write"])
def test_a_try_that_timed_out_on_the_wire_lands_after_its_retry_was_released(
    proxied: tuple[LossyProxy, str, str], name: str, kind: str
) -> None:
    """Try 1 times out with its request held back; the retry (the kept token, on a new
    connection) is granted and released; then try 1 lands. The release of a hold taken with
    a kept token marks it, so that try is refused (campaign seed 2404: held by nobody)."""
    proxy, _, direct = proxied
    sha = script("permit_acquire" if kind in ("semaphore", "write") else "acquire").sha
    lk = _make(kind, name, "hasty")
    proxy.delay_from(sha.encode())
    with pytest.raises(BackendUnavailable):
        lk.acquire(blocking=False)
    assert proxy.delayed.is_set()
    assert lk.acquire(blocking=False)  # the kept token, granted
    lk.release()
    proxy.let_go()  # the first try lands now
    newcomer = _make(kind, name, direct)
    assert newcomer.acquire(blocking=False), "the late try was granted: held by nobody"
    newcomer.release()


def test_a_common_release_leaves_no_marker(proxied: tuple[LossyProxy, str, str], name: str) -> None:
    """Only a hold taken with a kept token is marked at its release: the common one writes
    nothing more."""
    _, _, direct = proxied
    lk = lock(name, using=direct, ttl=TTL)
    assert lk.acquire(blocking=False)
    lk.release()
    assert locks[direct].client.keys("*:b:*") == []


def test_a_retry_cut_after_its_grant_marks_its_kept_token(
    proxied: tuple[LossyProxy, str, str], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, with the retry's grant cut before its record (a soft time limit): its
    hand-back frees the hold and marks the kept token, so the first try landing is refused."""
    from tests.support.grant_cut import cut_after_the_grant

    proxy, _, direct = proxied
    lk = _make("plain", name, "hasty")
    proxy.delay_from(script("acquire").sha.encode())
    with pytest.raises(BackendUnavailable):
        lk.acquire(blocking=False)
    assert proxy.delayed.is_set()
    cut_after_the_grant(monkeypatch, lk, lambda _: None)
    with pytest.raises(RuntimeError):
        lk.acquire(blocking=False)  # the kept token, granted, then handed back
    assert not lk.locked()
    proxy.let_go()  # the first try lands now
    newcomer = _make("plain", name, direct)
    assert newcomer.acquire(blocking=False), "the late try was granted: held by nobody"
    newcomer.release()


@pytest.mark.parametrize("kind", ["plain", "semaphore"])
def test_a_try_that_timed_out_on_the_wire_is_found_after_its_retry_was_refused(
    proxied: tuple[LossyProxy, str, str], name: str, kind: str
) -> None:
    """Try 1 times out with its request held back; the retry (the kept token) is refused (the
    lock held by another); the lock is freed, then try 1 lands and takes it. The token stays
    kept: the object's next try finds that grant, and its release frees the lock."""
    proxy, _, direct = proxied
    sha = script("permit_acquire" if kind == "semaphore" else "acquire").sha
    blocker = _make(kind, name, direct)
    assert blocker.acquire(blocking=False)
    lk = _make(kind, name, "hasty")
    proxy.delay_from(sha.encode())
    with pytest.raises(BackendUnavailable):
        lk.acquire(blocking=False)
    assert proxy.delayed.is_set()
    assert not lk.acquire(blocking=False)  # refused: the blocker holds it
    blocker.release()
    proxy.let_go()  # the first try lands now, on a free lock
    assert lk.acquire(blocking=False), "the late try's grant is nobody's"
    lk.release()
    newcomer = _make(kind, name, direct)
    assert newcomer.acquire(blocking=False), "the late try was granted: held by nobody"
    newcomer.release()
