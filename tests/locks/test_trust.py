"""Trust under faults and misuse: unknown is not lost, lost replies, fences across data loss,
misuse caught at once. Each test here failed before its fix."""

from __future__ import annotations

import asyncio
import os
import signal
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
    LockNotOwned,
    QuorumNotReached,
    lock,
    lock_all,
    locks,
    read_write_lock,
)
from django_redlock.signals import lock_lost
from django_redlock.testing import RedisServer

from ..conftest import Child
from ..support.proxy import LossyProxy

REDIS = "django_redlock.backends.redis.RedisBackend"
REDLOCK = "django_redlock.backends.redlock.RedlockBackend"


def _with_alias(alias: str, config: dict[str, Any]) -> Any:
    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config})


@pytest.fixture
def losses() -> Iterator[list[str]]:
    """Every lock_lost signal sent during the test, as the lock names."""
    seen: list[str] = []

    def note(sender: Any, lock: Any, **kwargs: Any) -> None:
        seen.append(lock.name)

    lock_lost.connect(note)
    yield seen
    lock_lost.disconnect(note)


@pytest.fixture
def proxied(redis_server: RedisServer) -> Iterator[LossyProxy]:
    """An alias "lossy" on the suite's Redis, through a proxy that can lose replies."""
    proxy = LossyProxy(redis_server.port)
    with _with_alias("lossy", {"BACKEND": REDIS, "LOCATION": proxy.url}):
        yield proxy
    proxy.close()


@pytest.fixture
def five(redis_factory: Callable[..., RedisServer]) -> Iterator[list[RedisServer]]:
    """Five independent masters and an alias "five" for the Redlock quorum over them."""
    servers = [redis_factory() for _ in range(5)]
    with _with_alias("five", {"BACKEND": REDLOCK, "LOCATION": [s.url for s in servers]}):
        yield servers


# -- lost replies ----------------------------------------------------------------------------


def test_a_release_whose_reply_was_lost_is_no_loss(
    proxied: LossyProxy, name: str, losses: list[str]
) -> None:
    held = lock(name, using="lossy", ttl=10)
    assert held.acquire()
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        held.release()  # it went through; the reply did not
    assert proxied.lost == 1
    assert not locks["redis"].is_locked(name)
    held.release()  # the retry finds the token gone: that is our own release
    assert losses == [] and held.lost is None
    assert held.fence is None
    with pytest.raises(LockNotOwned):
        held.release()


def test_an_acquire_whose_reply_was_lost_can_be_retried_at_once(
    proxied: LossyProxy, name: str
) -> None:
    held = lock(name, using="lossy", ttl=30)
    assert not held.locked()  # connected: the next reply is the acquire's
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        held.acquire(blocking=False)
    info = locks["redis"].inspect(name)
    assert info is not None  # the server granted it
    assert held.fence is None  # ... but nothing is reported held
    started = time.monotonic()
    assert held.acquire(timeout=5)  # the same token: finds its own hold
    assert time.monotonic() - started < 1
    assert held.fence == info.fence and held.token == info.token
    held.release()
    assert not locks["redis"].is_locked(name)


def test_owned_and_extend_when_redis_does_not_answer_keep_the_hold(
    redis_factory: Callable[..., RedisServer], name: str, losses: list[str]
) -> None:
    server = redis_factory()
    config = {"BACKEND": REDIS, "LOCATION": server.url, "OPTIONS": {"socket_timeout": 0.3}}
    with _with_alias("paused", config):
        held = lock(name, using="paused", ttl=3)
        held.acquire()
        server.pause()
        try:
            for call in (held.owned, held.locked, held.ttl, held.extend):
                with pytest.raises(BackendUnavailable):
                    call()
        finally:
            server.resume()
        assert held.owned() and held.fence is not None and held.lost is None
        time.sleep(3.5)  # past the TTL: only the watchdog, still renewing, keeps it
        assert held.owned()
        held.release()
    assert losses == []


# -- Redlock ---------------------------------------------------------------------------------


def test_redlock_unknown_is_not_lost(five: list[RedisServer], name: str, losses: list[str]) -> None:
    held = lock(name, using="five", ttl=2)
    with held:
        for server in five[:3]:
            server.pause()
        try:
            for call in (held.owned, held.locked, held.ttl, held.extend):
                with pytest.raises(QuorumNotReached):
                    call()
            time.sleep(0.5)  # the watchdog's renewals meanwhile get no majority either
        finally:
            for server in five[:3]:
                server.resume()
        assert held.lost is None
        time.sleep(2.2)  # past the TTL: renewal went on after the nodes came back
        assert held.owned()
    assert losses == []  # leaving the block released it, without LockLost
    assert not lock(name, using="five").locked()


def test_redlock_recovered_majority_is_used_at_once(five: list[RedisServer], name: str) -> None:
    for server in five[:3]:
        server.kill()
    with pytest.raises(QuorumNotReached):
        lock(name, using="five").acquire(blocking=False)
    for server in five[:3]:
        server.start()
    held = lock(name, using="five")
    assert held.acquire(blocking=False)  # within the breaker's second: probed, not skipped
    held.release()


def test_redlock_release_goes_to_every_node_despite_the_breaker(
    five: list[RedisServer], name: str
) -> None:
    held = lock(name, using="five", ttl=30)
    assert held.acquire()
    for server in five[:3]:
        server.pause()
    with pytest.raises(QuorumNotReached):
        held.owned()  # the three nodes now count as broken for a second
    for server in five[:3]:
        server.resume()
    held.release()  # every node is asked, so a majority confirms
    # The nodes the majority did not wait for are written to without the caller waiting.
    deadline = time.monotonic() + 5
    while any(server.client().exists(locks["five"].key(name)) for server in five):
        assert time.monotonic() < deadline, "a node kept the released hold"
        time.sleep(0.05)


# -- loss found at release -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_loss_found_at_release_is_signalled_and_recorded(name: str, losses: list[str]) -> None:
    from django_redlock.incidents import recorder
    from django_redlock.models import LockIncident

    held = lock(name, using="redis", ttl=0.2, auto_renew=False)
    held.acquire()
    time.sleep(0.4)
    with pytest.raises(LockLost):
        held.release()
    assert losses == [name]
    recorder.flush()
    assert LockIncident.objects.filter(kind="lost", name=name).exists()


# -- fences ----------------------------------------------------------------------------------


def test_fences_grow_across_a_redis_restarted_empty(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    with _with_alias("restarted", {"BACKEND": REDIS, "LOCATION": server.url}):
        fences = []
        for _ in range(3):
            with lock(name, using="restarted") as held:
                fences.append(held.fence)
        server.restart()  # the counter is gone with the data
        with lock(name, using="restarted") as held:
            assert held.fence is not None and held.fence > max(fences)


def test_fences_after_a_flush_in_the_same_millisecond_are_larger(
    redis_server: RedisServer, redis_alias: str, name: str
) -> None:
    """A FLUSHDB (a cache.clear() on a shared database, a failover to an empty replica) right
    after a hold: the next hold's fence is strictly larger, even in the same millisecond (it
    tied: both were the clock's ms x 1000)."""
    client = redis_server.client()
    for round in range(30):
        with lock(f"{name}:{round}", using=redis_alias, auto_renew=False) as held:
            before = held.fence
        client.flushdb()
        with lock(f"{name}:{round}", using=redis_alias, auto_renew=False) as held:
            assert before is not None and held.fence is not None
            assert held.fence > before, (round, before, held.fence)


def _keys_without_ttl(server: RedisServer) -> list[bytes]:
    client = server.client()
    return [key for key in client.scan_iter(count=1000) if client.pttl(key) == -1]


def test_no_key_lives_forever_after_names_used_once(redis_server: RedisServer, name: str) -> None:
    """Fence counters of names used once expire (a view keyed by a URL value wrote one key per
    URL, forever); fences stay larger after the counter is gone."""
    from django_redlock import read_write_lock, semaphore

    for i in range(20):
        with lock(f"{name}:plain:{i}", using="redis"):
            pass
        with lock(f"{name}:reentrant:{i}", using="redis", reentrant=True):
            pass
        with lock(f"{name}:fair:{i}", using="redis", fair=True):
            pass
        with semaphore(f"{name}:sem:{i}", limit=2, using="redis"):
            pass
        with read_write_lock(f"{name}:rw:{i}", using="redis").write():
            pass
    assert _keys_without_ttl(redis_server) == []
    counter = locks["redis"].fence_key(f"{name}:plain:0")
    assert 0 < redis_server.client().pttl(counter) <= 60_000 + 30_000


def test_no_key_lives_forever_on_redlock_but_its_node_markers(
    five: list[RedisServer], name: str
) -> None:
    # Nodes' timeouts of 2 s, not the default 0.1 s: a cold process's first acquire
    # connects to every node, and a loaded fresh-clone run saw three connects take longer
    # than 0.2 s (QuorumNotReached). What is checked here is the keys' TTLs.
    patient = {"BACKEND": REDLOCK, "LOCATION": [s.url for s in five],
               "OPTIONS": {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}}  # fmt: skip
    with _with_alias("patient", patient):
        for i in range(10):
            with lock(f"{name}:{i}", using="patient"):
                pass
    for server in five:
        left = [k for k in _keys_without_ttl(server) if b"{" in k]
        assert left == []


# -- misuse ----------------------------------------------------------------------------------


def test_waiting_for_a_lock_one_holds_oneself_fails_at_once(alias: str, name: str) -> None:
    with lock(name, using=alias):
        started = time.monotonic()
        with pytest.raises(LockError, match=r"wait for itself.*reentrant=True"):
            lock(name, using=alias).acquire()
        assert time.monotonic() - started < 1
        assert not lock(name, using=alias).acquire(timeout=0.1)  # a timeout still just waits

        got: list[bool] = []  # another thread waits as usual
        other = lock(name, using=alias)
        thread = threading.Thread(target=lambda: got.append(other.acquire(timeout=0)))
        thread.start()
        thread.join()
        assert got == [False]


def test_waiting_for_itself_in_asyncio(alias: str, name: str) -> None:
    async def scenario() -> None:
        async with lock(name, using=alias):
            with pytest.raises(LockError, match="wait for itself"):
                await lock(name, using=alias).aacquire()

            async def other() -> bool:  # another task is another owner: it just waits
                return await lock(name, using=alias).aacquire(timeout=0.1)

            assert await asyncio.create_task(other()) is False

    asyncio.run(scenario())


OUTER_HOLDS = [
    pytest.param({}, id="plain"),
    pytest.param({"reentrant": True}, id="reentrant"),
]


def _within(seconds: float, scenario: Callable[[], Any]) -> Any:
    """``scenario``'s outcome in a thread of its own; a wait for itself (the defect) still
    waiting after ``seconds`` fails the test instead of hanging it."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(scenario())
        except BaseException as exc:  # the outcome, whatever it is
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting for itself after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("outer", OUTER_HOLDS)
def test_waiting_for_a_hold_of_any_kind_one_holds_oneself_fails_at_once(
    alias: str, name: str, outer: dict[str, Any]
) -> None:
    """A reentrant hold is the thread's as a plain one is: a plain wait with no timeout (or
    lock_all's) behind it is refused at once. It waited for itself for ever before (review
    rw, 3)."""

    def scenario() -> list[str]:
        refused = []
        with lock(name, using=alias, ttl=20, **outer):
            for waiter in (lock(name, using=alias), lock_all(name, f"{name}:b", using=alias)):
                try:
                    waiter.acquire()
                except LockError as exc:
                    refused.append(str(exc))
        return refused

    refused = _within(3, scenario)
    assert not isinstance(refused, BaseException), refused
    assert len(refused) == 2 and "wait for itself" in refused[0], refused


@pytest.mark.parametrize("outer", OUTER_HOLDS)
def test_waiting_for_a_hold_of_any_kind_in_asyncio(
    alias: str, name: str, outer: dict[str, Any]
) -> None:
    async def scenario() -> None:
        async with lock(name, using=alias, ttl=20, **outer):
            with pytest.raises(LockError, match="wait for itself"):
                await lock(name, using=alias).aacquire()

            async def other() -> bool:  # another task is another owner: it just waits
                return await lock(name, using=alias).aacquire(timeout=0.1)

            assert await asyncio.create_task(other()) is False

    assert _within(3, lambda: asyncio.run(scenario())) is None


@pytest.mark.parametrize(
    "outer",
    [pytest.param({"auto_renew": False}, id="not-renewed"),
     pytest.param({"max_hold": 0.3}, id="max-hold")],
)  # fmt: skip
def test_a_hold_that_runs_out_by_itself_is_waited_for_not_refused(
    alias: str, name: str, outer: dict[str, Any]
) -> None:
    """Not renewed, or capped: the same thread's plain wait with no timeout is not refused
    (the server may end the hold before this process's clock says: a clock step, a restart);
    it waits, and takes the name once the hold ran out."""

    def scenario() -> bool:
        held = lock(name, using=alias, ttl=0.5, **outer)
        assert held.acquire()
        again = lock(name, using=alias)
        taken = again.acquire()
        again.release()
        with pytest.raises(LockLost):  # it ran out before the wait took the name
            held.release()
        return taken

    assert _within(5, scenario) is True


@pytest.mark.parametrize(
    "outer",
    [pytest.param({"auto_renew": False}, id="not-renewed"),
     pytest.param({"max_hold": 0.3}, id="max-hold")],
)  # fmt: skip
def test_a_hold_that_ran_out_by_itself_no_longer_refuses_its_actor_s_wait(
    alias: str, name: str, outer: dict[str, Any]
) -> None:
    """Not renewed (or past its cap) and past its TTL, the hold is gone: the same thread's
    wait with no timeout is no wait for itself. Before: refused at once, "would wait for
    itself forever" (review rw2, suspected); now the name is taken at once."""
    held = lock(name, using=alias, ttl=0.5, **outer)
    assert held.acquire()
    # Run out on the server (polled: no fixed 1.5 s); the object still believes it holds it.
    deadline = time.monotonic() + 10
    while locks[alias].is_locked(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not locks[alias].is_locked(name)
    again = lock(name, using=alias)
    started = time.monotonic()
    assert again.acquire()  # in this thread: the hold's actor (the name is free)
    assert time.monotonic() - started < 1
    again.release()


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_renewed_hold_the_server_lost_does_not_refuse_its_actor_s_acquire(
    alias: str, name: str, driver: str
) -> None:
    """A hold renewed for good that the server lost (a restart, a FLUSHALL, an operator's
    DEL: a forced release here) before its watchdog's next renewal: the same thread's wait
    with no timeout is no wait for itself, the name is free. Before: refused ("would wait
    for itself") until the watchdog noticed, up to a third of the TTL (review w3, 3); now the
    server is asked first, the lost hold declared lost (as the watchdog would) and the name
    taken at once."""
    held = lock(name, using=alias, ttl=30)
    again = lock(name, using=alias)

    async def ascenario() -> float:  # one task: the hold's actor
        assert await held.aacquire()
        assert await asyncio.to_thread(locks[alias].force_release, name)
        started = time.monotonic()
        assert await again.aacquire()
        return time.monotonic() - started

    def scenario() -> float:
        if driver == "async":
            return asyncio.run(ascenario())
        assert held.acquire()
        assert locks[alias].force_release(name)
        started = time.monotonic()
        assert again.acquire()
        return time.monotonic() - started

    try:
        took = _within(5, scenario)
        assert not isinstance(took, BaseException), took
        assert took < 1, took
        assert held.lost is not None and held.token is None  # declared lost
        assert again.owned()
    finally:
        if again.token is not None:
            again.release()


def test_a_hold_handed_to_another_thread_is_waited_for_with_a_timeout(
    alias: str, name: str
) -> None:
    """A plain Lock object handed to a thread that releases it: the process cannot tell the
    taker's next wait from a wait for itself, so with no timeout it is refused, and the
    message says what to do (review rw2, 3: it said "forever" and named only
    reentrant=True); with a timeout the wait ends when the other thread releases."""
    held = lock(name, using=alias, ttl=10)
    assert held.acquire()
    worker = threading.Thread(target=lambda: (time.sleep(0.5), held.release()))
    worker.start()
    with pytest.raises(LockError, match=r"wait for itself.*timeout=.*handed to another thread"):
        lock(name, using=alias).acquire()
    after = lock(name, using=alias)
    assert after.acquire(timeout=5)  # the worker released it
    worker.join()
    after.release()


def test_a_hold_handed_to_another_task_is_waited_for_with_a_timeout(alias: str, name: str) -> None:
    async def scenario() -> None:
        held = lock(name, using=alias, ttl=10)
        assert await held.aacquire()

        async def work() -> None:
            await asyncio.sleep(0.5)
            await held.arelease()

        worker = asyncio.create_task(work())
        with pytest.raises(LockError, match=r"wait for itself.*timeout=.*another thread or task"):
            await lock(name, using=alias).aacquire()
        after = lock(name, using=alias)
        assert await after.aacquire(timeout=5)  # the worker task released it
        await worker
        await after.arelease()

    assert _within(5, lambda: asyncio.run(scenario())) is None


def test_sync_methods_in_a_running_loop_are_sync(alias: str, name: str) -> None:
    async def scenario() -> None:
        held = lock(name, using=alias)
        with pytest.raises(LockError, match="aacquire"):
            held.acquire()
        with pytest.raises(LockError, match="aacquire"), lock(name, using=alias):
            pass
        assert held.acquire(blocking=False) is True  # one try is allowed, and is a bool
        assert held.owned() is True and held.locked() is True
        assert isinstance(held.ttl(), float)
        assert held.release() is None
        assert held.locked() is False

    asyncio.run(scenario())


def test_a_plain_try_does_not_jump_a_fair_queue(
    redis_alias: str, redis_server: RedisServer, name: str, child: Callable[..., Child]
) -> None:
    holder = lock(name, using=redis_alias, fair=True)
    holder.acquire()
    waiter = child(
        "queue", "--name", name, "--order", f"{name}:order", "--tag", "fair", "--fair",
        backend=redis_alias,
    )  # fmt: skip
    waiter.expect("WAITING")
    deadline = time.monotonic() + 5
    while not locks[redis_alias].inspect(name).waiters:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waiter.signal(signal.SIGSTOP)  # queued, and too slow to take its turn at once
    try:
        holder.release()
        barging = lock(name, using=redis_alias)
        assert not barging.acquire(blocking=False)  # the queue goes first
        assert not lock(name, using=redis_alias, reentrant=True).acquire(blocking=False)
    finally:
        waiter.signal(signal.SIGCONT)
    waiter.expect("DONE")
    assert redis_server.client().lrange(f"{name}:order", 0, -1) == [b"fair"]
    assert barging.acquire(blocking=False)  # nobody queues now
    barging.release()


def test_pruning_dead_fair_waiters_is_bounded_per_call(
    redis_server: RedisServer, name: str
) -> None:
    """10,000 waiters that died in the queue: no single script call prunes them all."""
    backend = locks["redis"]
    client = redis_server.client()
    dead = [f"deadprocess.{i}" for i in range(10_000)]
    client.rpush(backend.queue_key(name), *dead)
    client.zadd(backend.deadlines_key(name), dict.fromkeys(dead, 1))  # long past
    client.config_resetstat()
    held = lock(name, using="redis", fair=True)
    assert not held.acquire(blocking=False)  # one call: pruned the first 100 only
    pops = client.info("commandstats").get("cmdstat_lpop", {}).get("calls", 0)
    assert 0 < pops <= 100
    assert held.acquire(timeout=10)  # it gets there, 100 a try, without help
    held.release()
    assert not client.exists(backend.queue_key(name))


def test_a_forked_child_does_not_release_its_parents_lock(redis_alias: str, name: str) -> None:
    held = lock(name, using=redis_alias)
    with held:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child leaves the block: it must not free the parent's hold
            code = 1
            try:
                held.__exit__(None, None, None)
            except LockNotOwned:
                code = 0
            except BaseException:
                code = 2
            os.write(write, b"x")
            os._exit(code)
        os.read(read, 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert held.owned()  # still the parent's
    assert not held.locked()


@pytest.mark.django_db
def test_async_views_under_wsgi_do_not_leak_connections(redis_server: RedisServer) -> None:
    """A loop per request (async_to_sync): each loop's client closes with its loop."""
    from django.test import Client

    client = Client()
    for _ in range(20):
        assert client.get("/checkout-async/1/").status_code == 200
    before = len(redis_server.client().client_list())
    for _ in range(200):
        assert client.get("/checkout-async/1/").status_code == 200
    assert len(redis_server.client().client_list()) <= before + 3


def test_adopt_a_hold_by_its_token(alias: str, name: str) -> None:
    first = lock(name, using=alias, ttl=10, auto_renew=False)
    first.acquire()
    assert first.token is not None
    second = lock(name, using=alias, ttl=10)
    with pytest.raises(LockNotOwned):
        second.adopt(first.token + "x")
    second.adopt(first.token)
    assert second.fence == first.fence and second.owned()
    second.extend(20)
    ttl = second.ttl()
    assert ttl is not None and ttl > 19
    second.release()
    assert not second.locked()
    with pytest.raises(TypeError):
        second.adopt(None)  # type: ignore[arg-type]


def test_reentrant_counts_stay_true_across_lost_replies(
    proxied: LossyProxy, name: str, losses: list[str]
) -> None:
    """A lost reply may leave the server's count one off; the owner's next operation sets it
    to the count this process knows, so nothing lingers and no hold is counted twice."""
    held = lock(name, using="lossy", reentrant=True, ttl=10)
    assert not held.locked()  # connected: the next reply is the acquire's
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        held.acquire()  # went through: the server counts 1, we count 0
    assert held.acquire()  # the retry: settled first, so the count is 1, not 2
    assert held.hold_count() == 1
    nested = lock(name, using="lossy", reentrant=True, ttl=10)
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        nested.acquire()  # a nested acquire that went through, never retried
    held.release()  # settles the count (1), then releases: freed, nothing lingers
    assert not locks["redis"].is_locked(name)

    first = lock(name, using="lossy", reentrant=True, ttl=10)
    first.acquire()
    fence = first.fence
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        first.release()  # the reply was lost; the release is not retried
    again = lock(name, using="lossy", reentrant=True, ttl=10)
    assert again.acquire(timeout=1)  # a fresh hold, not a re-entry of the old one
    assert again.fence is not None and fence is not None and again.fence > fence
    again.release()
    assert not locks["redis"].is_locked(name)
    assert losses == []


def _reentrant_holds(kind: str, name: str, using: str) -> Any:
    if kind == "reentrant":
        return lock(name, using=using, reentrant=True, ttl=10, auto_renew=False)
    return read_write_lock(name, using=using, ttl=10, auto_renew=False).read()


def _rival_of(kind: str, name: str) -> Any:
    """Another owner's hold that the name's holds of ``kind`` exclude."""
    if kind == "reentrant":
        return lock(name, using="redis", reentrant=True, ttl=10, auto_renew=False)
    return read_write_lock(name, using="redis", ttl=10, auto_renew=False).write()


@pytest.mark.parametrize("retried", [True, False], ids=["retried", "not-retried"])
@pytest.mark.parametrize("kind", ["reentrant", "read"])
def test_an_unanswered_nested_release_counts_once(
    proxied: LossyProxy, name: str, losses: list[str], kind: str, retried: bool
) -> None:
    """Three objects of one owner nested; the inner one's release gets no answer (it went
    through). Retried or not, it counts once: the outer level is still held after the
    middle one's release, and another owner cannot take the name."""
    outer, middle, inner = (_reentrant_holds(kind, name, "lossy") for _ in range(3))
    assert outer.acquire(blocking=False) and middle.acquire(blocking=False)
    assert inner.acquire(blocking=False)
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        inner.release()
    if retried:
        inner.release()  # "calling it again succeeds either way"
        with pytest.raises(LockNotOwned):
            inner.release()  # and it was one release, not two
    middle.release()
    rival: list[bool] = []
    other = threading.Thread(
        target=lambda: rival.append(_rival_of(kind, name).acquire(blocking=False))
    )
    other.start()
    other.join()
    assert rival == [False]
    assert outer.owned()
    outer.release()
    assert not locks["redis"].is_locked(name)
    assert losses == []


@pytest.mark.parametrize("kind", ["reentrant", "read"])
def test_a_retried_release_of_the_last_level_frees_the_name(
    proxied: LossyProxy, name: str, losses: list[str], kind: str
) -> None:
    held = _reentrant_holds(kind, name, "lossy")
    assert held.acquire(blocking=False)
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        held.release()
    held.release()
    assert not locks["redis"].is_locked(name)
    assert losses == []


@pytest.mark.parametrize("reentrant", [False, True])
def test_acquiring_again_after_an_unanswered_release(
    proxied: LossyProxy, name: str, reentrant: bool
) -> None:
    held = lock(name, using="lossy", reentrant=reentrant, ttl=10)
    held.acquire()
    fence = held.fence
    proxied.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        held.release()
    assert held.acquire(timeout=1)  # the old release is finished first: a new hold
    assert held.fence is not None and fence is not None and held.fence > fence
    assert held.hold_count() == 1
    held.release()
    assert not locks["redis"].is_locked(name)


def test_no_answer_past_the_ttl_is_not_a_loss_until_redis_says_so(
    redis_factory: Callable[..., RedisServer], name: str, losses: list[str]
) -> None:
    server = redis_factory()
    config = {"BACKEND": REDIS, "LOCATION": server.url, "OPTIONS": {"socket_timeout": 0.2}}
    with _with_alias("paused", config):
        held = lock(name, using="paused", ttl=0.6)
        held.acquire()
        server.pause()
        try:
            time.sleep(1.5)  # renewals get no answer, well past the TTL
            assert held.lost is None and losses == []
        finally:
            server.resume()
        deadline = time.monotonic() + 3  # Redis answers: the key expired (wall clock)
        while held.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.lost is not None and losses == [name]
        with pytest.raises(LockLost):
            held.release()
