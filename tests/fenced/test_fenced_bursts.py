"""A burst of two exceptions a signal handler raises (a soft time limit, then a second one: a
``SIGALRM`` timeout) on a fenced block's exit: the first ends the block (rolled back, nothing
committed), the second lands as the block's lock is released. The release is owed
(``fencing.owe``): the thread's next fenced block, as it opens, or the end of the request
(Django's ``request_finished``; Celery's ``task_postrun`` alike) makes it, rather than leave
the hold renewed by the watchdog for as long as the process lives (docs/topics/fencing.md,
"Abandoned").
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from types import CodeType, FrameType
from typing import Any

import pytest
from django.core.signals import request_finished
from django.db import DEFAULT_DB_ALIAS, connections, transaction

from django_redlock import fencing, lock, lock_all
from django_redlock.locking.base import BaseLock
from django_redlock.locking.multi import MultiLock

from ..support.fenced_child import open_shop, sales, sell_one

pytestmark = pytest.mark.django_db(transaction=True)
DB = DEFAULT_DB_ALIAS


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: the first of the burst."""


class Timeout(Exception):
    """The second: a ``SIGALRM`` handler's."""


class Burst:
    """``TimeLimit`` as ``first`` starts (a trace function: unset as it raises), then
    ``Timeout`` as ``second`` (a function of ``owner``, replaced for the test) is next called:
    once each."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, first: CodeType, owner: Any, second: str
    ) -> None:
        self.first = first
        self.fired: list[str] = []
        real = getattr(owner, second)

        def cut(*args: Any, **kwargs: Any) -> Any:
            if self.fired == ["first"]:
                self.fired.append("second")
                raise Timeout(second)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, second, cut)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and not self.fired and frame.f_code is self.first:
            self.fired.append("first")
            raise TimeLimit(frame.f_code.co_name)


def owed_of(name: str) -> list[Any]:
    """This thread's owed releases of ``name``'s locks (another test's may be owed still:
    kept while its server gives no answer)."""
    return [d for d in fencing._owed() if d.lock.name.startswith(name)]  # type: ignore[attr-defined]


def then(name: str, after: str) -> None:
    """What comes next in the thread: its next fenced block, or the request's end."""
    if after == "next block":
        with lock(f"{name}:next", ttl=30, atomic=True):
            sell_one(DB, 1, "next")
    else:
        request_finished.send(sender=None)


FIRST_AND_RELEASE: dict[str, tuple[CodeType, Any, str]] = {
    # The exit's first line (before the COMMIT), then the rolled-back block's release.
    "with lock": (fencing._drop_left.__code__, fencing, "_release_level"),  # type: ignore[attr-defined]
    # As its exit is entered (abandoned), then the abandoned block's release.
    "with lock, abandoned": (BaseLock.__exit__.__code__, fencing, "_release_level"),
    # The exit's first step, then the release of its names.
    "lock_all": (MultiLock._leave_block.__code__, MultiLock, "release"),
}


@pytest.mark.parametrize("after", ["next block", "request end"])
@pytest.mark.parametrize("outer", [False, True], ids=["own transaction", "in atomic()"])
@pytest.mark.parametrize("how", FIRST_AND_RELEASE)
def test_a_release_a_burst_cut_short_is_made_later(
    name: str, how: str, outer: bool, after: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_shop(DB, 1, 10)
    seen: list[str] = []
    tracer = Burst(monkeypatch, *FIRST_AND_RELEASE[how])
    with transaction.atomic(using=DB) if outer else nullcontext():
        try:
            held = lock_all(name, f"{name}:2", ttl=30, atomic=True) if how == "lock_all" else None
            with held if held is not None else lock(name, ttl=30, atomic=True):
                sell_one(DB, 1, "body")
                sys.settrace(tracer)
        except (TimeLimit, Timeout) as exc:
            seen.append(type(exc).__name__)
        finally:
            sys.settrace(None)
    assert seen and tracer.fired == ["first", "second"], (seen, tracer.fired)
    assert not connections[DB].in_atomic_block
    assert "body" not in [who for who, _ in sales(DB)]  # raised: nothing committed
    then(name, after)
    assert not lock(name).locked() and not lock(f"{name}:2").locked()  # not renewed for ever
    assert not owed_of(name)


@pytest.mark.parametrize("later", ["hold", "reentrant hold", "reentrant level"])
def test_an_owed_release_never_releases_a_later_hold_of_the_same_lock(
    name: str, later: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owed release names its hold and level: once that hold (or level) is gone, a later
    hold of the same lock object, or a level of it taken again, is left alone. A reentrant
    owner's token is the same for all its holds (a module-level lock reused by a thread)."""
    open_shop(DB, 1, 10)
    held = lock(name, ttl=30, atomic=True, reentrant=later != "hold")
    levels = 2 if later == "reentrant level" else 1
    if levels == 2:
        held.acquire()  # the owed level is the second
    try:
        with held:
            sell_one(DB, 1, "body")
            sys.settrace(Burst(monkeypatch, *FIRST_AND_RELEASE["with lock"]))
    except (TimeLimit, Timeout):
        pass
    finally:
        sys.settrace(None)
    assert held.locked() and fencing._owed()  # type: ignore[attr-defined]
    held.release()  # by hand: the owed hold (or level) is gone
    held.acquire()  # a later hold (or level) of the same object
    request_finished.send(sender=None)
    for _ in range(levels):  # every level taken is still held
        assert held.locked()
        held.release()
    assert not held.locked()


class Interrupt(KeyboardInterrupt):
    """An interrupt (a ``BaseException``: not suppressed by the clean-up)."""


@pytest.mark.parametrize("how", ["with lock", "lock_all"])
def test_an_interrupt_cutting_the_clean_up_as_the_with_is_left_short(
    name: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented behaviour: the clean-up of an abandoned block runs as its ``with`` is
    left, in a weak reference's callback, which cannot raise: an interrupt landing in it goes to
    ``sys.unraisablehook``, not to the caller. The block is rolled back; its release, owed,
    is made at the request's end (or by the thread's next fenced block)."""
    open_shop(DB, 1, 10)
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    cut_release = [False]
    owner, second = (
        (fencing, "_drop_block") if how == "with lock" else (MultiLock, "_give_back_held")
    )
    real = getattr(owner, second)

    def cut(*args: Any, **kwargs: Any) -> Any:
        if not cut_release[0]:
            cut_release[0] = True
            raise Interrupt("during the clean-up")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, second, cut)
    code = (MultiLock if how == "lock_all" else BaseLock).__exit__.__code__
    tracer = Burst(monkeypatch, code, fencing, "_forget_mark")  # (its second never fires)
    with transaction.atomic(using=DB):
        try:
            held = lock_all(name, f"{name}:2", ttl=30, atomic=True) if how == "lock_all" else None
            with held if held is not None else lock(name, ttl=30, atomic=True):
                sell_one(DB, 1, "body")
                sys.settrace(tracer)
        except TimeLimit:
            sell_one(DB, 1, "handler")
        finally:
            sys.settrace(None)
    assert cut_release[0] and [type(each.exc_value) for each in unraisable] == [Interrupt]
    assert [who for who, _ in sales(DB)] == ["handler"]  # rolled back all the same
    assert lock(name).locked()  # owed
    request_finished.send(sender=None)
    assert not lock(name).locked() and not lock(f"{name}:2").locked()
    assert not owed_of(name)
