"""Redlock's throughput beside a clogged node, measured in every Redlock campaign run.

The run opens with a throughput phase: the clients take the lock in a tight loop (acquire,
a fenced write to the resource at the start and end of the hold, release; none of the direct
reads of the servers, the sleeps or the questions of the normal loop), while the nemesis
alternates healthy windows with *clogged* ones: one node SIGSTOPped for the whole window
(a GC pause, swap, a black-holed network) while the others serve. The holds granted per
second in each kind of window are compared; the clients see the phase through a file
(``Phase.flag``), created before they start and removed when the phase ends. The storms of
the rest of the run may clog a node too (``clog`` in the nemesis' node faults).

The floor, FLOOR x the healthy throughput of the same run: a quorum (3 of 5) never needs the
clogged node, so an operation waits for it at most a grace of a few ms before the breaker
skips it; expected is about 1 x (4 nodes to talk to instead of 5 even saves a little), and
the floor leaves room for the noise of a shared 2-core machine between adjacent windows of
a few seconds (0.36-0.43 x under load, where the same case alone gives 0.73-0.97 x). A
Redlock that waits for the clogged node's socket timeout (0.2 s here) on each operation, or
on each per process and breaker period, falls far below (0.1 x or less).

A window's rate is over its un-stalled time (stall.py): its length less the larger of the
harness's idle time in it (its proxies carry every request) and the clients' mean idle time
(each makes about a share of the holds); a window stalled for more than SKIP of itself is left out,
and the report says so (no window of a kind left: not judged).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .stall import Stalls

FLOOR = 0.3  # make test in 3 processes on 2 cores: 0.43 x seen (0.73-0.97 x alone)
#: The clients start in the phase (the run's second 0 is when they all run): the first
#: window opens once their connections are made.
SETTLE = 1.0
WINDOW = 2.0
#: After a clogged window, the node is back (the breaker's probe) before the next window.
RECOVER = 1.5
#: Runs shorter than this get one healthy and one clogged window, longer ones two of each.
TWO_ROUNDS = 40.0
#: Runs shorter than this get no phase (too little left for the storms).
SHORTEST = 15.0
#: A window stalled for more than this share of itself is left out.
SKIP = 0.5


@dataclass
class Window:
    kind: str  # "healthy" or "clogged"
    at: float  # run seconds
    until: float


@dataclass
class Phase:
    end: float  # run seconds: the storms start after
    node: int  # the node clogged in the clogged windows
    windows: list[Window] = field(default_factory=list)
    flag: Path | None = None  # set by the harness

    def clogs(self) -> list[tuple[float, float]]:
        return [(w.at, w.until - w.at) for w in self.windows if w.kind == "clogged"]


def plan(seconds: float, nodes: int, rng: random.Random) -> Phase | None:
    """The phase of a Redlock run (None for a single node or a short run)."""
    if nodes < 3 or seconds < SHORTEST:
        return None
    phase = Phase(0.0, rng.randrange(nodes))
    t = SETTLE
    for _ in range(2 if seconds >= TWO_ROUNDS else 1):
        phase.windows.append(Window("healthy", t, t + WINDOW))
        phase.windows.append(Window("clogged", t + WINDOW, t + 2 * WINDOW))
        t += 2 * WINDOW + RECOVER
    phase.end = t
    return phase


def judge(phase: Phase | None, events: list[dict[str, Any]], started: float,
          faults: list[Any], stalls: Stalls | None = None) -> dict[str, Any] | None:  # fmt: skip
    """Holds granted per second in the healthy and the clogged windows (wall clock:
    ``started`` is the run's second 0; a clogged window is measured while its node was
    actually stopped)."""
    if phase is None:
        return None
    clogs = sorted(
        (f for f in faults if f.kind == "clog" and f.started is not None and f.at < phase.end),
        key=lambda f: f.at,
    )
    spans: dict[str, list[tuple[float, float]]] = {"healthy": [], "clogged": []}
    for window in phase.windows:
        if window.kind == "healthy":
            spans["healthy"].append((started + window.at, started + window.until))
    for fault in clogs:
        spans["clogged"].append((fault.started, fault.healed or fault.started))
    granted = sorted(ev["t"] for ev in events if ev["e"] == "acq_ok")
    stalls = stalls if stalls is not None else Stalls(events)
    clients = sorted({ev["c"] for ev in events if ev["e"] == "acq"})
    rates: dict[str, Any] = {"skipped": [], "stalled": 0.0}
    raw: dict[str, float] = {}
    for kind, windows in spans.items():
        seconds, count = 0.0, 0
        everything = sum(b - a for a, b in windows)
        raw[kind] = sum(1 for t in granted for a, b in windows if a <= t < b) / (everything or 1)
        for a, b in windows:
            mean = sum(stalls.overlap(c, a, b) for c in clients) / max(1, len(clients))
            stalled = min(b - a, max(stalls.overlap("harness", a, b), mean))
            if b > a and stalled > SKIP * (b - a):
                rates["skipped"].append(f"{kind} {a - started:.1f}..{b - started:.1f} s"
                                        f" ({stalled:.2f} s stalled)")  # fmt: skip
                continue
            stalls.count(stalled > 0, False)
            rates["stalled"] += stalled
            seconds += b - a - stalled
            count += sum(1 for t in granted if a <= t < b)
        rates[kind] = count / seconds if seconds > 0 else 0.0
        rates[f"{kind}_holds"] = count
        rates[f"{kind}_seconds"] = seconds
    healthy, clogged = rates["healthy"], rates["clogged"]
    rates["ratio"] = clogged / healthy if healthy else 0.0
    rates["floor"] = FLOOR
    rates["node"] = phase.node
    # Every window of a kind left out: not judged (said so), rather than judged on noise.
    rates["judged"] = bool(rates["healthy_seconds"] and rates["clogged_seconds"])
    rates["ok"] = not rates["judged"] or (bool(healthy) and rates["ratio"] >= FLOOR)
    rates["raw_ratio"] = raw["clogged"] / raw["healthy"] if raw["healthy"] else 0.0
    stalls.count(
        False,
        rates["ok"] and rates["raw_ratio"] < FLOOR,
        f"clogged-throughput: {rates['raw_ratio']:.2f} x over all of the windows",
    )
    return rates


def describe(rates: dict[str, Any]) -> str:
    return (
        f"  throughput: {rates['healthy']:.0f} holds/s healthy ({rates['healthy_holds']}),"
        f" {rates['clogged']:.0f} holds/s with node{rates['node']} clogged"
        f" ({rates['clogged_holds']}): {rates['ratio']:.2f} x, floor {rates['floor']:g} x"
        f" (over un-stalled time, {rates.get('stalled', 0.0):.2f} s stalled; over all of it"
        f" {rates.get('raw_ratio', rates['ratio']):.2f} x"
        + (f"; left out: {', '.join(rates['skipped'])}" if rates.get("skipped") else "")
        + ("" if rates.get("judged", True) else "; NOT JUDGED: no window of a kind left")
        + ")"
    )
