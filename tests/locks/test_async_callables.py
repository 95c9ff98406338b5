"""Decorators over async callables that ``inspect.iscoroutinefunction`` does not recognise
(asgiref's ``sync_to_async``, an object with ``async def __call__``, a partial of one, a
function carrying asgiref's marker): the body runs under the lock, never after a release.
A sync callable that returns an awaitable is refused, nothing of it run."""

from __future__ import annotations

import asyncio
import functools
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from asgiref.sync import markcoroutinefunction, sync_to_async

from django_redlock import LockNotAcquired, lock, lock_all, semaphore, single_instance
from django_redlock.locking.templates import is_async_callable

ALIAS = "redis"


class Slow:
    """An object with an ``async def __call__``."""

    def __init__(self) -> None:
        self.inside = 0

    async def __call__(self, item: int) -> str:
        self.inside += 1
        try:
            await asyncio.sleep(0.3)
            return f"done {item}"
        finally:
            self.inside -= 1


def _slow_sync(item: int) -> str:
    time.sleep(0.3)
    return f"done {item}"


async def _slow(item: int, pause: float = 0.3) -> str:
    await asyncio.sleep(pause)
    return f"done {item}"


def _marked(item: int) -> Awaitable[str]:
    return _slow(item)


markcoroutinefunction(_marked)  # asgiref's marker, as Django's async View.as_view() carries


def _async_callables() -> dict[str, Callable[..., Any]]:
    return {
        "sync_to_async": sync_to_async(_slow_sync),
        "async __call__": Slow(),
        "partial": functools.partial(_slow, pause=0.3),
        "partial of async __call__": functools.partial(Slow()),
        "marked": _marked,
    }


@pytest.mark.parametrize("kind", list(_async_callables()))
@pytest.mark.parametrize("decorator", ["lock", "semaphore", "lock_all"])
def test_two_calls_of_a_decorated_async_callable_never_run_at_once(
    kind: str, decorator: str, name: str
) -> None:
    func = _async_callables()[kind]
    assert is_async_callable(func)
    template = f"{name}:{{item}}"
    decorate = {
        "lock": lock(template, using=ALIAS, timeout=0),
        "semaphore": semaphore(template, 1, using=ALIAS, timeout=0),
        "lock_all": lock_all(template, f"{template}:b", using=ALIAS, timeout=0),
    }[decorator]
    locked = decorate(func)

    async def scenario() -> list[object]:
        return list(await asyncio.gather(locked(1), locked(1), return_exceptions=True))

    outcomes = asyncio.run(scenario())
    assert "done 1" in outcomes
    assert any(isinstance(o, LockNotAcquired) for o in outcomes), outcomes
    assert not lock(f"{name}:1", using=ALIAS).locked()  # released after the body


def test_a_sync_callable_returning_a_coroutine_is_refused_unrun(name: str) -> None:
    ran = []

    async def body() -> None:
        ran.append(1)

    def sync_wrapper(item: int) -> Awaitable[None]:
        return body()

    for decorate in (
        lock(f"{name}:{{item}}", using=ALIAS),
        lock_all(f"{name}:{{item}}", using=ALIAS),
        semaphore(f"{name}:{{item}}", 2, using=ALIAS),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited": it is closed
            with pytest.raises(TypeError, match="returned an awaitable"):
                decorate(sync_wrapper)(1)
        assert not lock(f"{name}:1", using=ALIAS).locked()
    assert ran == []


def test_sync_callables_stay_sync() -> None:
    assert not is_async_callable(_slow_sync)
    assert not is_async_callable(functools.partial(_slow_sync, 1))
    assert not is_async_callable(functools.wraps(_slow)(lambda item: None))  # judged by itself
    assert not is_async_callable(Slow)  # a class: calling it makes an object


@pytest.mark.parametrize("kind", list(_async_callables()))
def test_single_instance_refuses_every_async_callable(kind: str) -> None:
    with pytest.raises(TypeError, match="async callable"):
        single_instance()(_async_callables()[kind])
