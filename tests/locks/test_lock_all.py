"""lock_all(): several names held together, all or none, never a deadlock, on real servers."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings
from redis.cluster import key_slot

from django_redlock import (
    BackendUnavailable,
    LockError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    lock,
    lock_all,
    locks,
)
from django_redlock.locking.multi import MAX_NAMES, MultiLock
from django_redlock.signals import lock_lost
from django_redlock.testing import RedisServer

from ..conftest import Child
from ..support.proxy import LossyProxy

REDIS = "django_redlock.backends.redis.RedisBackend"
# Every backend that keeps all names on one server takes a set in one script.
ONE_SERVER = ("redis", "cache", "sentinel", "acl")


def held_names(alias: str, names: list[str]) -> list[str]:
    backend = locks[alias]
    return [n for n in names if backend.is_locked(n)]


def evalsha_calls(server: RedisServer) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


# -- input, before any Redis call ------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "error", "says"),
    [
        ((), ValueError, "at least one name"),
        (("a", 7), TypeError, "must be str"),
        (("a", b"b"), TypeError, "must be str"),
        (("a", ""), ValueError, "must not be empty"),
        (tuple(f"n{i}" for i in range(MAX_NAMES + 1)), ValueError, f"at most {MAX_NAMES}"),
    ],
)
def test_bad_names_are_refused_before_any_redis_call(
    names: tuple[Any, ...], error: type[Exception], says: str
) -> None:
    backend = locks["down"]  # nobody listens there: any I/O would raise BackendUnavailable
    before = backend.round_trips
    with pytest.raises(error, match=says):
        lock_all(*names, using="down")
    assert backend.round_trips == before


def test_bad_options_are_refused_before_any_redis_call() -> None:
    before = locks["down"].round_trips
    with pytest.raises(TypeError, match="using"):
        lock_all("a", using=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="blocking=False"):
        lock_all("a", blocking=False, timeout=1, using="down")
    with pytest.raises(ValueError, match="names no database"):
        lock_all("a", atomic="nowhere", using="down")
    with pytest.raises(ValueError, match="ttl"):
        lock_all("a", ttl=-1, using="down")
    assert locks["down"].round_trips == before


def test_duplicates_count_once_and_the_order_is_canonical() -> None:
    held = lock_all("b", "a", "b", "a", using="redis")
    assert held.names == ["a", "b"]
    with held:
        assert list(held.fences) == ["a", "b"]
    assert MAX_NAMES == 64
    lock_all(*(["x"] * 200), using="down")  # 200 times one name: one name


# -- all or none ------------------------------------------------------------------------------


@pytest.fixture(params=("redis", "cache", "local", "cluster", "sentinel", "acl"))
def any_alias(request: pytest.FixtureRequest) -> str:
    if request.param in ("cluster", "sentinel", "acl"):
        request.getfixturevalue(f"_{request.param}_alias")
    return str(request.param)


def test_every_name_held_with_a_fence_then_all_released(any_alias: str) -> None:
    names = ["acct:1", "acct:2", "acct:3"]
    with lock_all(*reversed(names), using=any_alias, ttl=10) as held:
        assert held_names(any_alias, names) == names
        fences = held.fences
        assert list(fences) == names and all(isinstance(f, int) for f in fences.values())
        assert [lk.fence for lk in held.locks] == list(fences.values())
        assert held.held()
    assert held_names(any_alias, names) == []
    assert held.fences == dict.fromkeys(names)


def test_one_busy_name_leaves_nothing_held(any_alias: str) -> None:
    names = ["t:1", "t:2", "t:3"]
    other = lock("t:2", using=any_alias, ttl=10)
    assert other.acquire()
    refused = lock_all(*names, using=any_alias, blocking=False)
    with pytest.raises(LockNotAcquired, match="could not be acquired"), refused:
        pytest.fail("the body ran without every name")
    assert held_names(any_alias, names) == ["t:2"]
    started = time.monotonic()
    waited = lock_all(*names, using=any_alias, timeout=0.3)
    with pytest.raises(LockNotAcquired, match=r"within 0\.3 s"), waited:
        pytest.fail("the body ran without every name")
    assert time.monotonic() - started >= 0.29
    assert held_names(any_alias, names) == ["t:2"]
    other.release()
    with lock_all(*names, using=any_alias, blocking=False) as held:
        assert held_names(any_alias, names) == names
        assert held.held()


def test_the_body_s_error_releases_every_name(any_alias: str) -> None:
    names = ["e:1", "e:2"]
    with pytest.raises(ZeroDivisionError), lock_all(*names, using=any_alias):
        1 / 0  # noqa: B018
    assert held_names(any_alias, names) == []


def test_waiting_for_a_busy_set_wakes_on_the_release(any_alias: str) -> None:
    other = lock("w:b", using=any_alias, ttl=30)
    assert other.acquire()
    woke: list[float] = []

    def wait() -> None:
        with lock_all("w:a", "w:b", "w:c", using=any_alias, timeout=20):
            woke.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    # Waiting on w:b: seen registered where the backend counts waiters, else the old 0.5 s.
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        info = locks[any_alias].inspect("w:b")
        if info is not None and info.waiters >= 1:
            break
        time.sleep(0.01)
    if any_alias in ONE_SERVER:  # nothing held while waiting (else w:a, in canonical order)
        assert held_names(any_alias, ["w:a", "w:c"]) == []
    released = time.monotonic()
    other.release()
    thread.join(20)
    assert woke, "never woke"
    assert woke[0] - released < 5  # woken by the release, long before the 30 s TTL


# -- one round trip on one server -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", "django-redis"])
def test_one_round_trip_to_take_and_one_to_release_a_free_set(
    kind: str, redis_factory: Callable[..., RedisServer]
) -> None:
    """On a server of its own: no other test's watchdog talks to it while this counts."""
    server = redis_factory()
    if kind == "redis":
        config: dict[str, Any] = {"BACKEND": REDIS, "LOCATION": server.url}
        caches = settings.CACHES
    else:
        config = {"BACKEND": "django_redlock.backends.django_redis.DjangoRedisBackend",
                  "CACHE": "solo"}  # fmt: skip
        caches = {**settings.CACHES, "solo": {"BACKEND": "django_redis.cache.RedisCache",
                                              "LOCATION": server.url}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "solo": config},
                           CACHES=caches):  # fmt: skip
        names = [f"r:{i}" for i in range(10)]
        held = lock_all(*names, using="solo", auto_renew=False)
        backend = locks["solo"]
        with lock_all(*names, using="solo", auto_renew=False):
            pass  # connected, the scripts loaded (a first EVALSHA answers NOSCRIPT)
        before, calls = backend.round_trips, evalsha_calls(server)
        with held:
            assert backend.round_trips - before == 1
            assert evalsha_calls(server) - calls == 1  # one script for ten names
        assert backend.round_trips - before == 2  # the releases: one round trip
        assert evalsha_calls(server) - calls == 2  # one script for ten releases
        assert held_names("solo", names) == []


def test_a_waiting_set_does_not_poll(redis_server: RedisServer) -> None:
    other = lock("p:b", using="redis", ttl=30)
    assert other.acquire()
    backend = locks["redis"]
    before = backend.round_trips
    thread = threading.Thread(
        target=lambda: lock_all("p:a", "p:b", using="redis", timeout=20).__enter__()
    )
    thread.start()
    time.sleep(1.5)
    assert backend.round_trips - before <= 4  # a try, a registered try: then asleep
    other.release()
    thread.join(20)
    assert held_names("redis", ["p:a", "p:b"]) == ["p:a", "p:b"]


# -- losing one name is losing the whole -----------------------------------------------------


@pytest.mark.parametrize("noticed", [True, False], ids=["watchdog", "release"])
def test_one_name_deleted_behind_the_holder_s_back_ends_in_lock_lost(
    any_alias: str, noticed: bool
) -> None:
    names = ["l:1", "l:2", "l:3"]
    lost: list[str] = []

    def on_lost(sender: Any, lock: Any, reason: str, **kwargs: Any) -> None:
        lost.append(lock.name)

    lock_lost.connect(on_lost)
    try:
        # 2 s, not 1 (under load). Cluster's said lost twice: two shards' workers telling
        # the loss at once (see the test below).
        held = lock_all(*names, using=any_alias, ttl=2 if noticed else 10)
        with pytest.raises(LockLost, match="'l:2'"), held:
            assert locks[any_alias].force_release("l:2")
            if noticed:  # the watchdog renews every ttl/3 or so: it finds l:2 gone
                deadline = time.monotonic() + 10
                while not lost and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert lost == ["l:2"]
    finally:
        lock_lost.disconnect(on_lost)
    assert lost == ["l:2"]
    assert held_names(any_alias, names) == []


def test_a_member_s_loss_told_by_two_renewal_workers_at_once_is_declared_once(
    request: pytest.FixtureRequest,
) -> None:
    """On Cluster each shard's renewal worker tells every loss queued (the renewer's
    ``_declare_losses``): a second telling while the first handed the declaration over
    declared it again (lock_lost twice, metrics and incidents too; one run in three of the
    outside review's script, and the test above under load). Made at once here: the second
    worker tells the member while the first is inside its hand-over."""
    request.getfixturevalue("_cluster_alias")
    lost: list[str] = []

    def on_lost(sender: Any, lock: Any, reason: str, **kwargs: Any) -> None:
        lost.append(lock.name)

    handing_over, go_on = threading.Event(), threading.Event()

    def slow_hand_over(declare: Callable[[], None]) -> None:
        handing_over.set()
        go_on.wait(10)
        declare()

    lock_lost.connect(on_lost)
    try:
        held = lock_all("t:1", "t:2", "t:3", using="cluster", ttl=30)
        with pytest.raises(LockLost, match="'t:2'"), held:
            member = held.locks[1]
            token = member.token
            assert member.name == "t:2" and token is not None
            assert locks["cluster"].force_release("t:2")
            first = threading.Thread(target=member.mark_lost, args=(token, "gone", slow_hand_over))
            first.start()
            assert handing_over.wait(10)
            member.mark_lost(token, "gone", lambda declare: declare())  # the other worker
            go_on.set()
            first.join(10)
            assert lost == ["t:2"]
    finally:
        go_on.set()
        lock_lost.disconnect(on_lost)
    assert lost == ["t:2"]
    assert held_names("cluster", ["t:1", "t:2", "t:3"]) == []


def test_release_of_a_set_not_held_is_lock_not_owned() -> None:
    with pytest.raises(LockNotOwned, match="not held"):
        lock_all("n:1", "n:2", using="redis").release()


# -- several callers --------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["redis", "local", "cluster"])
def test_threads_taking_a_b_in_opposite_orders_never_overlap(
    alias: str, request: pytest.FixtureRequest
) -> None:
    if alias == "cluster":
        request.getfixturevalue("_cluster_alias")
    inside, overlaps, done = [0], [0], [0]
    guard = threading.Lock()

    def worker(first: str, second: str) -> None:
        for _ in range(60):
            with lock_all(first, second, using=alias, timeout=60):
                with guard:
                    inside[0] += 1
                    overlaps[0] += inside[0] != 1
                time.sleep(0.0005)
                with guard:
                    inside[0] -= 1
        with guard:
            done[0] += 1

    threads = [
        threading.Thread(target=worker, args=("o:a", "o:b") if i % 2 else ("o:b", "o:a"))
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert done[0] == 4 and overlaps[0] == 0


# -- decorator ---------------------------------------------------------------------------------


def test_decorator_names_are_templates_over_the_arguments() -> None:
    seen: list[dict[str, int | None]] = []

    @lock_all("acct:{src}", "acct:{dst}", using="redis", timeout=5)
    def transfer(src: int, dst: int, amount: int) -> int:
        assert locks["redis"].is_locked(f"acct:{src}") and locks["redis"].is_locked(f"acct:{dst}")
        return amount

    assert transfer(2, 1, amount=5) == 5
    assert transfer(3, 3, 1) == 1  # one name, taken once
    assert held_names("redis", ["acct:1", "acct:2", "acct:3"]) == []
    with pytest.raises(ValueError, match="not an argument"):
        lock_all("acct:{nope}", using="redis")(lambda src: src)
    assert seen == []


def test_async_with_and_a_coroutine_decorator(any_alias: str) -> None:
    import asyncio

    names = ["as:1", "as:2"]

    @lock_all("as:{src}", "as:{dst}", using=any_alias, timeout=5)
    async def transfer(src: int, dst: int) -> list[str]:
        return held_names(any_alias, names)

    async def main() -> None:
        async with lock_all(*names, using=any_alias, timeout=5) as held:
            assert held.held() and all(held.fences.values())
            assert held_names(any_alias, names) == names
            busy = lock_all(*names, using=any_alias)
            assert not await busy.aacquire(blocking=False)
            other = lock_all("as:2", "as:3", using=any_alias)
            waiter = asyncio.ensure_future(other.aacquire(timeout=10))
            await asyncio.sleep(0.3)
            assert not waiter.done()
        assert await waiter  # woken by the release
        assert held_names(any_alias, names) == ["as:2"]
        await other.arelease()
        assert await transfer(2, 1) == names

    asyncio.run(main())
    assert held_names(any_alias, names) == []


def test_atomic_is_refused_on_an_event_loop() -> None:
    async def body() -> None: ...

    with pytest.raises(LockError, match="synchronous"):
        lock_all("x", using="redis", atomic=True)(body)


# -- operators see one holder, marked as one multi-lock ----------------------------------------


def test_list_shows_each_name_with_the_same_multi_lock_holder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with lock_all("m:1", "m:2", using="redis") as held:
        infos = [locks["redis"].inspect(n) for n in held.names]
        marks = {info.holder.get("m") for info in infos if info is not None}
        assert len(infos) == 2 and marks == {f"2.{held.group}"}
        call_command("redlock", "list", "--backend", "redis")
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "m:1" in line or "m:2" in line]
    assert len(rows) == 2
    assert all(f"multi-lock {held.group[-8:]} of 2 names" in row for row in rows)


def test_a_lock_all_object_is_not_taken_twice() -> None:
    held = MultiLock("d:1", "d:2", using="redis")
    with held, pytest.raises(Exception, match="already held by this object"):
        held.acquire()


# -- processes ---------------------------------------------------------------------------------


class MultiChild(Child):
    """A process of tests/support/multi_child.py."""

    def __init__(self, url: str, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__("--url", url, *args, module="tests.support.multi_child", env=env)


@pytest.fixture
def multi_child(redis_server: RedisServer) -> Iterator[Callable[..., MultiChild]]:
    started: list[MultiChild] = []

    def start(*args: str, env: dict[str, str] | None = None) -> MultiChild:
        started.append(MultiChild(redis_server.url, *args, env=env))
        return started[-1]

    yield start
    for proc in started:
        proc.signal(signal.SIGCONT)
        proc.close()


@pytest.mark.timeout(300)
def test_four_processes_taking_a_b_in_opposite_orders_never_overlap(
    redis_server: RedisServer, multi_child: Callable[..., MultiChild]
) -> None:
    start = "multi:start"
    orders = ["a,b", "b,a", "a,b", "b,a"]
    procs = [
        multi_child("contend", "--names", order, "--rounds", "150", "--start", start)
        for order in orders
    ]
    client = redis_server.client()
    client.set(start, 1)
    assert [int(proc.expect("DONE", timeout=240).split()[0]) for proc in procs] == [0, 0, 0, 0]
    assert int(client.get(f"{start}:total") or 0) == 600
    assert held_names("redis", ["a", "b"]) == []


@pytest.mark.parametrize("where", ["redis", "redlock"])
def test_a_sigkilled_holder_frees_every_name_at_its_ttl(
    where: str, multi_child: Callable[..., MultiChild], request: pytest.FixtureRequest
) -> None:
    names = ["k:1", "k:2", "k:3"]
    alias, options = "redis", []
    if where == "redlock":
        alias = request.getfixturevalue("quorum")
        options = ["--nodes", ",".join(locks[alias].location)]  # type: ignore[arg-type]
    holder = multi_child(*options, "hold", "--names", ",".join(names), "--ttl", "1")
    fences = [int(f) for f in holder.expect("HELD", timeout=30).split()]
    assert len(fences) == 3
    holder.signal(signal.SIGKILL)
    killed = time.monotonic()
    assert held_names(alias, names) == names  # held until the TTL runs out
    with lock_all(*names, using=alias, timeout=10) as held:
        assert time.monotonic() - killed < 5
        assert all(new > old for new, old in zip(held.fences.values(), fences, strict=True))


# -- waiters pass a wake-up on ------------------------------------------------------------------


def test_a_set_waiter_woken_for_a_free_name_hands_the_wake_up_on() -> None:
    """The set waiter registered on a is woken by a's release, but b is busy: it must wake
    a's next waiter (a plain lock here), which would else sleep until a's old TTL."""
    holder_a, holder_b = lock("h:a", using="redis", ttl=30), lock("h:b", using="redis", ttl=30)
    assert holder_a.acquire() and holder_b.acquire()
    got_a: list[float] = []

    def set_wait() -> None:
        both = lock_all("h:a", "h:b", using="redis", timeout=3)
        if both.acquire(timeout=3):
            both.release()

    set_waiter = threading.Thread(target=set_wait)
    backend = locks["redis"]
    waiting = backend.waiting_key("h:a")  # type: ignore[attr-defined]
    client = backend.client  # type: ignore[attr-defined]

    def registered(count: int) -> None:  # polled, not a fixed 0.5 s
        deadline = time.monotonic() + 10
        while client.zcard(waiting) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.zcard(waiting) == count

    set_waiter.start()
    registered(1)  # registered on h:a first

    def plain() -> None:
        single = lock("h:a", using="redis", ttl=30)
        if single.acquire(timeout=20):
            got_a.append(time.monotonic())
            single.release()

    plain_waiter = threading.Thread(target=plain)
    plain_waiter.start()
    registered(2)
    released = time.monotonic()
    holder_a.release()
    plain_waiter.join(25)
    holder_b.release()  # the set waiter then ends (no wait for its 3 s timeout)
    set_waiter.join(10)
    assert got_a and got_a[0] - released < 2.5  # not the 30 s of h:a's old TTL


# -- Redlock and Cluster: canonical order -------------------------------------------------------


@pytest.fixture
def quorum(redis_factory: Callable[..., RedisServer]) -> Iterator[str]:
    nodes = [redis_factory() for _ in range(5)]
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in nodes],
        # Generous: a loaded test machine must not turn a slow reply into no quorum.
        "OPTIONS": {"socket_timeout": 2.0, "socket_connect_timeout": 2.0},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "quorum": config}):
        yield "quorum"


@pytest.fixture(params=("quorum", "cluster", "local"))
def in_order_alias(request: pytest.FixtureRequest) -> str:
    """A backend whose names are taken one by one (Redlock, Cluster, LocMem)."""
    if request.param == "cluster":
        request.getfixturevalue("_cluster_alias")
        return "cluster"
    if request.param == "quorum":
        return str(request.getfixturevalue("quorum"))
    return "local"


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_member_that_ran_out_while_a_later_one_was_waited_for_is_not_reported_held(
    in_order_alias: str, use_async: bool
) -> None:
    """``a`` (not renewed, TTL 0.3 s) is taken, then ``b`` is waited for ~1 s: ``a`` ran
    out meanwhile. The set comes back held only with ``a`` held again: nobody else gets it
    inside the block."""
    import asyncio

    alias = in_order_alias
    names = ["ex:a", "ex:b"]
    other = lock("ex:b", using=alias, ttl=1, auto_renew=False)
    assert other.acquire()
    taken = lock_all(*names, using=alias, ttl=0.3, timeout=10, auto_renew=False)

    def inside() -> tuple[bool, list[str]]:
        intruder = lock("ex:a", using=alias, ttl=5, auto_renew=False)
        stolen = intruder.acquire(blocking=False)
        if stolen:
            intruder.release()
        return stolen, held_names(alias, names)

    if use_async:

        async def main() -> tuple[bool, list[str]]:
            async with taken:
                return inside()

        stolen, seen = asyncio.run(main())
    else:
        with taken:
            stolen, seen = inside()
    assert not stolen
    assert seen == names
    assert held_names(alias, names) == []


def test_members_renewed_while_a_later_one_was_waited_for_are_extended_not_given_back(
    in_order_alias: str,
) -> None:
    """The same slow take with renewed members (TTL 0.3 s, ~0.8 s of waiting): each is
    extended as the take ends, none is lost or taken again."""
    alias = in_order_alias
    names = ["rx:a", "rx:b"]
    other = lock("rx:b", using=alias, ttl=0.8, auto_renew=False)
    assert other.acquire()
    lost: list[Any] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        lost.append(kwargs)

    lock_lost.connect(on_lost)
    try:
        with lock_all(*names, using=alias, ttl=0.3, timeout=10) as held:
            assert held_names(alias, names) == names
            assert all((lk.ttl() or 0) > 0.1 for lk in held.locks)
    finally:
        lock_lost.disconnect(on_lost)
    assert lost == []
    assert held_names(alias, names) == []


@pytest.mark.usefixtures("_cluster_alias")
def test_cluster_names_in_different_slots_all_or_none_and_waiting() -> None:
    names = ["slot:a", "slot:b", "slot:c"]
    backend = locks["cluster"]
    assert len({key_slot(backend.key(n).encode()) for n in names}) == 3
    assert not lock_all(*names, using="cluster").together  # taken in canonical order
    other = lock("slot:c", using="cluster", ttl=30)
    assert other.acquire()
    assert not lock_all(*names, using="cluster").acquire(blocking=False)
    assert held_names("cluster", names) == ["slot:c"]  # a and b given back
    threading.Timer(0.5, other.release).start()
    with lock_all(*reversed(names), using="cluster", timeout=20) as held:
        assert held_names("cluster", names) == names
        assert all(held.fences.values())
    assert held_names("cluster", names) == []


def test_redlock_all_or_none_waiting_and_loss(quorum: str) -> None:
    names = ["q:1", "q:2", "q:3"]
    other = lock("q:2", using=quorum, ttl=30)
    assert other.acquire()
    assert not lock_all(*names, using=quorum).acquire(blocking=False)
    assert held_names(quorum, names) == ["q:2"]
    threading.Timer(0.5, other.release).start()
    with lock_all(*names, using=quorum, timeout=20) as held:
        assert held_names(quorum, names) == names
        assert all(held.fences.values())
    assert held_names(quorum, names) == []
    held = lock_all(*names, using=quorum, ttl=10)
    with pytest.raises(LockLost, match="'q:3'"), held:
        assert locks[quorum].force_release("q:3")
    assert held_names(quorum, names) == []


@pytest.mark.timeout(300)
def test_redlock_processes_taking_a_b_in_opposite_orders_never_overlap(
    redis_server: RedisServer, quorum: str, multi_child: Callable[..., MultiChild]
) -> None:
    nodes = ",".join(locks[quorum].location)  # type: ignore[arg-type]
    start = "multi:start"
    procs = [
        multi_child(
            "--nodes", nodes, "contend", "--names", order, "--rounds", "40", "--start", start
        )
        for order in ("a,b", "b,a", "a,b", "b,a")
    ]
    client = redis_server.client()
    client.set(start, 1)
    assert [int(proc.expect("DONE", timeout=240).split()[0]) for proc in procs] == [0, 0, 0, 0]
    assert int(client.get(f"{start}:total") or 0) == 160
    assert held_names(quorum, ["a", "b"]) == []


# -- atomic=: every fence in one transaction ------------------------------------------------------

PG = "postgres"


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_atomic_records_every_fence_in_one_transaction_before_the_body() -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_redlock.fence_table import row_key
    from django_redlock.models import Fence

    held = lock_all("fa:2", "fa:1", atomic=True)
    with CaptureQueriesContext(connection) as queries, held:
        assert connection.in_atomic_block
        rows = dict(Fence.objects.values_list("name", "fence"))
        assert rows == held.fences
    sqls = [q["sql"] for q in queries.captured_queries]
    first = [next(i for i, sql in enumerate(sqls) if row_key("default", n) in sql)
             for n in ("fa:1", "fa:2")]  # fmt: skip
    assert first[0] < first[1]  # the rows locked in canonical order
    assert held_names("default", ["fa:1", "fa:2"]) == []
    # One transaction: the body's error rolls back every name's record, not the last only.
    with pytest.raises(ZeroDivisionError), lock_all("fb:2", "fb:1", atomic=True):
        1 / 0  # noqa: B018
    assert not Fence.objects.filter(name__startswith="fb:").exists()
    assert held_names("default", ["fb:1", "fb:2"]) == []


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_atomic_refuses_a_stale_fence_of_any_name_and_frees_every_name() -> None:
    from django_redlock import StaleFence
    from django_redlock.fence_table import check_fence

    with lock_all("st:1", "st:2") as held:
        fences = held.fences
    check_fence("default", "default", "st:2", 10**18)  # a later hold recorded st:2's fence
    body: list[str] = []
    with pytest.raises(StaleFence), lock_all("st:1", "st:2", atomic=True):
        body.append("ran")
    assert body == [] and all(fences.values())
    assert held_names("default", ["st:1", "st:2"]) == []


def eventually(condition: Callable[[], Any], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


@pytest.mark.django_db(databases=["default", PG], transaction=True)
@pytest.mark.timeout(120)
def test_postgresql_a_holder_paused_before_its_block_commits_nothing(
    multi_child: Callable[..., MultiChild], postgres_env: dict[str, str]
) -> None:
    from ..support.fenced_child import open_shop, sales, sell_one

    names = ["pg:a", "pg:b"]
    open_shop(PG, 1, 5)
    paused = multi_child("paused", "--names", ",".join(names), "--when", "before", "--ttl", "1",
                         "--no-renew", env=postgres_env)  # fmt: skip
    old = [int(f) for f in paused.expect("ACQUIRED", timeout=60).split()]
    paused.signal(signal.SIGSTOP)
    eventually(lambda: held_names("default", names) == [], "the paused holds' expiry")
    with lock_all(*reversed(names), ttl=10, atomic=PG) as held:
        sell_one(PG, 1, "next")
        assert all(new > o for new, o in zip(held.fences.values(), old, strict=True))
    paused.signal(signal.SIGCONT)
    paused.send("go")
    assert paused.expect("REFUSED", timeout=60).split()[0] == "StaleFence"
    assert sales(PG) == [("next", 5)]


@pytest.mark.django_db(databases=["default", PG], transaction=True)
@pytest.mark.timeout(120)
def test_postgresql_the_next_set_holder_starts_after_a_paused_holder_s_transaction(
    multi_child: Callable[..., MultiChild], postgres_env: dict[str, str]
) -> None:
    from django.db import connections

    from ..fenced.test_fenced_postgres import waiting_on_a_row
    from ..support.fenced_child import open_shop, sales, sell_one

    names = ["pg:a", "pg:b"]
    open_shop(PG, 1, 5)
    paused = multi_child("paused", "--names", ",".join(names), "--when", "inside", "--ttl", "1",
                         env=postgres_env)  # fmt: skip
    paused.expect("INSIDE", timeout=60)  # sold one, every fence recorded, not committed yet
    paused.signal(signal.SIGSTOP)
    eventually(lambda: held_names("default", names) == [], "the paused holds' expiry")
    seen: list[list[tuple[str, int]]] = []

    def next_holder() -> None:
        try:
            with lock_all("pg:b", "pg:a", ttl=10, timeout=30, atomic=PG):
                seen.append(sales(PG))
                sell_one(PG, 1, "next")
        finally:
            connections.close_all()

    thread = threading.Thread(target=next_holder, daemon=True)
    thread.start()
    eventually(waiting_on_a_row, "the next holder waiting for a name's row")
    assert seen == []  # every name held in Redis, its body not started
    paused.signal(signal.SIGCONT)
    paused.send("go")
    assert paused.expect("COMMITTED", timeout=60) == ""  # the lost-hold rule: in order
    thread.join(30)
    assert seen == [[("paused", 5)]]
    assert sales(PG) == [("paused", 5), ("next", 4)]


# -- the example shop ----------------------------------------------------------------------------


def test_the_example_shop_moves_tickets_to_the_box_office_under_both_locks() -> None:
    """The shop's "Move 10 tickets" (example_project/shop/stock.py) against buyers: every
    ticket is in one place, whatever the interleaving."""
    import importlib.util

    from ..conftest import ROOT

    spec = importlib.util.spec_from_file_location(
        "example_shop_stock", ROOT / "example_project/shop/stock.py"
    )
    assert spec is not None and spec.loader is not None
    stock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stock)
    stock.restock(60)

    def mover() -> None:
        for _ in range(5):
            stock.move_to_box_office(2)

    def buyer() -> None:
        for _ in range(10):
            with lock("tickets", timeout=30):
                stock.sell_one()

    threads = [threading.Thread(target=t) for t in (mover, mover, buyer, buyer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    sold = int(stock.redis().get(stock.SOLD_KEY) or 0)
    assert stock.box_office() == 20 and sold == 20
    assert stock.left() + stock.box_office() + sold == 60


# -- lost replies, waiting for oneself ------------------------------------------------------------


@pytest.fixture
def lossy(redis_server: RedisServer) -> Iterator[LossyProxy]:
    """An alias "lossy" on the suite's Redis, through a proxy that can lose replies."""
    proxy = LossyProxy(redis_server.port)
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": proxy.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "lossy": config}):
        yield proxy
    proxy.close()


def test_a_take_whose_reply_was_lost_gives_every_name_back(lossy: LossyProxy) -> None:
    names = ["lr:1", "lr:2", "lr:3"]
    held = lock_all(*names, using="lossy", ttl=30)
    with held:
        pass  # connected (the script's connection and the pipeline's): the next reply is ours
    lossy.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        held.acquire()  # the script took every name; its reply was lost
    assert lossy.lost == 1
    assert held_names("redis", names) == []  # given back at once, not at the TTL
    assert not held.held()
    with held:
        assert held_names("redis", names) == names


def test_a_release_whose_reply_was_lost_is_no_loss(lossy: LossyProxy) -> None:
    names = ["lq:1", "lq:2"]
    with lock_all(*names, using="lossy", ttl=30):
        pass  # connected: the release's pipeline too (the next reply is the release's)
    held = lock_all(*names, using="lossy", ttl=30)
    assert held.acquire()
    lossy.lose_replies(1)
    with pytest.raises(BackendUnavailable):
        held.release()  # the pipeline went through; its reply did not
    assert held_names("redis", names) == []
    held.release()  # the retry finds the tokens gone: our own release, no loss
    assert all(lk.lost is None for lk in held.locks)
    with pytest.raises(LockNotOwned):
        held.release()


def test_waiting_forever_for_a_name_this_thread_holds_is_refused() -> None:
    with lock("self:b", using="redis"):
        with pytest.raises(LockError, match="would wait forever"):
            lock_all("self:a", "self:b", using="redis").acquire()
        assert held_names("redis", ["self:a"]) == []
        assert not lock_all("self:a", "self:b", using="redis").acquire(timeout=0.1)


@pytest.mark.django_db
def test_the_admin_shows_each_name_with_the_same_holder_marked_as_one_multi_lock() -> None:
    from django.test import Client

    from ..support.factories import UserFactory

    client = Client()
    client.force_login(UserFactory(is_superuser=True))
    with lock_all("adm:1", "adm:2", using="redis") as held:
        page = client.get(
            "/admin/django_redlock/heldlock/", {"backend": "redis", "q": "adm:*"}
        ).content.decode()
    holders = re.findall(r'<td class="holder" title="([^"]*)">(.*?)<br>', page)
    short = f"MainThread (multi-lock {held.group[-8:]} of 2 names)"
    assert [who for _, who in holders] == [short, short]
    assert all(title.endswith(f"multi-lock {held.group} of 2 names") for title, _ in holders)


@pytest.mark.parametrize("alias", ["redis", "cluster"])
def test_the_watchdog_renews_every_name_past_its_ttl(
    alias: str, request: pytest.FixtureRequest
) -> None:
    if alias == "cluster":
        request.getfixturevalue("_cluster_alias")
    names = ["rn:1", "rn:2", "rn:3"]
    with lock_all(*names, using=alias, ttl=1) as held:
        time.sleep(2.5)  # 2.5 TTLs
        assert held_names(alias, names) == names
        assert all(lk.owned() for lk in held.locks)
    assert held_names(alias, names) == []


def test_a_blocking_take_in_a_running_event_loop_is_refused() -> None:
    import asyncio

    async def main() -> bool:
        with pytest.raises(LockError, match="event loop"):
            lock_all("ev:1", "ev:2", using="redis").acquire()
        held = lock_all("ev:1", "ev:2", using="redis")
        taken = held.acquire(blocking=False)  # one try never blocks the loop
        held.release()
        return taken

    assert asyncio.run(main())


def test_a_set_waiter_that_gives_up_leaves_no_registration(redis_server: RedisServer) -> None:
    other = lock("gu:b", using="redis", ttl=30)
    assert other.acquire()
    assert not lock_all("gu:a", "gu:b", "gu:c", using="redis").acquire(timeout=0.3)
    backend, client = locks["redis"], redis_server.client()
    assert [client.zcard(backend.waiting_key(n)) for n in ("gu:a", "gu:b", "gu:c")] == [0, 0, 0]
    other.release()


@pytest.mark.parametrize("alias", ["redis", "local"])
def test_an_interrupt_while_waiting_leaves_nothing_held(
    alias: str, redis_server: RedisServer
) -> None:
    """Ctrl-C (a KeyboardInterrupt from a signal handler) while waiting for a busy set."""
    other = lock("ki:c", using=alias, ttl=30)
    assert other.acquire()

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        waiting_set = lock_all("ki:a", "ki:b", "ki:c", using=alias, timeout=20)
        with pytest.raises(KeyboardInterrupt), waiting_set:
            pytest.fail("the body ran without every name")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert held_names(alias, ["ki:a", "ki:b", "ki:c"]) == ["ki:c"]
    if alias == "redis":
        waiting = [redis_server.client().zcard(locks[alias].waiting_key(f"ki:{n}")) for n in "abc"]
        assert waiting == [0, 0, 0]
    other.release()
    with lock_all("ki:a", "ki:b", "ki:c", using=alias, timeout=5):
        pass


def test_the_release_of_a_set_wakes_each_name_s_waiters(any_alias: str) -> None:
    names = ["rw:1", "rw:2", "rw:3"]
    holder = lock_all(*names, using=any_alias, ttl=30)
    assert holder.acquire()
    woke: dict[str, float] = {}

    def single() -> None:
        if lock("rw:3", using=any_alias, ttl=30).acquire(timeout=20):
            woke["single"] = time.monotonic()

    def a_set() -> None:
        if lock_all("rw:1", "rw:0", using=any_alias, ttl=30).acquire(timeout=20):
            woke["set"] = time.monotonic()

    threads = [threading.Thread(target=single), threading.Thread(target=a_set)]
    for thread in threads:
        thread.start()
    # Both seen registered (rw:3, rw:1) where the backend counts waiters, else the old 0.5 s.
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        infos = [locks[any_alias].inspect(n) for n in ("rw:3", "rw:1")]
        if all(info is not None and info.waiters >= 1 for info in infos):
            break
        time.sleep(0.01)
    released = time.monotonic()
    holder.release()
    for thread in threads:
        thread.join(25)
    assert sorted(woke) == ["set", "single"]
    assert all(when - released < 5 for when in woke.values())  # not the 30 s TTL


def test_a_name_held_by_another_kind_of_lock_is_busy_and_a_semaphores_an_error() -> None:
    from django_redlock import LockError, semaphore

    with lock("ok:r", using="redis", reentrant=True), semaphore("ok:s", limit=2, using="redis"):
        assert not lock_all("ok:a", "ok:r", using="redis").acquire(blocking=False)
        assert held_names("redis", ["ok:a"]) == []
        with pytest.raises(LockError, match="another kind, a semaphore"):
            lock_all("ok:a", "ok:s", using="redis").acquire(blocking=False)  # one kind a name
        assert held_names("redis", ["ok:a"]) == []


def test_a_free_name_with_a_fair_queue_is_left_to_its_queue(redis_server: RedisServer) -> None:
    backend, client = locks["redis"], redis_server.client()
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    client.rpush(backend.queue_key("fq:a"), "someone.1")  # a fair waiter, its place leased
    client.zadd(backend.deadlines_key("fq:a"), {"someone.1": now_ms + 60_000})
    assert not lock_all("fq:a", "fq:b", using="redis").acquire(blocking=False)
    assert not lock_all("fq:a", "fq:b", using="redis").acquire(timeout=0.3)
    assert held_names("redis", ["fq:a", "fq:b"]) == []
    client.delete(backend.queue_key("fq:a"), backend.deadlines_key("fq:a"))
    with lock_all("fq:a", "fq:b", using="redis", timeout=5):
        assert held_names("redis", ["fq:a", "fq:b"]) == ["fq:a", "fq:b"]


def test_decorating_a_generator_function_is_refused() -> None:
    def rows(src: int) -> Iterator[int]:
        yield src

    with pytest.raises(TypeError, match="generator"):
        lock_all("g:{src}", using="redis")(rows)


# -- Sentinel min_replicas, interrupts at any line of the take ---------------------------------


def test_sentinel_min_replicas_confirms_a_set_or_refuses_it(
    sentinel_group: list[RedisServer],
) -> None:
    """With OPTIONS min_replicas a set is held only once a replica confirmed it (WAIT, in the
    take's round trip), as lock() is: else QuorumNotReached, and nothing left held."""
    from django_redlock import QuorumNotReached

    config = {
        "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
        "LOCATION": [s.url for s in sentinel_group[2:]],
        "OPTIONS": {"service_name": "mymaster", "min_replicas": 1, "min_replicas_timeout": 0.3},
    }
    names = ["mr:1", "mr:2"]
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "sr": config}):
        with lock_all(*names, using="sr") as held:  # the replica confirms
            assert all(held.fences.values())
        replica = sentinel_group[1]
        replica.pause()
        try:
            for blocking in (False, True):
                with pytest.raises(QuorumNotReached, match="replicas"):
                    lock_all(*names, using="sr", blocking=blocking, timeout=None).acquire(
                        blocking=blocking, timeout=2 if blocking else None
                    )
                assert held_names("sr", names) == []
        finally:
            replica.resume()
        with lock_all(*names, using="sr", timeout=10):
            assert held_names("sr", names) == names


# The lines an interrupt may land on while a set is taken: every line of these functions (the
# driver's only while it runs the one-script take).
TAKE_PATH = {"acquire", "_take_together", "_take_in_order", "_take_each", "_ran_out",
             "_valid_since", "__enter__", "_wait"}  # fmt: skip


def _take_lines(frame: Any) -> bool:
    code = frame.f_code
    if code.co_filename.endswith("locking/multi.py"):
        return code.co_name in TAKE_PATH
    if code.co_filename.endswith("locking/steps.py") and code.co_name in ("drive", "_drive"):
        steps = frame.f_locals.get("steps")
        return getattr(getattr(steps, "gi_code", None), "co_name", "") == "_take_together"
    return False


def _trace(on_line: Callable[[Any], None]) -> Any:
    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            on_line(frame)
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if _take_lines(frame) else None

    return calls


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no close
@pytest.mark.parametrize("alias", ["redis", "quorum"])
def test_an_interrupt_at_any_line_of_the_take_leaves_nothing_held(
    alias: str, request: pytest.FixtureRequest
) -> None:
    """A KeyboardInterrupt (a signal handler, a time limit) raised at each line between the
    server's grant and the body, in turn: the interrupt comes out of the ``with``, the body
    never runs, and no name is held or renewed afterwards (nothing signalled lost). The
    driver throws an interrupt between its steps into them: no step generator is left to a
    close ("generator ignored GeneratorExit")."""
    import sys

    if alias == "quorum":
        request.getfixturevalue("quorum")
    names = ["int:1", "int:2", "int:3"]
    lines: list[tuple[str, int]] = []
    held = lock_all(*names, using=alias, ttl=5)
    sys.settrace(_trace(lambda f: lines.append((f.f_code.co_name, f.f_lineno))))
    try:
        held.__enter__()
    finally:
        sys.settrace(None)
    held.__exit__(None, None, None)
    assert len(lines) > 10
    lost: list[Any] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        lost.append(kwargs)

    lock_lost.connect(on_lost)
    try:
        for at in range(len(lines)):
            seen = [0]

            def interrupt(frame: Any, at: int = at, seen: list[int] = seen) -> None:
                seen[0] += 1
                if seen[0] == at + 1:
                    raise KeyboardInterrupt(f"at {lines[at]}")

            taking = lock_all(*names, using=alias, ttl=5)
            sys.settrace(_trace(interrupt))
            try:
                with pytest.raises(KeyboardInterrupt), taking:
                    sys.settrace(None)
                    pytest.fail(f"the body ran, interrupted at {lines[at]}")
            finally:
                sys.settrace(None)
            assert held_names(alias, names) == [], f"interrupted at {lines[at]}"
            assert not any(lk.token for lk in taking.locks), f"interrupted at {lines[at]}"
            assert not taking.held()
        with lock_all(*names, using=alias, blocking=False):  # free: nothing renews them
            time.sleep(0.2)
    finally:
        lock_lost.disconnect(on_lost)
    assert lost == []


def test_a_set_names_its_busy_name_and_counts_each_name_as_an_acquisition(
    quorum: str,
) -> None:
    """A refused set says which name was busy, on both paths; on one server each name counts
    as one acquisition (with the set's outcome), as a one-by-one take counts each member."""
    from prometheus_client import REGISTRY

    from django_redlock import observe

    assert observe.configure() is not None  # prometheus_client is installed for the tests

    def count(outcome: str) -> float:
        labels = {"backend": "redis", "kind": "plain", "outcome": outcome}
        return REGISTRY.get_sample_value("redlock_acquisitions_total", labels) or 0.0

    names = ["bz:a", "bz:b", "bz:c"]
    for alias in ("redis", quorum):
        with lock("bz:b", using=alias):
            for options in ({"timeout": 0.2}, {"blocking": False}):
                refused = pytest.raises(LockNotAcquired, match=r"'bz:b' is held")
                with refused, lock_all(*names, using=alias, **options):  # type: ignore[arg-type]
                    pytest.fail("taken")
    acquired, busy, timeout = count("acquired"), count("busy"), count("timeout")
    with lock_all(*names, using="redis"):
        assert count("acquired") == acquired + 3
    with lock("bz:c", using="redis"):
        assert not lock_all(*names, using="redis").acquire(blocking=False)
        assert not lock_all(*names, using="redis").acquire(timeout=0.1)
    assert (count("busy"), count("timeout")) == (busy + 3, timeout + 3)
