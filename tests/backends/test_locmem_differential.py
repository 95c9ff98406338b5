"""LocMem against a real Redis: the same random sequences of public calls (every kind, one
name shared by several kinds, blocking tries, expiry, extend, adopt, force release), run step
by step on both, must give the same answers. testing.md promises LocMem has the Redis backends'
semantics; the next divergence fails here.

Time is made deterministic for expiry: short holds have a TTL of SHORT seconds, the steps
between two sleeps take less than SHORT - MARGIN, and a sleep lasts SHORT + MARGIN, so a
short hold lives exactly until the next sleep on both backends (long ones never expire).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import LockError, lock, locks, read_write_lock, semaphore
from django_redlock.backends.base import Released

BACKENDS = ("local", "redis")
SHORT, MARGIN = 0.3, 0.12
WAIT = 0.03  # a blocking try's timeout: well inside a step budget
SEEDS = range(int(os.environ.get("DIFFERENTIAL_SEEDS", "12")))  # more: set it
STEPS = 40

KINDS: dict[str, Callable[[str, str, float], Any]] = {
    "plain": lambda n, a, t: lock(n, using=a, ttl=t, auto_renew=False),
    "reentrant": lambda n, a, t: lock(n, using=a, ttl=t, reentrant=True, auto_renew=False),
    "fair": lambda n, a, t: lock(n, using=a, ttl=t, fair=True, auto_renew=False),
    "semaphore": lambda n, a, t: semaphore(n, 2, using=a, ttl=t, auto_renew=False),
    "read": lambda n, a, t: read_write_lock(n, using=a, ttl=t, auto_renew=False).read(),
    "write": lambda n, a, t: read_write_lock(n, using=a, ttl=t, auto_renew=False).write(),
}


def _seconds(value: float | None) -> str | None:
    if value is None:
        return None
    return "short" if value < 1 else "long"


def _normal(value: Any) -> Any:
    if isinstance(value, Released):
        return value.name
    if isinstance(value, float):
        return _seconds(value)
    if hasattr(value, "holders"):  # a LockInfo
        return (value.kind, value.hold_count, len(value.holders or ()))
    return value


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return _normal(call())
    except (LockError, TypeError, ValueError) as exc:
        return type(exc).__name__


class World:
    """One backend's objects, built from the same specs as the other's."""

    def __init__(self, alias: str, names: list[str], specs: list[tuple[str, int, float]]):
        self.alias = alias
        self.names = names
        self.objects = [KINDS[kind](names[n], alias, ttl) for kind, n, ttl in specs]

    def do(self, step: tuple[Any, ...]) -> Any:
        what, *args = step
        if what == "force":
            return _outcome(lambda: locks[self.alias].force_release(self.names[args[0]]))
        if what == "inspect":
            return _outcome(lambda: locks[self.alias].inspect(self.names[args[0]]))
        obj = self.objects[args[0]]
        if what == "acquire":
            return _outcome(lambda: obj.acquire(blocking=False))
        if what == "wait":  # registers (or queues) as a waiter, then leaves
            return _outcome(lambda: obj.acquire(timeout=WAIT))
        if what == "adopt":
            token = self.objects[args[1]].token
            if token is None:
                return "no token"
            return _outcome(lambda: obj.adopt(token))
        if what == "available":
            if not hasattr(obj, "available"):
                return "n/a"
            return _outcome(obj.available)
        return _outcome(getattr(obj, what))  # release, extend, owned, locked, ttl, ...


def _plan(rng: random.Random) -> tuple[list[tuple[str, int, float]], list[tuple[Any, ...]]]:
    specs = [
        (rng.choice(list(KINDS)), rng.randrange(2), rng.choice((SHORT, 10.0))) for _ in range(7)
    ]
    calls = ["acquire"] * 6 + ["release"] * 3 + ["wait", "extend", "owned", "locked", "ttl"]
    calls += ["hold_count", "available", "fence_none"]
    steps: list[tuple[Any, ...]] = []
    for _ in range(STEPS):
        roll = rng.random()
        if roll < 0.08:
            steps.append(("sleep",))
        elif roll < 0.13:
            steps.append(("force", rng.randrange(2)))
        elif roll < 0.2:
            steps.append(("inspect", rng.randrange(2)))
        elif roll < 0.25:
            steps.append(("adopt", rng.randrange(len(specs)), rng.randrange(len(specs))))
        else:
            steps.append((rng.choice(calls), rng.randrange(len(specs))))
    return specs, steps


def _fence_none(obj: Any) -> bool:
    return obj.fence is None


@pytest.mark.parametrize("seed", SEEDS)
def test_locmem_answers_as_redis_does(seed: int, name: str) -> None:
    rng = random.Random(seed)
    specs, steps = _plan(rng)
    names = [f"{name}:{i}" for i in range(2)]
    worlds = [World(alias, names, specs) for alias in BACKENDS]
    for world in worlds:
        for obj in world.objects:
            obj.fence_none = (lambda o: lambda: _fence_none(o))(obj)  # type: ignore[attr-defined]
    since_sleep = time.monotonic()
    log: list[str] = []
    try:
        for number, step in enumerate(steps):
            if step[0] == "sleep" or time.monotonic() - since_sleep > SHORT - MARGIN:
                time.sleep(SHORT + MARGIN)  # every short hold taken since the last one ends
                since_sleep = time.monotonic()
                if step[0] == "sleep":
                    log.append(f"{number}: sleep")
                    continue
            answers = [world.do(step) for world in worlds]
            spec = specs[step[1]] if step[0] not in ("force", "inspect") else names[step[1]]
            log.append(f"{number}: {step} {spec} -> {answers}")
            assert answers[0] == answers[1], "LocMem and Redis differ:\n" + "\n".join(log)
    finally:
        for world in worlds:
            for each in names:
                locks[world.alias].force_release(each)
