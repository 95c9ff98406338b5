"""An exception a signal handler raises once a fenced block's ``__exit__`` returned "committed".

CPython (3.11 to 3.13) looks for pending signals only at some instructions: one arriving
during the last instructions of an ``__exit__``, after its last such check, is handled back
in the caller, on the ``with`` line, once ``__exit__`` returned: outside every ``try`` of the
exit (a bound method is no protection; a ``functools.partial``, a C callable, only added a
check). A Celery soft time limit there made the block look failed after its COMMIT and
release, and ``autoretry_for`` applied the work twice.

The decorator forms own the ``with`` line's frame: an ``Exception`` out of their ``with``
after the exit recorded "committed and released" (its last step) is logged and the call
returns its result. A ``with`` written by the caller cannot be helped from inside
``__exit__``: it raises, the block committed and the lock released (docs/topics/fencing.md,
"After the exit returned").

The handler's run is made deterministic: an opcode trace raises at the first instruction of
the ``with`` statement's frame after the outermost fenced exit returned, where CPython would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory

from django_redlock import (
    fencing,
    lock,
    lock_all,
    lock_view,
    read_write_lock,
    single_instance,
)
from django_redlock.locking.base import BaseLock
from django_redlock.locking.multi import MultiLock

from ..support.fenced_child import open_shop, sales, sell_one

pytestmark = pytest.mark.django_db(transaction=True)
DB = DEFAULT_DB_ALIAS


class TimeLimit(Exception):
    """Stands for Celery's SoftTimeLimitExceeded."""


def _exit_code(cls: type) -> CodeType:
    descriptor = cls.__dict__["__exit__"]
    return getattr(descriptor, "func", descriptor).__code__


EXITS = {_exit_code(BaseLock), _exit_code(MultiLock), _exit_code(fencing.FencedTransaction)}


class AfterExit:
    """A tracer raising ``TimeLimit`` once, at the first instruction of the ``with``
    statement's frame after the outermost fenced ``__exit__`` returned."""

    def __init__(self) -> None:
        self.armed, self.fired = True, False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self._exit if frame.f_code in EXITS else None

    def _exit(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return" and self.armed and not self._inside_another_exit(frame):
            self.armed = False
            owner = frame.f_back  # the frame running the ``with`` statement
            assert owner is not None
            owner.f_trace, owner.f_trace_opcodes = self._owner, True
        return self._exit

    @staticmethod
    def _inside_another_exit(frame: FrameType) -> bool:
        back = frame.f_back
        while back is not None:
            if back.f_code in EXITS:
                return True
            back = back.f_back
        return False

    def _owner(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and not self.fired:
            self.fired = True
            raise TimeLimit("a soft time limit, run on the with line")
        return self._owner


def _traced(call: Callable[[], Any]) -> tuple[Any, AfterExit]:
    tracer = AfterExit()
    sys.settrace(tracer)
    try:
        return call(), tracer
    except TimeLimit:
        return "raised", tracer
    finally:
        sys.settrace(None)


def _decorated(form: str, name: str) -> Callable[[], Any]:
    def body() -> str:
        sell_one(DB, 1, "body")
        return "result"

    if form == "@lock":
        return lock(name, ttl=30, atomic=True)(body)
    if form == "@write":
        return read_write_lock(name, ttl=30).write(atomic=True)(body)
    if form == "@lock_all":
        return lock_all(name, f"{name}:2", ttl=30, atomic=True)(body)
    if form == "@single_instance":
        return single_instance(key=name, ttl=30, atomic=True)(body)

    @lock_view(name, ttl=30, atomic=True)
    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse(body())

    return lambda: view(RequestFactory().post("/")).content.decode()


@pytest.mark.parametrize("form", ["@lock", "@write", "@lock_all", "@single_instance", "@lock_view"])
def test_a_decorated_call_returns_when_a_signal_lands_after_its_exit_returned_committed(
    name: str, form: str, caplog: pytest.LogCaptureFixture
) -> None:
    open_shop(DB, 1, 10)
    outcome, tracer = _traced(_decorated(form, name))
    assert tracer.fired, "the tracer never reached the with line after the exit"
    assert [who for who, _ in sales(DB)] == ["body"]  # committed
    assert not lock(name).locked()
    assert outcome == "result", "the call raised after its block committed and was released"
    assert "committed; then TimeLimit" in caplog.text


@pytest.mark.parametrize("opener", ["with lock", "lk.atomic()", "lock_all"])
def test_a_user_s_with_raises_after_its_exit_returned_committed_as_documented(
    name: str, opener: str
) -> None:
    """The documented rule: no ``__exit__`` can catch it; the block committed and the lock was
    released (``lk.atomic()``: the caller's own release) when it comes out of the ``with``."""
    open_shop(DB, 1, 10)
    held = None
    if opener == "with lock":
        cm: Any = lock(name, ttl=30, atomic=True)
    elif opener == "lk.atomic()":
        held = lock(name, ttl=30)
        assert held.acquire()
        cm = held.atomic()
    else:
        cm = lock_all(name, f"{name}:2", ttl=30, atomic=True)

    def run() -> str:
        with cm:
            sell_one(DB, 1, "body")
        return "returned"

    outcome, tracer = _traced(run)
    assert tracer.fired and outcome == "raised"
    if held is not None:
        held.release()
    assert [who for who, _ in sales(DB)] == ["body"]  # committed
    assert not lock(name).locked()


def _second_in_the_except_clause(frame: FrameType, event: str, arg: Any) -> Any:
    """Profile function (a trace function that raised is unset): a second ``TimeLimit`` as
    the decorator's ``except`` clause asks whether the block left committed (a burst)."""
    if event == "call" and frame.f_code is fencing.left_committed.__code__:
        sys.setprofile(None)
        raise TimeLimit("a second soft time limit, in the except clause")


@pytest.mark.parametrize("form", ["@lock", "@write", "@lock_all"])
def test_a_decorated_call_returns_when_a_second_signal_lands_in_its_except_clause(
    name: str, form: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst of two: the first on the ``with`` line after the exit returned committed, the
    second as the ``except`` clause looks at it. Committed and released: the call returns."""
    open_shop(DB, 1, 10)
    sys.setprofile(_second_in_the_except_clause)
    try:
        outcome, tracer = _traced(_decorated(form, name))
    finally:
        sys.setprofile(None)
    assert tracer.fired, "the tracer never reached the with line after the exit"
    assert [who for who, _ in sales(DB)] == ["body"]  # committed
    assert not lock(name).locked()
    assert outcome == "result", "the call raised after its block committed and was released"
    assert "committed; then TimeLimit" in caplog.text
