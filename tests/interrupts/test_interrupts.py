"""An interruption (KeyboardInterrupt, a time limit, a signal handler's exception) at every
round trip of every lock operation, before its request is sent or after its reply is lost.

The rules checked after each one, on a real server: nothing is reported held that is not;
no lock is declared lost that was not; and the name ends free once the owner carries on (its
next operation settles what the interruption left unsure), with no ghost in a fair queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import LockNotOwned, lock, lock_all, locks, read_write_lock, semaphore
from django_redlock.locking.base import WAITER_LEASE
from django_redlock.signals import lock_lost

ALIASES = ["redis", "local"]
KINDS: dict[str, Callable[[str, str], Any]] = {
    "plain": lambda name, alias: lock(name, using=alias, ttl=10),
    "reentrant": lambda name, alias: lock(name, using=alias, ttl=10, reentrant=True),
    "fair": lambda name, alias: lock(name, using=alias, ttl=10, fair=True),
    "semaphore": lambda name, alias: semaphore(name, limit=1, using=alias, ttl=10),
    "write": lambda name, alias: read_write_lock(name, using=alias, ttl=10).write(),
}


class Interrupted(KeyboardInterrupt):
    pass


class Interrupt:
    """The backend's ``at``-th round trip raises: before its request is sent, or (``lost``)
    after the server ran it, as if its reply were lost."""

    def __init__(
        self, alias: str, at: int, lost: bool, error: type[BaseException] = Interrupted
    ) -> None:
        self.backend, self.at, self.lost, self.calls = locks[alias], at, lost, 0
        self.error = error

    def __enter__(self) -> Interrupt:
        execute = type(self.backend).execute

        def interrupting(op: Any) -> Any:
            self.calls += 1
            if self.calls == self.at and not self.lost:
                raise self.error
            reply = execute(self.backend, op)
            if self.calls == self.at:
                raise self.error
            return reply

        self.backend.execute = interrupting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.execute


def round_trips(alias: str, operation: Callable[[], object]) -> int:
    with Interrupt(alias, 0, False) as counting:
        operation()
    return counting.calls


@pytest.fixture
def losses() -> Iterator[list[object]]:
    seen: list[object] = []

    def receiver(sender: object, lock: object, **kwargs: object) -> None:
        seen.append(lock)

    lock_lost.connect(receiver)
    yield seen
    lock_lost.disconnect(receiver)


def settle_and_check_free(lk: Any, fresh: Any) -> None:
    """The owner carries on: one more hold and release leave the name free."""
    assert lk.acquire(timeout=5)
    lk.release()
    while lk.owned():  # a reentrant owner may hold an unsure level still: release it too
        lk.release()
    assert not fresh.locked()


@pytest.mark.parametrize("lost", [False, True], ids=["unsent", "reply-lost"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alias", ALIASES)
def test_an_interrupted_acquire(alias: str, kind: str, lost: bool, name: str, losses: list) -> None:
    make = KINDS[kind]
    probe = make(name, alias)
    n = round_trips(alias, probe.acquire)
    probe.release()
    for at in range(1, n + 1):
        lk = make(name, alias)
        with Interrupt(alias, at, lost), pytest.raises(Interrupted):
            lk.acquire()
        if lk.owned():
            assert make(name, alias).locked()
        settle_and_check_free(lk, make(name, alias))
    assert losses == []


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alias", ALIASES)
def test_a_time_limit_as_an_acquire_s_reply_came_hands_the_hold_back_at_once(
    alias: str, kind: str, name: str, losses: list
) -> None:
    """An ``Exception`` (not a ``LockError``) while the reply was parsed was raised with no
    hand-back: the name stayed held by nobody until its TTL, and the next caller waited."""
    make = KINDS[kind]
    probe = make(name, alias)
    n = round_trips(alias, probe.acquire)
    probe.release()

    async def aacquire(lk: Any) -> None:
        with ACancel(alias, at, True, TimeLimit), pytest.raises(TimeLimit):
            await lk.aacquire()

    for at in range(1, n + 1):
        for asynchronous in (False, True):
            lk = make(name, alias)
            if asynchronous:
                asyncio.run(aacquire(lk))
            else:
                with Interrupt(alias, at, True, TimeLimit), pytest.raises(TimeLimit):
                    lk.acquire()
            assert not lk.owned() and not make(name, alias).locked(), (at, asynchronous)
            settle_and_check_free(lk, make(name, alias))
    assert losses == []


def in_thread(call: Callable[[], object]) -> None:
    """Run ``call`` as another owner (another thread); raise what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if raised:
        raise raised[0]


@pytest.mark.parametrize("lost", [False, True], ids=["unsent", "reply-lost"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alias", ALIASES)
def test_an_interrupted_wait(alias: str, kind: str, lost: bool, name: str, losses: list) -> None:
    make = KINDS[kind]
    holder = make(name, alias)
    assert holder.acquire()
    probe = make(name, alias)
    n = round_trips(alias, lambda: in_thread(lambda: probe.acquire(timeout=0.2)))
    assert n >= 2  # the try, then a try after watching (and for a fair lock, the leave)
    for at in range(1, n + 1):
        lk = make(name, alias)
        with Interrupt(alias, at, lost) as interrupt:
            try:
                in_thread(lambda lk=lk: lk.acquire(timeout=0.2))
            except Interrupted:
                pass
            else:  # fewer round trips this time (load used the 0.2 s up sooner): no such point
                assert interrupt.calls < at, (at, interrupt.calls)
        assert not lk.owned()
        holder.release()
        newcomer = make(name, alias)
        if not newcomer.acquire(blocking=False):
            # Only a fair waiter whose leave was never sent is left in the queue, and only
            # until its place lapses.
            assert kind == "fair" and at == n and not lost
            assert newcomer.acquire(timeout=WAITER_LEASE + 2)
        newcomer.release()
        assert holder.acquire(blocking=False)
    holder.release()
    assert losses == []


@pytest.mark.parametrize("lost", [False, True], ids=["unsent", "reply-lost"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alias", ALIASES)
def test_an_interrupted_release(alias: str, kind: str, lost: bool, name: str, losses: list) -> None:
    make = KINDS[kind]
    probe = make(name, alias)
    probe.acquire()
    n = round_trips(alias, probe.release)
    for at in range(1, n + 1):
        lk = make(name, alias)
        assert lk.acquire()
        with Interrupt(alias, at, lost), pytest.raises(Interrupted):
            lk.release()
        if lk.owned():
            assert make(name, alias).locked()
        # Released again: done, or "not owned" when the first one went through; never "lost".
        try:
            lk.release()
        except LockNotOwned as exc:
            assert type(exc) is LockNotOwned, exc
        assert not make(name, alias).locked()
    assert losses == []


@pytest.mark.parametrize("lost", [False, True], ids=["unsent", "reply-lost"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alias", ALIASES)
def test_an_interrupted_extend(alias: str, kind: str, lost: bool, name: str, losses: list) -> None:
    make = KINDS[kind]
    lk = make(name, alias)
    assert lk.acquire()
    n = round_trips(alias, lambda: lk.extend(20))
    for at in range(1, n + 1):
        with Interrupt(alias, at, lost), pytest.raises(Interrupted):
            lk.extend(30)
        assert lk.owned()
        ttl = lk.ttl()
        assert ttl is not None and ttl > 5
    lk.release()
    assert not make(name, alias).locked()
    assert losses == []


class ACancel:
    """The asyncio twin of :class:`Interrupt`: the ``at``-th awaited round trip is cancelled,
    before its request is sent or after its reply is lost."""

    def __init__(
        self, alias: str, at: int, lost: bool, error: type[BaseException] = asyncio.CancelledError
    ) -> None:
        self.backend, self.at, self.lost, self.calls = locks[alias], at, lost, 0
        self.error = error

    def __enter__(self) -> ACancel:
        aexecute = type(self.backend).aexecute

        async def cancelling(op: Any) -> Any:
            self.calls += 1
            if self.calls == self.at and not self.lost:
                raise self.error
            reply = await aexecute(self.backend, op)
            if self.calls == self.at:
                raise self.error
            return reply

        self.backend.aexecute = cancelling  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.aexecute


@pytest.mark.parametrize("lost", [False, True], ids=["unsent", "reply-lost"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alias", ALIASES)
def test_a_cancelled_aacquire_and_arelease(
    alias: str, kind: str, lost: bool, name: str, losses: list
) -> None:
    make = KINDS[kind]

    async def scenario() -> None:
        probe = make(name, alias)
        with ACancel(alias, 0, False) as counting:
            await probe.aacquire()
        acquiring = counting.calls
        with ACancel(alias, 0, False) as counting:
            await probe.arelease()
        releasing = counting.calls
        assert acquiring >= 1 and releasing >= 1
        for at in range(1, acquiring + 1):
            lk = make(name, alias)
            with ACancel(alias, at, lost), pytest.raises(asyncio.CancelledError):
                await lk.aacquire()
            if await lk.aowned():
                assert await make(name, alias).alocked()
            assert await lk.aacquire(timeout=5)
            await lk.arelease()
            while await lk.aowned():
                await lk.arelease()
            assert not await make(name, alias).alocked()
        for at in range(1, releasing + 1):
            lk = make(name, alias)
            assert await lk.aacquire()
            with ACancel(alias, at, lost), pytest.raises(asyncio.CancelledError):
                await lk.arelease()
            try:
                await lk.arelease()
            except LockNotOwned as exc:
                assert type(exc) is LockNotOwned, exc
            assert not await make(name, alias).alocked()

    asyncio.run(scenario())
    assert losses == []


class ACancelTwice(ACancel):
    """The ``at``-th awaited round trip is cancelled after the server ran it (its reply on
    its way), and the next one (the hand-back of what it may have granted) before it is
    sent: a task cancelled twice, e.g. by a timeout and then a shutdown."""

    def __enter__(self) -> ACancelTwice:
        aexecute = type(self.backend).aexecute

        async def cancelling(op: Any) -> Any:
            self.calls += 1
            if self.calls == self.at + 1:
                raise asyncio.CancelledError
            reply = await aexecute(self.backend, op)
            if self.calls == self.at:
                raise asyncio.CancelledError
            return reply

        self.backend.aexecute = cancelling  # type: ignore[method-assign]
        return self


TWICE: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "plain": ("redis", KINDS["plain"]),
    "reentrant": ("redis", KINDS["reentrant"]),
    "lock_all": ("redis", lambda name, alias: lock_all(name, f"{name}:b", using=alias, ttl=10)),
    "lock_all-in-order": (
        "local",
        lambda name, alias: lock_all(name, f"{name}:b", using=alias, ttl=10),
    ),
}


@pytest.mark.parametrize("kind", TWICE)
def test_a_second_cancellation_during_the_hand_back_still_frees_the_names(
    kind: str, name: str, losses: list
) -> None:
    """Cancelled while a grant was on its way, then again during its hand-back (or the
    release of the members already held): the object is thrown away, so no next try of
    it comes. The hand-back is finished by a task of its own, not left to the TTL."""
    alias, make = TWICE[kind]

    async def scenario() -> list[int]:
        probe = make(name, alias)
        with ACancel(alias, 0, False) as counting:
            await probe.aacquire()
        acquiring = counting.calls
        await probe.arelease()
        left = []
        for at in range(1, acquiring + 1):
            with ACancelTwice(alias, at, True), pytest.raises(asyncio.CancelledError):
                await make(name, alias).aacquire()
            await asyncio.sleep(0.3)  # the hand-back's own task
            if not await asyncio.create_task(free()):  # another owner
                left.append(at)
        return left

    async def free() -> bool:
        probe = make(name, alias)
        if not await probe.aacquire(blocking=False):
            return False
        await probe.arelease()
        return True

    assert asyncio.run(scenario()) == []
    assert losses == []


def test_a_retried_release_of_a_nested_reentrant_level_leaves_the_outer_one(
    name: str, losses: list
) -> None:
    """A nested level's release is cancelled with its reply on its way, then retried (as
    ``async with`` does in a task of its own after a second cancellation): the retry must
    not release again, by the owner's token, the outer level of the same owner."""

    async def scenario() -> None:
        outer = lock(name, using="redis", ttl=10, reentrant=True)
        inner = lock(name, using="redis", ttl=10, reentrant=True)
        assert await outer.aacquire() and await inner.aacquire()
        with ACancel("redis", 1, True), pytest.raises(asyncio.CancelledError):
            await inner.arelease()
        with contextlib.suppress(LockNotOwned):
            await inner.arelease()  # the retry
        assert await outer.aowned() and await lock(name, using="redis").alocked()
        await outer.arelease()
        assert not await lock(name, using="redis").alocked()

    asyncio.run(scenario())
    assert losses == []


@pytest.mark.parametrize("alias", ALIASES)
def test_a_release_interrupted_at_any_line_after_the_reply_is_no_loss(
    alias: str, name: str, losses: list
) -> None:
    """A KeyboardInterrupt (a signal) at each line of a plain lock's release once the server
    answered: the hold is not reported held while the name is free, and the release retried
    (as the docs say) raises at most ``LockNotOwned``, never ``LockLost``."""
    import linecache
    import sys
    from types import FrameType

    from django_redlock.locking.base import BaseLock

    code = BaseLock._release.__code__
    at = 0
    while at < 100:
        at += 1
        lk = lock(name, using=alias, ttl=10)
        assert lk.acquire()
        seen = [0]

        def tracer(
            frame: FrameType, event: str, arg: object, seen: list[int] = seen, at: int = at
        ) -> Any:
            if frame.f_code is not code:
                return None
            text = linecache.getline(code.co_filename, frame.f_lineno).strip()
            # (Not at a `with` line: there the tracer would also run as the block exits,
            # before its __exit__, which a real signal does not skip.)
            if (
                event == "line"
                and frame.f_locals.get("left") is not None
                and not text.startswith("with ")
            ):
                seen[0] += 1
                if seen[0] == at:
                    raise Interrupted
            return tracer

        sys.settrace(tracer)
        try:
            lk.release()
        except Interrupted:
            pass
        finally:
            sys.settrace(None)
        if seen[0] < at:
            break  # every line after the reply was tried
        if not lock(name, using=alias).locked():
            assert lk.token is None, at
        try:
            lk.release()
        except LockNotOwned as exc:
            assert type(exc) is LockNotOwned, (at, exc)
        assert not lock(name, using=alias).locked()
    assert at > 3
    assert losses == []
