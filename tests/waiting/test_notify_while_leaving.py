"""A waiter that leaves while a release's wake-up is being handed to it does not kill the
pub/sub reader.

``ReleaseHub.notify`` (run on the reader's thread) picked the waiter under the hub's mutex
and woke it after letting go; the woken waiter could leave in between (it tried again at its
deadline and took the lock), emptying the very group the reader tested again: it then read a
variable never set, the reader thread died of ``UnboundLocalError``, and from then on every
wait of the backend lasted its holder's whole TTL (review l3, 1).
"""

from __future__ import annotations

import inspect
import threading
import time
from types import FrameType
from typing import Any

from django_redlock import lock
from django_redlock.waiters import ReleaseHub


def _line_after_the_mutex() -> int:
    """The first line of ``notify`` after its ``with self._mutex:`` block."""
    source, start = inspect.getsourcelines(ReleaseHub.notify)
    at = next(n for n, line in enumerate(source) if line.strip() == "with self._mutex:")
    indent = len(source[at]) - len(source[at].lstrip())
    after = next(
        n for n in range(at + 1, len(source))
        if source[n].strip() and len(source[n]) - len(source[n].lstrip()) == indent
    )  # fmt: skip
    return start + after


def test_a_waiter_leaving_as_it_is_woken_leaves_the_reader_reading(
    redis_server: Any, name: str
) -> None:
    notify, line = ReleaseHub.notify.__code__, _line_after_the_mutex()
    parked, go = threading.Event(), threading.Event()
    died: list[str] = []

    def at_line(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == line and not parked.is_set():
            parked.set()  # the reader, between picking the waiter and waking it
            go.wait(10)
        return at_line

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is notify and threading.current_thread().name == "redlock-pubsub":
            return at_line
        return None

    hook = threading.excepthook
    threading.excepthook = lambda a: died.append(
        f"{a.thread.name if a.thread else '?'}: {a.exc_value!r}"
    )
    threading.settrace(tracer)
    try:
        holder = lock(name, ttl=10)
        assert holder.acquire(blocking=False)
        got: list[bool] = []

        def wait() -> None:
            waiter = lock(name, ttl=10)
            got.append(waiter.acquire(timeout=2))
            if got[-1]:
                waiter.release()

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)  # waiting (subscribed, registered)
        holder.release()  # the wake-up: the reader parks in notify
        assert parked.wait(5), "the reader never handed a wake-up"
        thread.join(10)  # the waiter tried again at its deadline, took the lock and left
        assert got == [True]
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
        go.set()
        time.sleep(0.3)
        threading.excepthook = hook
    assert not died, died
    # The reader still reads: a release 0.3 s into a wait wakes it, not the TTL (8 s).
    holder = lock(f"{name}:next", ttl=8)
    assert holder.acquire(blocking=False)
    waited: list[float] = []

    def wait_next() -> None:
        started = time.monotonic()
        waiter = lock(f"{name}:next", ttl=8)
        assert waiter.acquire(timeout=20)
        waited.append(time.monotonic() - started)
        waiter.release()

    thread = threading.Thread(target=wait_next)
    thread.start()
    time.sleep(0.3)
    holder.release()
    thread.join(25)
    assert waited and waited[0] < 4, f"woken only by the TTL: {waited}"
