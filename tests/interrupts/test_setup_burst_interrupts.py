"""A burst of two interrupts during a wait's set-up comes out of ``acquire()`` as the interrupt.

The set-up waited on ``threading.Event``s: the subscription's confirmation
(``waiters.Confirmation``) and ``Thread.start()`` (the hub's reader thread). An Event's wait
is a ``Condition``, whose ``finally`` re-takes the condition's lock; a second interrupt
landing there (the entry of ``_acquire_restore``: a call, where CPython runs signal
handlers) left it untaken, and ``with self._cond:`` raised ``RuntimeError: release unlocked
lock`` out of ``acquire()``: neither a ``LockError`` nor the interrupt. The confirmation is
now waited for on a plain lock's acquire, and a thread is started through
``waiters.start_thread``, which lets such a burst out as its interrupt.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.testing import RedisServer
from django_redlock.waiters import Confirmation, start_thread
from django_redlock.waiting import PubSubHub

from ..locks.test_faults import _alias

WAIT = threading.Condition.wait.__code__


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


@pytest.fixture
def burst(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[CodeType], list[str]]]:
    """``arm(caller)``: in this thread, the next Condition.wait called (through an Event's
    wait) from ``caller`` gets a first interrupt as it starts to sleep on the waiter lock,
    and a second at the entry of ``_acquire_restore`` in its ``finally``."""
    fired: list[str] = []
    restore = threading.Condition._acquire_restore  # type: ignore[attr-defined]
    main = threading.current_thread()

    def second(self: threading.Condition, state: Any) -> Any:
        if fired == ["first"] and threading.current_thread() is main:
            fired.append("second")
            raise Interrupt("second, at _acquire_restore")
        return restore(self, state)

    monkeypatch.setattr(threading.Condition, "_acquire_restore", second)

    def arm(caller: CodeType) -> list[str]:
        def tracer(frame: FrameType, event: str, arg: Any) -> Any:
            if fired or frame.f_code is not WAIT:
                return None
            outer = frame.f_back.f_back if frame.f_back is not None else None
            if outer is None or outer.f_code is not caller:
                return None

            released = [False]  # the condition's lock let go: its ``finally`` re-takes it

            def line(frame: FrameType, event: str, arg: Any) -> Any:
                if event == "line" and not fired:
                    source = _line(frame.f_code.co_filename, frame.f_lineno)
                    if released[0] and "waiter.acquire(" in source:
                        fired.append("first")
                        raise Interrupt("first, at the waiter lock's acquire")
                    released[0] = released[0] or "_release_save()" in source
                return line

            return line

        sys.settrace(tracer)
        return fired

    yield arm
    sys.settrace(None)


def _line(path: str, number: int) -> str:
    with open(path) as source:
        return source.readlines()[number - 1]


def test_a_burst_in_a_thread_start_comes_out_as_the_interrupt(
    burst: Callable[[CodeType], list[str]],
) -> None:
    ran = threading.Event()
    thread = threading.Thread(target=lambda: (time.sleep(0.05), ran.set()), daemon=True)
    fired = burst(threading.Thread.start.__code__)
    try:
        with pytest.raises(Interrupt):
            start_thread(thread)
    finally:
        sys.settrace(None)
    assert fired == ["first", "second"]
    assert ran.wait(5)  # started all the same


class SoftTimeLimit(Exception):
    """Celery's SoftTimeLimitExceeded: an ``Exception``, raised by a signal handler."""


# Thread.start's call that makes the thread (3.13: a joinable one).
_STARTER = (
    "_start_joinable_thread"
    if hasattr(threading, "_start_joinable_thread")
    else ("_start_new_thread")
)


def _limit_once_the_thread_began(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next thread made in this module comes out of its start call with SoftTimeLimit,
    once it runs (out of ``threading._limbo``): a signal handled as that C call returned."""
    real = getattr(threading, _STARTER)

    def start_then_limit(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(threading, _STARTER, real)
        real(*args, **kwargs)
        deadline = time.monotonic() + 5
        while any(t.name == "limited" for t in list(threading._limbo.values())):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline
            time.sleep(0.001)
        raise SoftTimeLimit("soft time limit")

    monkeypatch.setattr(threading, _STARTER, start_then_limit)


def test_a_soft_time_limit_as_a_thread_began_comes_out_as_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thread.start's clean-up of a failed start then raised ``KeyError: <the thread>`` (it
    had left ``_limbo``): a task's ``except SoftTimeLimitExceeded`` never saw its limit."""
    ran = threading.Event()
    thread = threading.Thread(target=ran.set, name="limited", daemon=True)
    _limit_once_the_thread_began(monkeypatch)
    with pytest.raises(SoftTimeLimit):
        start_thread(thread)
    assert ran.wait(5)  # it runs all the same


def test_a_soft_time_limit_as_a_reconnects_cut_timer_began_stops_the_timer(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer
) -> None:
    """fast_path's reconnect guard (a Timer that shuts the socket down past the deadline):
    the limit comes out as itself, and the timer that began is stopped (it would shut down
    a later user's socket)."""
    from django_redlock import fast_path

    client = redis_server.client()
    conn = client.connection_pool.get_connection()
    try:
        conn.connect()
        made: list[threading.Timer] = []
        real_timer = threading.Timer

        def named(*args: Any, **kwargs: Any) -> threading.Timer:
            timer = real_timer(*args, **kwargs)
            timer.name = "limited"
            made.append(timer)
            return timer

        monkeypatch.setattr(threading, "Timer", named)
        _limit_once_the_thread_began(monkeypatch)
        with pytest.raises(SoftTimeLimit):
            fast_path._Cut(conn, 0.2)
        time.sleep(0.4)  # past its deadline
        assert made and made[0].finished.is_set()  # cancelled: it never fired
        assert conn.send_command("PING") is None and conn.read_response() in (b"PONG", "PONG")
    finally:
        client.connection_pool.release(conn)
        client.close()


def test_a_burst_in_a_confirmations_wait_comes_out_as_the_interrupt(
    burst: Callable[[CodeType], list[str]],
) -> None:
    confirmed = Confirmation()
    threading.Timer(0.1, confirmed.set).start()
    burst(Confirmation.wait.__code__)
    try:
        confirmed.wait(2)  # (an Event's wait before: RuntimeError: release unlocked lock)
    except Interrupt:
        pass
    finally:
        sys.settrace(None)
    assert confirmed.confirmed


@pytest.mark.parametrize("where", ["thread_start", "confirmation"])
def test_a_burst_in_a_waits_set_up_comes_out_of_acquire_as_the_interrupt(
    redis_factory: Callable[..., RedisServer],
    name: str,
    where: str,
    burst: Callable[[CodeType], list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 2.0},
    }
    with _alias("burst", config):
        admin = server.client()
        holder = lock(name, using="burst", ttl=30, auto_renew=False)
        assert holder.acquire(blocking=False)
        if where == "confirmation":
            subscribing = PubSubHub._subscribe_inbox

            def slow(self: PubSubHub) -> Any:
                # The confirmation comes 0.3 s later: the set-up waits for it.
                admin.execute_command("CLIENT", "PAUSE", "300", "ALL")
                return subscribing(self)

            monkeypatch.setattr(PubSubHub, "_subscribe_inbox", slow)
            caller = Confirmation.wait.__code__
        else:
            caller = threading.Thread.start.__code__
        threading.Timer(1.0, holder.release).start()
        fired = burst(caller)
        try:
            outcome: object = lock(name, using="burst", ttl=10).acquire(timeout=5)
        except Interrupt as exc:
            outcome = exc
        except BaseException as exc:  # RuntimeError: release unlocked lock, before
            outcome = repr(exc)
        finally:
            sys.settrace(None)
        monkeypatch.undo()
        # Delivered, the interrupt comes out (a join's ``except Exception`` took the
        # RuntimeError for a failed subscribe before: the interrupt was lost).
        assert isinstance(outcome, Interrupt) if fired else outcome is True, (fired, outcome)
        # The hub is whole: a later wait is woken by the next release.
        time.sleep(1.2)
        locks["burst"].close()  # (the first waiter's hold, if it got one, is let go)
        later = lock(name + ":later", using="burst", ttl=10)
        other = lock(name + ":later", using="burst", ttl=10, auto_renew=False)
        assert other.acquire(blocking=False)
        threading.Timer(0.3, other.release).start()
        started = time.monotonic()
        assert later.acquire(timeout=5)
        assert time.monotonic() - started < 1.3
        later.release()


class _Burst:
    """The first interrupt at the ``at``-th line run (in ``threading.py`` and
    ``waiters.py``), the second at the next call after it, wherever (a call is where CPython
    runs signal handlers): a trace function that raises is unset, a profile function is
    not touched by it."""

    FILES = (threading.__file__, Confirmation.wait.__code__.co_filename)

    def __init__(self, at: int) -> None:
        self.at, self.lines, self.fired = at, 0, 0

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename not in self.FILES:
            return None
        return self.line

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and not self.fired:
            text = _line(frame.f_code.co_filename, frame.f_lineno).strip()
            if text == "try:" or text.startswith("with "):
                # As test_watch_interrupts: no signal is looked for at a ``try:``, and a
                # ``with`` line runs again to leave its block, __exit__ called first.
                return self.line
            self.lines += 1
            if self.lines == self.at:
                self.fired = 1
                raise Interrupt(f"first, at {frame.f_code.co_name}:{frame.f_lineno}")
        return self.line

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.fired == 1 and event == "call":
            self.fired = 2
            sys.setprofile(None)
            raise Interrupt(f"second, entering {frame.f_code.co_name}")


@pytest.mark.parametrize("what", ["confirmation", "thread_start"])
def test_a_burst_at_any_line_of_a_set_up_wait_comes_out_as_the_interrupt(what: str) -> None:
    failed: list[str] = []
    for at in range(1, 200):
        burst = _Burst(at)
        confirmed = Confirmation()
        if what == "confirmation":
            setter = threading.Timer(0.02, confirmed.set)
            setter.start()

            def call(confirmed: Confirmation = confirmed) -> None:
                confirmed.wait(1)

        else:
            thread = threading.Thread(target=lambda: None, daemon=True)

            def call(confirmed: Confirmation = confirmed, thread: Any = thread) -> None:
                start_thread(thread)

        sys.setprofile(burst.profile)
        sys.settrace(burst.trace)
        try:
            call()
        except Interrupt:
            pass
        except BaseException as exc:  # RuntimeError: release unlocked lock
            failed.append(f"line {at}: {exc!r}")
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        if what == "confirmation":
            # (An Event's burst could leave its lock taken: the setter, the hub's reader
            # thread, then hung on it for good.)
            setter.join(5)
            assert not setter.is_alive(), f"line {at}: the setter hangs"
            confirmed.wait(1)  # still usable, and set
            assert confirmed.confirmed
        # (A thread start() cut short may never run: the burst can leave its Event's lock
        # taken. The hub then finds its reader not alive, and the next join starts another.)
        if not burst.fired:  # past the last line
            break
    else:
        pytest.fail("the sweep never reached the end of the wait")
    assert not failed, failed
