"""An ``aacquire()`` coroutine closed while it waits (GeneratorExit: what the collector or a
torn-down event loop does to a pending task) cleans up without awaiting: it leaves the fair
queue and stops watching, and closing it raises nothing. The close only hands the clean-up
to the finisher thread (no I/O, no thread start where a finalizer runs), which runs it soon
after.

(A coroutine closed in the middle of redis-py's own read is redis-py's to clean up: its
async connection needs a running loop to disconnect.)
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from django_redlock import lock, lock_all, locks
from django_redlock.locking import finisher
from django_redlock.testing import RedisServer

from ..conftest import ROOT


def close_while_waiting(coro: Coroutine[Any, Any, Any], seconds: float) -> None:
    """Run ``coro`` as a task for ``seconds``, close its loop with the task pending, then
    close the coroutine itself (it raised "generator ignored GeneratorExit" before)."""
    close_while_waiting_later(coro, seconds)
    # Its clean-up runs on the finisher thread, not in close(): waited for, bounded.
    assert finisher.wait_finished(5)


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("alias", ["redis", "local"])
def test_a_waiter_closed_while_waiting_leaves_cleanly(alias: str, name: str, fair: bool) -> None:
    holder = lock(name, using=alias, ttl=10, fair=fair)
    assert holder.acquire()
    close_while_waiting(lock(name, using=alias, ttl=10, fair=fair).aacquire(timeout=5), 0.3)
    holder.release()
    # A fair waiter left in the queue would keep its place (until its lease lapses) and
    # refuse a newcomer's try.
    newcomer = lock(name, using=alias, ttl=10, fair=fair)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


@pytest.mark.parametrize("fair", [False, True])
def test_a_closed_waiter_s_late_clean_up_never_releases_the_same_object_s_later_hold(
    name: str, fair: bool
) -> None:
    """A waiting ``aacquire()`` of object L is closed (its loop torn down); its clean-up is
    the finisher's, which gets to it later. Meanwhile L takes the lock again (a module-level
    object, a view's). The hand-back decided what to release when it ran: L's new hold, whose
    caller was in its critical section, and a second object took the lock (review asy, 1).
    It is decided at the close now: nothing had been granted, so nothing is released."""
    holder = lock(name, using="redis", ttl=10, fair=fair)
    mine = lock(name, using="redis", ttl=10, fair=fair)
    assert holder.acquire()
    gate = threading.Event()
    finisher.ensure_started()
    finisher.hand(lambda: gate.wait(10))  # the finisher busy (an earlier job on a slow backend)
    try:
        loop = asyncio.new_event_loop()
        coro = mine.aacquire(timeout=5)
        task = loop.create_task(coro)
        loop.run_until_complete(asyncio.sleep(0.3))
        assert not task.done()
        task._log_destroy_pending = False  # left pending on purpose
        loop.close()
        coro.close()
        holder.release()
        assert mine.acquire(timeout=5), "the lock, released, is taken again by the same object"
    finally:
        gate.set()
    assert finisher.wait_finished(5)
    other = lock(name, using="redis", ttl=10, fair=fair)
    assert not other.acquire(blocking=False), "two holders: the late clean-up released it"
    assert mine.owned()
    mine.release()


@pytest.mark.parametrize("fair", [False, True])
def test_a_waiter_closed_while_its_wake_up_try_is_on_the_server_hands_the_grant_back(
    redis_server: RedisServer, name: str, fair: bool
) -> None:
    """The release wakes the waiter; its try waits in the server (CLIENT PAUSE WRITE) as its
    loop is closed and the coroutine with it. Cancelling the try needed the closed loop:
    "Event loop is closed" came out of close() in the exit's place, nothing went to the
    finisher, and the try's grant was held by nobody to its TTL (review asy, 5)."""
    client = redis_server.client()
    holder = lock(name, using="redis", ttl=20, fair=fair)
    assert holder.acquire()
    mine = lock(name, using="redis", ttl=20, fair=fair)
    loop = asyncio.new_event_loop()
    coro = mine.aacquire(timeout=10)
    task = loop.create_task(coro)

    def release_then_pause() -> None:
        holder.release()  # wakes the waiter: its try follows ...
        client.execute_command("CLIENT", "PAUSE", 800, "WRITE")  # ... and waits in the server

    loop.call_later(0.3, release_then_pause)
    loop.run_until_complete(asyncio.sleep(0.5))
    task._log_destroy_pending = False  # left pending on purpose
    loop.close()
    coro.close()  # raised RuntimeError before
    assert finisher.wait_finished(5)
    deadline = time.monotonic() + 3
    newcomer = lock(name, using="redis", ttl=5, fair=fair)
    while not newcomer.acquire(blocking=False):
        assert time.monotonic() < deadline, "the closed waiter's grant is held by nobody"
        time.sleep(0.05)
    newcomer.release()


def test_a_closed_waiter_s_hand_back_never_lends_its_token_to_the_object_s_next_try(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The finisher runs a closed waiter's clean-up: its hand-back stored the dead try's
    token as the object's, for a next try, then sent its release. The same object's next
    try (another task of a module-level object) took that token, was granted, and the
    hand-back's release, landing after (a slow packet), deleted its hold: two holders
    (review wai2, 1). On the finisher the token is not lent: no try of that coroutine comes
    again."""
    from django.conf import settings
    from django.test import override_settings

    from django_redlock.scripts import script
    from tests.support.proxy import LossyProxy

    server = redis_factory()
    proxy = LossyProxy(server.port)
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": f"redis://127.0.0.1:{proxy.port}/0",
        "OPTIONS": {"socket_timeout": 3.0},
    }
    direct = {**config, "LOCATION": server.url}
    aliases = {**settings.DJANGO_REDLOCK, "hb": config, "hbd": direct}
    try:
        with override_settings(DJANGO_REDLOCK=aliases):
            mine = lock(name, using="hb", ttl=30)
            holder = lock(name, using="hbd", ttl=30)  # (not through the proxy)
            assert holder.acquire()
            gate = threading.Event()
            finisher.ensure_started()
            finisher.hand(lambda: gate.wait(10))  # the clean-up waits for the delay's arming
            close_while_waiting_later(mine.aacquire(timeout=25), 0.5)
            holder.release()
            proxy.delay_from(script("release").sha.encode())  # the hand-back's release: late
            gate.set()
            deadline = time.monotonic() + 5
            while not proxy.delayed.is_set():
                assert time.monotonic() < deadline, "the hand-back's release never came"
                time.sleep(0.01)
            assert mine.acquire(blocking=False)  # the same object, in the meantime
            proxy.let_go()  # the late release lands
            assert finisher.wait_finished(5)
            other = lock(name, using="hb", ttl=30)
            assert not other.acquire(blocking=False), "two holders: the late release deleted it"
            mine.release()
            locks["hb"].close()
            locks["hbd"].close()
    finally:
        proxy.let_go()
        proxy.close()


def close_while_waiting_later(coro: Coroutine[Any, Any, Any], seconds: float) -> None:
    """As :func:`close_while_waiting`, not waiting for the finisher."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    loop.run_until_complete(asyncio.sleep(seconds))
    assert not task.done()
    task._log_destroy_pending = False  # left pending on purpose
    loop.close()
    coro.close()


# The collector closes a pending task's coroutine at whatever allocation triggered it, in any
# thread: here one inside Thread.start() (it holds threading's ``_active_limbo_lock``, which
# every other thread's start and every new thread's bootstrap wait for), within a waiter's try
# (a call deadline stands), while the server holds replies back (CLIENT PAUSE). A clean-up
# run there waits for the server, and every thread start in the process waits with it.
CLOSED_BY_THE_COLLECTOR = """
import asyncio, os, threading, time
import django
from django.conf import settings
settings.configure(INSTALLED_APPS=["django_redlock"], DJANGO_REDLOCK={config!r})
django.setup()
from django_redlock import fast_path, lock

holder = lock({name!r}, using="x", ttl=10, fair=True)
assert holder.acquire()
coro = lock({name!r}, using="x", ttl=10, fair=True).aacquire(timeout=5)
loop = asyncio.new_event_loop()
task = loop.create_task(coro)
loop.run_until_complete(asyncio.sleep(0.3))  # registered in the fair queue, asleep
assert not task.done()
task._log_destroy_pending = False
loop.close()
import redis
redis.Redis.from_url({url!r}).execute_command("CLIENT", "PAUSE", 1500, "ALL")
took, started = [], []
from django_redlock.locking import finisher
ran_by = finisher._finisher[0].thread  # started by the aacquire, before any close
assert ran_by is not None and ran_by.is_alive()

def finalizer() -> None:  # a thread of its own: no connection yet, so the leave connects
    with fast_path.answered_by(time.monotonic() + 10), threading._active_limbo_lock:
        before = set(threading.enumerate())
        began = time.monotonic()
        coro.close()
        took.append(time.monotonic() - began)
        started.extend(t.name for t in set(threading.enumerate()) - before)

closer = threading.Thread(target=finalizer, daemon=True)
closer.start()
closer.join(5)
if closer.is_alive():
    print("stalled", flush=True)
    os._exit(3)
holder.release()
newcomer = lock({name!r}, using="x", ttl=10, fair=True)
deadline = time.monotonic() + 5  # the queue left once the server answers, by the finisher
while not newcomer.acquire(blocking=False):
    assert time.monotonic() < deadline, "the closed waiter kept its place in the queue"
    time.sleep(0.02)
newcomer.release()
assert not started, started  # no thread started by the close
assert finisher._finisher[0].thread is ran_by  # the clean-up's thread existed before
print(round(took[0], 3), flush=True)
"""


def test_a_waiter_closed_by_the_collector_under_a_thread_start_s_lock_returns_at_once(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The collector closing a waiting ``aacquire()`` does no I/O and starts no thread there:
    the close returns at once; its queue entry is left shortly after (the finisher thread).
    Before: the clean-up's leave waited for the paused server there (1.5 s; a socket
    timeout, with the server gone), the thread start's lock held meanwhile (the stall the
    fault campaign caught: an acquire blocked 5 s)."""
    server = redis_factory()
    config = {
        "x": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    }
    code = textwrap.dedent(CLOSED_BY_THE_COLLECTOR.format(config=config, name=name, url=server.url))
    try:
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the subprocess hung")
    assert run.returncode == 0, (run.stdout, run.stderr[-3000:])
    assert float(run.stdout.split()[-1]) < 0.5  # the close itself: no round trip


FORKED = """
import asyncio, os, time
import django
from django.conf import settings
settings.configure(INSTALLED_APPS=["django_redlock"], DJANGO_REDLOCK={config!r})
django.setup()
from django_redlock import lock
from django_redlock.locking import finisher

async def probe() -> None:
    await lock({name!r} + ":probe", using="x").alocked()

asyncio.run(probe())  # the parent's finisher runs
assert finisher._finisher[0].running
pid = os.fork()
if pid == 0:
    code = 1
    try:
        assert not finisher._finisher[0].running  # the parent's thread is not the child's
        holder = lock({name!r}, using="x", ttl=10, fair=True)
        assert holder.acquire()
        coro = lock({name!r}, using="x", ttl=10, fair=True).aacquire(timeout=5)
        loop = asyncio.new_event_loop()
        task = loop.create_task(coro)
        loop.run_until_complete(asyncio.sleep(0.3))
        task._log_destroy_pending = False
        loop.close()
        coro.close()
        assert finisher.wait_finished(5)  # the child's own finisher left the queue
        holder.release()
        newcomer = lock({name!r}, using="x", ttl=10, fair=True)
        assert newcomer.acquire(blocking=False)
        newcomer.release()
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok", flush=True)
"""


def test_a_forked_child_runs_a_finisher_of_its_own(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    config = {
        "x": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    }
    code = textwrap.dedent(FORKED.format(config=config, name=name))
    try:
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the subprocess hung")
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.stdout, run.stderr[-3000:])


def _pending_in_a_closed_loop(
    make: Callable[[], Coroutine[Any, Any, Any]], count: int, seconds: float
) -> list[asyncio.Task[Any]]:
    """``count`` tasks of ``make()`` run for ``seconds``, then their loop closed with them
    pending (a torn-down loop): they never run again."""
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(make()) for _ in range(count)]
    loop.run_until_complete(asyncio.sleep(seconds))
    for task in tasks:
        assert not task.done()
        task._log_destroy_pending = False  # left pending on purpose
    loop.close()
    return tasks


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("alias", ["redis", "local"])
def test_waiters_of_a_closed_loop_take_no_wake_up_from_a_live_waiter(
    alias: str, name: str, fair: bool
) -> None:
    """Review wai, 1: waiters whose loop was closed, their tasks still referenced (so never
    collected), stayed in the hub and took the release's wake-up: a live waiter of the same
    process behind them slept to its timeout (plain) or ~2 s (fair). The first wake-up that
    finds a waiter's loop closed drops it, and its wake-up goes on at once."""
    holder = lock(name, using=alias, ttl=30, fair=fair)
    assert holder.acquire()
    zombies = _pending_in_a_closed_loop(
        lambda: lock(name, using=alias, ttl=30, fair=fair).aacquire(timeout=20), 3, 0.3
    )
    got: list[float] = []

    def live() -> None:
        waiter = lock(name, using=alias, ttl=30, fair=fair)
        if waiter.acquire(timeout=6):
            got.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=live)
    thread.start()
    time.sleep(0.3)  # waiting behind them
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got, "the live waiter never got the lock"
    assert got[0] - released < 1.0  # the paused-waiter bound is 0.5 s a hand-off
    del zombies
    gc.collect()  # (their clean-up now, the server up: not at the interpreter's exit)


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("alias", ["redis", "local"])
def test_waiting_tasks_of_a_closed_loop_are_collected(
    alias: str, name: str, fair: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review wai, 1: the hub held each waiting task (through its waiter's future), so the
    tasks of a torn-down loop were never collected and their clean-up never ran. Collected
    now, their clean-up leaves the server's waiters; the collector closing their steps
    before the coroutines ("generator ignored GeneratorExit") would leave them in line."""
    gc.collect()  # an earlier test's closed loops: their redis-py noise is not this test's
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    holder = lock(name, using=alias, ttl=30, fair=fair)
    assert holder.acquire()
    tasks = _pending_in_a_closed_loop(
        lambda: lock(name, using=alias, ttl=30, fair=fair).aacquire(timeout=20), 8, 0.3
    )
    registered = 0 if alias == "local" and not fair else 8  # (by channel there: no ids)
    assert (locks[alias].inspect(name) or pytest.fail()).waiters == registered
    refs = [weakref.ref(task) for task in tasks]
    del tasks
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == []
    assert [u.exc_value for u in unraisable] == []
    deadline = time.monotonic() + 2  # (the clean-up may run on a thread of its own)
    while (locks[alias].inspect(name) or pytest.fail()).waiters and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (locks[alias].inspect(name) or pytest.fail()).waiters == 0
    holder.release()
    newcomer = lock(name, using=alias, ttl=30, fair=fair)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def test_a_task_collected_inside_async_with_hands_its_release_to_the_finisher(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review asy, 2: a pending task dropped inside ``async with`` is closed by the collector,
    on the running loop. Its exit awaited the release inside the collection ("coroutine
    ignored GeneratorExit"), and nothing went to the finisher: the hold stayed to its TTL."""
    gc.collect()  # an earlier test's closed loops: their redis-py noise is not this test's
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    async def body() -> None:
        async with lock(name, using="redis", ttl=30):
            await asyncio.get_running_loop().create_future()  # never set: dropped below

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(body())
        await asyncio.sleep(0.3)  # inside the body
        task._log_destroy_pending = False  # dropped pending on purpose
        del task
        gc.collect()

    asyncio.run(main())
    assert finisher.wait_finished(5)
    assert [u.exc_value for u in unraisable] == []
    newcomer = lock(name, using="redis", ttl=30)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def test_lock_all_taken_one_by_one_closed_after_a_grant_hands_the_member_back(name: str) -> None:
    """Review asy, 3: names taken one by one (Redlock, Cluster, LocMem), the coroutine closed
    (its loop closed) while it waits for "b" with "a" granted. The close awaited the release
    of "a" ("no running event loop" out of close()), and the watchdog renewed "a" for as long
    as the object lived, held by nobody."""
    other = lock(f"{name}:b", using="local", ttl=30)
    assert other.acquire()
    taking = lock_all(f"{name}:a", f"{name}:b", using="local", ttl=30)
    close_while_waiting(taking.aacquire(timeout=20), 0.3)
    assert [lk.token for lk in taking.locks] == [None, None]
    newcomer = lock(f"{name}:a", using="local", ttl=30)
    assert newcomer.acquire(blocking=False)
    newcomer.release()
    other.release()


@pytest.mark.parametrize("kind", ["lock", "lock_all"])
def test_async_with_left_pending_by_a_closed_loop_releases_through_the_finisher(
    name: str, kind: str
) -> None:
    """Review asy, 4: a long-lived object used with ``async with``, its loop closed with the
    task inside the body. The exit's release needed the loop ("no running event loop" out of
    close()), so renewal never stopped: the hold lasted as long as the object."""
    names = [f"{name}:a", f"{name}:b"]
    held: Any = lock(name, using="redis", ttl=30) if kind == "lock" else lock_all(*names)

    async def body() -> None:
        async with held:
            await asyncio.sleep(30)

    close_while_waiting(body(), 0.3)
    newcomer: Any = lock(name, using="redis", ttl=30) if kind == "lock" else lock_all(*names)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def test_an_async_lock_view_left_pending_by_a_closed_loop_releases_through_the_finisher(
    name: str,
) -> None:
    """Review asy, 2 (``lock_view``'s async run: the same shape as ``async with``)."""
    from django.http import HttpRequest, HttpResponse
    from django.test import RequestFactory

    from django_redlock import lock_view

    @lock_view(name, using="redis", ttl=30)
    async def view(request: HttpRequest) -> HttpResponse:
        await asyncio.sleep(30)
        return HttpResponse("ran")

    close_while_waiting(view(RequestFactory().get("/")), 0.3)
    newcomer = lock(name, using="redis", ttl=30)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def test_an_async_generator_s_aclose_on_its_loop_still_releases_before_it_returns(
    name: str,
) -> None:
    """``aclose()`` throws GeneratorExit too, but on a running loop and outside a collection,
    where the release can be awaited: it is done when ``aclose()`` returns, not handed over."""
    held = lock(name, using="redis", ttl=30)

    async def rows() -> Any:
        async with held:
            yield 1

    async def main() -> None:
        gen = rows()
        assert await gen.__anext__() == 1
        await gen.aclose()
        assert held.token is None

    asyncio.run(main())
    newcomer = lock(name, using="redis", ttl=30)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def test_an_async_generator_s_aclose_releases_before_it_returns_while_another_thread_collects(
    name: str,
) -> None:
    """Review asy4 6: another thread's collection, its finalizer letting the GIL go, made
    every thread look "in a collection": ``aclose()`` handed the release to the finisher and
    returned with the hold still on the server and in the object."""
    held = lock(name, using="redis", ttl=30)

    class Slow:
        me: Any = None

        def __del__(self) -> None:
            time.sleep(0.6)  # a finalizer that lets the GIL go (I/O, a lock's wait)

    def collect() -> None:
        cycle = Slow()
        cycle.me = cycle  # only the collector frees it
        del cycle
        gc.collect()

    async def rows() -> Any:
        async with held:
            yield 1

    async def main() -> None:
        gen = rows()
        assert await gen.__anext__() == 1
        collecting = threading.Thread(target=collect)
        collecting.start()
        await asyncio.sleep(0.2)  # the other thread is inside its finalizer
        await gen.aclose()
        assert held.token is None, "aclose() returned with the hold not released"
        collecting.join(5)

    asyncio.run(main())
    newcomer = lock(name, using="redis", ttl=30)
    assert newcomer.acquire(blocking=False)
    newcomer.release()


def _closed_with_a_reply_due(
    redis_server: RedisServer,
    work: Callable[[Callable[[], None]], Coroutine[Any, Any, Any]],
    pause: str,
) -> weakref.ref[asyncio.Task[Any]]:
    """Run ``work`` (it calls the function it is given right before the command that is to
    wait in the server: CLIENT PAUSE), close its loop with the task pending and wait out the
    pause: the reply then comes to the closed loop's connection, never read."""
    paused: list[bool] = []

    def pause_now() -> None:
        redis_server.client().execute_command("CLIENT", "PAUSE", 300, pause)
        paused.append(True)

    loop = asyncio.new_event_loop()
    task = loop.create_task(work(pause_now))
    for _ in range(300):
        loop.run_until_complete(asyncio.sleep(0.01))
        if paused:
            break
    loop.run_until_complete(asyncio.sleep(0.05))  # the command sent, waiting in the server
    assert paused and not task.done()
    task._log_destroy_pending = False  # left pending on purpose
    gone = weakref.ref(task)
    loop.close()
    del task, loop
    time.sleep(0.4)  # the pause is over
    return gone


@pytest.mark.parametrize("where", ["outside any loop", "inside the next loop"])
@pytest.mark.parametrize("kind", ["lock", "lock_all"])
def test_a_take_closed_with_its_reply_due_hands_the_grant_back_wherever_collected(
    redis_server: RedisServer, name: str, kind: str, where: str
) -> None:
    """The take's script waits in the server as its loop is closed; the grant comes later.
    Before: the backend kept the closed loop's client, which kept the task (waiting on its
    connection): never collected, the grant held by nobody to its TTL (review asy4 2); let go
    by the next loop's first call and collected in that loop, redis-py's "Event loop is
    closed" replaced the close and was taken for an ordinary error: nothing handed back
    (review asy4 1)."""
    names = [f"{name}:a", f"{name}:b"] if kind == "lock_all" else [name]

    async def take(pause: Callable[[], None]) -> None:
        warm: Any = lock(f"{name}:warm", using="redis")  # a connection, the scripts loaded
        if kind == "lock_all":
            warm = lock_all(f"{name}:warm", f"{name}:warm2", using="redis")
        await warm.aacquire()
        await warm.arelease()
        taking: Any = lock_all(*names, using="redis", ttl=20) if kind == "lock_all" else None
        pause()
        await (taking or lock(name, using="redis", ttl=20)).aacquire(timeout=5)
        await asyncio.sleep(30)

    gone = _closed_with_a_reply_due(redis_server, take, "WRITE")
    assert all(lock(n, using="redis").locked() for n in names), "setup: not granted"
    if where == "inside the next loop":

        async def next_request() -> None:
            await lock(f"{name}:next", using="redis").alocked()
            gc.collect()

        asyncio.run(next_request())
    else:
        gc.collect()
    assert gone() is None, "the closed task is kept"
    assert finisher.wait_finished(5)
    held = [n for n in names if lock(n, using="redis").locked()]
    assert held == [], "the grant was held by nobody"


def test_async_with_closed_with_its_body_s_reply_due_releases_through_the_finisher(
    redis_server: RedisServer, name: str
) -> None:
    """The body awaits the lock's backend (``aowned()``) as its loop is closed. Before: the
    backend kept the closed loop's client, and through it the task: never closed, its hold
    renewed by the watchdog for as long as the process lived (review asy4 3)."""

    async def body(pause: Callable[[], None]) -> None:
        held = lock(name, using="redis", ttl=2)
        async with held:
            pause()
            await held.aowned()
            await asyncio.sleep(30)

    gone = _closed_with_a_reply_due(redis_server, body, "ALL")
    gc.collect()
    assert gone() is None, "the closed task is kept"
    assert finisher.wait_finished(5)
    assert not lock(name, using="redis").locked(), "the closed task's hold is renewed"
