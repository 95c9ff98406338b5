"""The long-TTL Redlock kind (issue #43): five nodes, holds with a TTL of 20 s (as
production's are), and single-node pauses one after another, never two at once.

With the campaign's TTL of 1 s, a released hold left behind on a node the release skipped
expires within a second, before anything can see it. With 20 s it stays: a release decided
by the other nodes that never reaches the paused node leaves the released hold there, and
three such nodes, each paused alone, refuse every acquire on a healthy cluster until the
TTLs run out (issue #42).

Two client processes, each on a lock name of its own (nobody else ever holds it): a loop of
``acquire(blocking=False)``, a short hold (10-100 ms), ``release()``. Property
``free-lock-refused``: an acquire answered False while every node had been up for 0.5 s, by
a client holding nothing whose last release returned without error (a release that raised
may have left its hold: the next TTL is not judged). ``error-one-node-down``: an acquire or
release that raised while at most one node was paused (from 0.5 s before the call): five nodes
tolerate two. A release's count takes in the nodes unavailable at its hold's acquire too (paused,
or skipped by their breaker, BREAKER after a pause): a hold the other three granted is released
by a majority of those three only. ``not-lock-error`` as elsewhere.

The client is this module run as ``python -m tests.campaign.longttl CONFIG_JSON``.
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

from .checker import BREAKER, Violation
from .scenario import KindReport, Log, excluded, read_logs, setup_django, storms
from .stall import Stalls, watch

ROOT = Path(__file__).resolve().parents[2]
TTL = 20.0
SOCKET_TIMEOUT = 0.2
CLIENTS = 2
NODES = 5
#: Every node up this long before a refusal is judged.
SETTLE = 0.5


def client(config: dict[str, Any]) -> None:
    options = {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT,
               "restart_guard": TTL}  # fmt: skip
    setup_django("django_redlock.backends.redlock.RedlockBackend", config["urls"], options, TTL)
    from django_redlock import LockError, lock

    log = Log(config["log"], config["id"])
    watch(log)  # scheduling stalls (stall.py)
    rng = random.Random(config["seed"])
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    log("start", pid=os.getpid())
    hold = 0
    while not stopping:
        hold += 1
        lk = lock(config["name"], ttl=TTL)
        log("acq", h=hold)
        try:
            got = lk.acquire(blocking=False)
        except LockError as exc:
            log("acq_err", h=hold, err=type(exc).__name__, msg=str(exc)[:200])
            time.sleep(0.05)
            continue
        except Exception as exc:
            log("bad", h=hold, what=f"acquire raised {type(exc).__name__}: {exc}"[:400])
            continue
        log("acq_ok" if got else "acq_no", h=hold)
        if got:
            time.sleep(rng.uniform(0.01, 0.1))
            since = time.time()
            try:
                lk.release()
                log("rel_ok", h=hold)
            except LockError as exc:
                log("rel_err", h=hold, err=type(exc).__name__, msg=str(exc)[:200], since=since)
            except Exception as exc:
                log("bad", h=hold, what=f"release raised {type(exc).__name__}: {exc}"[:400])
        time.sleep(rng.uniform(0.01, 0.05))
    log("stop")


def run_longttl(seed: int, seconds: float) -> KindReport:
    from django_redlock.testing import RedisServer

    directory = Path(tempfile.mkdtemp(prefix=f"campaign-longttl-{seed}-"))
    nodes = [RedisServer().start() for _ in range(NODES)]
    procs: list[subprocess.Popen[bytes]] = []
    faults: Counter[str] = Counter()
    pauses: list[tuple[int, float, float]] = []
    errors: list[str] = []
    try:
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
        for i in range(CLIENTS):
            cid = f"c{i + 1}"
            config = {"id": cid, "seed": seed * 100 + i, "urls": [n.url for n in nodes],
                      "name": f"campaign:longttl:{seed}:{cid}",
                      "log": str(directory / f"{cid}.jsonl")}  # fmt: skip
            with open(directory / f"{cid}.stderr", "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.campaign.longttl", json.dumps(config)],
                    cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=err,
                ))  # fmt: skip
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
            and len([p for p in directory.glob("c*.jsonl") if b'"start"' in p.read_bytes()[:300]])
            < CLIENTS
        ):
            time.sleep(0.1)
        rng = random.Random(seed * 17 + 1)
        origin, started = time.monotonic(), time.time()
        # Single-node pauses one after another (0.3-1 s each, 0.2-1 s apart).
        plan = [] if "node_pause" in excluded() else storms(
            seed, seconds, calm=(0.2, 1.0), storm=(0.3, 1.0), tail=1.0)  # fmt: skip
        last = -1
        for start, length in plan:
            time.sleep(max(0.0, origin + start - time.monotonic()))
            node = rng.choice([i for i in range(NODES) if i != last])
            last = node
            began = time.time()
            nodes[node].pause()
            faults["node_pause"] += 1
            time.sleep(max(0.0, origin + start + length - time.monotonic()))
            nodes[node].resume()
            pauses.append((node, began, time.time()))
        time.sleep(max(0.0, origin + seconds - time.monotonic()))
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for i, proc in enumerate(procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                errors.append(f"client c{i + 1} did not stop within 10 s of SIGTERM")
                proc.kill()
                proc.wait()
            if proc.returncode not in (0, -signal.SIGTERM):
                tail = (directory / f"c{i + 1}.stderr").read_text()[-1500:]
                errors.append(f"client c{i + 1} exited {proc.returncode}: {tail}")
        report = check(seed, seconds, read_logs(sorted(directory.glob("c*.jsonl"))), pauses)
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
            node.stop()
        if os.environ.get("CAMPAIGN_KEEP") is None:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def check(
    seed: int, seconds: float, events: list[dict[str, Any]], pauses: list[tuple[int, float, float]]
) -> KindReport:
    violations: list[Violation] = []
    stats: Counter[str] = Counter()
    doubtful_until: dict[str, float] = {}  # a release raised: its hold may stay a TTL
    began: dict[tuple[str, int], float] = {}
    acquired: dict[tuple[str, int], float] = {}  # when each hold's acquire returned True
    for ev in events:
        e, c = ev["e"], ev["c"]
        stats[e] += 1
        if e == "acq":
            began[(c, ev["h"])] = ev["t"]
        elif e == "acq_ok":
            acquired[(c, ev["h"])] = ev["t"]
        elif e == "rel_err" or e == "acq_err":
            doubtful_until[c] = ev["t"] + TTL
            # Five nodes tolerate two down: with one paused at most, no call may fail.
            start = began.get((c, ev["h"]), ev["t"]) if e == "acq_err" else ev.get("since", 0)
            down = {p[0] for p in pauses if p[1] < ev["t"] and p[2] > start - SETTLE}
            missed: set[int] = set()
            if e == "rel_err" and (c, ev["h"]) in began:
                # A release needs a majority of the nodes holding the hold, and the hold is on
                # those its acquire asked: a node paused then, or skipped by its breaker after
                # a pause that ended up to BREAKER before, never got it when the others made the
                # majority (tests/redlock/test_redlock_bare_majority_release.py).
                asked, got = began[(c, ev["h"])], acquired.get((c, ev["h"]), ev["t"])
                missed = {p[0] for p in pauses if p[1] < got and p[2] > asked - BREAKER}
            if len(down | missed) <= 1:
                violations.append(Violation(
                    "error-one-node-down", ev["t"],
                    f"{c}/h{ev['h']}: {e[:3]} raised {ev['err']}: {ev['msg']} (nodes paused from"
                    f" {SETTLE:g} s before the call: {sorted(down) or 'none'}"
                    + (f"; at its acquire, or {BREAKER:g} s before: {sorted(missed) or 'none'}"
                       if e == "rel_err" else "") + ")", {c},
                ))  # fmt: skip
        elif e == "bad":
            violations.append(Violation("not-lock-error", ev["t"], f"{c}: {ev['what']}", {c}))
        elif e == "acq_no":
            start = began.get((c, ev["h"]), ev["t"])
            if start < doubtful_until.get(c, 0.0):
                continue
            # Every node up from SETTLE before the call to its answer.
            if any(p[1] < ev["t"] and p[2] > start - SETTLE for p in pauses):
                continue
            stats["judged_refusals"] += 1
            violations.append(Violation(
                "free-lock-refused", ev["t"],
                f"{c}/h{ev['h']}: acquire(blocking=False) of a lock nobody held answered False"
                f" with every node up for {SETTLE:g} s; its last release had returned (TTL"
                f" {TTL:g} s; last pauses: nodes"
                f" {[p[0] for p in pauses if p[2] < ev['t']][-5:]})", {c},
            ))  # fmt: skip
    report = KindReport("redlock", "long-ttl", seed, seconds, {
        "clients": len({e["c"] for e in events}), "acq_ok": stats["acq_ok"],
        "writes": stats["rel_ok"], "lost": 0}, Counter(), violations)  # fmt: skip
    report.lines.append(
        f"  operations: {stats['acq']} acquires ({stats['acq_ok']} held, {stats['acq_no']} not,"
        f" {stats['acq_err']} errors), {stats['rel_ok']} releases ({stats['rel_err']} errors);"
        f" {len(pauses)} single-node pauses (TTL {TTL:g} s)")  # fmt: skip
    report.lines.append(Stalls(events).describe(harness=False))  # no property here is about time
    return report


if __name__ == "__main__":
    client(json.loads(sys.argv[1]))
