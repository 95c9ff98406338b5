"""The scheduling-stall probe: how long each campaign process was not running.

On a shared 2-core machine at load 3-10 a process may wait tens or hundreds of ms for a CPU,
and a property about time (an error within 1.5 socket timeouts, a hand-off within 0.5 s, the
clogged window's throughput) then judges the machine as well as the code. Every campaign
process (the clients of each kind, and the harness, whose proxies carry the clients'
traffic) runs a daemon thread that sleeps STEP s in a loop; when it wakes more than
THRESHOLD s late it logs a ``stall`` event: ``s`` (when it should have woken, wall clock),
the event's ``t`` (when it did), ``late`` and ``idle``: the lateness less the CPU time the
whole process used meanwhile. A process descheduled uses none (idle = late); one whose own
code held the GIL in C used it all (idle about 0: the code's slowness, never excused).

The judges (``Stalls.overlap``) take a timing judgement's duration less the idle time of its
own process overlapping it. A stall never excuses a safety property (fences, two holders, a
hold lost or held by nobody).

Signals: the probe thread blocks every signal, so the interrupt move's SIGUSR1 / SIGUSR2 /
SIGALRM (and SIGTERM) always reach a thread that runs Python's handlers, and CPython runs
those in the main thread anyway: the probe is never interrupted and never delays one.
"""

from __future__ import annotations

import bisect
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

#: How long the probe sleeps, and how late a wake-up is a stall.
STEP = 0.01
THRESHOLD = 0.05


def _loop(log: Callable[..., None], step: float, threshold: float, stop: threading.Event) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    while not stop.is_set():
        before, cpu = time.monotonic(), time.process_time()
        time.sleep(step)
        late = time.monotonic() - before - step
        if late > threshold:
            idle = max(0.0, late - (time.process_time() - cpu))
            now = time.time()
            log("stall", s=now - late, late=round(late, 4), idle=round(idle, 4))


def watch(
    log: Callable[..., None], step: float = STEP, threshold: float = THRESHOLD
) -> threading.Event:
    """Start the probe of this process: ``log("stall", s=..., late=..., idle=...)``. Setting
    the event returned stops it."""
    stop = threading.Event()
    threading.Thread(target=_loop, args=(log, step, threshold, stop), name="stall-probe",
                     daemon=True).start()  # fmt: skip
    return stop


class Recorder:
    """The harness's own probe: its stalls as events of the client ``harness``."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.stop = watch(self)

    def __call__(self, event: str, **fields: Any) -> None:
        self.events.append({"t": time.time(), "c": "harness", "e": event, **fields})


class Stalls:
    """The stalls of each process, from the history's ``stall`` events."""

    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        spans: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for ev in events:
            if ev["e"] == "stall" and ev.get("late", 0) > 0:
                spans[ev["c"]].append((ev["s"], ev["t"], min(1.0, ev["idle"] / ev["late"])))
        self.spans = {c: sorted(s) for c, s in spans.items()}
        self.ends = {c: [b for _, b, _ in s] for c, s in self.spans.items()}
        self.adjusted = 0  # judgements whose duration a stall shortened
        self.excused = 0  # of them, those that would have failed without
        self.notes: list[str] = []  # what those were

    def overlap(self, client: str, a: float, b: float) -> float:
        """The idle time of ``client``'s process within [a, b] (s)."""
        spans = self.spans.get(client)
        if not spans or b <= a:
            return 0.0
        total = 0.0
        for s, e, share in spans[bisect.bisect_right(self.ends[client], a) :]:
            if s >= b:
                break
            total += max(0.0, min(b, e) - max(a, s)) * share
        return total

    def largest(self, clients: Iterable[str]) -> tuple[float, str]:
        """The longest idle stall (s) of these processes, and whose."""
        return max(
            (((e - s) * share, c) for c in clients for s, e, share in self.spans.get(c, [])),
            default=(0.0, ""),
        )

    def count(self, adjusted: bool, excused: bool, what: str = "") -> None:
        """One judgement: whether a stall shortened it, whether it passes only so (``what``
        it was, for the report)."""
        self.adjusted += adjusted
        self.excused += excused
        if excused:
            self.notes.append(what)

    def describe(self, harness: bool = True) -> str:
        """The report's line; ``harness``: whether the harness ran a probe (the main
        harness, whose proxies carry the clients' requests; the other kinds have none)."""
        clients = [c for c in self.spans if c != "harness"]
        stall, client = self.largest(clients)
        own = (
            f", {len(self.spans.get('harness', []))} in the harness (largest"
            f" {self.largest(['harness'])[0]:.3f} s)"
            if harness
            else ""
        )
        return (
            f"  stalls: {sum(len(self.spans[c]) for c in clients)} in the clients (largest"
            f" {stall:.3f} s idle{f', {client}' if client else ''}){own};"
            f" {self.adjusted} timing judgements adjusted for them, {self.excused} of which"
            " pass only so" + "".join(f"\n    {note}" for note in self.notes[:5])
        )
