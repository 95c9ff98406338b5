"""A campaign client's moves on its own calls that outside reviewers proved defects with
(reports asy3, wai2): the request on the wire, the retry, and the judge's look afterwards.

* ``wire``: some holds go through a backend alias of their own (``wired``: the same servers,
  through a loopback proxy in the client's process, :class:`Wire`), armed before a call to
  hold back the next script call's request or its reply 0.2-1.5 s (one of them, on one node:
  a retransmission), while the caller is, half the time, interrupted (sync: the signal) or
  cancelled (asyncio) within the hold-back;
* ``retry``: an acquire that raised ``BackendUnavailable`` / ``QuorumNotReached`` is tried
  again at once on the same lock object (the caller's ordinary retry), up to twice;
* the client's loop torn down with lock calls pending is aclient.py's (``teardown``).

After a hold with any of them, :class:`Orphans` reads the servers directly once every
request of it went through and its clean-up ended, plus :data:`NOBODY_AFTER`: a name still
held by the hold's token is held by nobody (``check`` with ``when`` ``nobody``; the checker's
``held-by-nobody`` decides what the docs allow).
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from .proxy import HoldBack, Proxy

#: How long after its clean-up (and its held-back request or reply) a let-go hold may still
#: hold its name on servers that answer: a hand-back or release is one round trip (socket
#: timeouts 0.2-0.3 s), the finisher's too; under the TTL (1 s), so a hold left to its TTL is
#: seen.
NOBODY_AFTER = 0.5
#: The share of holds that go through the wire, and how long a request or reply is held.
WIRE_ODDS = 0.1
HOLD_BACK = (0.2, 1.5)
#: How often an unknown outcome is tried again at once (each time), and how often in a row.
RETRY_ODDS = 0.6
RETRIES = 2


class Wire:
    """The ``wired`` alias's proxies (one per lock server, in this process) and the draws."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.proxies = [Proxy(int(urlsplit(url).port or 0), name="wire")
                        for url in config["lock_urls"]]  # fmt: skip
        self.urls = [p.url for p in self.proxies]
        # A generator of its own: the holds' draws and the fault plan stay the seed's.
        self.rng = random.Random(int(config.get("seed") or 0) * 6151 + 3)

    def draw(self) -> bool:
        return self.rng.random() < WIRE_ODDS

    def plan(self, call: str, horizon: float) -> dict[str, Any]:
        """What the next wired call gets: the request or the reply held back, for how long,
        armed when (at its start, or anywhere within ``horizon``: a waiter's woken try), and
        whether its caller is cut within the hold-back (and when)."""
        rng = self.rng
        return {
            "call": call,
            "up": rng.random() < 0.6,
            "seconds": rng.uniform(*HOLD_BACK),
            # A release is one round trip: armed at its start.
            "at": 0.0 if rng.random() < 0.5 or call == "release" else rng.uniform(0.0, horizon),
            "node": rng.randrange(len(self.proxies)),
            "cut": rng.uniform(0.0, 1.0) if rng.random() < 0.5 else None,
        }

    def arm(
        self, plan: dict[str, Any], cut: Any, cuts: list[threading.Timer], note: Any
    ) -> HoldBack:
        """Arm one node's proxy; as it holds back, ``note(held)`` (from its thread), and
        ``cut()`` is called (from a timer) at the planned share of the hold-back, if the plan
        cuts the caller (the timer put in ``cuts``)."""

        def on_hold(held: HoldBack) -> None:
            note(held)
            if plan["cut"] is not None:
                timer = threading.Timer(plan["cut"] * held.seconds, cut)
                timer.daemon = True
                cuts.append(timer)
                timer.start()

        return self.proxies[plan["node"]].hold_back(plan["up"], plan["seconds"], on_hold)

    def disarm(self, plan: dict[str, Any], held: HoldBack) -> bool:
        return self.proxies[plan["node"]].disarm(held)


def wired_alias(alias: dict[str, Any], wire: Wire) -> dict[str, Any]:
    """The ``default`` alias's twin through ``wire``'s proxies: the same servers and keys."""
    location = wire.urls if isinstance(alias["LOCATION"], list) else wire.urls[0]
    return {**alias, "LOCATION": location}


def retries(rng: random.Random) -> int:
    """How many immediate retries an unknown outcome gets (0 to RETRIES)."""
    n = 0
    while n < RETRIES and rng.random() < RETRY_ODDS:
        n += 1
    return n


class Orphans:
    """The look after a hold the client let go (:data:`NOBODY_AFTER` after its clean-up and
    its held-back request or reply went through), from a thread of its own: the client goes
    on meanwhile (a later hold has another token prefix)."""

    def __init__(self, inspector: Any, log: Any) -> None:
        self.inspector = inspector
        self.log = log
        self.jobs: queue.Queue[tuple[float, dict[str, Any], HoldBack | None]] = queue.Queue()
        threading.Thread(target=self._run, name="orphans", daemon=True).start()

    def look(self, ended: float, fields: dict[str, Any], held: HoldBack | None = None) -> None:
        """``fields``: h, prefix, how (the object's last word: cut, teardown, released,
        refused, unknown), and what the checker needs to know of the moves."""
        self.jobs.put((ended, fields, held))

    def _run(self) -> None:
        while True:
            ended, fields, held = self.jobs.get()
            if held is not None:
                held.done.wait(HOLD_BACK[1] + 3.0)
            after = max(ended, (held.t1 or held.t0 or 0.0) if held is not None else 0.0)
            wait = after + NOBODY_AFTER - time.time()
            if wait > 0:
                time.sleep(wait)
            t0 = time.time()
            found, nodes = self.inspector.held_by(fields["prefix"])
            wire = {}
            if held is not None:
                wire = {"wire_up": held.up, "wire_t0": held.t0, "wire_t1": held.t1,
                        "wire_s": held.seconds}  # fmt: skip
            self.log("check", when="nobody", found=found, t0=t0, t1=time.time(), nodes=nodes,
                     after=after, **fields, **wire)  # fmt: skip


class Moves:
    """One hold's moves (a hold, and its retries: one lock object), on either path: the wire
    armed around its calls, the retries drawn, and the fields of the look after it
    (``ctx.look``), which the client hands to :class:`Orphans` once the hold is let go."""

    def __init__(
        self, ctx: Any, hold: int, prefix: str, role: str, horizon: float, cut: Any
    ) -> None:
        self.ctx, self.first, self.cut = ctx, hold, cut
        self.rng: random.Random = ctx.mrng
        self.wire: Wire | None = ctx.wire
        self.plan: dict[str, Any] | None = None
        self.held: HoldBack | None = None
        self.unknown = 0  # unknown outcomes in a row
        self.retries: int | None = None  # drawn at the first unknown outcome
        self.last_try = 0.0
        # A read's token is its owner's (no prefix of its own): nothing to look for.
        self.judged = bool(prefix) and role != "r"
        self.fields = {"h": hold, "prefix": prefix}
        if self.wire is not None:
            call = "acquire" if self.wire.rng.random() < 0.7 else "release"
            self.plan = self.wire.plan(call, horizon)
            self.start_look()

    def start_look(self) -> None:
        if self.judged and self.ctx.look is None:
            self.ctx.look = self.fields

    def tag(self, hold: int) -> dict[str, Any]:
        """An acquire's extra fields (a retry names its first try), as it begins."""
        self.last_try = time.time()
        tags: dict[str, Any] = {"retry_of": self.first} if hold != self.first else {}
        if self.plan is not None and hold == self.first:
            tags["wired"] = self.plan["call"]
        return tags

    @contextlib.contextmanager
    def wired(self, call: str, hold: int | None = None) -> Iterator[None]:
        """Around ``call`` (acquire or release; ``hold``: its hold number, a retry's own):
        its planned hold-back armed, at its start or at the planned moment within it;
        disarmed after it if nothing took it."""
        plan, wire = self.plan, self.wire
        if plan is None or wire is None or plan["call"] != call or self.held is not None:
            yield
            return
        cuts: list[threading.Timer] = []

        def cut() -> None:
            if not done.is_set():  # only while the call is under way
                self.cut()

        def note(held: HoldBack) -> None:  # the checker excuses the client's calls meanwhile
            self.ctx.log("wire", h=self.first if hold is None else hold, call=call, up=held.up,
                         node=plan["node"],
                         t0=held.t0, t1=(held.t0 or 0.0) + held.seconds,
                         cut=plan["cut"] is not None)  # fmt: skip

        def arm() -> None:
            if not done.is_set():
                self.held = wire.arm(plan, cut, cuts, note)

        done = threading.Event()
        timer = None
        if plan["at"]:
            timer = threading.Timer(plan["at"], arm)
            timer.daemon = True
            timer.start()
        else:
            arm()
        try:
            yield
        finally:
            done.set()
            if timer is not None:
                timer.cancel()
            for each in cuts:
                each.cancel()
            held = self.held
            if held is not None and wire.disarm(plan, held):
                self.held = None  # not taken: nothing was held back
            if self.held is not None:
                self.fields.update(wire_call=call, held=self.held)

    def retry(self, exc: BaseException) -> bool:
        """After an acquire raised: whether it is tried again at once (an unknown outcome,
        the retry move on, the draw)."""
        if type(exc).__name__ not in ("BackendUnavailable", "QuorumNotReached"):
            self.ended("error")
            return False
        self.unknown += 1
        if not self.ctx.config.get("retry"):
            self.ended("unknown")
            return False
        if self.retries is None:
            self.retries = retries(self.rng)
        if self.unknown > self.retries:
            self.ended("unknown")
            return False
        self.start_look()
        return True

    def ended(self, how: str) -> None:
        """The object's last word on the hold: refused, released, rel_err, unknown, error
        (``cut`` and ``teardown`` are the client's)."""
        self.fields.update(how=how, unknowns=self.unknown, last_try=self.last_try)
