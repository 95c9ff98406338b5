"""An exception a signal handler raises (Celery's soft time limit) inside Django's loop over a
fenced transaction's ``on_commit`` callbacks (``run_and_clear_commit_hooks``), after the
COMMIT answered, at a point where no callback raised: every callback runs once, before the
release, and the block returns (logged).

Two points the loop's own source lines did not tell apart: the line that calls a callback,
reached before the call (it was taken for the callback having raised: that one and the rest
were dropped), and the unpacking of the entry ``pop(0)`` just returned (the entry, on the
stack only, was lost; the block's own marker lost made its ``on_commit_or_proved`` callbacks
run twice, with a log that the COMMIT went unanswered). And one Django's loop itself hides:
on the line that calls a robust callback, before the call, inside Django's ``try:``, which
logs it as the callback's error and goes on (that callback never ran; the block's marker
never ran, and a second time limit later in the exit was raised as "nothing committed").
"""

from __future__ import annotations

import dis
import inspect
import sys
from types import FrameType
from typing import Any

import pytest
from django.db import connections, transaction

from django_redlock import fencing, lock
from django_redlock.fencing import on_commit_or_proved

from ..support.fenced_child import open_shop, sales, sell_one

PG = "postgres"
pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)

LOOP = "run_and_clear_commit_hooks"


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


def _cut_on_call_line(nth: int, robust: bool = False) -> Any:
    """Trace function: ``TimeLimit`` as Django's loop reaches, the ``nth`` time, the line that
    calls a callback, before the call is made: one registered without ``robust`` (the loop's
    last ``func()`` line), or a robust one (its first, inside its ``try:``: Django's
    ``except`` takes the cut for that callback's error and goes on)."""
    pick = min if robust else max

    def called(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_name != LOOP:
            return None
        lines, first = inspect.getsourcelines(frame.f_code)
        call = first + pick(i for i, text in enumerate(lines) if text.strip() == "func()")
        seen: list[int] = []

        def line(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == call:
                seen.append(call)
                if len(seen) == nth:
                    sys.settrace(None)
                    raise TimeLimit("soft time limit")
            return line

        return line

    return called


def _cut_as_pop_returns(nth: int) -> Any:
    """Trace function: ``TimeLimit`` at the instruction after Django's loop's ``pop(0)``
    returned its ``nth`` entry (the unpacking of that entry): where a real signal raised as
    ``pop(0)`` returns lands, the entry taken off the list and not yet in a variable."""

    def called(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_name != LOOP:
            return None
        frame.f_trace_opcodes = True
        code = frame.f_code.co_code
        seen: list[int] = []

        def opcode(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode" and dis.opname[code[frame.f_lasti]] == "UNPACK_SEQUENCE":
                seen.append(frame.f_lasti)
                if len(seen) == nth:
                    sys.settrace(None)
                    raise TimeLimit("soft time limit")
            return opcode

        return opcode

    return called


# The callbacks, in the order registered, after the block's own marker (the loop's 1st entry):
# "a", "b" plain (robust=False), "proved" (on_commit_or_proved: robust), "c" plain.
CUTS = {
    "before b's call": _cut_on_call_line(2),
    "before c's call": _cut_on_call_line(3),
    "the marker popped": _cut_as_pop_returns(1),
    "b popped": _cut_as_pop_returns(3),
    "proved popped": _cut_as_pop_returns(4),
    "c popped": _cut_as_pop_returns(5),
}


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("using", ["default", PG])
def test_a_time_limit_in_djangos_callback_loop_runs_every_callback_once(
    name: str, using: str, cut: str, caplog: pytest.LogCaptureFixture
) -> None:
    open_shop(using, 1, 10)
    ran: list[tuple[str, bool]] = []

    def callback(label: str) -> Any:
        return lambda: ran.append((label, lock(name).locked()))

    try:
        with lock(name, ttl=30, atomic=using):
            sell_one(using, 1, "first")
            transaction.on_commit(callback("a"), using=using)
            transaction.on_commit(callback("b"), using=using)
            on_commit_or_proved(callback("proved"), using=using)
            transaction.on_commit(callback("c"), using=using)
            sys.settrace(CUTS[cut])  # (the frames called from here on: the exit's)
    finally:
        sys.settrace(None)
    # Each once, in order, before the release; the block returned (committed).
    assert ran == [("a", True), ("b", True), ("proved", True), ("c", True)]
    assert not lock(name).locked()
    assert "did not answer" not in caplog.text and "was cut short" not in caplog.text
    assert "TimeLimit: soft time limit as Django's exit ended" in caplog.text
    connection = connections[using]
    assert connection.autocommit and not connection.in_atomic_block
    with lock(name, ttl=30, atomic=using):
        sell_one(using, 1, "next")
    assert [who for who, _ in sales(using)] == ["first", "next"]


@pytest.mark.parametrize("robust", [False, True])
def test_a_callback_that_raises_in_djangos_loop_keeps_djangos_rule_for_the_rest(
    name: str, robust: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The other side of the rule above: a callback that raised (not the loop's own line) is
    not run again, and the rest run as Django would run them: dropped after a plain one,
    run after a robust one (Django logged its error)."""
    open_shop(PG, 1, 10)
    ran: list[str] = []

    def failing() -> None:
        ran.append("failing")
        raise TimeLimit("soft time limit, in the callback")

    with lock(name, ttl=30, atomic=PG):
        sell_one(PG, 1, "first")
        transaction.on_commit(lambda: ran.append("a"), using=PG)
        transaction.on_commit(failing, using=PG, robust=robust)
        transaction.on_commit(lambda: ran.append("c"), using=PG)
    assert ran == (["a", "failing", "c"] if robust else ["a", "failing"])
    assert not lock(name).locked()
    assert "did not answer" not in caplog.text and "in the callback" in caplog.text
    with lock(name, ttl=30, atomic=PG):
        sell_one(PG, 1, "next")
    assert [who for who, _ in sales(PG)] == ["first", "next"]


@pytest.mark.parametrize("which", ["the marker", "proved", "robust"])
@pytest.mark.parametrize("using", ["default", PG])
def test_a_time_limit_before_a_robust_callbacks_call_runs_it_all_the_same(
    name: str, using: str, which: str
) -> None:
    """A soft time limit on the line of Django's loop that calls a robust callback (the
    block's marker, an ``on_commit_or_proved`` one, or ``robust=True``), before the call:
    Django's ``try:`` logged it as the callback's error and went on, and the callback never
    ran. It runs after Django's loop, before the release, once."""
    open_shop(using, 1, 10)
    ran: list[tuple[str, bool]] = []
    nth = {"the marker": 1, "proved": 2, "robust": 3}[which]

    def callback(label: str) -> Any:
        return lambda: ran.append((label, lock(name).locked()))

    try:
        with lock(name, ttl=30, atomic=using):
            sell_one(using, 1, "first")
            transaction.on_commit(callback("a"), using=using)
            on_commit_or_proved(callback("proved"), using=using)
            transaction.on_commit(callback("robust"), using=using, robust=True)
            transaction.on_commit(callback("c"), using=using)
            sys.settrace(_cut_on_call_line(nth, robust=True))
    finally:
        sys.settrace(None)
    assert sorted(ran) == [("a", True), ("c", True), ("proved", True), ("robust", True)]
    assert not lock(name).locked()
    with lock(name, ttl=30, atomic=using):
        sell_one(using, 1, "next")
    assert [who for who, _ in sales(using)] == ["first", "next"]


def test_a_marker_never_called_by_djangos_loop_still_marks_the_block_committed(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The block's marker swallowed so (above), then a second soft time limit as the exit
    goes on to the release: the block committed, so it returns (logged); it raised the time
    limit as if nothing had committed (a retry would sell twice)."""
    open_shop(PG, 1, 10)
    ran: list[str] = []
    release = fencing.release_after_commit.__code__
    cuts: list[str] = []

    def at_release(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is release:
            cuts.append("release")
            sys.settrace(None)
            raise TimeLimit("soft time limit, at the release")
        return None

    def proved() -> None:
        ran.append("proved")
        sys.settrace(at_release)  # (the first cut turned tracing off)

    try:
        with lock(name, ttl=30, atomic=PG):
            sell_one(PG, 1, "first")
            on_commit_or_proved(proved, using=PG)
            sys.settrace(_cut_on_call_line(1, robust=True))
    finally:
        sys.settrace(None)
    assert cuts == ["release"] and ran == ["proved"]
    assert not lock(name).locked()
    assert [who for who, _ in sales(PG)] == ["first"]
