"""A release (or hand-back) cut by a cancellation under ``asyncio.run`` is finished by a task
of its own; the loop's shutdown cancels that task too, before it sent anything. The release
is then finished as the task ends, not left on Redis to its TTL, held by nobody (asyncio.md:
"the release is finished by a task of its own rather than left to the lock's TTL").

The release's send is held back (a wrapper of the backend's ``aexecute``, standing for a wait
for a pooled connection, as with ``max_connections`` and every connection busy): the commands
that do go out go to the real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Container
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import lock, lock_all, locks
from django_redlock.locking import finisher
from django_redlock.testing import RedisServer

from ..redlock.test_redlock import quorum_alias

REDIS = "django_redlock.backends.redis.RedisBackend"


def _held_back(
    monkeypatch: pytest.MonkeyPatch, alias: str, names: Container[str] | None = None
) -> list[str]:
    """From the first ``"hold"`` put in the list returned, every async command of the backend
    (on one of ``names``, if given) waits (a pooled connection's wait) before it is sent;
    ``"cut"``: the one that follows a granted reply is cancelled as that reply comes in."""
    backend = locks[alias]
    send: Callable[[Any], Awaitable[Any]] = backend.aexecute
    state: list[str] = []

    async def aexecute(op: Any) -> Any:
        if state[-1:] == ["cut"]:  # the try: granted, its task cancelled as the reply comes in
            reply = await send(op)
            state.append("hold")
            _cancel_now()  # (no local: the traceback would keep the task from the collector)
            await asyncio.sleep(0)
            return reply
        if "hold" in state and (names is None or op.name in names):
            await asyncio.sleep(30)  # cancelled first
        return await send(op)

    monkeypatch.setattr(backend, "aexecute", aexecute)
    return state


def _cancel_now() -> None:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()


def _cancel_soon() -> None:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().call_later(0.1, task.cancel)


def test_a_cancelled_async_with_release_is_finished_despite_asyncio_run_s_shutdown(
    monkeypatch: pytest.MonkeyPatch, alias: str, name: str
) -> None:
    """Before: the finishing task, cancelled by the shutdown, was ignored; the key stayed
    (20 s TTL, no renewal: the release had stopped it)."""
    state = _held_back(monkeypatch, alias)

    async def main() -> None:
        async with lock(name, using=alias, ttl=20):
            state.append("hold")
            _cancel_soon()  # during the release's wait

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    monkeypatch.undo()
    assert not lock(name, using=alias).locked(), "the hold outlived asyncio.run()"
    assert lock(name, using=alias).acquire(blocking=False)


def test_a_reentrant_release_cut_the_same_way_is_finished_as_its_owner(
    monkeypatch: pytest.MonkeyPatch, alias: str, name: str
) -> None:
    """The owner's count is settled on the owner's behalf (the task that held it is gone)."""
    state = _held_back(monkeypatch, alias)

    async def main() -> None:
        async with lock(name, using=alias, ttl=20, reentrant=True):
            state.append("hold")
            _cancel_soon()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    monkeypatch.undo()
    assert not lock(name, using=alias).locked(), "the hold outlived asyncio.run()"


def test_an_aacquire_s_hand_back_cut_the_same_way_is_finished(
    monkeypatch: pytest.MonkeyPatch, alias: str, name: str
) -> None:
    """Cancelled as the granting reply came in, then again during the hand-back's wait."""
    state = _held_back(monkeypatch, alias)

    async def main() -> None:
        state.append("cut")
        _cancel_soon()  # the second cancellation, during the hand-back's wait
        await lock(name, using=alias, ttl=20).aacquire(blocking=False)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    monkeypatch.undo()
    assert state[-1] == "hold"  # the try was granted, and cancelled
    assert not lock(name, using=alias).locked(), "the granted hold outlived asyncio.run()"


def test_a_cancelled_lock_all_release_is_finished_despite_asyncio_run_s_shutdown(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Each member's release, finished by a task of its own, the same way."""
    state = _held_back(monkeypatch, "redis")
    names = [f"{name}:a", f"{name}:b", f"{name}:c"]

    async def main() -> None:
        async with lock_all(*names, using="redis", ttl=20):
            state.append("hold")
            _cancel_soon()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    monkeypatch.undo()
    held = [n for n in names if lock(n, using="redis").locked()]
    assert held == [], "holds outlived asyncio.run()"


def test_a_lock_all_aacquire_s_give_back_cut_the_same_way_is_finished(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """lock_all's own finishing task: the take granted as its task was cancelled, then
    cancelled again during the give-back's wait."""
    state = _held_back(monkeypatch, "redis")
    names = [f"{name}:a", f"{name}:b"]

    async def main() -> None:
        state.append("cut")
        _cancel_soon()
        await lock_all(*names, using="redis", ttl=20).aacquire(blocking=False)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    monkeypatch.undo()
    assert state[-1] == "hold"  # the take was granted, and cancelled
    held = [n for n in names if lock(n, using="redis").locked()]
    assert held == [], "the granted holds outlived asyncio.run()"


def test_redlock_a_cancelled_async_with_release_is_finished_despite_asyncio_run_s_shutdown(
    monkeypatch: pytest.MonkeyPatch, redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """Redlock takes the same route (its own fan-out owes only the writes it began)."""
    with quorum_alias("quorum", [redis_factory() for _ in range(3)]):
        state = _held_back(monkeypatch, "quorum")

        async def main() -> None:
            async with lock(name, using="quorum", ttl=20):
                state.append("hold")
                _cancel_soon()

        with pytest.raises(asyncio.CancelledError):
            asyncio.run(main())
        monkeypatch.undo()
        assert not lock(name, using="quorum").locked(), "the hold outlived asyncio.run()"


def test_lock_all_s_own_finishing_task_cut_the_same_way_is_finished(
    monkeypatch: pytest.MonkeyPatch, name: str, request: pytest.FixtureRequest
) -> None:
    """Cluster takes the names one by one. Cancelled while waiting for the third, then twice
    more during the give-back of the two held (each time while a release waits): the rest of
    the give-back goes to lock_all's finishing tasks, whose own member's release, made
    during the shutdown, may never run. Each cancelled finishing task releases what is left."""
    request.getfixturevalue("_cluster_alias")
    a, b, c = f"{name}:a", f"{name}:b", f"{name}:c"
    state = _held_back(monkeypatch, "cluster", {a, b})
    other = lock(c, using="cluster", ttl=20)
    assert other.acquire(blocking=False)

    async def main() -> None:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        loop.call_later(0.2, state.append, "hold")  # a and b held by then
        for at in (0.3, 0.6, 0.9):  # waiting for c; then in b's release, twice
            loop.call_later(at, task.cancel)
        await lock_all(a, b, c, using="cluster", ttl=20).aacquire(timeout=10)

    try:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(main())
        monkeypatch.undo()
        held = [n for n in (a, b) if lock(n, using="cluster").locked()]
        assert held == [], "holds outlived asyncio.run()"
    finally:
        other.release()


@pytest.mark.parametrize("kind", ["lock", "lock_all"])
def test_cut_releases_with_redis_not_answering_end_the_shutdown_in_about_one_socket_timeout(
    redis_factory: Callable[..., RedisServer], name: str, kind: str
) -> None:
    """Eight releases cut twice (a finishing task each) with the server paused: the shutdown
    finishes them in the loop's thread. Before: one after another, a socket timeout each
    (8 s here; review rw2, 2); after: the first finds no answer, the rest are not sent (they
    run out at their TTL), about one socket timeout in all."""
    server = redis_factory()
    timeout, n = 1.0, 8
    config = {"BACKEND": REDIS, "LOCATION": server.url, "OPTIONS": {"socket_timeout": timeout}}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "paused": config}):

        async def holder(i: int, entered: asyncio.Event) -> None:
            names = (f"{name}:{i}", f"{name}:{i}:b")
            held = lock_all(*names, using="paused", ttl=30) if kind == "lock_all" else None
            async with held or lock(names[0], using="paused", ttl=30):
                entered.set()
                await asyncio.sleep(100)

        async def main() -> None:
            entered = [asyncio.Event() for _ in range(n)]
            tasks = [asyncio.create_task(holder(i, e)) for i, e in enumerate(entered)]
            for e in entered:
                await e.wait()
            server.pause()
            for task in tasks:
                task.cancel()  # the body ends: each release is sent, with no answer
            await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()  # again, during the release: a finishing task each
            await asyncio.sleep(0)
            # returning: asyncio.run's shutdown cancels the finishing tasks

        started = time.monotonic()
        try:
            asyncio.run(main())
        finally:
            took = time.monotonic() - started
            server.resume()
            locks["paused"].close()
    assert took < 1.5 * timeout + 0.5, f"the shutdown took {took:.1f} s"


@pytest.mark.parametrize("kind", ["lock", "lock_all"])
def test_a_finishing_task_of_a_loop_closed_with_it_pending_is_not_kept(
    monkeypatch: pytest.MonkeyPatch, name: str, kind: str
) -> None:
    """``run_until_complete()`` then ``close()`` (a request's loop) with the finishing task
    still waiting for a connection: the loop never runs it again. Before: a module-level set
    kept the task for good (and through it the closed loop and the lock), so its coroutine was
    never closed, the finisher never got the release and the hold waited for its TTL (review
    asy 6). Now the loop keeps it: dropped with the loop, closed by the collector, and the
    release is finished by the finisher thread."""
    state = _held_back(monkeypatch, "redis")
    names = [f"{name}:a", f"{name}:b"] if kind == "lock_all" else [name]

    async def work() -> None:
        held = lock_all(*names, using="redis", ttl=20) if kind == "lock_all" else None
        async with held if held is not None else lock(name, using="redis", ttl=20):
            state.append("hold")  # from now on every command waits for a connection

    async def main() -> None:
        task = asyncio.ensure_future(work())
        await asyncio.sleep(0.3)  # in the release, waiting
        task.cancel()  # the release goes to a finishing task
        with contextlib.suppress(asyncio.CancelledError):
            await task

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    gone = weakref.ref(loop)
    del loop
    monkeypatch.undo()
    # (The backend lets go of a closed loop's client as the next loop makes one.)
    asyncio.run(lock(f"{name}:next", using="redis").alocked())
    gc.collect()
    assert gone() is None, "the closed loop is kept (by its finishing task)"
    assert finisher.wait_finished(5)
    held = [n for n in names if lock(n, using="redis").locked()]
    assert held == [], "the release was never finished"


def test_a_finishing_task_releases_the_hold_of_the_cut_not_one_taken_since(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A module-level plain lock (its hold is the object's): a task's ``async with`` release
    is cut by a second cancellation and left to a task of its own; the loop is then held by a
    sync call, and meanwhile a thread's ``acquire()`` finishes the stale release itself and
    takes a new hold. Before: the finishing task, reading which hold to release at its first
    step, released the thread's new hold under it (two holders; review asy3 6)."""
    state = _held_back(monkeypatch, "redis", {name})
    shared = lock(name, using="redis", ttl=20)
    started, taken = threading.Event(), []

    def thread() -> None:
        started.wait(5)
        taken.append(shared.acquire(timeout=3))

    other = threading.Thread(target=thread)
    other.start()

    async def work() -> None:
        async with shared:
            state.append("hold")  # its release waits for a connection
            await asyncio.sleep(30)

    async def blocker() -> None:
        started.set()
        time.sleep(0.5)  # a sync call keeps the loop

    async def main() -> None:
        task = asyncio.ensure_future(work())
        await asyncio.sleep(0.3)
        task.cancel()  # the release, on the way out, waits for a connection
        await asyncio.sleep(0.05)
        task.cancel()  # cut again: a task of its own finishes it
        blocking = asyncio.ensure_future(blocker())
        await asyncio.sleep(1.0)
        await blocking

    asyncio.run(main())
    other.join(5)
    monkeypatch.undo()
    try:
        assert taken == [True]
        assert not lock(name, using="redis").acquire(blocking=False), "two holders"
    finally:
        shared.release()


@pytest.mark.parametrize("kind", ["lock", "lock_all"])
def test_a_closed_take_whose_hand_back_was_waiting_is_handed_back_by_the_finisher(
    monkeypatch: pytest.MonkeyPatch, name: str, kind: str
) -> None:
    """The take was granted and its task cancelled as the reply came in; the hand-back's
    release waits for a connection as the loop is closed and the task collected. Before: on
    the finisher, the thrown-in cancellation met the hand-back's "finish it in a task of its
    own", which needs a running loop: RuntimeError, nothing sent, the grant held by nobody to
    its TTL (review asy3 7). Now it is given back there and then."""
    state = _held_back(monkeypatch, "redis")
    names = [f"{name}:a", f"{name}:b"] if kind == "lock_all" else [name]

    async def main() -> None:
        await lock(f"{name}:warm", using="redis").alocked()
        state.append("cut")
        take = lock_all(*names, using="redis", ttl=20) if kind == "lock_all" else None
        coroutine = (take or lock(name, using="redis", ttl=20)).aacquire(blocking=False)
        task = asyncio.ensure_future(coroutine)
        await asyncio.sleep(0.3)  # granted, cancelled, handing back (waiting)
        assert state[-1] == "hold" and not task.done()
        task._log_destroy_pending = False  # type: ignore[attr-defined]

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    del loop
    monkeypatch.undo()
    asyncio.run(lock(f"{name}:next", using="redis").alocked())  # lets the closed loop go
    gc.collect()
    assert finisher.wait_finished(5)
    held = [n for n in names if lock(n, using="redis").locked()]
    assert held == [], "the grant was held by nobody"


@pytest.mark.parametrize("cut", ["once", "twice"])
@pytest.mark.parametrize("kind", ["lock", "lock_all"])
def test_a_release_waiting_when_its_loop_is_closed_is_finished_by_the_finisher(
    monkeypatch: pytest.MonkeyPatch, name: str, kind: str, cut: str
) -> None:
    """``async with``'s release waits for a connection (cancelled once) as its loop is
    closed (``run_until_complete()`` then ``close()``), or was cut again and left to a task of
    its own that never took its first step. Before (review asy3 1): once, the driver's
    hand-over only marked the hold "releasing"; twice, the collector's close of a task that
    never started ran none of its code. Either way nothing was sent, and the name was held by
    nobody to its TTL on an answering server."""
    _closed_in_its_release(monkeypatch, name, kind, cut, next_loop=True)


@pytest.mark.parametrize("kind", ["lock", "lock_all"])
def test_a_release_left_to_a_task_a_closed_loop_never_started_is_sent_with_no_next_loop(
    monkeypatch: pytest.MonkeyPatch, name: str, kind: str
) -> None:
    """As above (cut twice) with no other loop using the backend afterwards (a management
    command, a worker whose other code is sync). Before: the backend kept the closed loop's
    client, and through it the loop and its never-started task: never collected, the
    release never sent (review asy4 4)."""
    _closed_in_its_release(monkeypatch, name, kind, "twice", next_loop=False)


def _closed_in_its_release(
    monkeypatch: pytest.MonkeyPatch, name: str, kind: str, cut: str, next_loop: bool
) -> None:
    names = [f"{name}:a", f"{name}:b"] if kind == "lock_all" else [name]
    state = _held_back(monkeypatch, "redis")

    async def work() -> None:
        held = lock_all(*names, using="redis", ttl=20) if kind == "lock_all" else None
        async with held if held is not None else lock(name, using="redis", ttl=20):
            state.append("hold")  # from now on every command waits for a connection
            await asyncio.sleep(30)

    async def main() -> None:
        task = asyncio.ensure_future(work())
        await asyncio.sleep(0.3)  # in the body
        task.cancel()  # the release, on the way out, waits
        await asyncio.sleep(0.05)
        if cut == "twice":
            task.cancel()  # a task of its own takes the release, as the loop stops

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    del loop
    monkeypatch.undo()
    if next_loop:
        asyncio.run(lock(f"{name}:next", using="redis").alocked())
    gc.collect()
    assert finisher.wait_finished(5)
    held = [n for n in names if lock(n, using="redis").locked()]
    assert held == [], "the release was never sent"


def test_an_async_lock_view_s_release_waiting_when_its_loop_is_closed_is_sent(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """As ``async with``'s above (cut once), for an async ``lock_view``: its release waits
    for a connection as its loop is closed. Before: the view's release had no close path,
    the hold was left "releasing" and never sent: held by nobody to its TTL (review asy4 5)."""
    from django.http import HttpRequest, HttpResponse
    from django.test import RequestFactory

    from django_redlock import lock_view

    state = _held_back(monkeypatch, "redis")

    @lock_view(name, using="redis", ttl=20)
    async def view(request: HttpRequest) -> HttpResponse:
        state.append("hold")  # its release waits for a connection
        return HttpResponse("ran")

    async def main() -> None:
        task = asyncio.ensure_future(view(RequestFactory().get("/")))
        await asyncio.sleep(0.3)  # the view returned, its release waiting
        assert not task.done()
        task._log_destroy_pending = False  # type: ignore[attr-defined]

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    del loop
    monkeypatch.undo()
    gc.collect()
    assert finisher.wait_finished(5)
    assert not lock(name, using="redis").locked(), "the release was never sent"
