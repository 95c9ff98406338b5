"""A campaign client: ``python -m tests.campaign.client CONFIG_JSON``.

It takes one lock again and again through the public API only, and inside every hold writes
to the fenced resource (begin, some work, end) with the hold's fence. Every event goes to
its own log file as one JSON line, written at once (a SIGKILL loses nothing already logged):

    acq      an acquire starts (mode "block" with a timeout, or "try")
    acq_ok   it returned True (fence), acq_no: False, acq_err: raised (type, message)
    check    what Redis itself says, read directly (not through the proxy): whether the hold
             is there right after the acquire, right after a loss was reported, and right
             after a release returned; found = true / false / null (could not tell)
    write    a write to the resource and its verdict
    nest     a reentrant re-entry inside the hold; rel_ok / rel_err: a release
    ask      owned() or locked() asked while holding, and the answer
    lost     the lock_lost signal
    db_*     the kind "database": a fenced transaction's start and outcome (database.py)

SIGTERM asks the client to finish its hold and exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import django
from django.conf import settings

QUORUM_OF = {1: 1, 3: 2, 5: 3}


class Log:
    def __init__(self, path: str, client_id: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.client_id = client_id
        self.mutex = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"t": time.time(), "c": self.client_id, "e": event, **fields}
        line = (json.dumps(record, default=str) + "\n").encode()
        with self.mutex:
            os.write(self.fd, line)


def setup(config: dict[str, Any]) -> None:
    # CAMPAIGN_BREAK=latency (a self-test): the client waits 2 socket timeouts, not one.
    timeout = config["socket_timeout"] * (2 if config.get("break") == "latency" else 1)
    options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if config.get("break") == "unavailable":  # a self-test: replies given up on in 2 ms
        options["socket_timeout"] = 0.002
    if config.get("tracer"):  # a small pool, which tracer.py's side threads keep busy
        options["max_connections"] = TRACED_POOL
    if config["backend"] == "redlock":
        options["restart_guard"] = config["restart_guard"]
        alias = {
            "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
            "LOCATION": config["lock_urls"],
            "OPTIONS": options,
            "TTL": config["ttl"],
        }
    else:
        alias = {
            "BACKEND": "django_redlock.backends.redis.RedisBackend",
            "LOCATION": config["lock_urls"][0],
            "OPTIONS": options,
            "TTL": config["ttl"],
        }
    from .database import database_settings

    wired = {}
    if config.get("wire"):  # the wire move (moves.py): the same servers through our proxies
        from .moves import Wire, wired_alias

        WIRE.append(Wire(config))
        wired = {"wired": wired_alias(alias, WIRE[0])}
    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DATABASES=database_settings(config),  # the kind "database" only
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},  # no incidents recorded
        DJANGO_REDLOCK_METRICS=False,
        DJANGO_REDLOCK={"default": alias, **side_alias(config), **wired},
        USE_TZ=True,
    )
    django.setup()


#: The wire move's proxies (moves.Wire), made at setup when the move is on.
WIRE: list[Any] = []


# -- a tracer, a small pool and busy callers (the "tracer" move) ------------------------------

#: The traced clients' ``max_connections``: one side thread more than it keeps it busy.
TRACED_POOL = 2


def install_tracer(config: dict[str, Any], stop: threading.Event) -> None:
    """As an APM's Redis instrumentation does (Sentry, ddtrace, OpenTelemetry): redis-py's
    ``Redis.execute_command`` wrapped (so the library's commands leave its fast path for the
    pool's: wire.bare_execute), and a trace function on every thread (``sys.settrace``,
    ``threading.settrace``; cheap: it traces no frame's lines). In bursts (0.3-1.2 s, every
    0.5-2 s: a traffic spike), three side threads call the backend back to back through the
    pool of two (``locked()`` of a name of their own, a GET), so a caller, or a watchdog
    renewal, that needs a pooled connection must queue behind them: a renewal kept waiting
    past its hold's TTL shows as ``lost-on-healthy``."""
    import redis

    from django_redlock import LockError, lock

    own = redis.Redis.execute_command

    def execute_command(self: Any, *args: Any, **options: Any) -> Any:
        return own(self, *args, **options)  # a span would open and close around this

    redis.Redis.execute_command = execute_command  # type: ignore[method-assign]

    def tracer(frame: Any, event: str, arg: Any) -> None:
        return None  # the call event only: no line tracing

    sys.settrace(tracer)
    threading.settrace(tracer)
    busy = lock(f"{config['name']}:busy")
    rush = threading.Event()  # set during a burst of callers
    rng = random.Random(config["seed"] * 31 + 7)

    def conduct() -> None:  # quiet 0.5-2 s, then a burst of callers 0.3-1.2 s long
        while not stop.is_set():
            time.sleep(rng.uniform(0.5, 2.0))
            rush.set()
            time.sleep(rng.uniform(0.3, 1.2))
            rush.clear()

    def hammer() -> None:
        while not stop.is_set():
            if not rush.wait(0.5):
                continue
            with contextlib.suppress(LockError):
                busy.locked()

    threading.Thread(target=conduct, name="busy-conductor", daemon=True).start()
    for i in range(TRACED_POOL + 1):  # one more caller than connections: they queue
        threading.Thread(target=hammer, name=f"busy-{i}", daemon=True).start()


# -- renewal faults: a second backend (the side server), extends racing the watchdog ----------

#: The side hold's TTL: a side pause (SIDE_PAUSE s at most) plus a client pause never outlast
#: it, so a side loss is a finding; the side server keeps the default socket timeout (2 s),
#: so that a paused side server is what would starve a single renewer thread.
SIDE_TTL = 10.0


def side_alias(config: dict[str, Any]) -> dict[str, Any]:
    """A second backend on the side server (no proxy), which the nemesis pauses for seconds
    (``side_pause``) while the lock servers' holds (TTL 1 s) must go on being renewed."""
    if not config.get("side_url"):
        return {}
    return {"side": {"BACKEND": "django_redlock.backends.redis.RedisBackend",
                     "LOCATION": config["side_url"], "TTL": SIDE_TTL}}  # fmt: skip


class SideHold:
    """One hold on the side server for the client's whole life, renewed by the watchdog
    beside the lock servers' holds. Its loss is a finding (``bad``): nothing may lose it."""

    def __init__(self, config: dict[str, Any], log: Any) -> None:
        from django_redlock import lock

        self.log = log
        self.lock = lock(f"{config['name']}:side:{config['id']}", using="side", ttl=SIDE_TTL)
        self.taken = False

    def keep(self) -> None:
        """Take it if not held (the side server may be paused: try again later)."""
        from django_redlock import LockError

        if self.taken:
            return
        try:
            self.taken = self.lock.acquire(blocking=False)
        except LockError:
            return
        self.log("side", taken=self.taken, fence=self.lock.fence)

    def lost(self, lock: Any, reason: str) -> bool:
        """Whether a lock_lost was the side hold's (then logged as a finding)."""
        if lock is not self.lock:
            return False
        self.taken = False
        self.log("bad", h=0, what=f"the side hold (TTL {SIDE_TTL:g} s) was lost: {reason}")
        return True


def maybe_extend(lk: Any, hold: int, rng: random.Random, log: Any, ttl: float) -> None:
    """Sometimes extend the hold to another TTL, racing the watchdog's batches (a batch taken
    with the old TTL may land after it). TTLs up to the run's: the checker's bounds hold."""
    from django_redlock import LockError

    if rng.random() >= 0.25:
        return
    new = ttl * rng.choice((0.6, 0.8, 1.0))
    t0 = time.time()
    try:
        lk.extend(new)
    except LockError as exc:
        log("ext_err", h=hold, ttl=new, err=type(exc).__name__, msg=str(exc)[:300], since=t0)
        return
    log("ext", h=hold, ttl=new)


class Inspector:
    """Reads the lock's keys straight from the servers (the documented key layout)."""

    def __init__(self, config: dict[str, Any]) -> None:
        import redis

        self.nodes = [
            redis.Redis.from_url(url, socket_timeout=0.3, socket_connect_timeout=0.3)
            for url in config["direct_urls"]
        ]
        self.key = f"redlock:{{{config['name']}}}"
        self.quorum = QUORUM_OF[len(self.nodes)]
        self.pid = str(os.getpid())
        #: Semaphores and read-write locks: the name's key is a sorted set of leases.
        self.leased = config["kind"] in ("semaphore", "write")
        self.seen = ""  # the modes of the live leases at the last lease read

    def leases(self, node: Any) -> tuple[int, list[tuple[str, int, str, int]]]:
        """A semaphore's or read-write lock's live leases on ``node``, read atomically with
        the server's clock (a lease lives while its expiry is after it, as the scripts
        judge): the server's ms, and (token, expiry ms, mode letter, fence) per lease."""
        pipe = node.pipeline(transaction=True)
        pipe.time()
        pipe.zrange(self.key, 0, -1, withscores=True)
        pipe.hgetall(f"{self.key}:h")
        (sec, usec), members, details = pipe.execute()
        now = int(sec) * 1000 + int(usec) // 1000
        live = []
        for raw, score in members:
            if int(score) <= now:
                continue
            detail = details.get(raw, b"").decode("utf-8", "replace").split("|")
            fence = int(detail[0]) if detail[0].isdigit() else -1
            mode = detail[3] if len(detail) > 3 else "?"
            live.append((raw.decode("utf-8", "replace"), int(score), mode, fence))
        return now, live

    def lease(self, prefix: str, fence: int | None) -> tuple[int, int, str] | None:
        """This hold's live lease on the (single) server: (ms left, expiry ms, the modes of
        every live lease, e.g. "ss" or "rrw"); None when it holds none. Raises when the
        server does not answer."""
        now, live = self.leases(self.nodes[0])
        self.seen = "".join(sorted(mode for *_, mode, _f in live))
        for token, expiry, _mode, lease_fence in live:
            if token.startswith(prefix) and lease_fence == fence:
                return expiry - now, expiry, self.seen
        return None

    def _node_has(self, node: Any, prefix: str, fence: int | None, reentrant: bool) -> int | None:
        """The hold's PTTL in ms on this node, or None when the node does not hold it."""
        if self.leased:
            found = self.lease(prefix, fence)
            return None if found is None else found[0]
        pipe = node.pipeline(transaction=False)
        if reentrant:
            pipe.hmget(self.key, ":fence", ":meta")
        else:
            pipe.get(self.key)
        pipe.pttl(self.key)
        value, pttl = pipe.execute()
        if reentrant:
            if value[0] is None or value[1] is None:
                return None
            meta = value[1].decode("utf-8", "replace").split("\x1f")
            ours = fence in (None, int(value[0])) and len(meta) > 1 and meta[1] == self.pid
            return int(pttl) if ours else None
        if value is None:
            return None
        parts = value.decode("utf-8", "replace").split("|")
        if not parts[0].startswith(prefix):
            return None
        # Redlock nodes keep their own counters: only the token says it is this hold there.
        # Fence None: not known to the client (a re-fence whose reply was lost), the token
        # alone says it.
        mismatch = len(parts) < 2 or parts[1] != str(fence)
        if len(self.nodes) == 1 and fence is not None and mismatch:
            return None
        return int(pttl)

    def held_by(self, prefix: str) -> tuple[bool | None, str]:
        """Whether a quorum of servers holds the name by a token of ``prefix`` (any hold of
        one lock object: a lock's string, a reentrant hash's owner field, a live lease), and
        each server's answer (1, 0, ?), as :meth:`holds`."""
        answers = ""
        for node in self.nodes:
            try:
                pipe = node.pipeline(transaction=True)
                pipe.type(self.key)
                pipe.time()
                if self.leased:
                    pipe.ping()
                else:
                    pipe.get(self.key)
                raw, (sec, usec), value = pipe.execute()
            except Exception:
                answers += "?"
                continue
            kind = raw.decode() if isinstance(raw, bytes) else str(raw)
            tokens: list[str] = []
            try:
                if kind == "string":
                    tokens = [value.decode("utf-8", "replace").split("|")[0]]
                elif kind == "hash":  # a reentrant hold: its owners' tokens are its fields
                    tokens = [k.decode("utf-8", "replace") for k in node.hkeys(self.key)]
                elif kind == "zset":  # leases: live while their expiry (ms) is ahead
                    now = int(sec) * 1000 + int(usec) // 1000
                    live = node.zrangebyscore(self.key, f"({now}", "+inf")
                    tokens = [m.decode("utf-8", "replace") for m in live]
            except Exception:
                answers += "?"
                continue
            answers += "1" if any(t.startswith(prefix) for t in tokens) else "0"
        if answers.count("1") >= self.quorum:
            return True, answers
        if answers.count("0") > len(self.nodes) - self.quorum:
            return False, answers
        return None, answers

    def holds(
        self, prefix: str, fence: int | None, reentrant: bool
    ) -> tuple[bool | None, str, int]:
        """True: a quorum of servers holds this hold; False: too few can; None: unknown.
        Each server's answer: 1 (holds it), 0 (does not), ? (did not answer). And how long
        a quorum of them still holds it (ms; the quorum-th longest PTTL)."""
        answers, pttls = "", []
        self.seen = "?"
        for node in self.nodes:
            try:
                pttl = self._node_has(node, prefix, fence, reentrant)
            except Exception:
                answers += "?"
                continue
            answers += "0" if pttl is None else "1"
            if pttl is not None:
                pttls.append(pttl)
        pttls.sort(reverse=True)
        left = pttls[self.quorum - 1] if len(pttls) >= self.quorum else -1
        if answers.count("1") >= self.quorum:
            return True, answers, left
        if answers.count("0") > len(self.nodes) - self.quorum:
            return False, answers, left
        return None, answers, left


def main() -> None:
    config = json.loads(sys.argv[1])
    setup(config)
    from redis import Redis

    from django_redlock import LockError, LockLost, lock, read_write_lock, semaphore
    from django_redlock.signals import lock_lost

    from . import database, interrupts, stall
    from .resource import Resource

    cid = config["id"]
    log = Log(config["log"], cid)
    stall.watch(log)  # how long this process was not running: the timing judges subtract it
    rng = random.Random(config["seed"])
    armed = interrupts.Interrupts(config.get("interrupt_flag") or "", random.Random(rng.random()))
    resource = Resource(Redis.from_url(config["resource_url"], socket_timeout=10))
    inspector = Inspector(config)
    kind = config["kind"]
    reentrant, fair = kind == "reentrant", kind == "fair"
    ttl = float(config["ttl"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    holds: dict[int, tuple[int, str, int | None]] = {}  # id(Lock) -> (hold, prefix, fence)

    def check(hold: int, when: str, prefix: str, fence: int | None) -> None:
        t0 = time.time()
        found, nodes, left = inspector.holds(prefix, fence, reentrant)
        extra = {"leases": inspector.seen} if inspector.leased else {}
        log("check", h=hold, when=when, found=found, t0=t0, t1=time.time(), fence=fence,
            nodes=nodes, left=left, **extra)  # fmt: skip

    side = SideHold(config, log) if config.get("side_url") else None

    def on_lost(lock: Any, reason: str, **_: Any) -> None:
        if side is not None and side.lost(lock, reason):
            return
        hold, prefix, fence = holds.get(id(lock), (-1, "", None))
        log("lost", h=hold, reason=reason, fence=fence)
        if hold >= 0:
            check(hold, "lost", prefix, fence)

    def expiry(prefix: str, fence: int) -> int | None:
        """A permit's expiry on the server's clock, read straight from it (None: not held,
        or no answer): what the resource checks a semaphore's write against."""
        try:
            found = inspector.lease(prefix, fence)
        except Exception:
            return None
        return None if found is None else found[1]

    def ask(lk: Any, hold: int, prefix: str, fence: int | None, role: str) -> None:
        """Ask owned() or locked() while holding: False must mean not held."""
        # locked() of a semaphore or a read lock may well be False while holding (a permit
        # left; no writer): only owned() says whether this hold is held.
        question = "owned" if role in ("s", "r") else rng.choice(["owned", "locked"])
        t0 = time.time()
        try:
            answer = getattr(lk, question)()
        except LockError as exc:
            log("ask", h=hold, q=question, err=type(exc).__name__, msg=str(exc)[:300], since=t0)
            return
        log("ask", h=hold, q=question, answer=answer)
        if answer is False:
            check(hold, f"{question}_false", prefix, fence)

    lock_lost.connect(on_lost, weak=False)
    if config.get("tracer"):
        install_tracer(config, stop)
    if kind == "database":  # prune-fences beside the buyers
        database.start_pruner(config, log, stop)
    ctx = Ctx(config, log, rng, armed, resource, inspector, holds, check, ask, expiry)
    if config.get("wire") or config.get("retry") or config.get("teardown"):
        from .moves import Orphans

        ctx.orphans = Orphans(Inspector(config), log)  # its own connections: another thread
    # The moves' draws (retries): a generator of their own, the holds' stay the seed's.
    ctx.mrng = random.Random(int(config["seed"]) * 3571 + 9)
    wire = WIRE[0] if WIRE else None
    driver = None
    if config.get("driver") == "async" and kind != "database":
        from .aclient import Driver

        driver = Driver(ctx)
    log("start", pid=os.getpid(), driver=config.get("driver") or "sync",
        tracer=bool(config.get("tracer")))  # fmt: skip
    flag = config.get("throughput_flag") or ""
    hold = 0
    while not stop.is_set():
        current = None  # the hold an interrupt (KeyboardInterrupt) may cut short
        # A hold still under way 10 s on (no hold takes so long) dumps every thread's stack
        # to the client's stderr: where a call hung (call-hung names the hold).
        faulthandler.dump_traceback_later(10.0)
        try:
            look, ctx.look = ctx.look, None
            if look is not None and look.get("how") and ctx.orphans is not None:
                # The last hold, a move's: is its name held by nobody once it was let go?
                ctx.orphans.look(time.time(), look, look.pop("held", None))
            if side is not None:
                side.keep()
            hold += 1
            if driver is not None:  # a twin task (aclient.py) took a number of its own
                hold = max(hold, driver.last + 1)
            hold = max(hold, ctx.last + 1)  # and a retry (moves.py)
            ctx.last = hold
            prefix = f"{cid}h{hold}."
            if flag and os.path.exists(flag):  # the throughput phase (Redlock: plain locks)
                quick_hold(lock(config["name"], ttl=ttl, token_prefix=prefix), hold, cid, rng,
                           resource, log, LockError, LockLost)  # fmt: skip
                continue
            if kind == "database" and rng.random() < 0.5:  # with lock(..., atomic=...): a hold
                with armed.armed(1.0):
                    database.run_with(config, hold, prefix, rng, log, check, holds)
                time.sleep(rng.uniform(0, 0.03))
                continue
            # The wire move: this hold's calls through the client's own proxies (moves.py).
            wired = wire is not None and kind != "database" and wire.draw()
            using = "wired" if wired else "default"
            if kind == "semaphore":
                role = "s"
                lk = semaphore(config["name"], config["limit"], ttl=ttl, token_prefix=prefix,
                               using=using)  # fmt: skip
            elif kind == "write":
                role = "x" if rng.random() < 0.6 else "r"
                rw = read_write_lock(config["name"], ttl=ttl, using=using)
                lk = rw.write(token_prefix=prefix) if role == "x" else rw.read(token_prefix=prefix)
                if role == "r":
                    prefix = ""  # a read's token is its owner's (reads are reentrant): its fence
            elif kind == "database":
                role = "x"
                lk = database.held_lock(config, prefix, rng)
            else:
                role = "x"
                lk = lock(config["name"], ttl=ttl, reentrant=reentrant, fair=fair,
                          token_prefix=prefix, using=using)  # fmt: skip
            current = lk
            ctx.wire = wire if wired else None
            if driver is not None:  # an asyncio client (aclient.py): the same hold, awaited
                driver.hold(lk, hold, prefix, role)
                continue
            if sync_hold(ctx, lk, hold, prefix, role):
                time.sleep(rng.uniform(0, 0.03))
        except interrupts.RAISED:  # asynchronous (interrupts.py)
            cut = time.time()
            while True:
                try:
                    interrupts.caught(log, hold, current, LockError)
                    break
                except interrupts.RAISED:  # the end of a burst, or a soft time limit
                    continue
            if ctx.look is not None:
                ctx.look.update(how="cut", cut=cut)

    log("stop")


@dataclasses.dataclass
class Ctx:
    """What one hold needs of its client (the sync path below, the asyncio one in
    aclient.py): they log the same events, so the checker judges both alike."""

    config: dict[str, Any]
    log: Log
    rng: random.Random
    armed: Any  # interrupts.Interrupts
    resource: Any
    inspector: Inspector
    holds: dict[int, tuple[int, str, int | None]]
    check: Any  # (hold, when, prefix, fence): a direct read of the servers, logged
    ask: Any  # (lk, hold, prefix, fence, role): owned() or locked() while holding
    expiry: Any  # (prefix, fence): a permit's expiry on the server's clock
    #: The moves of moves.py: the wire of this hold (None: not wired), the look after it
    #: (its fields; None: no move touched it), the last hold number used (a retry takes one).
    orphans: Any = None
    mrng: random.Random = dataclasses.field(default_factory=random.Random)
    wire: Any = None
    look: dict[str, Any] | None = None
    last: int = 0

    @property
    def cid(self) -> str:
        return str(self.config["id"])

    @property
    def kind(self) -> str:
        return str(self.config["kind"])

    @property
    def ttl(self) -> float:
        return float(self.config["ttl"])

    @property
    def broken(self) -> str:
        return str(self.config.get("break") or "")


def sync_hold(ctx: Ctx, lk: Any, hold: int, prefix: str, role: str) -> bool:
    """One hold on the sync path: acquire, the body (fenced writes), release, each checked.
    False when the acquire did not hold (its own short pause taken)."""
    from django_redlock import LockError, LockLost

    from . import database
    from .moves import Moves

    rng, log, armed, check, holds = ctx.rng, ctx.log, ctx.armed, ctx.check, ctx.holds
    kind, broken, cid, ttl, inspector = ctx.kind, ctx.broken, ctx.cid, ctx.ttl, ctx.inspector
    reentrant, ask, expiry = kind == "reentrant", ctx.ask, ctx.expiry
    blocking = rng.random() < 0.8
    timeout = rng.choice([0.5, 1.0, 2.0, 3.0, 4.0]) if blocking else None
    moves = Moves(ctx, hold, prefix, role, timeout or 0.05, cut=interrupt_me)
    while True:  # an unknown outcome may be tried again at once (moves.py: retry)
        log("acq", h=hold, mode="block" if blocking else "try", timeout=timeout, role=role,
            **moves.tag(hold))  # fmt: skip
        try:
            with armed.armed(timeout or 0.05), moves.wired("acquire", hold):
                got = lk.acquire(blocking=blocking, timeout=timeout)
        except LockError as exc:
            if broken == "spin" and type(exc).__name__ == "BackendUnavailable":
                spin(0.6)
            log("acq_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300])
            if moves.retry(exc):
                hold = ctx.last = max(hold, ctx.last) + 1  # the retry: a number of its own
                continue
            time.sleep(rng.uniform(0.01, 0.1))
            return False
        break
    if not got:
        log("acq_no", h=hold)
        moves.ended("refused")
        time.sleep(rng.uniform(0, 0.02))
        return False
    fence = lk.fence
    holds[id(lk)] = (hold, prefix, fence)
    log("acq_ok", h=hold, fence=fence)
    check(hold, "acquired", prefix, fence)
    if fence is None:
        log("bad", h=hold, what="acquired, but fence is None")
        fence = -1
    try:
        if kind == "database":  # one fenced transaction (lk.atomic()) in the hold
            # A re-fence (a clock step) gives the hold a new fence: the servers have it.
            with armed.armed(0.5):
                fence = database.run_held(lk, hold, fence, cid, rng, log, ttl)
            holds[id(lk)] = (hold, prefix, fence)
        else:
            with armed.armed(0.3):
                hold_body(lk, hold, fence, rng, ctx.resource, log, cid, ttl, reentrant,
                          functools.partial(ask, lk, hold, prefix, fence, role), role,
                          functools.partial(expiry, prefix, fence), broken,
                          inspector)  # fmt: skip
    except LockError as exc:
        log("nest_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300])
    check(hold, "releasing", prefix, fence)  # whether a loss at release can be right
    if broken == "handoff" and kind == "plain":  # a self-test: a release that tells
        released = release_quietly(lk, hold, log, inspector)  # no waiter
    else:
        with armed.armed(0.01), moves.wired("release"):
            released = release(lk, hold, rng, log, LockError, LockLost)
        moves.ended("released" if released else "rel_err")
    if released:
        check(hold, "released", prefix, fence)
    return True


def interrupt_me() -> None:
    """The wire move's cut of a sync call: the signal the interrupt move sends (its handler
    raises KeyboardInterrupt in the main thread, or once asgiref's call is over)."""
    os.kill(os.getpid(), signal.SIGUSR1)


def hold_body(
    lk: Any,
    hold: int,
    fence: int,
    rng: random.Random,
    resource: Any,
    log: Log,
    cid: str,
    ttl: float,
    reentrant: bool,
    ask: Any,
    role: str,
    expiry: Any,
    broken: str = "",
    inspector: Any = None,
) -> None:
    def write(phase: str) -> None:
        until = expiry() if role == "s" else None
        ok, last = resource.write(cid, hold, fence, phase, role, until)
        log("write", h=hold, phase=phase, fence=fence, ok=ok, last=last, role=role,
            expiry=until)  # fmt: skip

    write("begin")
    for _ in range(rng.randint(0, 3)):
        roll = rng.random()
        if roll < 0.04:
            time.sleep(rng.uniform(0.8 * ttl, 1.8 * ttl))  # the watchdog must renew
        elif roll < 0.2:
            time.sleep(rng.uniform(0.02, 0.15))
        else:
            time.sleep(rng.uniform(0, 0.01))
        if (reentrant or role == "r") and rng.random() < 0.3:  # reads are reentrant
            again = lk.acquire(blocking=False)
            log("nest", h=hold, ok=again, fence=lk.fence)
            if again:
                write("work")
                lk.release()
                log("unnest", h=hold)
        write("work")
        if broken == "lost" and not reentrant and role == "x" and rng.random() < 0.3:
            # A self-test: the hold's key deleted behind the client's back (a server that
            # answered throughout, yet the hold is lost).
            inspector.nodes[0].delete(inspector.key)
            time.sleep(0.8 * ttl)
        if rng.random() < 0.2:
            ask()
        maybe_extend(lk, hold, rng, log, ttl)
    write("end")


def quick_hold(
    lk: Any,
    hold: int,
    cid: str,
    rng: random.Random,
    resource: Any,
    log: Log,
    error: Any,
    lost: Any,
) -> None:
    """The throughput phase's loop: acquire, a fenced write at the start and the end of the
    hold, release; nothing else (no direct reads of the servers, no sleeps)."""
    log("acq", h=hold, mode="block", timeout=4.0, role="x")
    try:
        got = lk.acquire(timeout=4.0)
    except error as exc:
        log("acq_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300])
        time.sleep(rng.uniform(0.01, 0.05))
        return
    if not got:
        log("acq_no", h=hold)
        return
    fence = lk.fence
    log("acq_ok", h=hold, fence=fence)
    for phase in ("begin", "end"):
        ok, last = resource.write(cid, hold, fence, phase, "x", None)
        log("write", h=hold, phase=phase, fence=fence, ok=ok, last=last, role="x", expiry=None)
    release(lk, hold, rng, log, error, lost)


def spin(seconds: float) -> None:
    """CAMPAIGN_BREAK=spin (a self-test of the stall probe): the client's own code busy for
    ``seconds`` of CPU with the GIL held (``sum`` over a range runs in C) before it reports
    a ``BackendUnavailable``: its probe wakes that late, yet the process ran, so no stall
    excuses it and ``error-latency`` must fail."""
    n, spent = 100_000, 0.0
    while spent < 0.02:
        n *= 2
        t = time.process_time()
        sum(range(n))
        spent = time.process_time() - t
    sum(range(int(n * seconds / spent)))


def release_quietly(lk: Any, hold: int, log: Log, inspector: Inspector) -> bool:
    """CAMPAIGN_BREAK=handoff: the hold's key deleted straight from the server, with no word
    to its waiters (they sleep until its expiry), the object left to find it gone, and the
    client away for a second."""
    t0 = time.time()
    with contextlib.suppress(Exception):
        inspector.nodes[0].delete(inspector.key)
    log("rel_ok", h=hold, attempt=0, since=t0)
    time.sleep(1.0)  # steps away: the lock is its waiters' to take
    return True


def release(lk: Any, hold: int, rng: random.Random, log: Log, error: Any, lost: Any) -> bool:
    """Release; after an unknown outcome, try once more half of the time."""
    for attempt in range(2):
        t0 = time.time()  # the call's start: BackendUnavailable within 1.5 socket timeouts
        try:
            lk.release()
            log("rel_ok", h=hold, attempt=attempt, since=t0)
            return True
        except lost as exc:
            log("rel_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300], attempt=attempt,
                since=t0)  # fmt: skip
            return False
        except error as exc:
            log("rel_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300], attempt=attempt,
                since=t0)  # fmt: skip
            if rng.random() < 0.5:
                return False
            time.sleep(0.05)
    return False


def run() -> None:
    try:
        main()
    except Exception:  # anything but a LockError escaping the public API: a finding
        Log(json.loads(sys.argv[1])["log"], json.loads(sys.argv[1])["id"])(
            "crash", tb=traceback.format_exc()[-3000:]
        )
        raise
    except BaseException:  # an interrupt that escaped the loop's top: the client's own
        Log(json.loads(sys.argv[1])["log"], json.loads(sys.argv[1])["id"])(
            "died", tb=traceback.format_exc()[-3000:]
        )
        raise


if __name__ == "__main__":
    run()
