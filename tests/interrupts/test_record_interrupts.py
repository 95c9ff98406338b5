"""An interrupt (KeyboardInterrupt, a signal handler's exception: any BaseException) that lands
while a lock object records a hold the backend granted, or one adopt() took over: at every
line of ``BaseLock._record`` (and of the acquire's steps between the grant and the record,
and of the announcement after it), and at the entry of every function those lines call.

The rule checked after each one, on a real server (docs: ``BaseLock._record``): the object
either holds nothing (its retry works at once) or holds the hold and has it renewed by the
watchdog. Nothing reports a hold that nobody renews: after two TTLs every object that
reports a hold still has it in Redis, and releasing them all leaves nothing counted as held.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import sys
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from django_redlock import LockError, lock, semaphore
from django_redlock.backends.base import Attempt
from django_redlock.locking import holds
from django_redlock.locking.base import BaseLock

# Renewed every 0.67 s (a loaded machine's watchdog may be late by a second): 2 s, not 1.5 s,
# as the seven modes' holds wait together (the first mode's ones renewed for longest).
TTL = 2.0


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


def _codes(*names: str) -> set[CodeType]:
    # getattr: the test runs against older code too (to show it failed before the fix).
    return {getattr(BaseLock, n).__code__ for n in names if hasattr(BaseLock, n)}


GRANT = BaseLock._try_or_wait.__code__
RECORDING = _codes("_record", "_announce_held")


@functools.cache  # a sweep asks once a point: reading the source was most of a point
def _quiet_lines(code: CodeType) -> set[int]:
    """Lines left out: a ``with`` statement's own (Python runs it again to leave the block,
    and calls ``__exit__`` before it looks for a signal: the exception comes after the lock
    is released) and a ``try:`` (a no-op outside every handler, where no signal is looked
    for). A tracer raising there would do what no signal can: skip ``__exit__``."""
    lines, first = inspect.getsourcelines(code)
    return {
        first + i
        for i, line in enumerate(lines)
        if line.lstrip().startswith("with ") or line.strip() == "try:"
    }


_WITH: dict[CodeType, set[int]] = {}


class Interrupter:
    """A tracer that raises :class:`Interrupt` at the ``at``-th point (None: counts them):
    each line of the watched frames once the hold is granted, and each entry into a
    function that the recording frames call."""

    def __init__(self, at: int | None, watched: set[CodeType], from_grant: bool) -> None:
        self.at, self.watched, self.armed = at, watched | RECORDING, not from_grant
        for code in self.watched | {GRANT}:
            _WITH.setdefault(code, _quiet_lines(code))
        self.points = 0
        self.fired: str | None = None

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise Interrupt(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code is GRANT:
            return self._grant
        if code in self.watched:
            return self._line
        back = frame.f_back
        if self.armed and back is not None and back.f_code in RECORDING:
            self._point(frame)  # an interrupt at the callee's entry
        return None

    def _grant(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            # The backend granted the hold: from the next line of the take on (its return
            # line was a point where nothing handed the grant back).
            attempt = frame.f_locals.get("attempt")
            if not self.armed and isinstance(attempt, Attempt) and attempt.acquired:
                self.armed = True
            if self.armed and frame.f_lineno not in _WITH[GRANT]:
                self._point(frame)
        elif event == "return" and isinstance(arg, Attempt) and arg.acquired:
            self.armed = True
        return self._grant

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.armed and frame.f_lineno not in _WITH[frame.f_code]:
            self._point(frame)
        return self._line


def _interrupted(call: Callable[[], Any], tracer: Interrupter) -> None:
    sys.settrace(tracer)
    try:
        call()
    except Interrupt:
        pass
    finally:
        sys.settrace(None)


class Case:
    """One object whose hold is recorded with an interrupt at one point."""

    def __init__(self, mode: str, name: str) -> None:
        self.mode = mode
        reentrant = mode == "reentrant"
        make: Callable[[], BaseLock] = (
            (lambda: semaphore(name, 1, ttl=TTL))
            if mode.startswith("permit")
            else (lambda: lock(name, ttl=TTL, reentrant=reentrant))
        )
        self.lk = make()
        self.old: BaseLock | None = None
        self.token: str | None = None
        if mode.endswith("adopt"):
            self.old = make()
            assert self.old.acquire(blocking=False)
            self.token = self.old.token
        elif reentrant:
            assert self.lk.acquire(blocking=False)  # the interrupt lands in the re-entry

    def run(self) -> None:
        lk, mode = self.lk, self.mode
        if mode in ("acquire", "reentrant", "permit"):
            assert lk.acquire(blocking=False) is True
        elif mode == "aacquire":
            assert asyncio.run(lk.aacquire(blocking=False)) is True
        elif mode in ("adopt", "permit adopt"):
            lk.adopt(self.token)  # type: ignore[arg-type]
        else:
            asyncio.run(lk.aadopt(self.token))  # type: ignore[arg-type]

    def watched(self) -> tuple[set[CodeType], bool]:
        if self.mode.endswith("adopt"):
            return set(), False  # adopt's grant is its extend: the record is all that follows
        return _codes("_acquire"), True

    def after(self, where: str) -> None:
        """Right after the interrupt: an object that holds nothing takes the hold again at
        once (its bookkeeping cleared, the grant handed back); then the hand-over."""
        lk = self.lk
        if self.mode == "reentrant":
            depth = lk._holds[lk._owner()].depth
            assert depth in (1, 2), where
            assert lk.hold_count() == depth, f"{where}: Redis counts another depth"
        elif lk.token is None:
            if self.mode.endswith("adopt"):
                lk.adopt(self.token)  # type: ignore[arg-type]
            else:
                assert lk.acquire(blocking=False), f"{where}: the retry was refused"
        self.old = None  # the adopted hold's first holder lets go (no release)

    def check(self, where: str) -> None:
        lk = self.lk
        assert lk.token is not None, where
        assert lk.lost is None, f"{where}: lost ({lk.lost})"
        assert lk.owned(), f"{where}: reported held, but not renewed: it ran out"
        while lk.token is not None:
            lk.release()
        assert not lk.locked(), where


MODES = ["acquire", "adopt", "aacquire", "aadopt", "reentrant", "permit", "permit adopt"]


def _sweep(mode: str, name: str, cases: list[tuple[str, Case]], failed: list[str]) -> None:
    """One mode's interrupt at each point; the objects kept in ``cases`` for the check."""
    counting = Case(mode, f"{name}:count")
    watched, from_grant = counting.watched()
    tracer = Interrupter(None, watched, from_grant)
    _interrupted(counting.run, tracer)
    points = tracer.points
    assert points > 10, (mode, points)  # the record's lines and calls were seen
    counting.after(f"{mode}: no interrupt")
    cases.append((f"{mode}: no interrupt", counting))
    for at in range(1, points + 1):
        case = Case(mode, f"{name}:{at}")
        tracer = Interrupter(at, watched, from_grant)
        _interrupted(case.run, tracer)
        where = f"{mode}: interrupted at {tracer.fired or 'nothing'} (point {at})"
        try:
            case.after(where)
            cases.append((where, case))
        except (AssertionError, LockError) as exc:
            failed.append(f"{type(exc).__name__}: {exc}")


def test_an_interrupt_while_a_hold_is_recorded_leaves_it_renewed_or_not_held(name: str) -> None:
    """Every mode's sweep (MODES, each point's object kept), then one wait of two TTLs for
    all of them: the wait is most of the time, one for the seven modes instead of one each.
    Each object is checked as a mode's own test checked it (renewed or not held)."""
    gc.collect()  # holds an earlier test dropped are let go now, not during this one
    taken = holds.taken_count()
    cases: list[tuple[str, Case]] = []
    failed: list[str] = []
    for mode in MODES:
        _sweep(mode, f"{name}:{mode.replace(' ', '-')}", cases, failed)
    gc.collect()  # the first holders of adopted holds are gone: only the adopters renew
    time.sleep(2 * TTL + 0.5)  # a hold nobody renews is gone by now
    for where, case in cases:
        try:
            case.check(where)
        except AssertionError as exc:
            failed.append(str(exc))
    assert not failed, "\n".join(failed)
    gc.collect()
    assert holds.taken_count() == taken, "a released hold is still counted as taken"
