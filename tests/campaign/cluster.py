"""The Cluster kind (issue #43): a real 3-master Redis Cluster, clients holding several locks
at once (on every master), and a nemesis that pauses one master (SIGSTOP) for longer than the
TTL while holds live on the others.

Property ``lost-on-healthy``: no hold on a master that answered throughout (not paused from a
TTL before its acquire to the loss) is reported lost (the ``lock_lost`` signal, or
``LockLost`` at release). A shard is a backend for the watchdog: a paused master holds up its
own renewals and nobody else's. Before issue #41's fix one pipeline renewed every shard, and
redis-py re-sent each timed-out command on its own: every hold of the healthy masters
expired behind the paused one. Also ``not-lock-error``: nothing but ``LockError`` leaves the
API.

The client is this module run as ``python -m tests.campaign.cluster CONFIG_JSON``.
``CAMPAIGN_BREAK=lost`` (self-test): each client deletes one of its own holds' keys on a
healthy master now and then: ``lost-on-healthy`` must fail.
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
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .checker import Violation
from .scenario import KindReport, Log, excluded, read_logs, setup_django, storms

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.5
SOCKET_TIMEOUT = 0.3
CLIENTS = 3
HELD = 4  # holds each client keeps at once, on names spread over the masters
NAMES = 10  # names per client
#: No failover, no "cluster down": a pause stays far below the node timeout.
CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-node-timeout", "30000")


# -- the client ---------------------------------------------------------------------------------


def client(config: dict[str, Any]) -> None:
    options = {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT}
    setup_django("django_redlock.backends.cluster.RedisClusterBackend", config["url"], options, TTL)
    from django_redlock import LockError, LockLost, lock, locks
    from django_redlock.signals import lock_lost

    log = Log(config["log"], config["id"])
    rng = random.Random(config["seed"])
    backend = locks["default"]
    names = [f"{config['name']}:{config['id']}:{k}" for k in range(NAMES)]
    held: dict[str, tuple[Any, int, float]] = {}  # name -> (lock, hold, release at)
    hold_of: dict[int, int] = {}  # id(lock) -> hold
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
                guarded(h, "rel", lk.release)
                log("rel", h=h)
                del held[name]
                hold_of.pop(id(lk), None)
        if config.get("break") == "lost" and held and rng.random() < 0.01:
            name, (lk, h, _) = rng.choice(sorted(held.items()))
            with contextlib.suppress(Exception):
                backend.client.delete(backend.key(name))  # type: ignore[attr-defined]
                log("broke", h=h)
        if not stopping and len(held) < HELD:
            name = rng.choice([n for n in names if n not in held])
            lk = lock(name, ttl=TTL)
            hold += 1
            hold_of[id(lk)] = hold
            log("acq", h=hold, name=name, key=backend.key(name))
            if guarded(hold, "acq", lambda lk=lk: lk.acquire(blocking=False)):
                held[name] = (lk, hold, time.time() + rng.uniform(0.3, 4.0) * TTL)
                log("acq_ok", h=hold)
            else:
                hold_of.pop(id(lk), None)
        time.sleep(0.02)
    log("stop")


# -- the run ------------------------------------------------------------------------------------


def run_cluster(seed: int, seconds: float) -> KindReport:
    from django_redlock.testing import RedisServer, create_cluster

    directory = Path(tempfile.mkdtemp(prefix=f"campaign-cluster-{seed}-"))
    nodes = [RedisServer(args=CLUSTER_ARGS).start() for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    faults: Counter[str] = Counter()
    pauses: list[tuple[int, float, float]] = []  # (master, from, to), wall clock
    errors: list[str] = []
    try:
        create_cluster(nodes)
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
        for i in range(CLIENTS):
            config = {"id": f"c{i + 1}", "seed": seed * 100 + i, "url": nodes[0].url,
                      "name": f"campaign:cluster:{seed}", "log": str(directory / f"c{i + 1}.jsonl"),
                      "break": os.environ.get("CAMPAIGN_BREAK", "")}  # fmt: skip
            with open(directory / f"c{i + 1}.stderr", "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.campaign.cluster", json.dumps(config)],
                    cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=err,
                ))  # fmt: skip
        _wait_started(directory, CLIENTS, timeout=60)
        rng = random.Random(seed * 31 + 7)
        origin, started = time.monotonic(), time.time()
        plan = (
            []
            if "master_pause" in excluded()
            else storms(seed, seconds, calm=(0.5, 1.5), storm=(1.5 * TTL, 2 * TTL), tail=TTL)
        )
        for start, length in plan:
            _sleep_until(origin + start)
            master = rng.randrange(len(nodes))
            began = time.time()
            nodes[master].pause()
            faults["master_pause"] += 1
            _sleep_until(origin + start + length)
            nodes[master].resume()
            pauses.append((master, began, time.time()))
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
        owner = _owners(nodes, {e["key"] for e in events if e["e"] == "acq"})
        report = check(seed, seconds, events, owner, pauses, stopping)
        report.faults, report.started = faults, started
        report.harness_errors += errors
        report.exclude = ",".join(sorted(excluded()))
        return report
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for node in nodes:
            with contextlib.suppress(Exception):
                node.resume()
            node.kill()
            node.stop()
        if os.environ.get("CAMPAIGN_KEEP") is None:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def _wait_started(directory: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = [p for p in directory.glob("c*.jsonl") if b'"start"' in p.read_bytes()[:300]]
        if len(started) >= count:
            return
        time.sleep(0.1)


def _owners(nodes: list[Any], keys: set[str]) -> dict[str, int]:
    """Which master (index) serves each key."""
    client = nodes[0].client(socket_timeout=5)
    ranges = []
    for lo, hi, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
        port = int(primary[1])
        ranges.append((int(lo), int(hi), next(i for i, n in enumerate(nodes) if n.port == port)))
    owner = {}
    for key in keys:
        slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        owner[key] = next(i for lo, hi, i in ranges if lo <= slot <= hi)
    return owner


def check(
    seed: int,
    seconds: float,
    events: list[dict[str, Any]],
    owner: dict[str, int],
    pauses: list[tuple[int, float, float]],
    stopping: float,
) -> KindReport:
    holds: dict[tuple[str, int], dict[str, Any]] = {}
    violations: list[Violation] = []
    stats: Counter[str] = Counter()
    for ev in events:
        if "h" not in ev:
            continue
        hold = holds.setdefault((ev["c"], ev["h"]), {})
        e = ev["e"]
        stats[e] += 1
        if e == "acq":
            hold.update(start=ev["t"], key=ev["key"], name=ev["name"])
        elif e == "bad":
            violations.append(Violation("not-lock-error", ev["t"], f"{ev['c']}/h{ev['h']}: "
                                        f"{ev['what']}", {ev["c"]}))  # fmt: skip
        elif e == "lost" and "start" in hold and "lost" not in hold:
            hold["lost"] = ev["t"]
            master = owner[hold["key"]]
            since = hold["start"] - TTL
            hit = [p for p in pauses if p[0] == master and p[1] < ev["t"] and p[2] > since]
            if not hit:
                others = sorted({p[0] for p in pauses if p[1] < ev["t"] and p[2] > since})
                violations.append(Violation(
                    "lost-on-healthy", ev["t"],
                    f"{ev['c']}/h{ev['h']}: hold of {hold['name']!r} on master {master} reported"
                    f" lost ({ev.get('reason', '')}) {ev['t'] - hold['start']:.2f} s after its"
                    f" acquire; its master answered throughout (masters paused meanwhile:"
                    f" {others or 'none'})", {ev["c"]},
                ))  # fmt: skip
    lost_paused = sum(1 for h in holds.values() if "lost" in h) - sum(
        1 for v in violations if v.prop == "lost-on-healthy")  # fmt: skip
    report = KindReport("cluster", "cluster", seed, seconds, {
        "clients": len({c for c, _ in holds}), "acq_ok": stats["acq_ok"],
        "writes": stats["rel"], "lost": sum(1 for h in holds.values() if "lost" in h),
    }, Counter(), violations)  # fmt: skip
    report.lines.append(
        f"  operations: {stats['acq']} acquires ({stats['acq_ok']} held, {stats['acq_err']}"
        f" errors), {stats['rel']} releases ({stats['rel_err']} errors); {lost_paused} holds"
        f" lost on a paused master (allowed), {len(pauses)} master pauses of"
        f" {[round(b - a, 1) for _, a, b in pauses]} s (TTL {TTL:g} s)")  # fmt: skip
    return report


if __name__ == "__main__":
    client(json.loads(sys.argv[1]))
