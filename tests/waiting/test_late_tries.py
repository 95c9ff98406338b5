"""A waiter's try given up on at the wait's verdict (the server went silent) runs on to its own
socket timeout; a request that reaches the server after that (the server paused and resumed,
a request delayed on the wire) is granted to that try's token. backends.md: the same object's
next try "finds its own hold if it did". Real server, SIGSTOP/SIGCONT."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import BackendUnavailable, lock, locks
from django_redlock.locking import finisher
from django_redlock.testing import RedisServer

SOCKET_TIMEOUT = 1.0


@pytest.fixture
def server(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": SOCKET_TIMEOUT},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "late": config}):
        yield server


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_try_granted_after_its_own_timeout_is_found_by_the_same_object_s_next_try(
    server: RedisServer, name: str, fair: bool
) -> None:
    """Before: the late try's token was dropped when its command timed out; the grant was
    held by nobody and the same object's next tries (new tokens) were refused for its TTL."""
    backend = locks["late"]
    holder = lock(name, using="late", ttl=2.0, auto_renew=False, fair=fair)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + 2.0

    async def main() -> Any:
        waiter = lock(name, using="late", ttl=30, fair=fair)
        task = asyncio.create_task(waiter.aacquire(timeout=30))
        # Stopped just before the try at the hold's expiry; resumed after the try's own
        # read timeout (1 s after it went out): the request waits in the server's socket.
        await asyncio.sleep(max(0.0, expiry - 0.3 - time.monotonic()))
        trips = backend.round_trips
        server.pause()
        try:
            with pytest.raises(BackendUnavailable):
                await task
            await asyncio.sleep(SOCKET_TIMEOUT + 1.0)  # the try's own command timed out
        finally:
            server.resume()
        assert backend.round_trips > trips, "no try went out during the stop"
        deadline = time.monotonic() + 5
        while backend.inspect(name) is None or backend.inspect(name).token == holder.token:
            assert time.monotonic() < deadline, "the late try never reached the server"
            await asyncio.sleep(0.05)
        got = await waiter.aacquire(timeout=2)
        if got:
            await waiter.arelease()
        return got

    assert asyncio.run(main()) is True, "the same object's next try did not find its hold"
    assert backend.inspect(name) is None


def test_a_one_off_try_in_flight_when_its_loop_is_torn_down_hands_its_grant_back(
    server: RedisServer, name: str
) -> None:
    """The try is sent to a paused server; its loop is closed and the task collected. The
    close throws GeneratorExit into redis-py's read, whose clean-up then fails with "no running
    event loop": before, that error passed the driver's hand-over (only a GeneratorExit was
    one), and the grant the resumed server made was held by nobody to its TTL (review wai2 4).
    """
    backend = locks["late"]
    loop = asyncio.new_event_loop()
    warm = lock(f"{name}:warm", using="late")
    assert loop.run_until_complete(warm.aacquire(blocking=False))  # connected, scripts loaded
    loop.run_until_complete(warm.arelease())
    server.pause()
    try:
        task = loop.create_task(lock(name, using="late", ttl=30).aacquire(blocking=False))
        loop.run_until_complete(asyncio.sleep(0.1))  # the try is sent
        assert not task.done()
        task._log_destroy_pending = False  # type: ignore[attr-defined]
        loop.close()
    finally:
        server.resume()  # it runs the try: granted, the reply unread
    deadline = time.monotonic() + 3
    while backend.inspect(name) is None:
        assert time.monotonic() < deadline, "the try never ran"
        time.sleep(0.02)
    gone = weakref.ref(task)
    del task, loop
    # (The backend lets go of a closed loop's client as the next loop makes one.)
    asyncio.run(lock(f"{name}:next", using="late").alocked())
    gc.collect()
    assert gone() is None, "the task was not collected"
    assert finisher.wait_finished(5)
    deadline = time.monotonic() + 3
    while backend.inspect(name) is not None:
        assert time.monotonic() < deadline, "the grant was left held by nobody"
        time.sleep(0.05)


def test_a_late_try_s_hand_back_never_deletes_the_same_object_s_retry(
    server: RedisServer, name: str
) -> None:
    """An unanswered try keeps its token T for the next try; the next, a wait, reuses T and
    its woken try is given up on at the verdict; the caller retries at once. Before: the
    retry took T again, was granted (the late try's grant, found as its own), then the late
    reply's hand-back released T: the object believed it held, another client took the lock
    (review asy3 4). A token whose late grant will be handed back is never reused."""
    lk = lock(name, using="late", ttl=30)
    holder = lock(name, using="late", ttl=4, auto_renew=False)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + 4

    async def main() -> Any:
        # A warm pool: the retry's command is written before the server resumes.
        await asyncio.gather(*[lock(f"{name}:{i}", using="late").alocked() for i in range(8)])
        server.pause()
        try:
            with pytest.raises(BackendUnavailable):
                await lk.aacquire(blocking=False)  # unanswered: its token is kept
        finally:
            server.resume()
        kept = lk._unsure_token
        assert kept is not None
        task = asyncio.create_task(lk.aacquire(timeout=20))
        await asyncio.sleep(max(0.0, expiry - 0.6 - time.monotonic()))
        server.pause()  # the woken try meets a paused server, given up on at the verdict
        try:
            with pytest.raises(BackendUnavailable):
                await task
            retry = asyncio.create_task(lk.aacquire(blocking=False))  # written, unanswered
            await asyncio.sleep(0.15)
        finally:
            server.resume()
        got = await retry
        await asyncio.sleep(0.5)  # the late reply's hand-back, if any, lands
        return got

    got = asyncio.run(main())
    try:
        if got:
            assert lock(name, using="late").locked(), "the retry's hold was deleted under it"
            assert not lock(name, using="late").acquire(blocking=False), "two holders"
    finally:
        if got:
            lk.release()


def test_a_late_try_s_grant_is_found_after_an_immediate_retry_also_went_unanswered(
    server: RedisServer, name: str
) -> None:
    """The late try (token T1) runs on; the caller retries at once, its one-off try (a new
    token T2) unanswered as well. Before: T2 replaced the kept T1; the resumed server granted
    T1 (sent first), held by nobody, and the object's next tries (T2) were refused for its
    TTL (review asy3 2). One token is kept, the other handed back once the server answers."""
    holder = lock(name, using="late", ttl=1.5, auto_renew=False)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + 1.5
    lk = lock(name, using="late", ttl=30)

    async def main() -> Any:
        task = asyncio.create_task(lk.aacquire(timeout=20))
        await asyncio.sleep(max(0.0, expiry - 0.15 - time.monotonic()))
        server.pause()
        try:
            with pytest.raises(BackendUnavailable):
                await task  # its try at the expiry: given up at the verdict
            with pytest.raises(BackendUnavailable):
                await lk.aacquire(timeout=5)  # the retry's one-off try: unanswered too
            await asyncio.sleep(SOCKET_TIMEOUT + 0.5)  # both commands timed out
        finally:
            server.resume()
        await asyncio.sleep(0.3)  # the resumed server runs both requests
        assert locks["late"].inspect(name) is not None, "no late request was granted"
        started = time.monotonic()
        got = await lk.aacquire(timeout=2)
        took = time.monotonic() - started
        if got:
            await lk.arelease()
        return got, took

    got, took = asyncio.run(main())
    assert got, "the same object's next try was refused: the late grant is held by nobody"
    assert took < 1.0, f"the next try got the lock after {took:.2f}s"
    assert locks["late"].inspect(name) is None


# (redis-py's clean-up of the collected command: "no running event loop")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_late_try_whose_loop_is_closed_keeps_its_token(server: RedisServer, name: str) -> None:
    """The waiter's try is given up on at the verdict; its loop is then closed by
    run_until_complete() + close() with the command still pending: no done-callback ever
    runs. Before: the token was not kept; the resumed server's grant was held by nobody and
    the same object's next try (another loop) refused for the TTL (review asy3 5)."""
    holder = lock(name, using="late", ttl=1.5, auto_renew=False)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + 1.5
    lk = lock(name, using="late", ttl=30)

    async def request1() -> None:
        task = asyncio.create_task(lk.aacquire(timeout=20))
        await asyncio.sleep(max(0.0, expiry - 0.15 - time.monotonic()))
        server.pause()
        with pytest.raises(BackendUnavailable):
            await task  # its try at the expiry: given up at the verdict

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(request1())
        for task in asyncio.all_tasks(loop):
            task._log_destroy_pending = False  # type: ignore[attr-defined]
        loop.close()
    finally:
        server.resume()
    del loop  # (the command lives on: ``task``, the last of the closed loop's)
    deadline = time.monotonic() + 3
    while locks["late"].inspect(name) is None or locks["late"].inspect(name).token == holder.token:
        assert time.monotonic() < deadline, "the late try never reached the server"
        time.sleep(0.05)

    async def request2() -> bool:
        got = await lk.aacquire(timeout=2)
        if got:
            await lk.arelease()
        return got

    assert asyncio.run(request2()), "the same object's next try did not find its hold"
    assert locks["late"].inspect(name) is None
    del task
    gc.collect()  # the closed loop's command: its noise stays in this test


def test_a_displaced_try_s_grant_is_released_and_the_try_made_once_more(
    server: RedisServer, name: str
) -> None:
    """The other order of the case above: the displaced token's request is the one granted
    (stood for by a hold taken with that token). The next try, refused by it, releases it
    once the server answered and tries once more: this object's own lost grant is no
    refusal."""
    lost = lock(name, using="late", ttl=30, auto_renew=False)
    lost.use_token("displaced-token")
    assert lost.acquire(blocking=False)
    lk = lock(name, using="late", ttl=30)
    lk._displace("displaced-token")
    assert lk.acquire(blocking=False), "refused by its own lost try's grant"
    assert locks["late"].inspect(name).token == lk.token
    assert not lk._displaced
    lk.release()


def test_a_late_try_s_kept_token_survives_a_cancelled_retry_s_hand_back(
    server: RedisServer, name: str
) -> None:
    """As the immediate-retry case, but the retry is cancelled with its try unanswered: its
    hand-back took the one slot for its own token. Before: the late try's token, kept just
    then, was lost; the resumed server granted it to nobody, and the object's next tries were
    refused for its TTL. Now it is handed back once the server answers the next try."""
    holder = lock(name, using="late", ttl=1.5, auto_renew=False)
    assert holder.acquire(blocking=False)
    expiry = time.monotonic() + 1.5
    lk = lock(name, using="late", ttl=30)

    async def main() -> Any:
        task = asyncio.create_task(lk.aacquire(timeout=20))
        await asyncio.sleep(max(0.0, expiry - 0.15 - time.monotonic()))
        server.pause()
        try:
            with pytest.raises(BackendUnavailable):
                await task  # its try at the expiry: given up at the verdict, runs on
            late = next(iter(lk._late_commands))
            retry = asyncio.create_task(lk.aacquire(timeout=5))
            while lk._unsure_token != late:  # the late try's command timed out: kept
                await asyncio.sleep(0.02)
            retry.cancel()  # its try unanswered: its hand-back's release waits too
            with pytest.raises(asyncio.CancelledError):
                await retry
        finally:
            server.resume()
        await asyncio.sleep(0.3)  # the resumed server runs the requests
        assert locks["late"].inspect(name) is not None, "no late request was granted"
        started = time.monotonic()
        got = await lk.aacquire(timeout=2)
        took = time.monotonic() - started
        if got:
            await lk.arelease()
        return got, took

    got, took = asyncio.run(main())
    assert got, "the same object's next try was refused: the late grant is held by nobody"
    assert took < 1.0, f"the next try got the lock after {took:.2f}s"
    assert locks["late"].inspect(name) is None


def test_the_displaced_tokens_an_object_keeps_are_bounded(server: RedisServer, name: str) -> None:
    """Each is one round trip of the next answered try: the oldest beyond the bound is
    dropped (its grant, if any, runs out at its TTL)."""
    lk = lock(name, using="late", ttl=30)
    for i in range(20):
        lk._displace(f"displaced-{i}")
    assert list(lk._displaced) == [f"displaced-{i}" for i in range(12, 20)]
    assert lk.acquire(blocking=False)
    assert not lk._displaced
    lk.release()
