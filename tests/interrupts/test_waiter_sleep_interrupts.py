"""An interrupt (a signal handler's exception) while a waiting thread sleeps comes out as
itself, whatever line it lands on.

A waiter slept on a ``threading.Event``: its ``wait`` is a ``Condition`` in Python, whose
``finally`` re-takes the condition's lock; a second interrupt there (the campaign's bursts,
redis/write seed 1607) left it untaken, and ``with self._cond:`` raised ``RuntimeError:
release unlocked lock``, which crashed the client: no ``LockError``, not the interrupt. The
waiter now sleeps on a plain lock's acquire, which an interrupt leaves whole.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

from django_redlock.waiters import Waiter


class Interrupt(BaseException):
    """What a signal handler may raise between two bytecodes."""


def test_an_interrupt_at_any_line_of_a_waiter_s_sleep_comes_out_as_itself() -> None:
    failed: list[str] = []
    points = 0
    for at in range(1, 60):
        seen = [0]

        def tracer(
            frame: FrameType, event: str, arg: Any, at: int = at, seen: list[int] = seen
        ) -> Any:
            if frame.f_code.co_filename != threading.__file__:
                return None

            def line(frame: FrameType, event: str, arg: Any) -> Any:
                if event == "line":
                    seen[0] += 1
                    if seen[0] == at:
                        raise Interrupt(f"threading.py:{frame.f_lineno}")
                return line

            return line

        waiter = Waiter()
        waker = threading.Timer(0.001, waiter.wake)
        waker.start()
        sys.settrace(tracer)
        try:
            waiter.wait(0.05)
        except Interrupt:
            pass
        except Exception as exc:
            failed.append(f"line {at}: {exc!r}")
        finally:
            sys.settrace(None)
            waker.join()
        points = max(points, seen[0])
        assert waiter.wait(0) in (True, False)  # still usable
        if seen[0] < at:
            break
    assert not failed, failed
