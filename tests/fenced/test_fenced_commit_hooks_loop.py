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
Then the review of that fix (rf): a cut inside the library's own wrapper of a callback, before
its call (it counted as called); a cut on the loop after a plain callback returned (a signal
handler's frame below the loop looked like that callback raising); a second cut after the
loop (a robust callback Django's ``try:`` swallowed never ran).
"""

from __future__ import annotations

import dis
import functools
import inspect
import os
import signal
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


def _cut_in_the_wrapper_before_the_call(target: Any, entry: bool = False) -> Any:
    """Trace function: ``TimeLimit`` on the line of the library's own wrapper of ``target``
    (put on as the COMMIT is sent) that calls it, before the call: not in the callback. Or
    (``entry``) as ``target``'s frame is entered, before its first line: where a signal
    pending at the call is handled (the callee's first instruction), none of it run."""
    wrapper = fencing._Called.__call__
    lines, first = inspect.getsourcelines(wrapper)
    call = first + next(i for i, text in enumerate(lines) if text.strip() == "self.func()")

    def called(frame: FrameType, event: str, arg: Any) -> Any:
        if entry and event == "call" and frame.f_code is target.__code__:
            sys.settrace(None)
            raise TimeLimit("soft time limit")
        if entry or event != "call" or frame.f_code is not wrapper.__code__:
            return None
        func = frame.f_locals["self"].func
        if target not in (func, getattr(func, "func", None)):
            return None

        def line(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == call:
                sys.settrace(None)
                raise TimeLimit("soft time limit")
            return line

        return line

    return called


@pytest.mark.parametrize("entry", [False, True], ids=["wrapper's call line", "callee's entry"])
@pytest.mark.parametrize("kind", ["plain", "robust", "proved"])
def test_a_time_limit_in_the_callbacks_wrapper_before_its_call_runs_it_once(
    name: str, kind: str, entry: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The wrapper that records a callback's call marked it called before calling it: a soft
    time limit between the two left it never run (a plain one: the rest dropped too, logged
    as a callback that raised). It runs once; the rest as for a cut on Django's loop. So
    too for a limit handled as the callback is entered, before any of it ran."""
    open_shop("default", 1, 10)
    ran: list[str] = []

    def target() -> None:
        ran.append("target")

    with lock(name, ttl=30, atomic="default"):
        sell_one("default", 1, "first")
        transaction.on_commit(lambda: ran.append("a"), using="default")
        if kind == "proved":
            on_commit_or_proved(target, using="default")
        else:
            transaction.on_commit(target, using="default", robust=kind == "robust")
        transaction.on_commit(lambda: ran.append("c"), using="default")
        sys.settrace(_cut_in_the_wrapper_before_the_call(target, entry))
    sys.settrace(None)
    # A robust one Django's try swallowed runs after its loop (as on its own call line).
    assert ran == (["a", "target", "c"] if kind == "plain" else ["a", "c", "target"])
    assert not lock(name).locked()
    assert "an on_commit callback raised" not in caplog.text


def _cut_on_the_loop_after(label: str) -> Any:
    """Trace function: ``TimeLimit`` on the first line of Django's loop reached after the
    callback ``label`` returned (``while current_run_on_commit:``): a Python signal handler's
    frame (the tracer's here) lies below the loop's frame, as a callback's would."""

    def called(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_name != LOOP:
            return None

        def line(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line" and label in seen:
                sys.settrace(None)
                raise TimeLimit("soft time limit")
            return line

        return line

    seen: list[str] = []
    return called, seen


def test_a_time_limit_on_djangos_loop_after_a_plain_callback_returned_runs_the_rest(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Told by depth alone ("the traceback goes below the loop's frame"), a time limit on the
    loop after a plain callback returned was that callback raising: every later callback of
    the committed block was dropped, and the log said a callback raised."""
    open_shop("default", 1, 10)
    ran: list[str] = []
    tracer, seen = _cut_on_the_loop_after("a")

    def a() -> None:
        ran.append("a")
        seen.append("a")

    with lock(name, ttl=30, atomic="default"):
        sell_one("default", 1, "first")
        transaction.on_commit(a, using="default")
        transaction.on_commit(lambda: ran.append("r"), using="default", robust=True)
        on_commit_or_proved(lambda: ran.append("p"), using="default")
        transaction.on_commit(lambda: ran.append("c"), using="default")
        sys.settrace(tracer)
    sys.settrace(None)
    assert ran == ["a", "r", "p", "c"]
    assert not lock(name).locked()
    assert "an on_commit callback raised" not in caplog.text
    assert "TimeLimit: soft time limit as Django's exit ended" in caplog.text


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1")
def test_a_real_signal_handled_as_a_c_callback_returns_runs_the_rest(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real signal (Celery's soft time limit is SIGUSR1's handler) sent by a callback
    written in C is handled as it returns, in the wrapper's frame: it returned, it did not
    raise; the rest run."""
    open_shop("default", 1, 10)
    ran: list[str] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        raise TimeLimit("soft time limit")

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with lock(name, ttl=30, atomic="default"):
            sell_one("default", 1, "first")
            transaction.on_commit(functools.partial(os.kill, os.getpid(), signal.SIGUSR1),
                                  using="default")  # fmt: skip
            transaction.on_commit(lambda: ran.append("r"), using="default", robust=True)
            on_commit_or_proved(lambda: ran.append("p"), using="default")
            transaction.on_commit(lambda: ran.append("c"), using="default")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert ran == ["r", "p", "c"]
    assert not lock(name).locked()
    assert "an on_commit callback raised" not in caplog.text


def test_a_second_time_limit_after_djangos_loop_still_runs_the_robust_callback_it_swallowed(
    name: str,
) -> None:
    """A first soft time limit on a robust callback's call line (Django's ``try:`` swallowed
    it: the callback is run after the loop), then a second as that run begins: only the
    entry the loop took last was looked at again, and the robust one never ran."""
    open_shop("default", 1, 10)
    ran: list[str] = []
    cuts: list[str] = []
    after_loop = fencing._run_uncalled.__code__

    def at_run_uncalled(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is after_loop:
            cuts.append("second")
            sys.settrace(None)
            raise TimeLimit("second soft time limit")
        return None

    def c() -> None:
        ran.append("c")
        sys.settrace(at_run_uncalled)  # (the first cut turned tracing off)

    try:
        with lock(name, ttl=30, atomic="default"):
            sell_one("default", 1, "first")
            transaction.on_commit(lambda: ran.append("a"), using="default")
            transaction.on_commit(lambda: ran.append("r"), using="default", robust=True)
            transaction.on_commit(c, using="default")
            sys.settrace(_cut_on_call_line(2, robust=True))  # (the marker's is the 1st)
    finally:
        sys.settrace(None)
    assert cuts == ["second"]
    assert ran == ["a", "c", "r"]
    assert not lock(name).locked()
    assert [who for who, _ in sales("default")] == ["first"]


@pytest.mark.parametrize(
    "which", ["the marker", "proved", "robust", "robust: wrapper's call line", "robust: entry"]
)
@pytest.mark.parametrize("using", ["default", PG])
def test_a_time_limit_before_a_robust_callbacks_call_then_a_plain_one_raising_runs_it_once(
    name: str, using: str, which: str, caplog: pytest.LogCaptureFixture
) -> None:
    """review rf (session 20), defects 1 and 2: a soft time limit on the call of a robust
    callback, before it (Django's ``try:`` swallowed it), then a later plain callback raises
    an ordinary error. Only the entry taken last was looked at: it raised and is plain, so the
    robust one was never run (an ``on_commit_or_proved`` one included); the block's marker so
    cut made the error read as a COMMIT cut short, and its ``on_commit_or_proved`` callbacks
    ran twice. The cut one runs once, before the release; the plain one's error is logged
    (committed); nothing after it runs (Django's rule)."""
    open_shop(using, 1, 10)
    ran: list[tuple[str, bool]] = []

    def callback(label: str) -> Any:
        return lambda: ran.append((label, lock(name).locked()))

    def robust() -> None:
        ran.append(("robust", lock(name).locked()))

    def boom() -> None:
        ran.append(("boom", lock(name).locked()))
        raise RuntimeError("mail server down")

    cuts = {
        "the marker": _cut_on_call_line(1, robust=True),
        "proved": _cut_on_call_line(2, robust=True),
        "robust": _cut_on_call_line(3, robust=True),
        "robust: wrapper's call line": _cut_in_the_wrapper_before_the_call(robust),
        "robust: entry": _cut_in_the_wrapper_before_the_call(robust, entry=True),
    }
    try:
        with lock(name, ttl=30, atomic=using):
            sell_one(using, 1, "first")
            transaction.on_commit(callback("a"), using=using)
            on_commit_or_proved(callback("proved"), using=using)
            transaction.on_commit(robust, using=using, robust=True)
            transaction.on_commit(boom, using=using)
            transaction.on_commit(callback("dropped"), using=using)
            sys.settrace(cuts[which])
    finally:
        sys.settrace(None)
    assert sorted(ran) == [("a", True), ("boom", True), ("proved", True), ("robust", True)]
    assert not lock(name).locked()
    assert "did not answer" not in caplog.text and "was cut short" not in caplog.text
    assert "mail server down" in caplog.text
    assert [who for who, _ in sales(using)] == ["first"]
    connection = connections[using]
    assert connection.autocommit and not connection.in_atomic_block


def _first_cut(where: str) -> Any:
    """Trace function: ``TimeLimit`` after the COMMIT answered, as the driver's switch back to
    autocommit returns (the block's exit then runs Django's step again) or as the driver's
    COMMIT returns (its outcome check proves it, and the callbacks still pending run)."""
    first = {"autocommit on": "_set_autocommit", "COMMIT returned": "_commit"}[where]

    def on_return(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            sys.settrace(None)
            raise TimeLimit("soft time limit, the first")
        return on_return

    def called(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code.co_name != first:
            return None
        return on_return if first == "_commit" or frame.f_locals.get("autocommit") else None

    return called


@pytest.mark.parametrize("which", ["the marker", "proved", "robust"])
@pytest.mark.parametrize("where", ["autocommit on", "COMMIT returned"])
def test_a_time_limit_before_a_robust_callbacks_call_in_djangos_loop_run_again_runs_it_once(
    name: str, where: str, which: str, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """review rf (session 20), suspected: a first soft time limit after the COMMIT answered
    has the exit run Django's loop again (its step again, or the callbacks still pending once
    the COMMIT is proved); a second on a robust callback's call line there (Django's ``try:``
    swallows it) left that callback never run, or, on the block's marker, the outcome check
    ran the ``on_commit_or_proved`` callbacks twice. Each runs once, before the release."""
    open_shop(PG, 1, 10)
    ran: list[tuple[str, bool]] = []
    nth = {"the marker": 1, "proved": 2, "robust": 3}[which]
    run_rest = fencing._run_rest

    def then_the_second(*args: Any) -> bool:
        # (A trace function that raises is turned off: the second is put on as the exit
        # goes on past the first, before it runs Django's loop again.)
        sys.settrace(_cut_on_call_line(nth, robust=True))
        return run_rest(*args)

    monkeypatch.setattr(fencing, "_run_rest", then_the_second)

    def callback(label: str) -> Any:
        return lambda: ran.append((label, lock(name).locked()))

    try:
        with lock(name, ttl=30, atomic=PG):
            sell_one(PG, 1, "first")
            transaction.on_commit(callback("a"), using=PG)
            on_commit_or_proved(callback("proved"), using=PG)
            transaction.on_commit(callback("robust"), using=PG, robust=True)
            transaction.on_commit(callback("c"), using=PG)
            sys.settrace(_first_cut(where))
    finally:
        sys.settrace(None)
    assert "Error calling" in caplog.text  # (the second cut, swallowed by Django's try:)
    assert sorted(ran) == [("a", True), ("c", True), ("proved", True), ("robust", True)]
    assert not lock(name).locked()
    assert [who for who, _ in sales(PG)] == ["first"]
    connection = connections[PG]
    assert connection.autocommit and not connection.in_atomic_block


def test_a_second_time_limit_as_the_exit_takes_a_plain_callbacks_error_still_runs_the_cut_one(
    name: str,
) -> None:
    """review rf2 #5: a first soft time limit on a robust callback's call line (Django's
    ``try:`` swallowed it), then a plain callback raises, then a second time limit on the
    exit's ``except`` line, before ``_run_rest`` ran the cut one: the block returned
    committed and the robust callback never ran. It runs at the block's end, once."""
    open_shop("default", 1, 10)
    ran: list[str] = []
    cuts: list[int] = []
    steps = fencing._fenced_steps.__code__
    lines, first = inspect.getsourcelines(steps)
    at = first + next(i for i, text in enumerate(lines) if "except BaseException as exc:" in text)

    def on_except(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == at and not cuts:
            cuts.append(at)
            frame.f_trace = None
            sys.settrace(None)
            raise TimeLimit("second soft time limit")
        return on_except

    def boom() -> None:
        ran.append("boom")
        frame = sys._getframe()
        while frame is not None and frame.f_code is not steps:
            frame = frame.f_back  # type: ignore[assignment]
        assert frame is not None
        sys.settrace(lambda *_: None)  # (the first cut turned tracing off)
        frame.f_trace = on_except
        raise RuntimeError("mail server down")

    try:
        with lock(name, ttl=30, atomic="default"):
            sell_one("default", 1, "first")
            transaction.on_commit(lambda: ran.append("a"), using="default")
            transaction.on_commit(lambda: ran.append("r"), using="default", robust=True)
            transaction.on_commit(boom, using="default")
            transaction.on_commit(lambda: ran.append("dropped"), using="default")
            sys.settrace(_cut_on_call_line(2, robust=True))  # (the marker's is the 1st)
    finally:
        sys.settrace(None)
    assert cuts == [at]
    assert ran == ["a", "boom", "r"]
    assert not lock(name).locked()
    assert [who for who, _ in sales("default")] == ["first"]
