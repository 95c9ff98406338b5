"""The nemesis: a fault schedule drawn from a seeded random generator, and its execution.

The schedule alternates storms (faults) and calms (none): the calms are where liveness is
judged, and the run always ends in one, with every fault healed. A fault has a start, a
duration and a heal; at most one fault at a time per target (a client slot, a lock server,
the proxy in front of it). On Redlock at most a minority of nodes is down, paused, cut off
or restarted at once (a restarted node counts until its restart guard has passed), except
in the planned majority phase, where three nodes are paused or cut off and nobody may be
granted the lock; lost, late and cut messages may hit any node at any time. A Redlock run
opens with a throughput phase (see throughput.py): healthy windows and windows with one
node clogged (SIGSTOPped for seconds), before the first storm; the storms may clog a node
too.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from . import throughput

WARMUP = 1.5
STORM = 6.0
CALM = 4.0

#: (fault, weight); node faults target one lock server or the proxy in front of it.
#: "client_interrupt": asynchronous exceptions in a client (interrupts.py).
CLIENT_FAULTS = [("client_kill", 1.0), ("client_pause", 1.5), ("client_interrupt", 2.0)]
NODE_FAULTS = [
    ("server_pause", 1.0),
    ("server_restart", 0.7),
    ("server_down", 0.5),
    ("script_flush", 1.0),
    ("busy", 0.8),  # a long script: BUSY to everyone until SCRIPT KILL
    ("latency", 1.0),
    ("black_hole", 1.5),
    ("lose_replies", 3.0),
    ("reset", 1.0),
]
#: Redlock only: one node SIGSTOPped for seconds while the others serve (a GC pause, swap).
CLOG = ("clog", 0.6)
#: A node has two layers, each with one fault at a time: the server, and its proxy.
NETWORK = {"latency", "black_hole", "lose_replies", "reset"}
#: Lost, late or cut messages make a node's answers unknown, never its data wrong: Redlock
#: must stay safe with them on every node, so they do not count towards the minority.
MESSAGES = {"latency", "lose_replies", "reset"}
#: Faults after which a node has lost its data (and its fence counters).
DATA_LOSS = {"server_restart", "server_down"}
#: Clock faults (servers under libfaketime; the kind "database" only: the fence table is what
#: keeps order through them, while Redis's own holds expire early or late). The server's wall
#: clock steps forward or back by ``arg`` seconds at the start, and back again at the heal;
#: "clock_restore" is a VM restored from a snapshot: forward at the start, then at the heal
#: the server restarts empty with its clock back, so fences start below those recorded.
CLOCK_FAULTS = [("clock_forward", 0.8), ("clock_back", 0.5), ("clock_restore", 2.5)]
#: Redlock: a majority's clocks step forward at once (Kleppmann's case), back at the heal.
CLOCK_MAJORITY = "clock_majority"
CLOCK = {kind for kind, _ in CLOCK_FAULTS} | {CLOCK_MAJORITY}


@dataclass
class Fault:
    kind: str
    target: Any  # a client slot (int) or a tuple of node indexes
    at: float  # seconds from the start of the run
    duration: float
    arg: float = 0.0  # latency seconds, replies to lose
    # Filled in while it runs (wall clock):
    started: float | None = None
    healed: float | None = None  # once healed (a loaded nemesis may record it late)
    healing: float | None = None  # just before the heal began: surely still in force
    client: str = ""  # the client id a client fault hit
    note: str = ""

    def describe(self) -> str:
        arg = f" arg={self.arg:g}" if self.arg else ""
        return f"{self.kind} target={self.target} for {self.duration:.2f}s{arg} {self.note}"


@dataclass
class Plan:
    seed: int
    seconds: float
    faults: list[Fault] = field(default_factory=list)
    storms: list[tuple[float, float]] = field(default_factory=list)
    phase: throughput.Phase | None = None


def storms(seconds: float, start: float = WARMUP) -> list[tuple[float, float]]:
    """The storm windows, from ``start``: the run ends in a calm at least CALM long."""
    found, t = [], start
    while t + STORM + CALM <= seconds + 1e-9:
        found.append((t, t + STORM))
        t += STORM + CALM
    if seconds - CALM - t >= 2.0:  # room for a shorter last storm
        found.append((t, seconds - CALM))
    return found


def make_plan(
    seed: int,
    seconds: float,
    nodes: int,
    clients: int,
    ttl: float,
    guard: float,
    exclude: frozenset[str] = frozenset(),
    clock: bool = False,
    database: bool = False,
) -> Plan:
    """The faults of one run. ``exclude`` leaves fault kinds out (to isolate a finding);
    ``clock``: the servers run under libfaketime, and the clock faults join the rest."""
    rng = random.Random(seed)
    phase = throughput.plan(seconds, nodes, rng) if "clog" not in exclude else None
    plan = Plan(seed, seconds, phase=phase)
    plan.storms = storms(seconds, phase.end if phase else WARMUP)
    for at, duration in phase.clogs() if phase else []:
        plan.faults.append(Fault("clog", (phase.node,), at, duration))  # type: ignore[union-attr]
    node_faults = NODE_FAULTS + ([CLOG] if nodes > 1 else []) + (CLOCK_FAULTS if clock else [])
    busy: dict[Any, float] = {}  # target -> busy until (run seconds)
    node_busy: list[list[tuple[float, float]]] = [[] for _ in range(nodes)]
    layer_busy: dict[tuple[int, bool], list[tuple[float, float]]] = defaultdict(list)
    majority: list[tuple[float, float]] = []

    def nodes_faulted(start: float, end: float) -> set[int]:
        return {i for i, spans in enumerate(node_busy) for a, b in spans if a < end and start < b}

    for number, (s_start, s_end) in enumerate(plan.storms):
        if nodes > 1 and number % 3 == 0 and "majority" not in exclude:  # every third storm
            at = s_start + rng.uniform(0.5, max(0.6, STORM - 3.0))
            length = rng.uniform(1.2, 2.0)
            chosen = tuple(sorted(rng.sample(range(nodes), nodes // 2 + 1)))
            kind = rng.choice(["majority_pause", "majority_black_hole"])
            kind, step = majority_clock(rng, kind) if clock else (kind, 0.0)
            plan.faults.append(Fault(kind, chosen, at, length, step))
            majority.append((at - 0.3, at + length + 0.3))
            for i in chosen:
                node_busy[i].append((at - 0.3, at + length + 0.3))
                for network in (False, True):
                    layer_busy[(i, network)].append((at - 0.3, at + length + 0.3))
        t = s_start
        while True:
            t += rng.uniform(0.05, 0.4)
            if t >= s_end - 0.2:
                break
            on_client = rng.random() < 0.3
            kinds = CLIENT_FAULTS if on_client else node_faults
            kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
            if kind in exclude:
                continue
            if kind == "client_kill":
                duration = rng.uniform(0.05, 0.5)  # until its replacement starts
            elif kind == "client_pause":
                duration = rng.uniform(1.2, 2.5) * ttl  # past its TTL
            elif kind == "server_pause":
                duration = rng.uniform(0.1, 1.2 * ttl)
            elif kind == "clog":
                duration = rng.uniform(2.0, 4.0)
            elif kind == "busy":
                duration = rng.uniform(0.5, 2.0)
            elif kind == "client_interrupt":
                duration = rng.uniform(1.0, 3.0)
            elif kind == "server_down":
                duration = rng.uniform(0.2, 1.0)
            elif kind == "latency":
                duration = rng.uniform(0.3, 1.5)
            elif kind == "black_hole":
                duration = rng.uniform(0.1, 0.8)
            elif kind == "lose_replies":
                duration = rng.uniform(0.5, 1.5)  # armed this long at most
            elif kind in CLOCK:
                duration = clock_duration(rng)
            else:
                duration = 0.0
            if t + duration > s_end:
                continue
            if on_client:
                target: Any = rng.randrange(clients)
                if busy.get(("client", target), -1.0) > t:
                    continue
                busy[("client", target)] = t + duration + 0.2
            else:
                node = rng.randrange(nodes)
                until = t + duration + 0.2
                if kind in DATA_LOSS or kind == "clock_restore":
                    until += guard  # abstains (restart guard) until then
                layer = layer_busy[(node, kind in NETWORK)]
                if any(a < until and t < b for a, b in layer):
                    continue
                if any(a < until and t < b for a, b in majority):
                    continue
                minority = (nodes - 1) // 2
                counted = kind not in MESSAGES
                if nodes > 1 and counted and len(nodes_faulted(t, until) | {node}) > minority:
                    continue
                if counted:
                    node_busy[node].append((t, until))
                layer.append((t, until))
                target = (node,)
            arg = 0.0
            if kind == "latency":
                arg = rng.uniform(0.01, 0.15)
            elif kind == "lose_replies":
                arg = float(rng.randint(1, 3))
            elif kind in CLOCK:
                arg = clock_step(rng)
            plan.faults.append(Fault(kind, target, t, duration, arg))
    if "side_pause" not in exclude:
        plan.faults += side_faults(seed, plan.storms)
    if database:
        plan.faults += database_faults(seed, plan.storms, exclude)
    plan.faults.sort(key=lambda f: f.at)
    return plan


def majority_clock(rng: random.Random, kind: str) -> tuple[str, float]:
    """Half the majority phases of a run with clock faults step the majority's clocks
    instead: the fault and its step."""
    if rng.random() < 0.5:
        return CLOCK_MAJORITY, clock_step(rng)
    return kind, 0.0


def clock_duration(rng: random.Random) -> float:
    """How long a clock fault lasts: holds taken meanwhile meet its heal's step."""
    return rng.uniform(0.5, 2.5)


def clock_step(rng: random.Random) -> float:
    """A clock fault's step, seconds: past the TTL (holds expire at a forward step), and
    short enough that keys set an extra step longer still run out before the run ends (its
    last calm is CALM long)."""
    return rng.uniform(1.5, 2.5)


#: The longest side pause: with a client pause on top, within the side hold's TTL (10 s).
SIDE_PAUSE = 4.0


def side_faults(seed: int, windows: list[tuple[float, float]]) -> list[Fault]:
    """Renewal faults: the side server (a second backend, where every client keeps a hold)
    SIGSTOPped for 1.5-4 s in about two storms of three, while the lock servers' holds (TTL
    1 s) must go on being renewed on time. Drawn from a generator of their own, so that the
    other faults of a seed stay what they were."""
    rng = random.Random(seed * 104729 + 37)
    found = []
    for start, end in windows:
        length = rng.uniform(1.5, SIDE_PAUSE)
        if rng.random() < 0.67 and end - start > length + 0.2:
            at = start + rng.uniform(0.1, end - start - length - 0.1)
            found.append(Fault("side_pause", ("side",), at, length))
    return found


#: The kind "database": faults of the proxy in front of PostgreSQL (tests/proxy.py), armed for the
#: next COMMIT while they last: its reply lost (the connection cut after the server
#: committed), late (held ``arg`` s), or late while every client gets an interrupt (a time
#: limit firing during a slow COMMIT); and every connection reset.
DATABASE_FAULTS = [("commit_lost", 2.0), ("commit_late", 1.0), ("commit_interrupted", 1.5),
                   ("db_reset", 0.5)]  # fmt: skip


def database_faults(
    seed: int, windows: list[tuple[float, float]], exclude: frozenset[str]
) -> list[Fault]:
    """Four to eight database faults per storm, from a generator of their own."""
    rng = random.Random(seed * 7727 + 5)
    found = []
    for start, end in windows:
        t = start
        for _ in range(rng.randint(4, 8)):
            t += rng.uniform(0.1, 0.6)
            kind = rng.choices([k for k, _ in DATABASE_FAULTS], [w for _, w in DATABASE_FAULTS])[0]
            duration = 0.0 if kind == "db_reset" else rng.uniform(0.3, 1.0)
            if t + duration + 2.0 > end or kind in exclude:
                continue
            hold = rng.uniform(0.5, 2.0) if kind != "commit_lost" else 0.0
            found.append(Fault(kind, ("db",), t, duration, hold))
            t += duration + hold
    return found


class Nemesis:
    """Runs a plan against a harness (see ``harness.Run``) on its own thread."""

    def __init__(self, plan: Plan, run: Any) -> None:
        self.plan = plan
        self.run = run
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._main, name="nemesis", daemon=True)
        self._stop = threading.Event()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self, origin: float) -> None:
        self.origin = origin  # monotonic time of the run's start
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _main(self) -> None:
        actions: list[tuple[float, int, Fault, bool]] = []
        for i, fault in enumerate(self.plan.faults):
            actions.append((fault.at, i, fault, True))
            actions.append((fault.at + fault.duration, i, fault, False))
        actions.sort(key=lambda a: (a[0], a[3]))
        for when, _, fault, apply in actions:
            delay = self.origin + when - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            try:
                if apply:
                    fault.started = time.time()
                    self.run.apply(fault)
                else:
                    fault.healing = time.time()
                    self.run.heal(fault)
                    fault.healed = time.time()
            except Exception as exc:  # a harness problem: reported, never hidden
                self.errors.append(f"{fault.describe()}: {type(exc).__name__}: {exc}")
                if not apply:
                    fault.healed = time.time()
        # Whatever happens, everything is healed at the end.
        for fault in self.plan.faults:
            if fault.started is not None and fault.healed is None:
                try:
                    self.run.heal(fault)
                finally:
                    fault.healed = time.time()
