"""One campaign run: servers, proxies, the resource, client processes, the nemesis, the check.

``run_campaign(backend, kind, seed, seconds)`` returns a :class:`~.checker.Report`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from django_redlock.testing import FakeClock, RedisServer, faketime_server

from . import throughput
from .checker import Report, Violation, check
from .database import Database
from .nemesis import CLOCK, DATA_LOSS, Fault, Nemesis, make_plan
from .proxy import Proxy
from .resource import Resource

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.0
CLIENTS = 4
SOCKET_TIMEOUT = {"redis": 0.3, "redlock": 0.2}
RESTART_GUARD = 2 * TTL  # Redlock: >= the TTL, as the docs advise
#: Fair waiters and waiting writers that died keep their place this long
#: (locking.WAITER_LEASE): a waiting writer's lease keeps new readers out.
WAITER_LEASE = 5.0
WAITER_LEASES = ("fair", "write")
KEY_PREFIX = "redlock:"
#: The semaphore kind's permits: fewer than the clients, so they wait for each other.
LIMIT = 2


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class Run:
    """The live pieces of one run; the nemesis calls :meth:`apply` and :meth:`heal`."""

    def __init__(self, backend: str, kind: str, seed: int, seconds: float) -> None:
        self.backend, self.kind, self.seed, self.seconds = backend, kind, seed, seconds
        self.dir = Path(tempfile.mkdtemp(prefix=f"campaign-{backend}-{kind}-{seed}-"))
        # Processes die with the *thread* that started them (PR_SET_PDEATHSIG), so every
        # server and client is started by this one thread, which lives as long as the run.
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher")
        self.rng = random.Random(seed * 7919 + 1)  # the nemesis' own choices at run time
        nodes = 5 if backend == "redlock" else 1
        # Clock faults: each lock server under libfaketime, with a clock of its own.
        self.clocks = [FakeClock() for _ in range(nodes)] if clock_faults(kind) else []
        self.servers = [self.launch(self.lock_server(i).start) for i in range(nodes)]
        self.proxies = [Proxy(s.port, f"node{i}") for i, s in enumerate(self.servers)]
        self.resource_server = self.launch(RedisServer().start)
        self.resource = Resource(self.resource_server.client())
        # The kind "database": fenced transactions on a PostgreSQL the nemesis never touches.
        self.database = Database(self.launch) if kind == "database" else None
        self.name = f"campaign:{kind}:{seed}"
        self.clients: list[subprocess.Popen[bytes] | None] = [None] * CLIENTS
        self.client_ids: list[str] = []
        self.spawned = 0
        self.killed: set[int] = set()  # slots whose client the nemesis killed
        self.procs: list[subprocess.Popen[bytes]] = []  # every client ever started
        self.client_of: dict[int, str] = {}  # pid -> client id
        self._slots = threading.RLock()  # the nemesis and the main loop both (re)spawn
        self.throughput_flag = self.dir / "throughput"  # exists during the throughput phase

    def lock_server(self, i: int) -> RedisServer:
        if not self.clocks:
            return RedisServer()
        return RedisServer(executable=faketime_server(), env=self.clocks[i].env())

    # -- clients -----------------------------------------------------------------------------

    def launch(self, start: Callable[[], Any]) -> Any:
        return self._launcher.submit(start).result()

    def spawn(self, slot: int) -> None:
        with self._slots:
            self.launch(lambda: self._spawn(slot))

    def _spawn(self, slot: int) -> None:
        self.spawned += 1
        cid = f"c{self.spawned}"
        self.client_ids.append(cid)
        config = {
            "id": cid,
            "seed": self.seed * 1000 + self.spawned,
            "backend": self.backend,
            "kind": self.kind,
            "limit": LIMIT,
            "name": self.name,
            "ttl": TTL,
            "socket_timeout": SOCKET_TIMEOUT[self.backend],
            "restart_guard": RESTART_GUARD,
            "lock_urls": [p.url for p in self.proxies],
            "direct_urls": [s.url for s in self.servers],
            "resource_url": self.resource_server.url,
            "database": self.database.settings() if self.database else None,
            "log": str(self.dir / f"{cid}.jsonl"),
            "throughput_flag": str(self.throughput_flag),
        }
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.dir / f"{cid}.stderr", "wb") as err:
            self.clients[slot] = proc = subprocess.Popen(
                [sys.executable, "-m", "tests.campaign.client", json.dumps(config)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                preexec_fn=_die_with_parent,
            )
        self.procs.append(proc)
        self.client_of[proc.pid] = cid

    def wait_started(self, timeout: float) -> None:
        """Until every client has logged its start (Django set up: it takes locks now)."""
        deadline = time.monotonic() + timeout
        for cid in list(self.client_ids):
            path = self.dir / f"{cid}.jsonl"
            while time.monotonic() < deadline:
                if path.exists() and b'"start"' in path.read_bytes()[:200]:
                    break
                time.sleep(0.05)

    def respawn_dead(self) -> None:
        """A client that crashed (its traceback is in the report) is replaced."""
        with self._slots:
            for slot, proc in enumerate(self.clients):
                if slot not in self.killed and proc is not None and proc.poll() is not None:
                    self.spawn(slot)

    def stop_clients(self, grace: float) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- faults ------------------------------------------------------------------------------

    def apply(self, fault: Fault) -> None:
        kind, target = fault.kind, fault.target
        if kind in CLOCK:
            self.apply_clock(fault)
            return
        if kind.startswith("client_"):
            with self._slots:
                proc = self.clients[target]
                if proc is None or proc.poll() is not None:
                    fault.note = "(client already gone)"
                    return
                fault.client = self.client_of[proc.pid]
                fault.note = fault.client
                if kind == "client_kill":
                    self.killed.add(target)
                    proc.kill()
                    proc.wait()
                else:
                    proc.send_signal(signal.SIGSTOP)
            return
        for i in target:
            server, proxy = self.servers[i], self.proxies[i]
            if kind in ("server_pause", "majority_pause", "clog"):
                server.pause()
            elif kind == "server_restart":
                self.launch(server.restart)
            elif kind == "server_down":
                server.kill()
            elif kind == "script_flush":
                server.client(socket_timeout=2).script_flush()
            elif kind == "latency":
                proxy.latency = fault.arg
            elif kind in ("black_hole", "majority_black_hole"):
                proxy.black_hole(fault.duration)
            elif kind == "lose_replies":
                proxy.lose_replies(int(fault.arg))
            elif kind == "reset":
                fault.note = f"({proxy.reset()} connections cut)"
            else:
                raise ValueError(f"unknown fault {kind}")

    def heal(self, fault: Fault) -> None:
        kind, target = fault.kind, fault.target
        if kind in CLOCK:
            self.heal_clock(fault)
            return
        if kind == "client_kill":
            with self._slots:
                if target in self.killed:
                    self.killed.discard(target)
                    self.spawn(target)
            return
        if kind == "client_pause":
            proc = self.clients[target]
            if proc is not None:
                proc.send_signal(signal.SIGCONT)
            return
        for i in target:
            server, proxy = self.servers[i], self.proxies[i]
            if kind in ("server_pause", "majority_pause", "clog"):
                server.resume()
            elif kind == "server_down":
                self.launch(server.start)
            elif kind == "lose_replies":
                lost = proxy.lost_replies
                proxy.heal()
                fault.note = f"({lost} replies lost through node{i} so far)"
            else:
                proxy.heal()

    def apply_clock(self, fault: Fault) -> None:
        """Step the nodes' wall clocks: back for "clock_back", else forward."""
        for i in fault.target:
            self.clocks[i].step(-fault.arg if fault.kind == "clock_back" else fault.arg)

    def heal_clock(self, fault: Fault) -> None:
        """Step them again to the real time; "clock_restore" restarts the node empty too (a
        snapshot's data and clock: its fence counters are gone)."""
        for i in fault.target:
            self.clocks[i].step(fault.arg if fault.kind == "clock_back" else -fault.arg)
            if fault.kind == "clock_restore":
                self.launch(self.servers[i].restart)

    # -- the end -----------------------------------------------------------------------------

    def leftover_keys(self) -> dict[int, dict[str, int]]:
        """Each lock server's keys under the prefix, except the fence counters (and the
        Redlock restart guard's node marker), with their PTTL."""
        found: dict[int, dict[str, int]] = {}
        for i, server in enumerate(self.servers):
            client = server.client(socket_timeout=5)
            keys: dict[str, int] = {}
            for raw in client.scan_iter(match=f"{KEY_PREFIX}*", count=1000):
                key = raw.decode("utf-8", "replace")
                if key.endswith(":f") or key == f"{KEY_PREFIX}node":
                    continue
                keys[key] = int(client.pttl(raw))
            if keys:
                found[i] = keys
        return found

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proxy in self.proxies:
            proxy.stop()
        for server in [*self.servers, self.resource_server]:
            server.stop()
        if self.database is not None:
            self.database.close()
        for clock in self.clocks:
            clock.close()
        self._launcher.shutdown()
        if os.environ.get("CAMPAIGN_KEEP") is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def events(self) -> list[dict[str, Any]]:
        events = []
        for cid in self.client_ids:
            path = self.dir / f"{cid}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        events.append(json.loads(line))
        return events


def clock_faults(kind: str) -> bool:
    """Whether a run of ``kind`` steps its servers' clocks: fenced transactions only (the
    database keeps order through a step; Redis's own holds and fences may not), on servers
    that start under libfaketime, unless CAMPAIGN_EXCLUDE names "clock"."""
    excluded = "clock" in os.environ.get("CAMPAIGN_EXCLUDE", "").split(",")
    return kind == "database" and not excluded and faketime_server() is not None


def run_campaign(backend: str, kind: str, seed: int, seconds: float) -> Report:
    run = Run(backend, kind, seed, seconds)
    nodes = len(run.servers)
    exclude = frozenset(filter(None, os.environ.get("CAMPAIGN_EXCLUDE", "").split(",")))
    plan = make_plan(seed, seconds, nodes, CLIENTS, TTL, RESTART_GUARD, exclude,
                     clock=bool(run.clocks))  # fmt: skip
    nemesis = Nemesis(plan, run)
    try:
        if plan.phase is not None:
            run.throughput_flag.touch()  # the clients start in the throughput phase
        for slot in range(CLIENTS):
            run.spawn(slot)
        if plan.phase is not None:  # its windows are timed from when the clients run
            run.wait_started(timeout=60.0)
        started = time.time()
        origin = time.monotonic()
        nemesis.start(origin)
        while time.monotonic() < origin + seconds:
            time.sleep(0.2)
            run.respawn_dead()
            if plan.phase is not None and time.monotonic() >= origin + plan.phase.end:
                run.throughput_flag.unlink(missing_ok=True)
        nemesis.stop()  # heals whatever is still faulted
        stopping = time.time()
        run.stop_clients(grace=4.0 + 2 * TTL)
        # What the clients left behind must be gone within its TTL (fair waiters that died:
        # their lease); whatever has no TTL, or outlives that bound, leaked.
        waiter_lease = WAITER_LEASE if kind in WAITER_LEASES else 0.0
        bound = time.monotonic() + TTL + waiter_lease + 1.5
        leftover = run.leftover_keys()
        while leftover and time.monotonic() < bound:
            if any(pttl == -1 for keys in leftover.values() for pttl in keys.values()):
                break
            time.sleep(0.2)
            leftover = run.leftover_keys()
        events = run.events()
        report = check(
            backend=backend,
            kind=kind,
            seed=seed,
            seconds=seconds,
            ttl=TTL,
            nodes=nodes,
            started=started,
            stopping=stopping,
            events=events,
            writes=run.resource.history(),
            faults=plan.faults,
            data_loss=DATA_LOSS,
            leftover=leftover,
            harness_errors=nemesis.errors,
            waiter_lease=waiter_lease,
            lost_replies=sum(p.lost_replies for p in run.proxies),
            limit=LIMIT if kind == "semaphore" else 1,
            database=run.database.history() if run.database else None,
        )
        report.exclude = ",".join(sorted(exclude))
        rates = throughput.judge(plan.phase, events, started, plan.faults)
        if rates is not None:
            report.stats["throughput"] = rates
            if not rates["ok"]:
                report.violations.append(Violation(
                    "clogged-throughput", started + plan.phase.end,  # type: ignore[union-attr]
                    throughput.describe(rates).strip() + ": below the floor",
                ))  # fmt: skip
        return report
    finally:
        if nemesis.started:
            nemesis.stop()
        run.close()
