"""The Sentinel kind (issue #43): a real Sentinel set (a master, two replicas, three
sentinels), clients on ``SentinelBackend`` with ``min_replicas=1`` holding locks of three names
and writing to a fenced resource, and a nemesis that fails the master over, pauses it, kills
it (and starts it again empty, as a master the sentinels must demote), and restarts a replica
empty.

What the docs promise, and so what is judged (docs/topics/backends.md, "Sentinel"):
replication is asynchronous; ``min_replicas=1`` makes an acquire wait until a replica has the
lock (``WAIT``), so a hold confirmed before a failover is on the replicas. A failover may still
lose a lock that a replica had not acknowledged (with two replicas, ``WAIT 1`` may have been
answered by the one not promoted), and a take sent before the sentinels announced the switch
may land on the old master (its other replica confirms it, then follows the new master and
drops it). Renewals sent to the old master after the promotion are lost too: the watchdog
renews on the new master once the switch is announced, so a hold survives when the
announcement comes within what its TTL has left (about two thirds of it, renewals coming at a
third).

Properties:

* ``overlap-accepted``, ``stale-fence-accepted`` (the resource, one per name, resource.py):
  the resource accepted writes of two holds interleaved, or a fence below one it accepted (a
  stale fence's write refused is fencing doing its job: counted, not reported);
* ``fence-behind``: a hold's fence not above that of a hold of the same name granted before
  this acquire began (fences are at least the server clock's microseconds, one host: they grow
  across failovers and restarts empty);
* ``lost-on-healthy``: a hold reported lost (``lock_lost``, or ``LockLost`` at release) though
  its master answered throughout, or its disruptions from its confirmation to the loss (a
  pause; a failover's promotion to the sentinels' naming; a kill to the naming) were each
  shorter than ``GRACE`` (the TTL a
  renewal leaves, less slack), and it was not confirmed within a disruption (a take that may
  have landed on the old master, or been acknowledged by the replica not promoted);
* ``take-unavailable``: two acquires in a row of one client, begun at least ``LIVE_BOUND``
  after the sentinels named the new master (or after any other fault ended), with no fault
  since, raised ``BackendUnavailable`` / ``QuorumNotReached`` (one is counted);
* ``waiter-starved``: a blocking take that timed out in quiet time (a TTL after a fault)
  while the name was free for ``WAKE`` by every hold the clients know of (the wait's wake-up
  on the new master);
* ``not-lock-error``: nothing but ``LockError`` leaves the API.

The client is this module run as ``python -m tests.campaign.sentinel CONFIG_JSON``.
``CAMPAIGN_BREAK=lost`` (self-test): each client now and then deletes the key of the hold it
has on the master: ``lost-on-healthy`` must fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checker import Violation
from .resource import Resource, Write
from .scenario import KindReport, Log, excluded, read_logs, setup_django, storms
from .stall import Stalls, watch

ROOT = Path(__file__).resolve().parents[2]
#: The sentinels look at a replica once a second during a failover: its promotion is named
#: 0.9-1.2 s after it happened, and renewals sent meanwhile go to the old master. A TTL of
#: 1.5 s (renewed at a third: 1 s left) would let every failover excuse its losses; at 2.5 s
#: a hold confirmed before the failover must survive it.
TTL = 2.5
SOCKET_TIMEOUT = 0.5
WAIT_TIMEOUT = 0.3  # min_replicas_timeout: below the socket timeout (else refused)
CLIENTS = 4
NAMES = ("a", "b", "c")
SERVICE = "mymaster"
#: Sentinels fail over by themselves only after this: every pause stays shorter.
DOWN_AFTER = 6.0
#: A disruption at least this long may expire a hold (renewed at TTL/3, late by up to 0.3 s).
GRACE = TTL * 2 / 3 - 0.3
#: A take confirmed this close to a disruption may be on one replica only (or the old master).
REPL = 0.2
#: After a fault ended (a failover: the sentinels named the new master), takes succeed.
LIVE_BOUND = 2.0
#: A waiter is woken when the name is freed (a release publishes it): within this.
WAKE = 0.5
#: A take whose process stalled (stall.py) this long during the call is not judged by
#: take-unavailable (a third of the WAIT's timeout).
STALLED = 0.1
MOVES = ("failover", "master_pause", "master_kill", "replica_restart")
UNKNOWN = ("BackendUnavailable", "QuorumNotReached")


# -- the client ---------------------------------------------------------------------------------


def client(config: dict[str, Any]) -> None:
    options = {"service_name": SERVICE, "socket_timeout": SOCKET_TIMEOUT,
               "socket_connect_timeout": SOCKET_TIMEOUT, "min_replicas": 1,
               "min_replicas_timeout": WAIT_TIMEOUT}  # fmt: skip
    setup_django("django_redlock.backends.sentinel.SentinelBackend", config["sentinels"], options,
                 TTL)  # fmt: skip
    import redis

    from django_redlock import LockError, LockLost, lock, locks
    from django_redlock.signals import lock_lost

    log = Log(config["log"], config["id"])
    watch(log)  # scheduling stalls (stall.py)
    rng = random.Random(config["seed"])
    backend = locks["default"]
    resources = {name: Resource(redis.Redis(port=config["resource"], db=i, socket_timeout=10))
                 for i, name in enumerate(NAMES)}  # fmt: skip
    hold_of: dict[int, int] = {}  # id(lock) -> hold
    lost: set[int] = set()
    stopping: list[int] = []

    def on_lost(sender: Any, lock: Any = None, **kwargs: Any) -> None:
        hold = hold_of.get(id(lock))
        if hold is not None:
            lost.add(hold)
            log("lost", h=hold, reason=str(kwargs.get("reason", ""))[:200])

    lock_lost.connect(on_lost, weak=False)
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    log("start", pid=os.getpid())

    def guarded(hold: int, what: str, call: Any) -> Any:
        t0 = time.time()
        try:
            return call()
        except LockLost as exc:
            lost.add(hold)
            log("lost", h=hold, reason=f"{what}: {type(exc).__name__}: {exc}"[:300])
        except LockError as exc:
            log(f"{what}_err", h=hold, err=type(exc).__name__, msg=str(exc)[:200], since=t0)
        except Exception as exc:
            log("bad", h=hold, what=f"{what} raised {type(exc).__name__}: {exc}"[:400])
        return None

    def break_hold(name: str, hold: int) -> None:
        """The self-test: delete this hold's key on the master, behind the lock's back."""
        with contextlib.suppress(Exception):
            sentinel = redis.Redis.from_url(config["sentinels"][0], socket_timeout=1)
            host, port = sentinel.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
            redis.Redis(host=host, port=int(port), socket_timeout=1).delete(backend.key(name))
            log("broke", h=hold)

    hold = 0
    while not stopping:
        name = rng.choice(NAMES)
        lk = lock(name, ttl=TTL)
        hold += 1
        hold_of[id(lk)] = hold
        blocking = rng.random() < 0.6
        timeout = rng.uniform(0.3, 1.5) if blocking else None
        log("acq", h=hold, name=name, blocking=blocking)
        got = guarded(hold, "acq", lambda lk=lk, b=blocking, t=timeout: lk.acquire(b, t))
        if not got:
            log("acq_no" if got is False else "acq_end", h=hold)
            hold_of.pop(id(lk), None)
            time.sleep(rng.uniform(0.0, 0.1))
            continue
        log("acq_ok", h=hold, fence=lk.fence)
        for phase in ("begin", "work", "end"):
            if hold in lost:
                break
            accepted, last = resources[name].write(config["id"], hold, lk.fence or -1, phase)
            log("w", h=hold, phase=phase, ok=accepted, last=last)
            if phase == "end":
                break
            # Now and then past the TTL: the watchdog renews (through the faults too).
            long_ = rng.random() < 0.2
            work = rng.uniform(0.6, 1.4) * TTL if long_ else rng.uniform(0.02, 0.3)
            ends = time.monotonic() + work
            while not stopping and time.monotonic() < ends:  # SIGTERM: finish now
                time.sleep(max(0.0, min(0.05, ends - time.monotonic())))  # (ends may pass)
            if config.get("break") == "lost" and rng.random() < 0.1:
                break_hold(name, hold)
        guarded(hold, "rel", lk.release)
        log("rel", h=hold)
        hold_of.pop(id(lk), None)
        time.sleep(rng.uniform(0.0, 0.1))
    log("stop")


# -- the servers --------------------------------------------------------------------------------


@dataclass
class Fault:
    """A move of the nemesis: ``a``-``b`` is the disruption (wall clock): a pause's, or a
    failover's from its promotion (or the kill) to the sentinels' naming of the new master."""

    kind: str
    start: float  # when the move began
    a: float
    b: float
    end: float  # when the move ended (a restart: the server back)
    detail: str = ""


class Group:
    """The Sentinel set: servers[0] the first master, then the replicas; the sentinels."""

    def __init__(self, replicas: int = 2, sentinels: int = 3) -> None:
        from django_redlock.testing import RedisServer, SentinelServer

        # No diskless-sync delay (Redis 7: 5 s) on any server: each may become the master.
        master = RedisServer(args=["--repl-diskless-sync-delay", "0"]).start()
        self.servers = [master] + [
            RedisServer(args=["--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1",
                              str(master.port)]).start()
            for _ in range(replicas)
        ]  # fmt: skip
        self.sentinels = [
            SentinelServer(master, SERVICE, down_after=DOWN_AFTER).start() for _ in range(sentinels)
        ]
        deadline = time.monotonic() + 30
        for sentinel in self.sentinels:
            client = sentinel.client()
            while len(client.execute_command("SENTINEL", "REPLICAS", SERVICE)) < replicas:
                if time.monotonic() > deadline:
                    raise RuntimeError("the sentinels never saw the replicas")
                time.sleep(0.1)
        self.master = 0
        self.synced(deadline)

    def synced(self, deadline: float) -> None:
        """Every replica of the master streams from it (a WAIT meanwhile would count none)."""
        master = self.servers[self.master]
        replicas = len(self.servers) - 1
        pipe = master.client(socket_timeout=35).pipeline(transaction=False)
        pipe.publish("__synced__", "")
        pipe.execute_command("WAIT", replicas, max(1, int((deadline - time.monotonic()) * 1000)))
        if pipe.execute()[1] < replicas:
            raise RuntimeError("the replicas never acknowledged a write")

    def named(self, sentinel: int = 0) -> int:
        """The server the sentinel names as master (its index), -1 if it does not answer."""
        try:
            _, port = (
                self.sentinels[sentinel]
                .client(socket_timeout=1)
                .execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
            )
        except Exception:
            return -1
        return next((i for i, s in enumerate(self.servers) if s.port == int(port)), -1)

    def role(self, index: int, follows: bool = False) -> str:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:
            # No retries: redis-py's default backs off for seconds on a server that is down.
            client = self.servers[index].client(socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
            role = client.execute_command("ROLE")
            if follows and role[0] == b"slave":  # the index of the server it follows
                port = int(role[2])
                of = next((i for i, s in enumerate(self.servers) if s.port == port), port)
                return f"replica of {of} ({role[3].decode()})"
            return str(role[0].decode())
        except Exception:
            return "?"

    def fail_over(self, leader: int, dead: float | None = None) -> tuple[float, float, str]:
        """SENTINEL FAILOVER on sentinel ``leader`` (the others hear of it within seconds):
        (promotion, its naming of the new master, detail)."""
        old = self.master
        # An old master stays one until the sentinels demote it (about 10 s): not a promotion.
        masters = {i for i in range(len(self.servers)) if self.role(i) == "master"}
        deadline = time.monotonic() + 10
        asked, refused = time.time(), ""
        while True:  # refused (INPROG, NOGOODSLAVE) until the last one ended, the replicas known
            try:
                self.sentinels[leader].client(socket_timeout=1).execute_command(
                    "SENTINEL", "FAILOVER", SERVICE
                )
                break
            except Exception as exc:
                refused = f" (refused {time.time() - asked:.1f} s: {str(exc)[:40]})"
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sentinel refused the failover: {exc}") from exc
                time.sleep(0.05)
        promoted: float | None = dead
        while True:
            named = self.named(leader)
            if promoted is None and any(
                self.role(i) == "master" for i in range(len(self.servers)) if i not in masters
            ):
                promoted = time.time()
            if named not in (-1, old):
                now = time.time()
                self.master = named
                return (promoted or now, now, f"{old}->{named} by s{leader}{refused}")
            if time.monotonic() > deadline + 20:
                raise RuntimeError("the sentinels never named a new master")
            time.sleep(0.01)

    def watch(self, path: Path, done: threading.Event) -> None:
        """Until ``done``: every 0.1 s, what each sentinel names as master and each server's
        role (a replica: the port it follows), as JSON lines (CAMPAIGN_KEEP keeps them)."""
        with open(path, "w") as out:
            while not done.wait(0.1):
                named = [self.named(i) for i in range(len(self.sentinels))]
                roles = [self.role(i, follows=True) for i in range(len(self.servers))]
                out.write(json.dumps({"t": time.time(), "named": named, "roles": roles}) + "\n")

    def stop(self) -> None:
        for server in [*self.servers, *self.sentinels]:
            with contextlib.suppress(Exception):
                server.kill()
                server.stop()


# -- the run ------------------------------------------------------------------------------------


def run_sentinel(seed: int, seconds: float) -> KindReport:
    from django_redlock.testing import RedisServer

    directory = Path(tempfile.mkdtemp(prefix=f"campaign-sentinel-{seed}-"))
    resource = RedisServer().start()
    group: Group | None = None
    procs: list[subprocess.Popen[bytes]] = []
    faults: Counter[str] = Counter()
    applied: list[Fault] = []
    errors: list[str] = []
    try:
        began = time.monotonic()
        group = Group()
        phases = [time.monotonic() - began]
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
        for i in range(CLIENTS):
            config = {"id": f"c{i + 1}", "seed": seed * 100 + i, "resource": resource.port,
                      # Each client asks the sentinels in its own order: some ask the
                      # failover's leader last (the others name the old master meanwhile).
                      "sentinels": [s.url for s in group.sentinels[i:] + group.sentinels[:i]],
                      "log": str(directory / f"c{i + 1}.jsonl"),
                      "break": os.environ.get("CAMPAIGN_BREAK", "")}  # fmt: skip
            with open(directory / f"c{i + 1}.stderr", "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.campaign.sentinel", json.dumps(config)],
                    cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=err,
                ))  # fmt: skip
        _wait_started(directory, CLIENTS, timeout=60)
        phases.append(time.monotonic() - began)
        watching = threading.Event()
        watcher = threading.Thread(target=group.watch, args=(directory / "views.jsonl", watching))
        watcher.start()
        moves = [m for m in MOVES if m not in excluded()]
        rng = random.Random(seed * 37 + 11)
        origin, started = time.monotonic(), time.time()
        plan = storms(seed, seconds, calm=(1.0, 2.5), storm=(1.0, 2.5), tail=LIVE_BOUND)
        for n, (start, length) in enumerate(plan if moves else []):
            _sleep_until(origin + start)
            # The first move is a failover (when allowed): make test's short run has one.
            move = "failover" if n == 0 and "failover" in moves else rng.choice(moves)
            applied.append(_move(group, move, length, rng))
            faults[move] += 1
        _sleep_until(origin + seconds)
        stopping = time.time()
        watching.set()
        watcher.join()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                errors.append(f"client pid {proc.pid} did not stop within 15 s of SIGTERM")
                proc.kill()
                proc.wait()
        for i, proc in enumerate(procs):
            if proc.returncode not in (0, -signal.SIGTERM):
                tail = (directory / f"c{i + 1}.stderr").read_text()[-1500:]
                errors.append(f"client c{i + 1} exited {proc.returncode}: {tail}")
        (directory / "faults.json").write_text(json.dumps([vars(f) for f in applied]))
        phases.append(time.monotonic() - began)
        events = read_logs(sorted(directory.glob("c*.jsonl")))
        writes = {name: Resource(resource.client(db=i)).history() for i, name in enumerate(NAMES)}
        report = check(seed, seconds, events, writes, applied, stopping, started)
        report.faults, report.started = faults, started
        report.harness_errors += errors
        report.exclude = ",".join(sorted(excluded()))
        report.lines.append(f"  time: servers up {phases[0]:.1f} s, clients {phases[1]:.1f} s,"
                            f" clients stopped {phases[2]:.1f} s")  # fmt: skip
        return report
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if group is not None:
            group.stop()
        resource.kill()
        resource.stop()
        if os.environ.get("CAMPAIGN_KEEP") is None:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def _move(group: Group, move: str, length: float, rng: random.Random) -> Fault:
    began = time.time()
    # The harness's own record: a sentinel other than the last failover's leader may still
    # name the old master for seconds (the sentinels fail over only when told).
    master = group.master
    server = group.servers[master]
    if move == "failover":  # planned: the old master answers throughout
        promoted, named, detail = group.fail_over(rng.randrange(len(group.sentinels)))
        return Fault(move, began, promoted, named, time.time(), detail)
    if move == "master_pause":  # shorter than down-after: no failover
        pause = rng.uniform(0.2, 1.2) if rng.random() < 0.5 else rng.uniform(2.0, 3.5)
        server.pause()
        time.sleep(pause)
        server.resume()
        return Fault(move, began, began, time.time(), time.time(), f"server {master}")
    if move == "master_kill":  # then a forced failover, and the old master back empty
        server.kill()
        killed = time.time()
        _, named, detail = group.fail_over(rng.randrange(len(group.sentinels)), dead=killed)
        server.extra_args = ["--repl-diskless-sync-delay", "0"]  # a master, empty
        server.start()
        return Fault(move, began, killed, named, time.time(), detail)
    # replica_restart: a replica killed, back empty a moment later, syncing from the master
    index = rng.choice([i for i in range(len(group.servers)) if i != master])
    replica = group.servers[index]
    replica.kill()
    killed = time.time()
    time.sleep(min(length, 1.0))
    replica.extra_args = ["--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1",
                          str(server.port)]  # fmt: skip
    replica.start()
    deadline = time.monotonic() + 10
    while replica.client(socket_timeout=1).info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return Fault(move, began, killed, time.time(), time.time(), f"server {index}")


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def _wait_started(directory: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = [p for p in directory.glob("c*.jsonl") if b'"start"' in p.read_bytes()[:300]]
        if len(started) >= count:
            return
        time.sleep(0.1)


# -- the checker --------------------------------------------------------------------------------


def check(
    seed: int,
    seconds: float,
    events: list[dict[str, Any]],
    writes: dict[str, list[Write]],
    applied: list[Fault],
    stopping: float,
    started: float = 0.0,
) -> KindReport:
    holds: dict[tuple[str, int], dict[str, Any]] = {}
    violations: list[Violation] = []
    stats: Counter[str] = Counter()
    stalls = Stalls(events)
    for ev in events:
        if "h" not in ev:
            continue
        hold = holds.setdefault((ev["c"], ev["h"]), {"c": ev["c"], "h": ev["h"]})
        hold["last"] = ev["t"]
        e = ev["e"]
        stats[e] += 1
        if e == "acq":
            hold.update(start=ev["t"], name=ev["name"], blocking=ev.get("blocking", False))
        elif e == "acq_ok":
            hold.update(end=ev["t"], fence=ev["fence"])
        elif e in ("acq_err", "acq_no"):
            hold.update(end=ev["t"], outcome=e, err=ev.get("err", ""), msg=ev.get("msg", ""))
        elif e == "bad":
            violations.append(Violation("not-lock-error", ev["t"], f"{ev['c']}/h{ev['h']}: "
                                        f"{ev['what']}", {ev["c"]}))  # fmt: skip
        elif e == "lost" and "lost" not in hold:
            hold["lost"] = ev["t"]
            hold["reason"] = ev.get("reason", "")
        elif e == "w" and not ev["ok"]:
            stats["refused"] += 1
        elif e in ("rel", "rel_err"):
            hold[e] = ev["t"]

    disruptions = [f for f in applied if f.kind != "replica_restart"]
    # -- lost holds -------------------------------------------------------------------------
    excused = 0
    for hold in holds.values():
        if "lost" not in hold or "fence" not in hold:
            continue
        # A disruption over before the acquire was confirmed cannot expire the hold: its key
        # was written (and replicated: WAIT) after it.
        since, t = hold["end"] - 0.05, hold["lost"]
        near = [f for f in disruptions if f.a < t and f.b > since]
        long_ = [f for f in near if f.b - f.a >= GRACE]
        # A take confirmed within a failover or kill (or just before it) may be on the old
        # master, or on the replica not promoted: the docs' window.
        window = [f for f in near if f.kind != "master_pause"
                  and f.a - REPL <= hold["end"] <= f.b + REPL]  # fmt: skip
        # A replica restarted empty shortly before a failover may be promoted without it.
        failovers = [g for g in near if g.kind != "master_pause"]
        resynced = [f for f in applied if f.kind == "replica_restart"
                    and any(g.a - 5.0 < f.end <= g.a for g in failovers)]  # fmt: skip
        if long_ or window or resynced:
            excused += 1
            continue
        shown = ", ".join(f"{f.kind} {f.detail} {f.a - hold['start']:+.2f}.."
                          f"{f.b - hold['start']:+.2f} s" for f in near) or "none"  # fmt: skip
        violations.append(Violation(
            "lost-on-healthy", t,
            f"{hold['c']}/h{hold['h']}: hold of {hold['name']!r} (fence {hold.get('fence')})"
            f" confirmed by a replica, reported lost ({hold['reason']}) {t - hold['start']:.2f} s"
            f" after its acquire began; its master's disruptions meanwhile (from its acquire):"
            f" {shown}{f', each under {GRACE:.2f} s' if near else ''}", {hold["c"]},
        ))  # fmt: skip

    # -- the resource, per name -------------------------------------------------------------
    for name, history in writes.items():
        top = -1
        spans: dict[tuple[str, int], list[int]] = {}
        for w in history:
            if not w.accepted:
                continue
            if w.fence < top:
                violations.append(Violation("stale-fence-accepted", w.t, f"{name!r}: resource"
                                            f" write #{w.seq} fence {w.fence} accepted after"
                                            f" fence {top}", {w.client}))  # fmt: skip
            top = max(top, w.fence)
            spans.setdefault((w.client, w.hold), [w.seq, w.seq])[1] = w.seq
        active: list[tuple[tuple[str, int], list[int]]] = []
        for key, (first, last) in sorted(spans.items(), key=lambda kv: kv[1][0]):
            active = [(k, span) for k, span in active if span[1] > first]
            if active:
                inside = ", ".join(f"{c}/h{h} (writes #{s[0]}..#{s[1]})" for (c, h), s in active)
                violations.append(Violation(
                    "overlap-accepted", history[first].t,
                    f"{name!r}: the resource accepted {key[0]}/h{key[1]} (fence"
                    f" {history[first].fence}, write #{first}) inside the section of {inside}",
                    {key[0], *(c for (c, _), _ in active)},
                ))  # fmt: skip
            active.append((key, [first, last]))
    # fence-behind: per name, a hold granted after another's acquire returned has a higher fence
    granted: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for hold in holds.values():
        if "fence" in hold and hold["fence"] is not None:
            granted[hold["name"]].append(hold)
    for name, same in granted.items():
        by_end = sorted(same, key=lambda h: h["end"])
        for b in same:
            before = [a for a in by_end if a["end"] < b["start"] - 0.001]
            best = max(before, key=lambda a: a["fence"], default=None)
            if best is not None and b["fence"] <= best["fence"]:
                violations.append(Violation(
                    "fence-behind", b["end"],
                    f"{name!r}: {b['c']}/h{b['h']} (fence {b['fence']}) began acquiring after"
                    f" {best['c']}/h{best['h']} (fence {best['fence']}) had been granted",
                    {b["c"], best["c"]},
                ))  # fmt: skip

    # -- liveness: takes succeed once the fault is over -------------------------------------
    def over(f: Fault) -> float:  # a kill's server came back after the naming: not a fault
        return f.b if f.kind == "master_kill" else max(f.b, f.end)

    # One failed take in quiet time is counted (a loaded machine may starve the replica past
    # the WAIT's 0.3 s once); a client's next take failing too is the violation.
    quiet_errors, failed = 0, dict[str, dict[str, Any]]()
    for hold in sorted((h for h in holds.values() if "end" in h), key=lambda h: h["start"]):
        t0, t1 = hold["start"], hold["end"]
        if t0 > stopping - 0.5 or any(f.start <= t1 and over(f) + LIVE_BOUND > t0 for f in applied):
            failed.pop(hold["c"], None)
            continue  # during a fault, or within the bound after it
        if hold.get("outcome") != "acq_err" or hold.get("err") not in UNKNOWN:
            failed.pop(hold["c"], None)
            continue
        # Its process not running for STALLED of the call (stall.py): the machine's, not
        # counted against the backend (nor breaking a streak).
        if stalls.overlap(hold["c"], t0, t1) > STALLED:
            stalls.count(True, hold["c"] in failed, f"take-unavailable {hold['c']}/h{hold['h']}")
            continue
        quiet_errors += 1
        earlier = failed.setdefault(hold["c"], hold)
        if earlier is hold:
            continue
        prev = max((f for f in applied if over(f) <= t0), key=over, default=None)
        since = (f"{prev.kind} {prev.detail} over {earlier['start'] - over(prev):.2f} s before"
                 if prev else "no fault before")  # fmt: skip
        violations.append(Violation(
            "take-unavailable", t1,
            f"{hold['c']}/h{earlier['h']} and h{hold['h']}: takes begun in quiet time raised"
            f" {earlier['err']} and {hold['err']} ({hold['msg'][:160]}), one after the other, the"
            f" first {since}", {hold["c"]},
        ))  # fmt: skip

    # A waiter is woken when the name is freed: a blocking take that timed out while the
    # name was free for WAKE (by every hold the clients know of), in quiet time (a TTL after
    # a fault: a release sent to the old master leaves the new one's copy to its TTL).
    occupied: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for hold in holds.values():
        if "fence" in hold:  # held until released (a release that raised: its TTL more)
            until = hold.get("rel", stopping + TTL) + (TTL if "rel_err" in hold else 0.0)
            occupied[hold["name"]].append((hold["end"], until))
        elif hold.get("outcome") == "acq_err":  # maybe taken: its TTL
            occupied[hold["name"]].append((hold["start"], hold["end"] + TTL))
    waited = 0
    for hold in holds.values():
        if hold.get("outcome") != "acq_no" or not hold.get("blocking"):
            continue
        t0, t1 = hold["start"], hold["end"]
        if any(f.start <= t1 and over(f) + TTL + 0.5 > t0 for f in applied):
            continue
        waited += 1
        gaps, at = [], t0
        for lo, hi in sorted(x for x in occupied[hold["name"]] if x[1] > t0 and x[0] < t1):
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        gaps.append((at, t1))
        # A free span less the waiter's own stalls in it (not running: it could not take it).
        raw = max(b - a for a, b in gaps)
        free, stalled = max((b - a - stalls.overlap(hold["c"], a, b), stalls.overlap(
            hold["c"], a, b)) for a, b in gaps)  # fmt: skip
        stalls.count(raw >= WAKE and raw > free, raw >= WAKE > free,
                     f"waiter-starved {hold['c']}/h{hold['h']}: free {raw:.2f} s, {free:.2f}"
                     " s not stalled")  # fmt: skip
        if free >= WAKE:
            violations.append(Violation(
                "waiter-starved", t1,
                f"{hold['c']}/h{hold['h']}: a blocking take of {hold['name']!r} timed out after"
                f" {t1 - t0:.2f} s in quiet time, the name free for {free + stalled:.2f} s of"
                f" it (by every hold the clients know of), {stalled:.2f} s of which its"
                " process stalled",
                {hold["c"]},
            ))  # fmt: skip

    # How many holds confirmed before a failover or kill (outside its window) lived through it
    across: Counter[str] = Counter()
    for f in applied:
        if f.kind in ("failover", "master_kill"):
            for hold in holds.values():
                if ("fence" in hold and hold["end"] < f.a - REPL and hold["last"] > f.b + 0.5
                        and hold.get("lost", f.b) >= f.b):  # fmt: skip
                    across["lost" if "lost" in hold else "kept"] += 1
    lost = sum(1 for h in holds.values() if "lost" in h)
    accepted = sum(1 for history in writes.values() for w in history if w.accepted)
    report = KindReport("sentinel", "sentinel", seed, seconds, {
        "clients": len({c for c, _ in holds}), "acq_ok": stats["acq_ok"], "writes": accepted,
        "lost": lost,
    }, Counter(), violations)  # fmt: skip
    report.lines.append(
        f"  operations: {stats['acq']} acquires ({stats['acq_ok']} held, {stats['acq_no']} not"
        f" taken, {stats['acq_err']} errors), {stats['rel']} releases ({stats['rel_err']}"
        f" errors); {accepted} resource writes accepted, {stats['refused']} refused (stale"
        f" fences), {quiet_errors} takes failed in quiet time, {waited} blocking takes timed"
        f" out in quiet time (judged: waiter-starved); {lost} holds lost ({excused}"
        f" in a disruption of {GRACE:.2f} s or more, or"
        f" confirmed within one); holds confirmed before a failover or kill and held through"
        f" it: {across['kept']} kept, {across['lost']} lost")  # fmt: skip
    report.lines.append(stalls.describe(harness=False))
    report.lines.append("  moves: " + "; ".join(
        f"{f.kind} {f.detail} at {f.start - started:.1f} s (disruption {f.b - f.a:.2f} s,"
        f" move {f.end - f.start:.2f} s)" for f in applied))  # fmt: skip
    return report


if __name__ == "__main__":
    client(json.loads(sys.argv[1]))
