"""An exception a signal handler raises as a fenced block's ``__exit__`` is entered (Celery's
soft time limit, ``SIGALRM``: Python runs pending handlers as a function starts), before any
line of the exit ran: the block's ``with`` statement is left, its transaction open and its
lock held. Whatever opened the block (``with lock``, a reentrant re-entry, ``lk.atomic()``,
``lock_all``, ``@single_instance``, ``@lock_view``), and wherever the exception is handled
(an ``except`` clause of the function running the ``with``, or a caller), the thread's next
fenced block is a transaction of its own whose COMMIT commits (not a savepoint of the
abandoned one, reported committed while nothing ever commits), and the abandoned block's
lock is not left held and renewed (docs/topics/fencing.md, "Abandoned").
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from types import CodeType, FrameType
from typing import Any

import pytest
from django.core.signals import request_finished
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.http import HttpRequest, HttpResponse
from django.test import Client, RequestFactory
from django.urls import path

from django_redlock import fencing, lock, lock_all, lock_view, single_instance
from django_redlock.locking.base import BaseLock
from django_redlock.locking.multi import MultiBlock, MultiLock

from ..support.fenced_child import open_shop, sales, sell_one

pytestmark = pytest.mark.django_db(transaction=True)
DB = DEFAULT_DB_ALIAS


class TimeLimit(Exception):
    """Stands for Celery's SoftTimeLimitExceeded (an ``Exception``)."""


def at_entry_of(code: CodeType) -> Callable[[FrameType, str, Any], Any]:
    """Trace function: ``TimeLimit`` as ``code`` starts (its frame has run nothing)."""

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is code:
            sys.settrace(None)
            raise TimeLimit(f"entering {code.co_qualname}")

    return trace


def cut(code: CodeType) -> None:
    """From the body's last line: the exit's entry raises."""
    sys.settrace(at_entry_of(code))


#: What an error reporter keeps of a handled exception (its traceback: every frame of it,
#: the abandoned block's ``__exit__`` with it), while :data:`PLAIN` is set.
KEPT: list[Any] = []
#: Set: the handler writes with a plain statement (no fenced block of its own).
PLAIN: list[bool] = []


def handler(name: str) -> None:
    """What a task's ``except SoftTimeLimitExceeded:`` does: records it in a fenced block."""
    if PLAIN:
        KEPT.append(sys.exc_info()[1])
        sell_one(DB, 1, "handler")
        return
    with lock(f"{name}:failures", ttl=30, atomic=True):
        sell_one(DB, 1, "handler")


# Each with its ``except`` in the function running the ``with`` (its frame still on the stack).


def with_lock(name: str) -> None:
    try:
        with lock(name, ttl=30, atomic=True):
            sell_one(DB, 1, "body")
            cut(BaseLock.__exit__.__code__)
    except TimeLimit:
        handler(name)


def reentrant_inner(name: str) -> None:
    held = lock(name, ttl=30, atomic=True, reentrant=True)
    try:
        with held:
            sell_one(DB, 1, "body")
            with held:
                sell_one(DB, 1, "inner")
                cut(BaseLock.__exit__.__code__)
    except TimeLimit:
        handler(name)


def lk_atomic(name: str) -> None:
    held = lock(name, ttl=30)
    held.acquire()
    try:
        with held.atomic():
            sell_one(DB, 1, "body")
            cut(fencing.FencedTransaction.__exit__.__code__)
    except TimeLimit:
        handler(name)
    finally:
        held.release()


def with_lock_all(name: str) -> None:
    try:
        with lock_all(name, f"{name}:2", ttl=30, atomic=True):
            sell_one(DB, 1, "body")
            cut(MultiLock.__exit__.__code__)
    except TimeLimit:
        handler(name)


def lock_all_atomic(name: str) -> None:
    held = lock_all(name, f"{name}:2", ttl=30)
    held.acquire()
    try:
        with held.atomic():
            sell_one(DB, 1, "body")
            cut(MultiBlock.__exit__.__code__)
    except TimeLimit:
        handler(name)
    finally:
        held.release()


# The ``with`` in the package's code; the exception handled by the caller.


def task(name: str) -> None:
    @single_instance(key=name, ttl=30, atomic=True)
    def run() -> None:
        sell_one(DB, 1, "body")
        cut(fencing.FencedTransaction.__exit__.__code__)

    try:
        run()
    except TimeLimit:
        handler(name)


def view(name: str) -> None:
    @lock_view(name, ttl=30, atomic=True)
    def buy(request: HttpRequest) -> HttpResponse:
        sell_one(DB, 1, "body")
        cut(fencing.FencedTransaction.__exit__.__code__)
        return HttpResponse("sold")

    try:
        buy(RequestFactory().get("/"))
    except TimeLimit:
        handler(name)


FORMS = {
    "with lock": with_lock,
    "reentrant inner with": reentrant_inner,
    "lk.atomic()": lk_atomic,
    "lock_all": with_lock_all,
    "lock_all().atomic()": lock_all_atomic,
    "@single_instance": task,
    "@lock_view": view,
}


@pytest.mark.parametrize("form", FORMS)
def test_an_exception_entering_the_exit_leaves_the_next_block_a_transaction_of_its_own(
    name: str, form: str
) -> None:
    open_shop(DB, 1, 10)
    try:
        FORMS[form](name)
    finally:
        sys.settrace(None)
    # The handler's block committed on its own; the abandoned block's sales were rolled back.
    assert not connections[DB].in_atomic_block and connections[DB].get_autocommit()
    assert [who for who, _ in sales(DB)] == ["handler"]
    # Nothing of the abandoned block's left held (renewed by the watchdog for ever).
    assert not lock(name).locked() and not lock(f"{name}:2").locked()
    blocks = fencing._blocks()  # type: ignore[attr-defined]
    assert not [block for block in blocks if block.lock.name.startswith(name)]


@pytest.mark.parametrize("outer", [False, True], ids=["own transaction", "in atomic()"])
@pytest.mark.parametrize("form", FORMS)
def test_the_except_clause_s_writes_after_an_abandoned_block_commit(
    name: str, form: str, outer: bool
) -> None:
    """The abandoned block is rolled back (to its savepoint, inside the caller's transaction)
    and its lock released as its ``with`` is left, before the ``except`` clause runs, whatever
    opened it, and whatever keeps the block alive (here the handled exception, kept as an
    error reporter keeps it: its traceback holds the block's ``__exit__`` frame): the
    handler's plain write lands in the caller's transaction (or commits on its own), not in
    the abandoned block's transaction or savepoint, rolled back with it later."""
    open_shop(DB, 1, 10)
    PLAIN.append(True)
    try:
        with transaction.atomic(using=DB) if outer else nullcontext():
            FORMS[form](name)
        assert not connections[DB].in_atomic_block and connections[DB].get_autocommit()
        assert [who for who, _ in sales(DB)] == ["handler"]
        assert not lock(name).locked() and not lock(f"{name}:2").locked()
        assert len(KEPT) == 1  # (the block was alive all along)
    finally:
        sys.settrace(None)
        PLAIN.clear()
        KEPT.clear()


def test_the_same_with_in_a_loop_after_one_was_abandoned(name: str) -> None:
    """The next round of a loop runs the same ``with`` statement in the same frame: its block
    is a transaction of its own, the abandoned round's rolled back."""
    open_shop(DB, 1, 10)
    for round in range(2):
        try:
            with lock(name, ttl=30, atomic=True):
                sell_one(DB, 1, f"round {round}")
                if round == 0:
                    cut(BaseLock.__exit__.__code__)
        except TimeLimit:
            pass
        finally:
            sys.settrace(None)
    assert not connections[DB].in_atomic_block
    assert [who for who, _ in sales(DB)] == ["round 1"] and not lock(name).locked()


@pytest.mark.parametrize("kind", ["with lock", "lk.atomic()"])
def test_the_same_with_run_again_with_no_fenced_block_opens_one_of_its_own(
    name: str, kind: str
) -> None:
    """The next round runs the same ``with`` statement with a ``nullcontext()``: a block
    opened in that round's body is in the statement's body again, yet the abandoned round's
    block is not open around it (the frame's position cannot tell the two runs apart)."""
    open_shop(DB, 1, 10)
    held = lock(name, ttl=30, reentrant=True, atomic=kind == "with lock")
    if kind == "lk.atomic()":
        held.acquire()
    code = (BaseLock if kind == "with lock" else fencing.FencedTransaction).__exit__
    for round in range(2):
        cm = (held if kind == "with lock" else held.atomic()) if round == 0 else nullcontext()
        try:
            with cm:
                if round == 0:
                    sell_one(DB, 1, "abandoned")
                    cut(code.__code__)
                else:
                    with lock(f"{name}:b", ttl=30, atomic=True):
                        sell_one(DB, 1, "round 1")
        except TimeLimit:
            pass
        finally:
            sys.settrace(None)
    if kind == "lk.atomic()":
        held.release()
    assert not connections[DB].in_atomic_block
    assert [who for who, _ in sales(DB)] == ["round 1"] and not held.locked()


#: The frame ids of :func:`call_of`'s calls.
FRAMES: list[int] = []


def call_of(name: str, cm: Any, first: bool) -> None:
    """One call of a function whose ``with`` is abandoned (first) or runs a nullcontext."""
    FRAMES.append(id(sys._getframe()))
    try:
        with cm:
            if first:
                sell_one(DB, 1, "abandoned")
                cut(BaseLock.__exit__.__code__)
            else:
                with lock(f"{name}:b", ttl=30, atomic=True):
                    sell_one(DB, 1, "second call")
    except TimeLimit:
        pass
    finally:
        sys.settrace(None)


def test_a_later_call_of_the_function_reusing_its_frame_opens_a_block_of_its_own(
    name: str,
) -> None:
    """Two calls of one function: the second call's frame takes the first's id (CPython
    reuses its memory), at the same ``with``, in its body."""
    open_shop(DB, 1, 100)
    for calls in range(1, 21):  # until the id is reused (nearly always at once)
        FRAMES.clear()
        call_of(f"{name}:{calls}", lock(f"{name}:{calls}", ttl=30, atomic=True), True)
        call_of(f"{name}:{calls}", nullcontext(), False)
        if FRAMES[0] == FRAMES[1]:
            break
    else:
        pytest.skip("this Python gave the second call's frame another id each time")
    assert not connections[DB].in_atomic_block
    assert [who for who, _ in sales(DB)] == ["second call"] * calls
    assert not lock(f"{name}:{calls}").locked()


def test_blocks_opened_inside_a_body_s_except_clause_stay_savepoints_of_it(name: str) -> None:
    """Not abandoned: the outer ``with`` still runs its body (an ``except`` clause inside it,
    a nested ``with`` of the same function, a reentrant re-entry): the inner blocks are its
    savepoints, and everything commits with it."""
    open_shop(DB, 1, 10)
    held = lock(name, ttl=30, atomic=True, reentrant=True)
    with held:
        sell_one(DB, 1, "outer")
        try:
            raise TimeLimit("caught in the body")
        except TimeLimit:
            with lock(f"{name}:b", ttl=30, atomic=True):
                sell_one(DB, 1, "in except")
        with held:
            sell_one(DB, 1, "re-entry")
            with held.atomic():
                sell_one(DB, 1, "atomic()")
        with lock_all(f"{name}:c", f"{name}:d", ttl=30, atomic=True):
            sell_one(DB, 1, "lock_all")
        assert connections[DB].in_atomic_block
    assert not connections[DB].in_atomic_block and not held.locked()
    assert [who for who, _ in sales(DB)] == [
        "outer",
        "in except",
        "re-entry",
        "atomic()",
        "lock_all",
    ]


def test_a_block_abandoned_inside_an_outer_transaction_is_rolled_back_to_its_savepoint(
    name: str,
) -> None:
    """Inside an outer transaction the abandoned block is a savepoint: rolled back to it as the
    next block opens (and its lock released), not committed with the outer transaction."""
    open_shop(DB, 1, 10)
    with transaction.atomic(using=DB):
        try:
            with lock(name, ttl=30, atomic=True):
                sell_one(DB, 1, "body")
                cut(BaseLock.__exit__.__code__)
        except TimeLimit:
            with lock(f"{name}:failures", ttl=30, atomic=True):
                sell_one(DB, 1, "handler")
            assert not lock(name).locked()
        finally:
            sys.settrace(None)
    assert not connections[DB].in_atomic_block
    assert [who for who, _ in sales(DB)] == ["handler"]


def test_a_block_abandoned_with_no_next_block_is_let_go_as_its_with_is_left(name: str) -> None:
    """No fenced block comes next in the thread: the abandoned block (its own transaction) is
    rolled back and its lock released as its ``with`` is left, before the ``except`` clause
    runs (its writes would otherwise land in the abandoned transaction, and be lost), rather
    than at the end of the request (Django's ``request_finished``; Celery's ``task_postrun``),
    or left held and renewed until the thread's next block."""
    open_shop(DB, 1, 10)

    def work() -> None:
        try:
            with lock(name, ttl=30, atomic=True):
                sell_one(DB, 1, "body")
                cut(BaseLock.__exit__.__code__)
        except TimeLimit:
            pass  # handled: the work goes on, and ends
        finally:
            sys.settrace(None)

    work()
    assert not lock(name).locked() and not connections[DB].in_atomic_block
    request_finished.send(sender=None)
    assert not lock(name).locked() and not connections[DB].in_atomic_block
    assert sales(DB) == []


def abandoning_view(request: HttpRequest) -> HttpResponse:
    """Its fenced block abandoned (the exception caught by the view), then a sale of its own."""
    try:
        with lock(request.GET["name"], ttl=30, atomic=True):
            sell_one(DB, 1, "abandoned")
            cut(BaseLock.__exit__.__code__)
    except TimeLimit:
        pass
    finally:
        sys.settrace(None)
    sell_one(DB, 1, "view")
    return HttpResponse("ok")


def next_view(request: HttpRequest) -> HttpResponse:
    with lock(f"{request.GET['name']}:next", ttl=30, atomic=True):
        sell_one(DB, 1, "next request")
    return HttpResponse("ok")


urlpatterns = [path("abandon/", abandoning_view), path("next/", next_view)]


def test_with_atomic_requests_a_block_abandoned_in_a_view_is_rolled_back_as_its_with_is_left(
    name: str, settings: Any
) -> None:
    """ATOMIC_REQUESTS: the view's transaction is an ``Atomic`` around it, the fenced block a
    savepoint of it. Left open, Django's exit of the view's ``Atomic`` took the block's
    savepoint for its own: the request's transaction stayed open (nothing of the view
    committed, the lock held and renewed, later requests failing). The block is rolled back to
    its savepoint and its lock released as its ``with`` statement is left."""
    settings.ROOT_URLCONF = __name__
    open_shop(DB, 1, 10)
    connections[DB].settings_dict["ATOMIC_REQUESTS"] = True
    try:
        response = Client().get("/abandon/", {"name": name})
        assert response.status_code == 200
        assert not lock(name).locked()
        assert not connections[DB].in_atomic_block
        assert [who for who, _ in sales(DB)] == ["view"]  # the view's own sale committed
        assert Client().get("/next/", {"name": name}).status_code == 200
        assert [who for who, _ in sales(DB)] == ["view", "next request"]
    finally:
        connections[DB].settings_dict["ATOMIC_REQUESTS"] = False
