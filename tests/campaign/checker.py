"""The judge: properties proved over a campaign's whole history.

Inputs: every client event (their own clocks, one host: comparable), the resource's log (its
own total order, and the server clock), the nemesis' faults, and the keys left at the end.

Safety (every moment of the run, faults or not):

* ``fence-granted-twice``: two holds (acquire returned True) got the same fence;
* ``fence-behind``: a hold's fence is not greater than the fence of a hold granted before
  this acquire even started (fences must follow real time: after a restart too);
* ``overlap-accepted``: the resource accepted writes of two holds interleaved (one's section
  began before the other's ended), whatever their fences, where one of them is exclusive (a
  lock, a write lock): readers may share the resource, and up to ``limit`` semaphore permits
  (more than ``limit`` permits' sections at once is the violation there);
* ``stale-fence-accepted``: the resource accepted an exclusive hold's fence lower than one it
  had accepted, or a read's fence not above the last writer's; for a permit: a write after
  the permit's expiry (see resource.py);
* ``over-limit-held``: a direct read of the servers saw more than ``limit`` live permits of
  the semaphore at once; ``writer-not-alone``: it saw a write lease beside another lease;
* ``phantom-hold``: right after acquire returned True, the servers (read directly) did not
  hold it, with no data loss in between;
* ``lost-but-held``: a hold was reported lost (``lock_lost``) while the servers still held it
  ("unknown is not lost");
* ``false-but-held``: owned() or locked(), asked while holding, answered False, yet the
  servers still held the hold;
* ``released-but-held``: release() returned, yet the servers still held the hold;
* ``release-reported-lost``: release() raised LockLost/LockNotOwned on its first try, though
  the servers (read just before) held the hold for longer than the release took;
* ``release-hid-loss``: release() returned normally for a hold the servers no longer had;
* ``granted-without-majority``: a Redlock acquire succeeded while a majority was down;
* ``reentry-fence``: a re-entry returned another fence than its hold's; ``bad``: acquire
  returned True with no fence;
* ``client-crash``: an exception other than ``LockError`` escaped the public API.

Liveness (only in quiet time, when no fault has been active for a while):

* ``waiter-starved``: a blocking acquire timed out although the lock was free, by every
  hold the clients know of, for longer than a TTL plus slack while it waited (waiters are
  woken at the holder's expiry at the latest);
* ``quiet-outage``: acquires kept failing with errors for seconds with every server up;
* ``keys-leaked``: after the clients stopped, keys other than fence counters remained
  beyond their TTLs (or had none).

Time (error latency, a call that hung, hand-off, a hold lost on servers that answered,
a call failed on servers that answered, Redlock's round trips): see :class:`Timing`.

An asyncio client's loop blocked by sync code (``loop_block``: aclient.LoopBlocks) is time
its calls could not run: the properties about time (and ``waiter-starved``) discount it as
they discount a stall; nothing about the servers' answers is excused by it.

A paused holder whose write the resource *rejects* after its lock expired is fencing doing
its job, and is counted, not reported.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .resource import Write
from .stall import Stalls
from .throughput import describe as describe_throughput

UNKNOWN_ERRORS = ("BackendUnavailable", "QuorumNotReached")
_ROLES = {"x": "exclusive", "r": "read", "s": "permit"}
BREAKER = 1.0  # Redlock skips a failed node this long


@dataclass
class Hold:
    """One acquire call of one client, and, if it succeeded, the hold it made."""

    client: str
    hold: int
    mode: str = ""
    role: str = "x"  # x exclusive (a lock, a write lock), r a read, s a semaphore permit
    timeout: float | None = None
    start: float = 0.0
    end: float | None = None  # when acquire returned or raised
    outcome: str | None = None  # ok, no, err (None: never returned)
    error: str = ""
    fence: int | None = None
    released: float | None = None  # release returned (rel_ok)
    release_error: float | None = None
    lost: float | None = None
    last_seen: float = 0.0  # the client's last event about this hold
    #: When the lock object's first try began: a retry's (moves.py) may find that try's grant
    #: (the same object's next try finds its own hold), fence and all.
    began: float = 0.0
    #: When its acquire's request held back on the wire (moves.py) went through, if later than
    #: the call's end: it may have taken the lock then (an unknown outcome's grant lapses at
    #: its TTL, held by nobody: documented).
    landed: float = 0.0

    @property
    def key(self) -> tuple[str, int]:
        return (self.client, self.hold)

    def label(self) -> str:
        return f"{self.client}/h{self.hold} (fence {self.fence})"


@dataclass
class Violation:
    prop: str
    t: float
    message: str
    clients: set[str] = field(default_factory=set)


@dataclass
class Report:
    backend: str
    kind: str
    seed: int
    seconds: float
    stats: dict[str, Any]
    faults: Counter[str]
    violations: list[Violation]
    harness_errors: list[str]
    histories: list[str]
    exclude: str = ""  # fault kinds left out (CAMPAIGN_EXCLUDE)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.harness_errors

    def summary(self) -> str:
        s = self.stats
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        verdict = "PASS" if self.ok else f"FAIL ({len(self.violations)} violations)"
        by_prop = Counter(v.prop for v in self.violations)
        lines = [
            f"campaign {self.backend}/{self.kind} seed={self.seed} {self.seconds:g}s: {verdict}",
            f"  operations: {s['acquires']} acquires ({s['acq_ok']} held, {s['acq_no']} not,"
            f" {s['acq_err']} errors), {s['releases']} releases ({s['rel_err']} errors),"
            f" {s['writes']} writes ({s['rejected']} rejected by fencing),"
            f" {s['lost']} holds reported lost, {s['checks']} direct checks",
            f"  faults: {faults}; {s['lost_replies']} replies lost;"
            f" {s['clients']} client processes",
            f"  liveness judged over {s['quiet_waits']} timed-out waits in quiet time"
            f" ({s['quiet_seconds']:.1f} s quiet)",
            f"  time: {s.get('unavailable', 0)} BackendUnavailable judged (slowest"
            f" {s.get('slowest_error', 0):.3f} s from its call or fault), {s.get('handoffs', 0)}"
            f" hand-offs judged (slowest {s.get('slowest_handoff', 0):.3f} s),"
            f" {s.get('interrupts', 0)} interrupts caught, {s.get('loop_blocks', 0)} loop"
            f" blocks; {s.get('unknown_errors', 0)} BackendUnavailable / QuorumNotReached,"
            f" {s.get('unknown_on_healthy', 0)} of them on servers that answered",
        ]
        if s.get("moves"):
            m = s["moves"]
            looks = ", ".join(f"{k} {v}" for k, v in sorted(m["looks"].items())) or "none"
            lines.append(f"  moves: {m['wire']} held back on the wire, {m['retry']} retries,"
                         f" {m['teardown']} loops torn down; held by nobody? {looks}")  # fmt: skip
        if s.get("stalls"):
            lines.append(s["stalls"].describe())
        if s.get("roundtrips"):
            r = s["roundtrips"]
            lines.append(f"  round trips: {r['ops']} quiet acquire+release, script calls per"
                         f" node per op {r['per_op']} (2 expected); node clock skews (ms)"
                         f" {[round(k * 1000, 1) for k in s.get('skews', [])]}")  # fmt: skip
        if s.get("throughput"):
            lines.append(describe_throughput(s["throughput"]))
        if "database" in s:
            from .database import summary

            lines.append(summary(s["database"]))
        if by_prop:
            lines.append("  violations: " + ", ".join(f"{k} x{v}" for k, v in by_prop.items()))
        lines += [f"  HARNESS ERROR: {e}" for e in self.harness_errors]
        return "\n".join(lines)

    def details(self) -> str:
        return "\n\n".join(
            [self.summary(), *self.histories,
             f"reproduce: make soak SECONDS={self.seconds:g} SEED={self.seed}"
             f" CAMPAIGN_BACKEND={self.backend} CAMPAIGN_KIND={self.kind}"
             + (f" CAMPAIGN_EXCLUDE={self.exclude}" if self.exclude else "")]
        )  # fmt: skip


def granted_at(h: Hold) -> float:
    """When ``h`` was granted, at the latest: its acquire's return, or its fence's time when
    that is earlier (a fence is at least the server's clock in us when granted, one host):
    a grant whose reply the taker read late (its loop blocked, seed 2303: granted 1 ms after
    the release, ``acq_ok`` logged 0.8 s later) was a take all the same."""
    end = h.end or 0.0
    if h.fence is None or not h.start - 0.5 <= h.fence / 1e6 <= end:
        return end  # no clock in it (a made-up history's, or a counter far ahead)
    return max(h.start, h.fence / 1e6)


def held_by_nobody(
    ev: dict[str, Any],
    holds: dict[tuple[str, int], Hold],
    node_faults: list[Any],
    nodes: int,
    stopping: float,
    paused: dict[str, list[tuple[float, float]]],
    stalls: Any,
    blocks: Blocks,
) -> str:
    """The verdict on one ``nobody`` look (moves.Orphans): a name still held by the token of
    a hold its client let go, :data:`moves.NOBODY_AFTER` after the hold's clean-up ended and
    its held-back request or reply (the wire move) went through.

    Judged: a call cut (cancelled, interrupted) or its loop torn down (the library cleans up:
    it hands back a grant, releases an ``async with``'s hold, on the finisher thread for a
    closed one), a release that returned, an acquire refused. Not judged: the object's last
    try raised (``BackendUnavailable``: its token is kept and the same object's *next* try
    finds the grant; with none, it lapses at its TTL, backends.md), nor a refused try begun
    before a held-back request of the object's went through (the next one would find it), a
    release that raised. Excused: any fault of the nemesis on the servers from before the
    acquire to the look (a clean-up not answered, or not sent to a server that just did not
    answer, lapses at its TTL), the client paused, or stalled or its loop blocked more than
    0.1 s after the clean-up (it ran late). No case is exempt: the two once left open (reviews
    wai2 3 and asy3 2) are fixed (README "Moves of reports asy3 and wai2")."""
    if ev["found"] is not True:
        return "free"
    how = ev.get("how")
    hold = holds.get((ev["c"], ev["h"]))
    if hold is None or how not in ("cut", "teardown", "released", "refused"):
        return "not judged"
    landed = ev.get("wire_t1") or (ev.get("wire_t0") or 0.0) + (ev.get("wire_s") or 0.0)
    if how == "refused" and ev.get("wire_t0") and landed >= ev.get("last_try", 0.0):
        return "not judged"
    a, b = hold.start - UNAVAILABLE_BEFORE, ev["t1"]
    before = BREAKER if nodes > 1 else 0.0
    if any(f.started < b and a - before < (f.healed or stopping) for f in node_faults):
        return "excused"
    client = ev["c"]
    if any(s < b and a < e for s, e in paused.get(client, [])):
        return "excused"
    if stalls.overlap(client, ev["after"], b) + blocks.overlap(client, ev["after"], b) > 0.1:
        return "excused"
    return "held-by-nobody"


def _wire_note(ev: dict[str, Any]) -> str:
    if not ev.get("wire_t0"):
        return ""
    what = "request" if ev.get("wire_up") else "reply"
    return (f" (its {ev.get('wire_call')}'s {what} held back {ev.get('wire_s', 0):.3f} s from"
            f" {ev['wire_t0']:.3f})")  # fmt: skip


def _holds(events: list[dict[str, Any]]) -> dict[tuple[str, int], Hold]:
    holds: dict[tuple[str, int], Hold] = {}
    for ev in events:
        if "h" not in ev:
            continue
        key = (ev["c"], ev["h"])
        hold = holds.get(key)
        if hold is None:
            hold = holds[key] = Hold(ev["c"], ev["h"], start=ev["t"])
        hold.last_seen = max(hold.last_seen, ev["t"])
        e = ev["e"]
        if e == "acq":
            hold.mode, hold.timeout, hold.start = ev["mode"], ev["timeout"], ev["t"]
            hold.role = ev.get("role", "x")
            first = holds.get((ev["c"], ev.get("retry_of", -1)))
            hold.began = first.began if first is not None else ev["t"]
        elif e in ("acq_ok", "acq_no", "acq_err"):
            hold.end, hold.outcome = ev["t"], e[4:]
            if e == "acq_ok":
                hold.fence = ev["fence"]
            elif e == "acq_err":
                hold.error = ev["err"]
        elif e == "rel_ok":
            hold.released = ev["t"]
        elif e == "rel_err":
            hold.release_error = ev["t"]
        elif e == "lost":
            hold.lost = ev["t"] if hold.lost is None else hold.lost
        elif e == "wire" and ev.get("up") and ev.get("call") == "acquire":
            hold.landed = max(hold.landed, ev["t1"])
    return holds


class Blocks:
    """Each asyncio client's loop blocks (``loop_block`` events: ``t0``..``t1``)."""

    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for ev in events:
            if ev["e"] == "loop_block":
                self.spans[ev["c"]].append((ev["t0"], ev["t1"]))

    def overlap(self, client: str, a: float, b: float) -> float:
        """How long ``client``'s loop was blocked within [a, b] (s)."""
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in self.spans.get(client, []))


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _at_least(spans: Iterable[tuple[float, float]], n: int) -> list[tuple[float, float]]:
    """The times covered by at least ``n`` of ``spans`` at once, merged."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    found, count, since = [], 0, 0.0
    for t, step in edges:
        if step > 0:
            count += 1
            if count == n:
                since = t
        else:
            if count == n:
                found.append((since, t))
            count -= 1
    return _merge(found)


def check(
    *,
    backend: str,
    kind: str,
    seed: int,
    seconds: float,
    ttl: float,
    nodes: int,
    started: float,
    stopping: float,
    events: list[dict[str, Any]],
    writes: list[Write],
    faults: list[Any],
    data_loss: set[str],
    leftover: dict[int, dict[str, int]],
    harness_errors: list[str],
    waiter_lease: float,
    lost_replies: int = 0,
    limit: int = 1,
    database: Any = None,
    socket_timeout: float = 0.0,
    killed_at_stop: dict[str, float] | None = None,
    roundtrips: dict[str, Any] | None = None,
    harness_stalls: list[dict[str, Any]] | None = None,
) -> Report:
    events = sorted(events, key=lambda e: e["t"])
    stalls = Stalls([*events, *(harness_stalls or [])])
    blocks = Blocks(events)
    # The harness late at all (its own CPU too: the proxies' threads) delays every reply.
    proxies = Stalls(
        {**ev, "idle": ev["late"]}
        for ev in [*events, *(harness_stalls or [])]
        if ev["e"] == "stall" and ev["c"] == "harness"
    )
    holds = _holds(events)
    granted = sorted((h for h in holds.values() if h.outcome == "ok"), key=lambda h: h.end or 0)
    violations: list[Violation] = []

    def violate(prop: str, t: float, message: str, *clients: str) -> None:
        violations.append(Violation(prop, t, message, set(clients)))

    applied = [f for f in faults if f.started is not None]
    steps = clock_steps(applied)
    # A counter written while a clock ran ahead keeps fences ahead of the clock after the
    # step back, until it is lost: a restart that empties the server after a step is a step
    # for fences (the documented case: the clock went back and the counter was lost).
    epochs = sorted(
        steps
        + [f.started for f in applied if f.kind in data_loss and steps and f.started > steps[0]]
    )

    # -- safety: fences --------------------------------------------------------------------
    by_fence: dict[int, list[Hold]] = defaultdict(list)
    for h in granted:
        if h.fence is not None:
            by_fence[h.fence].append(h)
    for fence, same in sorted(by_fence.items()):
        if len(same) > 1:
            violate(
                "fence-granted-twice",
                same[1].end or 0,
                f"fence {fence} was granted to {len(same)} holds: "
                + ", ".join(f"{h.label()} at {h.end:.3f}" for h in same),
                *(h.client for h in same),
            )
    # fence-behind: for each hold B, the highest fence granted (acquire returned) before B's
    # acquire began must be below B's fence.
    # Across a clock step of a server the comparison starts afresh (see clock_epoch): B is
    # compared with the holds that began in the epoch B's acquire ended in.
    # A retry is judged from its object's first try: it may have found that try's grant.
    by_start = sorted((h for h in granted if h.fence is not None), key=lambda h: h.began)
    i, best_in = 0, dict[int, Hold]()
    for b in by_start:
        while i < len(granted) and (granted[i].end or 0) < b.began - 0.001:
            a = granted[i]
            epoch = clock_epoch(epochs, a.start)
            leader = best_in.get(epoch)
            # A step logged within its slack after A's acquire began may have come before or
            # after the grant (its line is written once done): A leads neither epoch.
            sure = epoch == clock_epoch(epochs, a.start - 0.05) == clock_epoch(epochs, a.end or 0)
            if sure and a.fence is not None and (leader is None or a.fence > (leader.fence or 0)):
                best_in[epoch] = a
            i += 1
        best = best_in.get(clock_epoch(epochs, b.end or b.start))
        if best is not None and b.fence is not None and b.fence <= (best.fence or 0):
            violate(
                "fence-behind",
                b.end or b.start,
                f"{b.label()} began acquiring at {b.began:.3f}, after {best.label()} had been"
                f" granted at {best.end:.3f}, yet got a fence not above it",
                b.client,
                best.client,
            )

    # -- safety: the resource --------------------------------------------------------------
    # A clock step expires holds early (forward) or gives fences below earlier ones (back,
    # with the counter lost): for what Redis says, as data loss does.
    loss_times = sorted([f.started for f in applied if f.kind in data_loss] + steps)
    top, top_x = -1, -1
    spans: dict[tuple[str, int], list[int]] = {}
    for w in writes:
        if not w.accepted:
            continue
        if w.role == "s":
            if w.expiry < 0 or w.t * 1000 >= w.expiry:
                violate("stale-fence-accepted", w.t, f"resource write #{w.seq} of permit"
                        f" fence {w.fence} accepted at {w.t:.3f}, not before its expiry"
                        f" {w.expiry / 1000:.3f}", w.client)  # fmt: skip
        elif w.fence <= top_x if w.role == "r" else w.fence < top:
            violate("stale-fence-accepted", w.t, f"resource write #{w.seq} fence {w.fence}"
                    f" ({'read' if w.role == 'r' else 'exclusive'}) accepted after fence"
                    f" {top_x if w.role == 'r' else top}", w.client)  # fmt: skip
        if w.role != "s":
            top = max(top, w.fence)
        if w.role == "x":
            top_x = max(top_x, w.fence)
        span = spans.setdefault((w.client, w.hold), [w.seq, w.seq])
        span[1] = w.seq
    # Sections in the resource's order: an exclusive one overlaps no other, a read none
    # exclusive, and at most `limit` permits' sections overlap.
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    active: list[tuple[tuple[str, int], list[int]]] = []
    for key, (first, last) in ordered:
        active = [(k, span) for k, span in active if span[1] > first]
        role = writes[first].role
        if role == "s":
            clash = [k for k, _ in active] if len(active) + 1 > limit else []
            # A permit's expiry read just before a lock server restarted empty may let one
            # more write in (the restart dropped the lease, and a new permit was granted).
            w = writes[first]
            lo = bisect.bisect_left(loss_times, w.t - ttl)
            if lo < len(loss_times) and loss_times[lo] <= w.t:
                clash = []
        elif role == "r":
            clash = [k for k, _ in active if writes[spans[k][0]].role == "x"]
        else:
            clash = [k for k, _ in active]
        if clash:
            w1 = writes[first]
            inside = ", ".join(
                f"{c}/h{h} (fence {writes[spans[(c, h)][0]].fence},"
                f" writes #{spans[(c, h)][0]}..#{spans[(c, h)][1]})"
                for c, h in clash
            )
            violate(
                "overlap-accepted",
                w1.t,
                f"the resource accepted {key[0]}/h{key[1]} ({_ROLES[role]}, fence {w1.fence},"
                f" write #{first}) inside the section"
                f"{'s' if len(clash) > 1 else ''} of {inside}"
                + (f" (limit {limit})" if role == "s" else ""),
                key[0],
                *(c for c, _ in clash),
            )
        active.append((key, [first, last]))

    # -- safety: what the servers say ------------------------------------------------------
    paused: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for f in applied:
        if f.kind == "client_pause" and f.client:
            paused[f.client].append((f.started, f.healed or stopping))
    # The wire move (moves.py): a request or reply of the client's held back on its own wire
    # is a fault of its calls then (a call's error, its time, a waiter's try, a renewal
    # caught by it), not a pause: nothing about safety is excused by it.
    wired: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        if ev["e"] == "wire":
            wired[ev["c"]].append((ev["t0"], ev["t1"] + 0.05))
    for ev in events:
        e = ev["e"]
        if e == "bad":
            violate("bad", ev["t"], f"{ev['c']}/h{ev['h']}: {ev['what']}", ev["c"])
        elif e == "nest" and ev["ok"]:
            hold = holds.get((ev["c"], ev["h"]))
            if hold is not None and ev["fence"] != hold.fence:
                violate("reentry-fence", ev["t"], f"{hold.label()} re-entered with fence"
                        f" {ev['fence']}", ev["c"])  # fmt: skip
        elif e == "check":
            hold = holds.get((ev["c"], ev["h"]))
            if hold is None:
                continue
            found, when = ev["found"], ev["when"]
            seen = ev.get("leases") or ""  # every live lease's mode, read at once
            if kind == "semaphore" and seen.count("s") > limit:
                violate("over-limit-held", ev["t0"], f"the servers held {seen.count('s')}"
                        f" permits at once (limit {limit}) at {ev['t0']:.3f}..{ev['t1']:.3f}",
                        ev["c"])  # fmt: skip
            elif "w" in seen and len(seen) > 1:
                violate("writer-not-alone", ev["t0"], f"the servers held a write lease beside"
                        f" others (modes {seen}) at {ev['t0']:.3f}..{ev['t1']:.3f}",
                        ev["c"])  # fmt: skip
            if when == "acquired" and found is False:
                # Every key the acquire set lives for a TTL from when it was set: at most the
                # node timeout plus proxy latency before acquire returned. Data loss, or this
                # client paused in between, excuse a miss.
                quick = ev["t1"] - (hold.end or ev["t0"]) <= ttl * 0.5
                lo = bisect.bisect_left(loss_times, hold.start - 0.05)
                lossy = lo < len(loss_times) and loss_times[lo] <= ev["t1"]
                stopped = any(a < ev["t1"] and hold.start < b for a, b in paused[ev["c"]])
                # Its loop blocked within the acquire: granted, then its task did not run, as a
                # paused process (semaphore seed 14: granted 1.07 s before acquire returned).
                stopped = stopped or blocks.overlap(ev["c"], hold.start, ev["t1"]) > 0
                if quick and not lossy and not stopped:
                    violate(
                        "phantom-hold",
                        ev["t0"],
                        f"{hold.label()}: acquire returned True at {hold.end:.3f}, but the"
                        f" servers did not hold it at {ev['t0']:.3f}..{ev['t1']:.3f}",
                        ev["c"],
                    )
            elif when == "lost" and found is True:
                violate(
                    "lost-but-held",
                    ev["t0"],
                    f"{hold.label()} was reported lost, yet the servers still held it at"
                    f" {ev['t0']:.3f}..{ev['t1']:.3f} (unknown is not lost)",
                    ev["c"],
                )
            elif when in ("owned_false", "locked_false") and found is True:
                violate(
                    "false-but-held",
                    ev["t0"],
                    f"{hold.label()}: {when.split('_')[0]}() answered False while holding, yet"
                    f" the servers still held it at {ev['t0']:.3f}..{ev['t1']:.3f} (nodes"
                    f" {ev.get('nodes')}): an unknown answered as no",
                    ev["c"],
                )
            elif when == "released" and found is True:
                violate(
                    "released-but-held",
                    ev["t0"],
                    f"{hold.label()}: release() returned at {hold.released or 0:.3f}, yet the"
                    f" servers still held it at {ev['t0']:.3f}..{ev['t1']:.3f}",
                    ev["c"],
                )
    # release-reported-lost / release-hid-loss: what release() said against what the servers
    # held just before it (the "releasing" check, read straight from them).
    releasing: dict[tuple[str, int], dict[str, Any]] = {}
    for ev in events:
        key = (ev["c"], ev.get("h", -1))
        if ev["e"] == "check" and ev["when"] == "releasing":
            releasing[key] = ev
            continue
        before = releasing.get(key)
        if before is None or ev["e"] not in ("rel_ok", "rel_err") or ev.get("attempt"):
            continue  # a second try may well find its own first try's work done
        lo = bisect.bisect_left(loss_times, before["t0"] - 0.05)
        if lo < len(loss_times) and loss_times[lo] <= ev["t"]:
            continue
        hold = holds[key]
        if ev["e"] == "rel_err" and ev["err"] in ("LockLost", "LockNotOwned"):
            alive_until = before["t0"] + before.get("left", -1) / 1000 - 0.05
            if before["found"] is True and ev["t"] < alive_until:
                violate(
                    "release-reported-lost",
                    ev["t"],
                    f"{hold.label()}: release() raised {ev['err']} at {ev['t']:.3f}, but the"
                    f" servers held it (nodes {before['nodes']}) at {before['t0']:.3f} for"
                    f" {before.get('left')} ms more",
                    ev["c"],
                )
        elif ev["e"] == "rel_ok" and before["found"] is False:
            violate(
                "release-hid-loss",
                ev["t"],
                f"{hold.label()}: release() returned at {ev['t']:.3f}, but the hold was already"
                f" gone at {before['t0']:.3f} (nodes {before['nodes']}): a loss went unreported",
                ev["c"],
            )
    for f in applied:
        if not f.kind.startswith("majority_"):
            continue
        # Surely down until the heal began (a loaded nemesis records "healed" late, after
        # grants the healed nodes gave); a black hole ends by itself once its duration is
        # over (the proxy's own clock), maybe before the nemesis even woke to heal it.
        down_until = f.healing or f.healed or stopping
        if f.kind.endswith("black_hole") and f.duration:
            down_until = min(down_until, f.started + f.duration)
        for h in granted:
            if h.start >= f.started + 0.05 and (h.end or 0) <= down_until:
                violate(
                    "granted-without-majority",
                    h.end or 0,
                    f"{h.label()} was granted at {h.end:.3f} while nodes {f.target} were"
                    f" down ({f.kind} {f.started:.3f}..{f.healed:.3f})",
                    h.client,
                )
    for ev in events:
        if ev["e"] == "crash":
            violate("client-crash", ev["t"], f"{ev['c']} died of an exception:\n{ev['tb']}",
                    ev["c"])  # fmt: skip

    # -- held by nobody: a hold a move touched, once let go (moves.py) ----------------------
    node_faults = [f for f in applied if isinstance(f.target, tuple)
                   and all(isinstance(i, int) for i in f.target)]  # fmt: skip
    looks = Counter[str]()
    for ev in events:
        if ev["e"] != "check" or ev["when"] != "nobody":
            continue
        verdict = held_by_nobody(ev, holds, node_faults, nodes, stopping, paused, stalls, blocks)
        looks[verdict] += 1
        if verdict == "held-by-nobody":
            violate(
                "held-by-nobody",
                ev["t0"],
                f"{ev['c']}/h{ev['h']} (token prefix {ev['prefix']!r}): its name was held by its"
                f" token at {ev['t0']:.3f}..{ev['t1']:.3f} (nodes {ev['nodes']}),"
                f" {ev['t0'] - ev['after']:.3f} s after the client let it go ({ev['how']}"
                f"{', ' + ev['teardown'] if ev.get('teardown') else ''}) and every request of"
                f" it went through{_wire_note(ev)}, on servers that answered throughout: held"
                " by nobody",
                ev["c"],
            )

    # -- liveness, in quiet time -----------------------------------------------------------
    # A fair waiter that died or froze keeps its place at the head of the queue until its
    # deadline there: its acquire's deadline, or the waiter lease, whichever is first.
    waits: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for h in holds.values():
        if h.mode == "block":
            end = h.end if h.end is not None else float("inf")
            waits[h.client].append((h.start, end, h.start + (h.timeout or float("inf"))))
    disturbed = []
    for f in applied:
        until = (f.healed or stopping) + ttl + 0.5
        if f.kind.startswith("client_") and waiter_lease:
            for since, until_end, deadline in waits.get(f.client, []):
                if since <= f.started <= until_end:
                    until = max(until, min(f.started + waiter_lease, deadline) + 0.5)
        elif nodes > 1:
            until += BREAKER + (2 * ttl if f.kind in data_loss else 0.0)
        until += clock_delay(f, ttl)
        disturbed.append((f.started - 0.05, until))
    disturbed.append((stopping - 0.05, float("inf")))
    disturbed = _merge(disturbed)
    quiet_seconds = max(0.0, stopping - started) - sum(
        min(b, stopping) - max(a, started) for a, b in disturbed if a < stopping
    )

    def quiet(a: float, b: float) -> bool:
        return a >= started and not any(s < b and a < e for s, e in disturbed)

    # When the name was not free for a waiter of each role: any hold (a lock, a write lock);
    # at least `limit` holds (a semaphore's permits); a write held or waited for (a read:
    # a waiting writer's lease keeps new readers out).
    spans_of: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for h in holds.values():
        if h.outcome == "ok":
            ends = [t for t in (h.released, h.lost) if t is not None]
            if not ends:
                ends = [(h.release_error or h.last_seen) + ttl]
            spans_of[h.role].append((h.start, min(ends)))
        elif h.outcome == "err" or h.outcome is None:
            # It may have left a hold behind (when its held-back request went through, too).
            spans_of[h.role].append((h.start, max(h.end or h.last_seen, h.landed) + ttl))
        if h.role == "x" and h.mode == "block" and kind == "write":
            # A waiting writer (its lease runs out at its acquire's deadline at the latest).
            deadline = h.start + (h.timeout or 0.0)
            spans_of["w"].append((h.start, min(deadline, h.end or deadline)))
    every = [span for role, spans in spans_of.items() if role != "w" for span in spans]
    busy_for = {
        "x": _merge(every),
        "r": _merge([*spans_of["x"], *spans_of["w"]]),
        "s": _at_least(spans_of["s"], limit),
    }
    quiet_waits = 0
    for h in holds.values():
        if h.outcome != "no" or h.mode != "block" or not h.timeout or h.end is None:
            continue
        if not quiet(h.start, h.end):
            continue
        quiet_waits += 1
        wait_from, wait_to = h.start + 0.05, h.end - 0.05
        free_from, gap = wait_from, 0.0
        for since, until in busy_for[h.role]:
            if until <= wait_from or since >= wait_to:
                continue
            if since > free_from:
                gap = max(gap, since - free_from)
            free_from = max(free_from, until)
        gap = max(gap, wait_to - free_from)
        # A loop blocked meanwhile could not take it (the woken waiter ran late), nor a try
        # held back on the wire.
        held_back = sum(max(0.0, min(h.end, b) - max(h.start, a)) for a, b in wired[h.client])
        if gap > ttl + 0.5 + blocks.overlap(h.client, h.start, h.end) + held_back:
            violate(
                "waiter-starved",
                h.end,
                f"{h.client}/h{h.hold} waited {h.timeout:g} s ({h.start:.3f}..{h.end:.3f}) and"
                f" timed out, though no known hold covered {gap:.2f} s of that wait, in quiet"
                " time",
                h.client,
            )
    errors = sorted(
        (h for h in holds.values() if h.outcome in ("ok", "err") and h.end is not None),
        key=lambda h: h.end or 0,
    )
    streak: list[Hold] = []
    for one in [*errors, None]:
        if one is not None and one.outcome == "err" and quiet(one.start, one.end or one.start):
            streak.append(one)
            continue
        if len(streak) >= 3 and (streak[-1].end or 0) - streak[0].start >= 2.5:
            violate(
                "quiet-outage",
                streak[0].start,
                f"{len(streak)} acquires failed ({', '.join(sorted({s.error for s in streak}))})"
                f" over {streak[0].start:.3f}..{streak[-1].end:.3f} with every server up and"
                " no fault for a while",
                *{s.client for s in streak},
            )
        streak = []
    if leftover:
        listing = "; ".join(
            f"node{i}: " + ", ".join(f"{k} (pttl {v})" for k, v in sorted(keys.items()))
            for i, keys in sorted(leftover.items())
        )
        violate("keys-leaked", stopping, f"keys left after every client stopped: {listing}")

    # -- time: errors, hand-offs, holds on servers that answered, round trips ----------------
    timing = Timing(
        backend=backend, kind=kind, ttl=ttl, nodes=nodes, holds=holds, events=events,
        applied=applied, quiet=quiet, stopping=stopping,
        paused={c: [*paused.get(c, []), *wired.get(c, [])] for c in {*paused, *wired}},
        socket_timeout=socket_timeout, data_loss=data_loss, stalls=stalls, blocks=blocks,
        proxies=proxies,
    )  # fmt: skip
    for prop, t, message, clients in timing.judge(killed_at_stop or {}, roundtrips):
        violate(prop, t, message, *clients)

    # -- the database resource (kind "database"): its committed history ----------------------
    if database is not None:
        from .database import judge

        found, database_stats = judge(database, events)
        for prop, t, message, clients in found:
            violate(prop, t, message, *clients)

    # -- the report ------------------------------------------------------------------------
    counts = Counter(ev["e"] for ev in events)
    stats = {
        "acquires": counts["acq"],
        "acq_ok": counts["acq_ok"],
        "acq_no": counts["acq_no"],
        "acq_err": counts["acq_err"],
        "releases": counts["rel_ok"] + counts["rel_err"],
        "rel_err": counts["rel_err"],
        "writes": len(writes),
        "rejected": sum(1 for w in writes if not w.accepted),
        "lost": counts["lost"],
        "checks": counts["check"],
        "lost_replies": lost_replies,
        "clients": counts["start"],
        "quiet_waits": quiet_waits,
        "quiet_seconds": quiet_seconds,
        "errors": Counter(h.error for h in holds.values() if h.error),
        "interrupts": counts["intr"],
        "loop_blocks": counts["loop_block"],
        "moves": {
            "wire": counts["wire"],
            "teardown": counts["teardown"],
            "retry": sum(1 for ev in events if ev["e"] == "acq" and "retry_of" in ev),
            "looks": looks,
        },
        "stalls": stalls,  # described when the report is printed (throughput counts too)
        **timing.stats,
    }
    if database is not None:
        stats["database"] = database_stats
    report = Report(
        backend, kind, seed, seconds, stats, Counter(f.kind for f in applied), violations,
        list(harness_errors), [],
    )  # fmt: skip
    shown: Counter[str] = Counter()
    for v in sorted(violations, key=lambda v: v.t):
        shown[v.prop] += 1
        if shown[v.prop] <= 2:
            report.histories.append(_history(v, started, events, writes, applied))
    hidden = sum(n - 2 for n in shown.values() if n > 2)
    if hidden:
        report.histories.append(f"({hidden} more violations of the same properties not shown)")
    return report


# -- clock faults (nemesis.CLOCK): kept apart from the rest ---------------------------------------


def clock_steps(applied: list[Any]) -> list[float]:
    """When a server's clock stepped: a clock fault's start and its heal."""
    found = []
    for f in applied:
        if f.kind.startswith("clock_"):
            found += [t for t in (f.started, f.healed) if t is not None]
    return sorted(found)


def clock_epoch(steps: list[float], t: float) -> int:
    """How many clock steps came before ``t`` (slack for the step's own time). A hold that
    began after a step may get a fence below one granted before it (the counter lost, the
    clock behind): fence-behind compares holds of one epoch only; the fenced resource, not
    Redis, keeps the order across steps (the database kind's checker)."""
    return bisect.bisect_right(steps, t + 0.05)


def clock_delay(fault: Any, ttl: float) -> float:
    """How much longer than its TTL a key may live after a clock fault: the step (a key set
    before a step back lives that much longer)."""
    return float(fault.arg) + ttl if fault.kind.startswith("clock_") else 0.0


def _history(
    v: Violation,
    origin: float,
    events: list[dict[str, Any]],
    writes: list[Write],
    faults: list[Any],
) -> str:
    """The history around a violation (times in seconds from the run's start): the events of
    the clients involved from 2.5 s before to 1 s after, other clients' holds and the
    resource's writes from 1 s before, and every fault. An acquire is one line, at its end."""
    lo, hi = v.t - 2.5, v.t + 1.0
    starts = {(ev["c"], ev["h"]): ev for ev in events if ev["e"] == "acq"}
    lines: list[tuple[float, str]] = []
    for ev in events:
        t, c, e = ev["t"], ev["c"], ev["e"]
        if not lo <= t <= hi or e == "acq":
            continue
        if c not in v.clients and (t < v.t - 1.0 or e in ("acq_no", "acq_err", "check")):
            continue
        rest = " ".join(
            f"{k}={ev[k]}" for k in ev if k not in ("t", "c", "e", "h", "msg", "t0", "t1", "tb")
        )
        if e.startswith("acq_"):
            begun = starts.get((c, ev["h"]))
            if begun is not None:
                rest += (
                    f" ({begun['mode']} {begun['timeout'] or ''} from {begun['t'] - origin:.3f})"
                )
            if e == "acq_err":
                rest += " " + ev.get("msg", "")[:120]
        if e == "loop_block":
            rest += f" blocked {ev['t0'] - origin:.3f}..{ev['t1'] - origin:.3f}"
        lines.append((t, f"{c:>4} h{ev.get('h', ''):<4} {e:<8} {rest}"))
    for w in writes:
        if v.t - 1.0 <= w.t <= hi:
            verdict = "accepted" if w.accepted else "REJECTED"
            lines.append((w.t, f" res #{w.seq} {w.client}/h{w.hold} fence {w.fence} {w.phase}"
                               f" {verdict} (last {w.last})"))  # fmt: skip
    for f in faults:
        if f.started is not None and lo - 3 <= f.started <= hi:
            lines.append((f.started, f"  !! {f.describe()}"))
        if f.healed is not None and lo <= f.healed <= hi and f.duration:
            lines.append((f.healed, f"  !! healed {f.kind} target={f.target}"))
    lines.sort(key=lambda x: x[0])
    if len(lines) > 90:
        near = sorted(lines, key=lambda x: abs(x[0] - v.t))[:90]
        lines = sorted(near, key=lambda x: x[0])
    body = "\n".join(f"  {t - origin:8.3f}  {text}" for t, text in lines)
    return f"VIOLATION {v.prop} at {v.t - origin:.3f} s: {v.message}\n{body}"


# -- time (issue #43): error latency, hand-off, holds on servers that answered, round trips ------

#: A node fault that makes the server not answer at all (the others delay or cut messages).
SILENT = {"server_pause", "majority_pause", "clog", "black_hole", "majority_black_hole", "busy",
          "server_down"}  # fmt: skip
#: The events of a call that may raise (acquire, release, owned() / locked(), extend()).
CALLS = {"acq_err", "rel_err", "ask", "ext_err"}
#: Slack for a shared, loaded machine on top of each bound.
SLACK = 0.1
#: A free lock is taken by a live waiter within this long (plain locks, quiet time).
HANDOFF = 0.5
#: unavailable-on-healthy: without a blocked loop, an error this long after its call began
#: may be a server the machine starved (judged only beside a blocked loop then).
STARVED_AFTER = 0.1

#: unavailable-on-healthy looks this far back before a call for faults on its servers (a
#: connection a fault cut, a late heal); Redlock adds BREAKER (a node that failed is skipped
#: that long) and, after a restart empty, the restart guard (2 TTLs: it votes no).
UNAVAILABLE_BEFORE = 0.5
#: A healthy Redlock: script calls per node per acquire and release (one round trip each).
ROUND_TRIPS = 2.0


class Timing:
    """The properties about time, judged from the history:

    * ``error-latency``: a ``BackendUnavailable`` came more than 1.5 socket timeouts (plus
      SLACK) after its call began or after the fault that silenced the server began,
      whichever is later (a blocking acquire: only when the server was silent from before
      the call to its error: a waiter asleep when the fault began learns of it at its next
      try; on Redlock, enough nodes to deny a quorum); ``call-hung``: a client still inside
      a call (its last event an acquire's start) when the run ended, past the call's
      timeout plus 1.5 socket timeouts;
    * ``handoff-slow``: in quiet time, a plain lock released (``rel_ok``) while another
      client's blocking acquire waited, and nobody took it within HANDOFF s (plus SLACK);
    * ``lost-on-healthy``: a hold reported lost (``lock_lost``) though its servers answered
      throughout (no fault on them, or on one Redlock node at most, from a TTL before its
      acquire to the loss; its client not paused or interrupted meanwhile). On Redlock the
      faulted node must leave a majority of the nodes the hold was on at its acquire (the
      check right after it): a hold granted by a bare majority has no node to spare. A loss
      found by a release whose loop was blocked after it began, or within a TTL of an
      acquire whose loop was blocked, is excused, as a pause;
    * ``unavailable-on-healthy``: a call (acquire, release, ``owned()`` / ``locked()``,
      ``extend()``) raised ``BackendUnavailable`` or ``QuorumNotReached`` though its servers
      answered throughout: no fault on them (on Redlock: on fewer than a majority of the
      nodes, and a majority of the nodes its hold was placed on left) from UNAVAILABLE_BEFORE
      before the call (a call on a hold: before its acquire) to the error, its process
      neither paused nor stalled (the probe's idle; the harness late at all: its proxies carry
      the replies) nor interrupted meanwhile; a connect past its timeout with the loop not
      blocked is a loaded machine's, not judged. Its loop blocked (``loop_block``) is no
      excuse: the loop's busyness is not counted against the server (docs/topics/asyncio.md);
    * ``round-trips``: on a quiet, healthy Redlock (its nodes' clocks skewed a few ms), a node
      served more than ROUND_TRIPS script calls per acquire and release (roundtrips.py).

    A bound on a duration (error-latency, handoff-slow) is measured against the duration
    less the scheduling stalls (stall.py) of the process that had to act meanwhile: the
    caller's own for an error, the waiters' (the least stalled of them) and the harness's
    (its proxies carry every reply) for a hand-off. Nothing else is excused by a stall. An
    asyncio client's loop blocked by sync code (``loop_block``) is discounted alike from its
    own durations: its calls could not return, nor its waiter take, meanwhile.
    """

    def __init__(
        self, *, backend: str, kind: str, ttl: float, nodes: int, holds: dict[Any, Hold],
        events: list[dict[str, Any]], applied: list[Any], paused: dict[str, Any],
        quiet: Any, stopping: float, socket_timeout: float, data_loss: set[str],
        stalls: Stalls | None = None, blocks: Blocks | None = None,
        proxies: Stalls | None = None,
    ) -> None:  # fmt: skip
        self.backend, self.kind, self.ttl, self.nodes = backend, kind, ttl, nodes
        self.holds, self.events, self.applied, self.paused = holds, events, applied, paused
        self.quiet, self.stopping, self.socket_timeout = quiet, stopping, socket_timeout
        self.data_loss = data_loss
        self.stalls = stalls if stalls is not None else Stalls(events)
        self.blocks = blocks if blocks is not None else Blocks(events)
        self.proxies = proxies if proxies is not None else Stalls([])
        self.stats: dict[str, Any] = {}
        self.found: list[tuple[str, float, str, set[str]]] = []
        self.node_faults = [
            f for f in self.applied
            if isinstance(f.target, tuple) and all(isinstance(i, int) for i in f.target)
        ]  # fmt: skip
        self.interrupted: dict[str, list[float]] = defaultdict(list)
        for ev in self.events:
            if ev["e"] == "intr":
                self.interrupted[ev["c"]].append(ev["t"])
        for f in self.applied:
            if f.kind == "client_interrupt" and f.client:
                self.interrupted[f.client].append(f.started)

    def judge(
        self, killed: dict[str, float], roundtrips: dict[str, Any] | None
    ) -> list[tuple[str, float, str, set[str]]]:
        if self.socket_timeout:
            self.error_latency()
            self.hung(killed)
        if self.kind in ("plain", "reentrant"):
            self.handoff()
        if self.kind != "database":
            self.lost_on_healthy()
            self.unavailable_on_healthy()
        if roundtrips is not None:
            self.round_trips(roundtrips)
        return self.found

    def _paused(self, client: str, a: float, b: float) -> bool:
        return any(s < b and a < e for s, e in self.paused.get(client, []))

    def _silent(self, t: float) -> list[Any]:
        return [
            f
            for f in self.node_faults
            if f.kind in SILENT and f.started <= t <= (f.healed or self.stopping)
        ]

    def error_latency(self) -> None:
        bound = 1.5 * self.socket_timeout + SLACK
        judged, slowest = 0, 0.0
        for ev in self.events:
            if ev.get("err") != "BackendUnavailable":
                continue
            t, client = ev["t"], ev["c"]
            hold = self.holds.get((client, ev.get("h", -1)))
            if ev["e"] == "acq_err" and hold is not None:
                since = hold.start
                if hold.mode == "block":  # silent from before the call to its error
                    before = {id(f) for f in self._silent(since)}
                    through = [f for f in self._silent(t) if id(f) in before]
                    # ... enough of them to deny a quorum: else the silence that ended the
                    # wait began within it, at a moment the history does not say.
                    if len({i for f in through for i in f.target}) < self.nodes - self.nodes // 2:
                        continue
            elif "since" in ev:
                since = ev["since"]
            else:
                continue
            if self._paused(client, since - 0.05, t):
                continue
            began = [f.started for f in self.node_faults if f.started <= t]
            ref = max([since, *[b for b in began if b >= since]])
            judged += 1
            stalled = self.stalls.overlap(client, ref, t) + self.blocks.overlap(client, ref, t)
            took = t - ref - stalled
            self.stalls.count(
                stalled > 0, took <= bound < t - ref,
                f"error-latency {client}/h{ev.get('h')}: {t - ref:.3f} s less {stalled:.3f} s",
            )  # fmt: skip
            slowest = max(slowest, took)
            if took > bound:
                what = "after its call began" if ref == since else "after a fault began"
                self.found.append(
                    (
                        "error-latency",
                        t,
                        f"{client}/h{ev.get('h')}: {ev['e']}"
                        f" BackendUnavailable {took:.3f} s {what} (call from"
                        f" {since:.3f}; {t - ref:.3f} s less {stalled:.3f} s its process"
                        f" stalled), over 1.5 socket timeouts ({self.socket_timeout:g} s)"
                        f" + {SLACK:g}",
                        {client},
                    )
                )
        self.stats["unavailable"] = judged
        self.stats["slowest_error"] = slowest

    def hung(self, killed: dict[str, float]) -> None:
        last: dict[str, dict[str, Any]] = {}
        for ev in self.events:
            if ev["e"] != "stall":
                last[ev["c"]] = ev
        for client, when in killed.items():
            ev = last.get(client) or {}
            if ev.get("e") != "acq":
                continue
            limit = ev["t"] + (ev.get("timeout") or 0.0) + 1.5 * self.socket_timeout + 1.0
            limit += self.blocks.overlap(client, ev["t"], when)
            if when > limit and not self._paused(client, ev["t"], when):
                self.found.append(
                    (
                        "call-hung",
                        when,
                        f"{client}/h{ev['h']}: an acquire"
                        f" ({ev['mode']} {ev.get('timeout')}) began at {ev['t']:.3f}"
                        f" and had not returned when the client was killed at"
                        f" {when:.3f}",
                        {client},
                    )
                )

    def handoff(self) -> None:
        limit = HANDOFF + SLACK
        takes = sorted(granted_at(h) for h in self.holds.values() if h.outcome == "ok" and h.end)
        unknown = [h for h in self.holds.values() if h.outcome not in ("ok", "no")]
        judged, slowest = 0, 0.0
        for ev in self.events:
            if ev["e"] != "rel_ok":
                continue
            t = ev["t"]
            if not self.quiet(t - 0.05 - self.ttl, t + limit):
                continue
            waiters = [
                h
                for h in self.holds.values()
                if h.mode == "block"
                and h.client != ev["c"]
                and h.start <= t - 0.05
                and h.start + (h.timeout or 0) >= t + limit + 0.1
                and (h.end is None or h.end >= t)
                and not self._paused(h.client, h.start, t + limit)
                and not any(
                    h.start - 0.05 <= i <= t + limit for i in self.interrupted.get(h.client, [])
                )
            ]
            if not waiters:
                continue
            # An acquire that raised or was cut short may have taken it (unknown): unjudged.
            # (Its request held back on the wire may take it when it goes through: seed 2401.)
            if any(
                h.start < t + limit and max(h.end or h.last_seen, h.landed) > t for h in unknown
            ):
                continue
            # A take logged before the release's own rel_ok (the release call had returned
            # on the server): from the release call's start.
            i = bisect.bisect_left(takes, ev.get("since", t))
            taken = takes[i] if i < len(takes) else float("inf")
            judged += 1
            # A live waiter takes it: the least stalled one (or the harness's proxies) says
            # how long the machine held them all back.
            until = min(taken, t + 9.9)
            stalled = max(
                min(
                    self.stalls.overlap(h.client, t, until)
                    + self.blocks.overlap(h.client, t, until)
                    for h in waiters
                ),
                self.stalls.overlap("harness", t, until),
            )
            took = taken - t - stalled
            self.stalls.count(
                stalled > 0, took <= limit < taken - t,
                f"handoff-slow {ev['c']}/h{ev['h']}: {taken - t:.3f} s less {stalled:.3f} s",
            )  # fmt: skip
            slowest = max(slowest, min(took, 9.9))
            if took > limit:
                w = waiters[0]
                self.found.append(
                    (
                        "handoff-slow",
                        t,
                        f"{ev['c']}/h{ev['h']} released at"
                        f" {t:.3f} while {w.client}/h{w.hold} waited (since"
                        f" {w.start:.3f}, timeout {w.timeout:g} s); nobody took the"
                        f" lock for {taken - t:.3f} s (less {stalled:.3f} s stalled; bound"
                        f" {HANDOFF:g} s), in quiet time",
                        {ev["c"], w.client},
                    )
                )
        self.stats["handoffs"] = judged
        self.stats["slowest_handoff"] = slowest

    def lost_on_healthy(self) -> None:
        held = {(ev["c"], ev["h"]) for ev in self.events  # lost-but-held says it already
                if ev["e"] == "check" and ev["when"] == "lost" and ev["found"] is True}  # fmt: skip
        # Where each hold was at its acquire (the direct check right after it): a Redlock
        # hold is granted by a majority, not by every node (a node still holding its last
        # holder's key, or skipped by its breaker, refuses or is not asked), and a renewal
        # never puts a missing copy back. A node that did not answer the check ("?") counts.
        placed = {
            (ev["c"], ev["h"]): {i for i, bit in enumerate(ev["nodes"]) if bit in "1?"}
            for ev in self.events
            if ev["e"] == "check" and ev["when"] == "acquired" and ev.get("nodes")
        }
        quorum = self.nodes // 2 + 1
        releasing = {
            (ev["c"], ev["h"]): ev["t"]
            for ev in self.events
            if ev["e"] == "check" and ev["when"] == "releasing"
        }
        for h in self.holds.values():
            if h.outcome != "ok" or h.lost is None or h.end is None or h.key in held:
                continue
            # Its release begun (renewals end with it), then its loop blocked: the release's
            # task did not run, as if paused (redlock plain seed 2: blocked 2.2 s, LockLost).
            began = releasing.get(h.key)
            if (
                began is not None
                and began <= h.lost
                and self.blocks.overlap(h.client, began, h.lost)
            ):
                continue
            # Granted while its loop was blocked, lost within a TTL of the acquire's return:
            # expired before its task ran again (phantom-hold's excuse, the same).
            if self.blocks.overlap(h.client, h.start, h.end) and h.lost < h.end + self.ttl:
                continue
            a, b = h.start - self.ttl, h.lost + 0.1
            faulted = {
                i
                for f in self.node_faults
                for i in f.target
                if f.started < b and a < (f.healed or self.stopping)
            }
            if len(faulted) > (0 if self.nodes == 1 else 1):
                continue
            on = placed.get(h.key)
            if self.nodes > 1 and on is not None and len(on - faulted) < quorum:
                continue  # its own majority lost a node: what Redlock tolerates is spent
            if self._paused(h.client, a, b) or any(
                a <= i <= b for i in self.interrupted.get(h.client, [])
            ):
                continue
            self.found.append(
                (
                    "lost-on-healthy",
                    h.lost,
                    f"{h.label()} was reported lost at"
                    f" {h.lost:.3f} (held since {h.end:.3f}), though its servers"
                    f" answered throughout (faulted nodes: {sorted(faulted) or 'none'};"
                    f" placed on nodes {sorted(on) if on is not None else 'unknown'})",
                    {h.client},
                )
            )

    def unavailable_on_healthy(self) -> None:
        placed = {
            (ev["c"], ev["h"]): {i for i, bit in enumerate(ev["nodes"]) if bit in "1?"}
            for ev in self.events
            if ev["e"] == "check" and ev["when"] == "acquired" and ev.get("nodes")
        }
        quorum = self.nodes // 2 + 1
        interrupts: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for f in self.applied:
            if f.kind == "client_interrupt" and f.client:
                interrupts[f.client].append((f.started, f.healed or self.stopping))
        for client, times in self.interrupted.items():
            interrupts[client] += [(t, t) for t in times]
        errors = judged = 0
        for ev in self.events:
            if ev.get("err") not in UNKNOWN_ERRORS or ev["e"] not in CALLS:
                continue
            errors += 1
            t, client = ev["t"], ev["c"]
            hold = self.holds.get((client, ev.get("h", -1)))
            if hold is None:
                continue
            if ev["e"] == "acq_err":
                since = hold.start
            elif "since" in ev:
                since = ev["since"]
            else:
                continue
            # A call on a hold: its servers must have answered since its acquire.
            a, b = hold.start - UNAVAILABLE_BEFORE, t + 0.1
            faulted: set[int] = set()
            for f in self.node_faults:
                before = 0.0
                if self.nodes > 1:
                    before = BREAKER + (2 * self.ttl if f.kind in self.data_loss else 0.0)
                if f.started < b and a - before < (f.healed or self.stopping):
                    faulted |= set(f.target)
            if self.nodes == 1 and faulted:
                continue
            if self.nodes > 1:
                if len(faulted) >= quorum:
                    continue
                # A call on a hold: a majority of the nodes it was placed on must be left. Not
                # checked (the throughput phase's holds), it may be on a bare majority (seed 2:
                # a release beside a clogged node, 2 of 4 nodes holding it).
                on = placed.get(hold.key) if ev["e"] != "acq_err" else None
                if ev["e"] != "acq_err" and faulted and (on is None or len(on - faulted) < quorum):
                    continue
            if self._paused(client, a, b) or any(
                s <= b and a <= e for s, e in interrupts.get(client, [])
            ):
                continue
            stalled = self.stalls.overlap(client, since - 0.05, t)
            stalled += self.proxies.overlap("harness", since - 0.05, t)  # it carries the replies
            if stalled > 0:
                continue
            blocked = self.blocks.overlap(client, since, t)
            if not blocked and "connect" in ev.get("msg", "").replace("onnection", ""):
                # A connect (through a Python proxy, to a server that needs a CPU too) past the
                # socket timeout on a loaded machine: the promise kept ("Timeout connecting";
                # Redlock: "the connect did not finish in time", seed 2's throughput phase).
                # Beside a blocked loop it is the busyness the docs do not count. ("Connection
                # reset" or "closed" is no connect.)
                continue
            if not blocked and t - since >= STARVED_AFTER:
                # No loop block: a reply the server sent later than the socket timeout on a
                # loaded machine (the redis-server's own scheduling is not stall-probed; seed
                # 2204, redis write: a wait's PING unanswered within 0.3 s beside make test).
                # Judged: a call given up on before any server could have been that late (the
                # self-test's 2 ms), and any call beside a blocked loop.
                continue
            judged += 1
            self.found.append(
                (
                    "unavailable-on-healthy",
                    t,
                    f"{client}/h{ev.get('h')}: {ev['e']} {ev['err']} {t - since:.3f} s after"
                    f" its call began ({since:.3f}), though its servers answered throughout"
                    f" (faulted nodes: {sorted(faulted) or 'none'}; its loop blocked"
                    f" {blocked:.3f} s of the call): {ev.get('msg', '')}",
                    {client},
                )
            )
        self.stats["unknown_errors"], self.stats["unknown_on_healthy"] = errors, judged

    def round_trips(self, probe: dict[str, Any]) -> None:
        ops = max(1, int(probe["ops"]))
        per_op = [round(c / ops, 2) for c in probe["calls"]]
        self.stats["roundtrips"] = {"ops": probe["ops"], "per_op": per_op}
        if probe["ops"] < 10:
            self.found.append(
                (
                    "round-trips",
                    self.stopping,
                    f"the quiet probe took the lock only {probe['ops']} times of 40",
                    set(),
                )
            )
        elif max(per_op) > ROUND_TRIPS + 0.15:
            self.found.append(
                (
                    "round-trips",
                    self.stopping,
                    f"a quiet, healthy Redlock served"
                    f" {per_op} script calls per node per acquire and release"
                    f" ({ROUND_TRIPS:g} expected: one round trip each)",
                    set(),
                )
            )
