"""The Cluster kind (issue #43): a real 3-master Redis Cluster (a replica per master when the
plan fails one over), clients holding several locks at once (on every master, on names they
share), and a nemesis whose storms each make one move (``CAMPAIGN_EXCLUDE`` leaves any out):

* ``master_pause``: one master SIGSTOPped for longer than the TTL while holds live on the
  others;
* ``failover``: ``CLUSTER FAILOVER`` on one master's replica, planned: the master stops
  taking writes, the replica catches up with its replication offset, then takes over, so a
  confirmed hold is on the new master. Healed by leaving it: the old master is the new one's
  replica and the next failover of that shard fails back. Masters vote about one master once
  per two node timeouts, and a refused planned failover holds the master's writes back for
  seconds, as does a fail-back asked before every node knew the old master demoted (1 s
  after a failover): the planner picks a shard whose vote would be given and whose replica
  every node knows as such (no shard ready: a pause instead), and one still not handed over
  in 2.5 s is finished with ``TAKEOVER`` (``failover_stalled``: counted as forced);
* ``failover_force``: the replica SIGSTOPped and its replication link cut by the master,
  and 0.1-0.6 s later ``CLUSTER FAILOVER TAKEOVER`` (no handshake, no vote), sent before it
  resumes: it takes over without what the master wrote meanwhile, as an asynchronous replica
  can (on loopback a cut link alone is back within milliseconds, missing nothing), so holds of
  that shard may be lost (docs/topics/backends.md: Cluster loses locks "as Sentinel, per
  shard"); fences still grow (at least the server's clock in us).

Properties: ``lost-on-healthy``: no hold on a master that answered throughout (neither paused
nor failed over from a TTL before its acquire to the loss) is reported lost (the
``lock_lost`` signal, or ``LockLost`` at release). A shard is a backend for the watchdog: a
paused master holds up its own renewals and nobody else's. Before issue #41's fix one
pipeline renewed every shard, and redis-py re-sent each timed-out command on its own: every
hold of the healthy masters expired behind the paused one. ``lost-on-failover``: a planned
failover that handed over within a third of the TTL costs no hold (a hold renewed every
third of its TTL had two thirds left; the renewal the master held back lands, by its
``MOVED``, on the new master in time); a longer or forced one may. ``fence-order``: a name's
fences strictly increase in acquire order (a hold confirmed before another's acquire began
has the smaller fence), failovers included: fences are at least the server's clock in us.
``two-holders``: two holds of one name, neither ever reported lost and both released
without error, were never both held at once (from the acquire's return to the release's
call). ``not-lock-error``: nothing but ``LockError`` leaves the API.

The client is this module run as ``python -m tests.campaign.cluster CONFIG_JSON``.
``CAMPAIGN_BREAK=lost`` (self-test): each client deletes one of its own holds' keys on a
healthy master now and then: ``lost-on-healthy`` must fail. ``CAMPAIGN_BREAK=fence``: each
client now and then logs a fence 10 s below the one it got: ``fence-order`` must fail.
``CAMPAIGN_BREAK=twice``: each client now and then counts a refused acquire as held:
``two-holders`` must fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .checker import Violation
from .scenario import KindReport, Log, excluded, read_logs, setup_django, storms
from .stall import Stalls, watch

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.5
SOCKET_TIMEOUT = 0.3
CLIENTS = 3
HELD = 4  # holds each client keeps at once, on names spread over the masters
NAMES = 16  # names shared by the clients
MOVES = ("master_pause", "failover", "failover_force")
#: With replicas: no automatic failover, a pause (at most 2 TTLs) stays below the node
#: timeout. Masters vote about one master once per two node timeouts, and a replica tries
#: again four node timeouts after its last try: the planner waits for both. Without
#: replicas, 30 s: a master marked failed would take the whole cluster down.
NODE_TIMEOUT = 5.0


def cluster_args(node_timeout: float) -> tuple[str, ...]:
    return ("--cluster-enabled", "yes", "--cluster-node-timeout", str(int(node_timeout * 1000)),
            "--repl-diskless-sync-delay", "0")  # fmt: skip


#: A planned failover handing over within this costs no hold; past it, it is a pause.
PLANNED_WINDOW = TTL / 3
#: A planned failover not done by then is finished with TAKEOVER (the window counts forced).
PLANNED_PATIENCE = 2.5


# -- the client ---------------------------------------------------------------------------------


def client(config: dict[str, Any]) -> None:
    options = {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT}
    setup_django("django_redlock.backends.cluster.RedisClusterBackend", config["url"], options, TTL)
    from django_redlock import LockError, LockLost, lock, locks
    from django_redlock.signals import lock_lost

    log = Log(config["log"], config["id"])
    watch(log)  # scheduling stalls (stall.py)
    rng = random.Random(config["seed"])
    backend = locks["default"]
    names = [f"{config['name']}:{k}" for k in range(NAMES)]
    held: dict[str, tuple[Any, int, float]] = {}  # name -> (lock, hold, release at)
    hold_of: dict[int, int] = {}  # id(lock) -> hold
    fake: set[int] = set()  # CAMPAIGN_BREAK=twice: holds refused, yet counted on
    stopping = []

    def on_lost(sender: Any, lock: Any = None, **kwargs: Any) -> None:
        hold = hold_of.get(id(lock))
        if hold is not None:
            log("lost", h=hold, reason=str(kwargs.get("reason", ""))[:200])

    lock_lost.connect(on_lost, weak=False)
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    log("start", pid=os.getpid())

    def guarded(hold: int, what: str, call: Any) -> Any:
        t0 = time.time()
        try:
            return call()
        except LockLost as exc:
            log("lost", h=hold, reason=f"{what}: {type(exc).__name__}: {exc}"[:300])
        except LockError as exc:
            log(f"{what}_err", h=hold, err=type(exc).__name__, msg=str(exc)[:200], since=t0)
        except Exception as exc:
            log("bad", h=hold, what=f"{what} raised {type(exc).__name__}: {exc}"[:400])
        return None

    hold = 0
    while not stopping or held:
        now = time.time()
        for name, (lk, h, until) in list(held.items()):
            if stopping or now >= until:
                log("rel", h=h)  # before the call: the hold is no longer counted on from here
                if h not in fake:
                    guarded(h, "rel", lk.release)
                del held[name]
                hold_of.pop(id(lk), None)
        if config.get("break") == "lost" and held and rng.random() < 0.01:
            name, (lk, h, _) = rng.choice(sorted(held.items()))
            with contextlib.suppress(Exception):
                backend.client.delete(backend.key(name))  # type: ignore[attr-defined]
                log("broke", h=h)
        free = [n for n in names if n not in held]
        if not stopping and len(held) < HELD and free:
            name = rng.choice(free)
            lk = lock(name, ttl=TTL)
            hold += 1
            hold_of[id(lk)] = hold
            log("acq", h=hold, name=name, key=backend.key(name))
            if guarded(hold, "acq", lambda lk=lk: lk.acquire(blocking=False)):
                held[name] = (lk, hold, time.time() + rng.uniform(0.3, 4.0) * TTL)
                fence = lk.fence
                if fence is not None and config.get("break") == "fence" and rng.random() < 0.1:
                    fence -= 10_000_000  # as if granted 10 s earlier
                log("acq_ok", h=hold, fence=fence)
            elif config.get("break") == "twice" and rng.random() < 0.1:
                held[name] = (lk, hold, time.time() + rng.uniform(0.3, 4.0) * TTL)
                fake.add(hold)
                log("acq_ok", h=hold, fence=None)  # refused, yet counted on as held
            else:
                hold_of.pop(id(lk), None)
        time.sleep(0.02)
    log("stop")


# -- the run ------------------------------------------------------------------------------------


class Shards:
    """The cluster's three shards, each a master and (when a failover is planned) a replica;
    which of the two is master changes with each failover."""

    def __init__(self, masters: list[Any], replicas: list[Any]) -> None:
        self.pairs = [[m, *([replicas[i]] if replicas else [])] for i, m in enumerate(masters)]
        self.master = [0] * len(masters)  # index in pairs[i] of the current master
        self.tried: dict[int, float] = {}  # port -> when it last asked for votes (candidate)
        self.voted: dict[int, float] = {}  # port -> when masters last voted about it
        self.clients = {n.port: n.client(socket_timeout=2) for p in self.pairs for n in p}

    def of(self, shard: int) -> tuple[Any, Any]:
        """(master, replica) of a shard; no replica: None."""
        pair = [*self.pairs[shard], None]
        return pair[self.master[shard]], pair[1 - self.master[shard]]

    def slot(self, shard: int) -> int:
        return shard * 16384 // len(self.pairs)

    def can_plan(self, shard: int, now: float) -> bool:
        """A planned failover of ``shard`` now is neither refused by the votes nor stalled."""
        master, replica = self.of(shard)
        return (now - self.tried.get(replica.port, -1e9) > 4 * NODE_TIMEOUT + 1
                and now - self.voted.get(master.port, -1e9) > 2 * NODE_TIMEOUT + 1
                and self.synced(shard) and self.known(shard))  # fmt: skip

    def known(self, shard: int) -> bool:
        """Every node knows the shard's replica as its master's replica: a fail-back asked
        before the old master's demotion reached them stalls (1 s after a failover: stalled
        till the TAKEOVER; 2 s after: handed over in 0.06 s)."""
        master, replica = self.of(shard)
        try:
            ids = {n.port: self.clients[n.port].execute_command("CLUSTER", "MYID").decode()
                   for n in (master, replica)}  # fmt: skip
            for node in self.clients.values():
                for line in node.execute_command("CLUSTER", "NODES").decode().splitlines():
                    fields = line.split()
                    if fields[0] == ids[replica.port] and (
                        "slave" not in fields[2] or fields[3] != ids[master.port]
                    ):
                        return False
            return True
        except Exception:
            return False

    def failed_over(self, shard: int) -> bool:
        """Whether the shard's replica took over on its own (then it is the master now)."""
        _, replica = self.of(shard)
        with contextlib.suppress(Exception):
            if replica and self.clients[replica.port].info("replication")["role"] == "master":
                self.master[shard] = 1 - self.master[shard]
                return True
        return False

    def synced(self, shard: int) -> bool:
        _, replica = self.of(shard)
        with contextlib.suppress(Exception):
            info = self.clients[replica.port].info("replication")
            return bool(info.get("master_link_status") == "up")
        return False

    def handed_over(self, shard: int, new: Any, old: Any) -> bool:
        """Every node names ``new`` the shard's master, and ``old`` is a replica."""
        slot = self.slot(shard)
        try:
            for node in self.clients.values():
                for lo, hi, primary, *_ in node.execute_command("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi and int(primary[1]) != new.port:
                        return False
            return bool(self.clients[old.port].info("replication")["role"] == "slave")
        except Exception:
            return False

    def failover(
        self, shard: int, force: float | None, errors: list[str]
    ) -> tuple[float, float, bool]:
        """Fail the shard over to its replica: (began, ended, forced), wall clock. Forced: the
        replica misses what the master wrote in its last ``force`` seconds (on loopback it
        would miss nothing): SIGSTOPped, its replication link cut by the master, and the
        TAKEOVER sent before it resumes, so that it takes over (at once, on reading the
        command) before its reconnection's handshake can bring the missed writes."""
        old, new = self.of(shard)
        began = time.time()
        client = self.clients[new.port]
        if force is not None:
            new.pause()
            try:
                self.clients[old.port].execute_command("CLIENT", "KILL", "TYPE", "replica")
                time.sleep(force)
                with socket.create_connection(("127.0.0.1", new.port), timeout=5) as raw:
                    raw.sendall(b"*3\r\n$7\r\nCLUSTER\r\n$8\r\nFAILOVER\r\n$8\r\nTAKEOVER\r\n")
                    new.resume()
                    if not raw.recv(100).startswith(b"+OK"):
                        errors.append(f"TAKEOVER on port {new.port} refused")
            finally:
                new.resume()
        else:
            self.tried[new.port] = self.voted[old.port] = time.monotonic()
            client.execute_command("CLUSTER", "FAILOVER")
        deadline = time.monotonic() + (10.0 if force is not None else PLANNED_PATIENCE)
        forced = force is not None
        while not self.handed_over(shard, new, old):
            if time.monotonic() > deadline:
                if forced:
                    errors.append(f"failover of shard {shard} to port {new.port} not done in 10 s")
                    break
                forced = True  # stalled (refused votes): what an operator does next
                client.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
                deadline = time.monotonic() + 10.0
            time.sleep(0.01)
        self.master[shard] = 1 - self.master[shard]
        return began, time.time(), forced


def run_cluster(seed: int, seconds: float) -> KindReport:
    from django_redlock.testing import RedisServer

    directory = Path(tempfile.mkdtemp(prefix=f"campaign-cluster-{seed}-"))
    plan = [] if not (set(MOVES) - excluded()) else storms(
        seed, seconds, calm=(0.5, 1.5), storm=(1.5 * TTL, 2 * TTL), tail=TTL)  # fmt: skip
    moving = random.Random(seed * 37 + 11)
    moves = [moving.choice([m for m in MOVES if m not in excluded()]) for _ in plan]
    with_replicas = any(m.startswith("failover") for m in moves)
    args = cluster_args(NODE_TIMEOUT if with_replicas else 30.0)
    masters = [RedisServer(args=args).start() for _ in range(3)]
    replicas = [RedisServer(args=args).start() for _ in range(3)] if with_replicas else []
    procs: list[subprocess.Popen[bytes]] = []
    faults: Counter[str] = Counter()
    pauses: list[tuple[int, float, float]] = []  # (shard, from, to), wall clock
    failovers: list[tuple[int, float, float, bool]] = []  # (shard, from, to, forced)
    errors: list[str] = []
    try:
        _create(masters, replicas)
        shards = Shards(masters, replicas)
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
        for i in range(CLIENTS):
            config = {"id": f"c{i + 1}", "seed": seed * 100 + i, "url": masters[0].url,
                      "name": f"campaign:cluster:{seed}", "log": str(directory / f"c{i + 1}.jsonl"),
                      "break": os.environ.get("CAMPAIGN_BREAK", "")}  # fmt: skip
            with open(directory / f"c{i + 1}.stderr", "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.campaign.cluster", json.dumps(config)],
                    cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=err,
                ))  # fmt: skip
        _wait_started(directory, CLIENTS, timeout=60)
        _settle([*masters, *replicas], len(replicas))
        rng = random.Random(seed * 31 + 7)
        origin, started = time.monotonic(), time.time()
        for (start, length), move in zip(plan, moves, strict=True):
            _sleep_until(origin + start)
            shard = rng.randrange(len(masters))
            if move.startswith("failover"):
                now = time.monotonic()
                ready = [i for i in range(len(masters)) if shards.synced(i)
                         and (move == "failover_force" or shards.can_plan(i, now))]  # fmt: skip
                if ready:
                    shard = ready[rng.randrange(len(ready))]
                    cut = rng.uniform(0.1, 0.6) if move == "failover_force" else None
                    began, ended, forced = shards.failover(shard, cut, errors)
                    failovers.append((shard, began, ended, forced))
                    faults[move if forced == (move != "failover") else "failover_stalled"] += 1
                    _sleep_until(origin + start + length)
                    continue
                if "master_pause" in excluded():
                    continue  # no shard ready for this failover, and no pause instead
                faults["failover_not_ready"] += 1
            if time.monotonic() > origin + start + length - 0.5:
                continue  # the move before ran into this storm (a stalled failover)
            master, _ = shards.of(shard)
            began = time.time()
            master.pause()
            faults["master_pause"] += 1
            _sleep_until(origin + start + length)
            master.resume()
            pauses.append((shard, began, time.time()))
            if shards.failed_over(shard):  # a pause past the node timeout (a loaded machine)
                failovers.append((shard, began, time.time(), True))
                faults["auto_failover"] += 1
        _sleep_until(origin + seconds)
        stopping = time.time()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                errors.append(f"client pid {proc.pid} did not stop within 10 s of SIGTERM")
                proc.kill()
                proc.wait()
        for i, proc in enumerate(procs):
            if proc.returncode not in (0, -signal.SIGTERM):
                tail = (directory / f"c{i + 1}.stderr").read_text()[-1500:]
                errors.append(f"client c{i + 1} exited {proc.returncode}: {tail}")
        events = read_logs(sorted(directory.glob("c*.jsonl")))
        owner = _owners(shards, {e["key"] for e in events if e["e"] == "acq"})
        report = check(seed, seconds, events, owner, pauses, stopping, failovers)
        report.faults, report.started = faults, started
        report.harness_errors += errors
        report.exclude = ",".join(sorted(excluded()))
        return report
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for node in [*masters, *replicas]:
            with contextlib.suppress(Exception):
                node.resume()
            node.kill()
            node.stop()
        if os.environ.get("CAMPAIGN_KEEP") is None:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def _create(masters: list[Any], replicas: list[Any], timeout: float = 30.0) -> None:
    """``create_cluster``'s cluster, the replicas joined while the masters settle (a master
    takes 2 s from its start to serve its slots; joining after that cost 3.6 s more). Returns
    once every slot is served and each replica synced; ``_settle`` waits for the rest."""
    from django_redlock.testing import create_cluster

    if not replicas:
        create_cluster(masters)
        return
    everyone = [*masters, *replicas]
    for i, server in enumerate(masters):
        slots = range(i * 16384 // len(masters), (i + 1) * 16384 // len(masters))
        server.client().execute_command("CLUSTER", "ADDSLOTS", *slots)
    for server in everyone[1:]:
        server.client().execute_command("CLUSTER", "MEET", "127.0.0.1", masters[0].port)
    ids = [m.client().execute_command("CLUSTER", "MYID").decode() for m in masters]
    deadline = time.monotonic() + timeout
    waiting = dict(zip(ids, replicas, strict=True))
    while waiting:  # refused until the replica knows its master
        for master_id, replica in list(waiting.items()):
            with contextlib.suppress(Exception):
                replica.client().execute_command("CLUSTER", "REPLICATE", master_id)
                del waiting[master_id]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError("a replica never knew its master")
        time.sleep(0.05)

    def serving(server: Any) -> bool:
        c = server.client()
        if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
            return False
        return server in masters or c.info("replication").get("master_link_status") == "up"

    while not all(serving(s) for s in everyone):
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not come up")
        time.sleep(0.05)


def _settle(everyone: list[Any], replicas: int, timeout: float = 30.0) -> None:
    """Every node knows every replica as one (else a failover's election lacks the votes):
    gossip takes a second or two more, spent while the clients start."""

    def settled(server: Any) -> bool:
        lines = server.client().execute_command("CLUSTER", "NODES").decode().splitlines()
        flags = [line.split()[2] for line in lines]
        return (len(flags) == len(everyone) and sum("slave" in f for f in flags) == replicas
                and not any("handshake" in f or "noaddr" in f for f in flags))  # fmt: skip

    deadline = time.monotonic() + timeout
    while replicas and not all(settled(s) for s in everyone):
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster's nodes never all knew each other")
        time.sleep(0.05)


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def _wait_started(directory: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = [p for p in directory.glob("c*.jsonl") if b'"start"' in p.read_bytes()[:300]]
        if len(started) >= count:
            return
        time.sleep(0.1)


def _owners(shards: Shards, keys: set[str]) -> dict[str, int]:
    """Which shard (index) serves each key: its slot's range (slots never move here)."""
    client = shards.clients[shards.of(0)[0].port]
    owner = {}
    for key in keys:
        slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        count = len(shards.pairs)
        owner[key] = next(i for i in range(count) if slot < (i + 1) * 16384 // count)
    return owner


def check(
    seed: int,
    seconds: float,
    events: list[dict[str, Any]],
    owner: dict[str, int],
    pauses: list[tuple[int, float, float]],
    stopping: float,
    failovers: list[tuple[int, float, float, bool]],
) -> KindReport:
    holds: dict[tuple[str, int], dict[str, Any]] = {}
    violations: list[Violation] = []
    stats: Counter[str] = Counter()
    excused: Counter[str] = Counter()
    # Windows that excuse a loss on their shard: pauses, forced failovers, and planned ones
    # that took long enough to be pauses themselves.
    excuses = [*pauses, *((s, a, b) for s, a, b, forced in failovers
                          if forced or b - a > PLANNED_WINDOW)]  # fmt: skip
    for ev in events:
        if "h" not in ev:
            continue
        hold = holds.setdefault((ev["c"], ev["h"]), {})
        e = ev["e"]
        stats[e] += 1
        if e == "acq":
            hold.update(start=ev["t"], key=ev["key"], name=ev["name"], client=ev["c"], h=ev["h"])
        elif e == "acq_ok":
            hold.update(held=ev["t"], fence=ev.get("fence"))
        elif e == "rel" and "released" not in hold:
            hold["released"] = ev["t"]
        elif e == "rel_err":
            hold["rel_err"] = True
        elif e == "bad":
            violations.append(Violation("not-lock-error", ev["t"], f"{ev['c']}/h{ev['h']}: "
                                        f"{ev['what']}", {ev["c"]}))  # fmt: skip
        elif e == "lost" and "start" in hold and "lost" not in hold:
            hold["lost"] = ev["t"]
            shard = owner[hold["key"]]
            since = hold["start"] - TTL
            if any(w[0] == shard and w[1] < ev["t"] and w[2] > since for w in pauses):
                excused["pause"] += 1
                continue
            if any(w[0] == shard and w[1] < ev["t"] and w[2] > since for w in excuses):
                excused["failover"] += 1
                continue
            planned = [round(b - a, 3) for s, a, b, _ in failovers
                       if s == shard and a < ev["t"] and b > since]  # fmt: skip
            meanwhile = [*pauses, *failovers]
            others = sorted({w[0] for w in meanwhile if w[1] < ev["t"] and w[2] > since})
            violations.append(Violation(
                "lost-on-failover" if planned else "lost-on-healthy", ev["t"],
                f"{ev['c']}/h{ev['h']}: hold of {hold['name']!r} on shard {shard} reported"
                f" lost ({ev.get('reason', '')}) {ev['t'] - hold['start']:.2f} s after its"
                + (f" acquire; its shard failed over (planned) meanwhile, handed over in"
                   f" {planned} s (under {PLANNED_WINDOW:g} s: a confirmed hold survives it)"
                   if planned else
                   " acquire; its master answered throughout")
                + f" (shards paused or failed over meanwhile: {others or 'none'})", {ev["c"]},
            ))  # fmt: skip
    fenced, overlaps = _fences(holds)
    violations += fenced
    lost = sum(1 for h in holds.values() if "lost" in h)
    report = KindReport("cluster", "cluster", seed, seconds, {
        "clients": len({c for c, _ in holds}), "acq_ok": stats["acq_ok"],
        "writes": stats["rel"], "lost": lost,
    }, Counter(), violations)  # fmt: skip
    report.lines.append(
        f"  operations: {stats['acq']} acquires ({stats['acq_ok']} held, {stats['acq_err']}"
        f" errors, {stats['acq'] - stats['acq_ok'] - stats['acq_err']} refused as held),"
        f" {stats['rel']} releases ({stats['rel_err']} errors); holds lost on a paused master"
        f" {excused['pause']}, on a failed-over one {excused['failover']} (allowed); {overlaps}"
        f" holds of a name taken while an earlier one, later reported lost, was still counted"
        f" on; {len(pauses)} master pauses of {[round(b - a, 1) for _, a, b in pauses]} s"
        f" (TTL {TTL:g} s)")  # fmt: skip
    report.lines.append(Stalls(events).describe(harness=False))  # no property here is about time
    if failovers:
        # Holds confirmed before a planned failover of their shard and counted on after it.
        through = Counter(
            "lost" in h for h in holds.values() if "held" in h
            for s, a, b, f in failovers
            if not f and owner[h["key"]] == s and h["held"] < a
            and min(h.get("released", stopping), h.get("lost", stopping)) > b
        )  # fmt: skip
        report.lines.append(
            "  failovers (shard, handed over in s, forced): "
            + ", ".join(f"({s}, {b - a:.3f}, {'forced' if f else 'planned'})"
                        for s, a, b, f in failovers)
            + f"; holds through a planned failover: {through[False] + through[True]}"
            f" ({through[True]} later lost)")  # fmt: skip
    return report


def _fences(holds: dict[tuple[str, int], dict[str, Any]]) -> tuple[list[Violation], int]:
    """``fence-order`` and ``two-holders``, per name; and how many holds began while an
    earlier one of their name, later reported lost, was still counted on (what the fences
    are for)."""
    violations: list[Violation] = []
    overlaps = 0
    by_name: dict[str, list[dict[str, Any]]] = {}
    for hold in holds.values():
        if "held" in hold:
            by_name.setdefault(hold["name"], []).append(hold)
    for name, group in by_name.items():
        group.sort(key=lambda h: h["held"])
        for b in group:
            # Every hold confirmed before b's acquire began was granted before b's was.
            for a in group:
                if a["held"] >= b["start"]:
                    break
                if a["fence"] is not None and b["fence"] is not None and a["fence"] >= b["fence"]:
                    violations.append(Violation(
                        "fence-order", b["held"],
                        f"{b['client']}/h{b['h']} of {name!r} got fence {b['fence']}, not above"
                        f" {a['fence']} of {a['client']}/h{a['h']}, confirmed"
                        f" {b['start'] - a['held']:.3f} s before its acquire began",
                        {a["client"], b["client"]},
                    ))  # fmt: skip
                    break
        for a in group:
            if "lost" in a:
                ended = min(a["lost"], a.get("released", a["lost"]))
                overlaps += sum(1 for b in group if a["held"] < b["held"] < ended)
        # Holds believed from the acquire's return to the release's call, never reported lost.
        kept = [h for h in group if "released" in h and "lost" not in h and "rel_err" not in h]
        latest: dict[str, Any] | None = None  # the kept hold released last so far
        for b in kept:
            before = latest
            if before is None or b["released"] > before["released"]:
                latest = b
            if before is not None and b["held"] < before["released"]:
                a = before
                violations.append(Violation(
                    "two-holders", b["held"],
                    f"{a['client']}/h{a['h']} and {b['client']}/h{b['h']} both held {name!r}"
                    f" for {min(a['released'], b['released']) - b['held']:.3f} s (fences"
                    f" {a['fence']}, {b['fence']}), and neither was ever reported lost",
                    {a["client"], b["client"]},
                ))  # fmt: skip
    return violations, overlaps


if __name__ == "__main__":
    client(json.loads(sys.argv[1]))
