"""After a fenced block's exit returned "committed", nothing may raise out of its ``with``
statement. CPython checks for pending signals after a call to a C-level callable returns, in
the caller's frame: an ``__exit__`` handed to the ``with`` as a ``functools.partial`` thus gave
a signal arriving during the exit's last returns a line of the caller to raise on, after the
COMMIT (a Celery soft time limit: a retry applied the work twice). A Python method is entered
and left inline: no such check. Here the handler's run at that check is made deterministic:
an opcode trace of the caller raises at the first instruction after the exit returned, as
CPython would, but only where the exit is a C-level callable."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS

from django_redlock import lock, lock_all

from ..support.fenced_child import open_shop, sales, sell_one

pytestmark = pytest.mark.django_db(transaction=True)
DB = DEFAULT_DB_ALIAS


class TimeLimit(Exception):
    """Stands for Celery's SoftTimeLimitExceeded."""


def _exit_of(cm: Any) -> tuple[Any, types.CodeType]:
    """What a ``with`` statement gets for ``cm``'s ``__exit__``, and that exit's code."""
    descriptor = next(k.__dict__["__exit__"] for k in type(cm).__mro__ if "__exit__" in k.__dict__)
    got = descriptor.__get__(cm, type(cm))
    func = getattr(descriptor, "func", descriptor)
    return got, func.__code__


@pytest.mark.parametrize("opener", ["with lock", "lk.atomic()", "lock_all"])
def test_no_signal_is_handled_on_the_with_line_after_the_exit_committed(
    name: str, opener: str
) -> None:
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
    got, exit_code = _exit_of(cm)
    c_level = not isinstance(got, (types.FunctionType, types.MethodType))
    armed: list[bool] = []

    def run() -> str:
        with cm:
            sell_one(DB, 1, "body")
        return "returned"

    def in_run(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" and armed and c_level:  # CPython's check after a C call
            armed.clear()
            raise TimeLimit("a soft time limit, run on the with line")
        return in_run

    def in_exit(frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and frame.f_back is not None and frame.f_back.f_code is run.__code__:
            armed.append(True)
        return in_exit

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is exit_code:
            return in_exit
        if frame.f_code is run.__code__:
            frame.f_trace_opcodes = True
            return in_run
        return None

    sys.settrace(tracer)
    try:
        outcome = run()
    except TimeLimit:
        outcome = "raised"
    finally:
        sys.settrace(None)
    if held is not None:
        held.release()
    assert [who for who, _ in sales(DB)] == ["body"]  # committed
    assert outcome == "returned", f"the with raised after its block committed ({type(got)})"
