"""An interrupt at every line of a waiter's try bounded by its hub's verdict
(``RedisBackend.execute_by`` and the fast path under it), and at the entry of every function
those lines call.

The rule checked after each one: the bound ends with the try. A deadline left behind by an
interrupt (one that landed in the ``finally`` putting the thread's deadline back) cut every
later command of that thread to 1 ms once it had passed: ``BackendUnavailable`` ("Timeout
reading") on a healthy server, for the life of the thread. Then, while the interrupt's
exception lived (its traceback keeps the call's frame): the same, and the same at every line
of a plain operation's ``execute``; a deadline now stands only while its call is running.
"""

from __future__ import annotations

import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any

from django.conf import settings
from django.test import override_settings

from django_redlock import fast_path, lock, locks
from django_redlock.backends.redis import RedisBackend

from ..support.line_interrupts import Interrupt, LineInterrupter, interrupted

SLOW = (
    "local t = redis.call('TIME'); local s = t[1] * 1e6 + t[2]\n"
    "repeat local n = redis.call('TIME') until n[1] * 1e6 + n[2] - s > 30000\nreturn 1"
)
ONE_AT_A_TIME = threading.Lock()
BY = RedisBackend.execute_by.__code__


def _watched() -> set[CodeType]:
    codes = {BY, RedisBackend.execute.__code__}
    for value in vars(fast_path).values():  # whatever the fast path's helpers are named
        for each in vars(value).values() if isinstance(value, type) else [value]:
            code = getattr(getattr(each, "__wrapped__", each), "__code__", None)
            if code is not None and code.co_filename == fast_path.__file__:
                codes.add(code)
    return codes


class FirstTry:
    """Raises :class:`Interrupt` at the ``at``-th point (None: counts them) of the first
    bounded try: each line of the watched functions, and each entry of a function they call,
    from its entry into ``execute_by`` until that call returns."""

    def __init__(self, at: int | None) -> None:
        self.at, self.watched = at, _watched()
        self.points, self.depth, self.done = 0, 0, False
        self.fired: str | None = None

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.at:
            self.fired = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise Interrupt(self.fired)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.done:
            return None
        if frame.f_code is BY and self.depth == 0:
            self.depth = 1
            self._point(frame)
            return self._line
        if self.depth == 0:
            return None
        back = frame.f_back
        if back is not None and back.f_code in self.watched:
            self._point(frame)  # at the callee's entry
        return self._line if frame.f_code in self.watched else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.done:
            return None
        if event == "line":
            self._point(frame)
        elif event == "return" and frame.f_code is BY:
            self.done = True
        return self._line


def _case(name: str, at: int | None, checks: list[str]) -> tuple[FirstTry, threading.Event]:
    """A waiter on a held name, interrupted at point ``at`` of its first bounded try; then,
    on the same thread once any deadline of that try has passed and with the interrupt's
    exception still alive, a healthy 30 ms command and a lock operation."""
    backend = locks["default"]
    client: Any = backend.client  # type: ignore[attr-defined]
    timeout = client.connection_pool.connection_kwargs["socket_timeout"]
    tracer = FirstTry(at)
    interrupted = threading.Event()

    def waiter() -> None:
        kept: Interrupt | None = None  # alive as long as this thread runs: its traceback too
        sys.settrace(tracer)
        try:
            lock(name, ttl=5).acquire(timeout=0.1)
        except Interrupt as exc:
            kept = exc
        finally:
            sys.settrace(None)
            interrupted.set()
        time.sleep(timeout + 0.2)  # past whatever deadline the try had
        try:
            with ONE_AT_A_TIME:  # (the server runs them one after another)
                fast_path.command(client, "EVAL", SLOW, "0")
            assert backend.execute(backend.op_locked(name)), "the holder's lock is not seen"
        except Exception as exc:
            checks.append(f"{tracer.fired}: {type(exc).__name__}: {exc}")
        del kept

    threading.Thread(target=waiter, daemon=True).start()
    return tracer, interrupted


def test_an_interrupt_at_any_line_of_a_bounded_try_leaves_no_deadline_behind(name: str) -> None:
    holder = lock(name, ttl=30, auto_renew=False)
    assert holder.acquire(blocking=False)
    checks: list[str] = []
    counted, done = _case(name, None, checks)
    assert done.wait(10)
    total = counted.points
    assert total > 10, total
    threads_before = set(threading.enumerate())
    for at in range(1, total + 1):
        tracer, done = _case(name, at, checks)
        assert done.wait(10), at
        assert tracer.fired is not None or at > tracer.points, at
    for thread in set(threading.enumerate()) - threads_before:
        thread.join(10)
    holder.release()
    assert not checks, (total, checks)


QUICK = 0.5  # the socket timeout of the alias below: a deadline left behind passes quickly


def _execute_window() -> set[CodeType]:
    return {RedisBackend.execute.__code__, RedisBackend.execute_on.__code__,
            fast_path.begin_call.__code__, fast_path.end_call.__code__}  # fmt: skip


def _interrupted_try(name: str, at: int | None, kept: list[Any], checks: list[str]) -> None:
    """On a thread of its own: a lock held, then a non-blocking try interrupted at point
    ``at`` of ``execute`` (and of begin_call/end_call); with the exception still alive (kept,
    as Celery's retry(exc=exc) or a log record keeps it) and the try's deadline past, the
    held lock's release and a fresh try must be answered."""
    before = lock(f"{name}:before", using="quick", ttl=30, auto_renew=False)
    assert before.acquire(blocking=False)
    tracer = LineInterrupter(at, _execute_window(), lambda frame: True)
    exc = interrupted(lambda: lock(name, using="quick", ttl=30).acquire(blocking=False), tracer)
    if exc is None and at is not None:
        return
    kept.append((tracer, exc))
    time.sleep(QUICK + 0.1)  # past the interrupted call's deadline
    try:
        before.release()
        fresh = lock(f"{name}:fresh", using="quick", ttl=30, auto_renew=False)
        assert fresh.acquire(blocking=False), "a fresh name was busy"
        fresh.release()
    except BaseException as error:
        checks.append(f"{tracer.fired}: {type(error).__name__}: {error}")


def test_an_interrupted_call_whose_exception_lives_leaves_no_deadline_behind(
    redis_server: Any, name: str
) -> None:
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend",
              "LOCATION": redis_server.url,
              "OPTIONS": {"socket_timeout": QUICK, "socket_connect_timeout": QUICK}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "quick": config}):
        assert lock(f"{name}:warm", using="quick").acquire(blocking=False)  # scripts loaded
        counting = LineInterrupter(None, _execute_window(), lambda frame: True)
        first = lock(f"{name}:n", using="quick", auto_renew=False)
        assert interrupted(lambda: first.acquire(blocking=False), counting) is None
        total = counting.points
        assert total > 10, total
        kept: list[Any] = []
        checks: list[str] = []
        threads = [
            threading.Thread(target=_interrupted_try, args=(f"{name}:{at}", at, kept, checks))
            for at in range(1, total + 1)
        ]  # each on its own thread: the thread-local deadline is per thread
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        # A run beside 23 others may take another path (a connection made, not pooled) and
        # never reach its point: that point again, alone, on the counted path.
        for at in sorted(set(range(1, total + 1)) - {tracer.at for tracer, _ in kept}):
            alone = threading.Thread(
                target=_interrupted_try, args=(f"{name}:{at}+", at, kept, checks)
            )
            alone.start()
            alone.join(30)
        assert len(kept) == total, (total, len(kept))
        assert not checks, (total, checks)
