"""The campaign's asyncio driver (``aclient.py``): how a hold is run, on a real server."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from django_redlock import LockError, lock, locks
from django_redlock.testing import RedisServer

from . import aclient, client
from .interrupts import Interrupts


class Scripted(random.Random):
    """``random()`` from a script (then 0.5), ``choice`` the last option: a driver that runs
    the hold in asgiref's thread (``one``: below 0.1) on a loop closed 0.3 s in."""

    def __init__(self, *values: float) -> None:
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0) if self.values else 0.5

    def uniform(self, a: float, b: float) -> float:
        return b

    def choice(self, seq: Any) -> Any:
        return seq[-1]


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # a thread still waiting goes on


@pytest.mark.parametrize("how", ["loop_closed", "run_ended"])
def test_an_abandoned_hold_is_not_run_on_in_asgiref_thread(
    redis_server: RedisServer, name: str, gate: threading.Event, how: str
) -> None:
    """``loop_closed`` closes a fresh loop under the hold's task, then releases the Lock from
    sync code (the call is left pending for good); ``run_ended``'s ``asyncio.run`` cancels
    the task, which releases it (as ``async with`` does). A hold drawn to run whole in
    asgiref's thread (``sync_to_async``, 1 in 10) is neither pending nor cancelled: the
    thread runs on, and that release deleted the hold its acquire had just been granted
    there, so the thread's check found it gone: the campaign's ``phantom-hold`` (seed 2115,
    redlock plain, c10/h19: acquire returned True, the servers did not hold it 0-12 ms
    later). Its own misuse, not the library's: such a hold runs on the loop, never in a
    thread."""
    key = locks["default"].key(name)
    direct = redis_server.client()
    found: list[tuple[str, bool, bool]] = []  # (when, found, in the main thread)
    events: list[tuple[str, dict[str, Any]]] = []

    def check(hold: int, when: str, prefix: str, fence: int | None) -> None:
        main = threading.current_thread() is threading.main_thread()
        if not main:  # asgiref's thread: until the loop was closed and the Lock released
            gate.wait(5)
        value = direct.get(key)
        found.append((when, value is not None and value.startswith(prefix.encode()), main))

    class Resource:
        def write(self, cid: str, hold: int, fence: int, phase: str, *_: Any) -> tuple[bool, int]:
            if phase == "begin":  # past the loop's 0.3 s: it is closed under the hold
                threading.Event().wait(0.4)
            return True, 0

    ctx = client.Ctx(
        config={"id": "c1", "kind": "plain", "ttl": 5.0},
        log=lambda e, **fields: events.append((e, fields)),
        rng=Scripted(0.0, 0.0),  # sync_hold: blocking; one: a sync_to_async hold's draws
        armed=Interrupts("", random.Random(0)),  # no flag file: never armed
        resource=Resource(),
        inspector=None,
        holds={},
        check=check,
        ask=None,
        expiry=None,
    )
    driver = aclient.Driver(ctx)
    driver.rng = Scripted(0.0)  # one(): the whole sync hold in asgiref's thread (< 0.1)
    lk = lock(name, ttl=5, token_prefix="c1h1.")
    try:
        if how == "loop_closed":
            driver.loop_closed(lk, 1, "c1h1.", "x")
        else:
            driver.run_ended(lk, 1, "c1h1.", "x", False)
    finally:
        gate.set()
    assert any(e == "intr" and f["h"] == 1 for e, f in events), events
    deadline = threading.Event()
    for _ in range(50):  # the thread's check, if a thread ran the hold
        if found:
            break
        deadline.wait(0.1)
    acquired = [f for f in found if f[0] == "acquired"]
    assert acquired, f"the hold never acquired: {events}"
    assert all(f[1] for f in acquired), f"a hold reported held was gone: {found}, {events}"
    assert all(f[2] for f in acquired), f"the hold ran in asgiref's thread: {found}"
    with pytest.raises(LockError):
        lk.release()  # released by the clean-up (loop_closed's, or the cancelled task's)
