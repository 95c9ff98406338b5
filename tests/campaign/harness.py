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

from . import stall, throughput
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
#: How long a hand-back marker is kept (lua/release.lua HANDED_BACK_MS).
HANDED_BACK_MS = 120_000
#: The semaphore kind's permits: fewer than the clients, so they wait for each other.
LIMIT = 2


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class Run:
    """The live pieces of one run; the nemesis calls :meth:`apply` and :meth:`heal`."""

    def __init__(
        self, backend: str, kind: str, seed: int, seconds: float, moves_off: frozenset[str]
    ) -> None:
        self.backend, self.kind, self.seed, self.seconds = backend, kind, seed, seconds
        self.dir = Path(tempfile.mkdtemp(prefix=f"campaign-{backend}-{kind}-{seed}-"))
        # Processes die with the *thread* that started them (PR_SET_PDEATHSIG), so every
        # server and client is started by this one thread, which lives as long as the run.
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher")
        self.rng = random.Random(seed * 7919 + 1)  # the nemesis' own choices at run time
        nodes = 5 if backend == "redlock" else 1
        # Clock faults: each lock server under libfaketime, with a clock of its own; on
        # Redlock, each node's clock skewed a few ms for the whole run (skews()).
        under_faketime = clock_faults(kind) or skewed(backend)
        self.clocks = [FakeClock() for _ in range(nodes)] if under_faketime else []
        self.skews = skews(seed, nodes) if skewed(backend) else []
        for clock, skew in zip(self.clocks, self.skews, strict=False):
            clock.step(skew)
        self.servers = [self.launch(self.lock_server(i).start) for i in range(nodes)]
        self.proxies = [Proxy(s.port, f"node{i}") for i, s in enumerate(self.servers)]
        self.resource_server = self.launch(RedisServer().start)
        # A second backend the clients hold a lock on, paused by the nemesis (side_pause).
        self.side_server = self.launch(RedisServer().start)
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
        self.roundtrips_error = ""
        self.drivers = Drivers(seed, backend, kind, moves_off)

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
            "side_url": self.side_server.url,
            "database": self.database.settings() if self.database else None,
            "database_direct": self.database.direct() if self.database else None,
            "log": str(self.dir / f"{cid}.jsonl"),
            "throughput_flag": str(self.throughput_flag),
            "interrupt_flag": str(self.dir / f"interrupt-{cid}"),
            "break": os.environ.get("CAMPAIGN_BREAK", ""),
            **self.drivers.draw(self.spawned),
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

    def stop_clients(self, grace: float) -> dict[str, float]:
        """SIGTERM every client; those still running after ``grace`` s are killed: their
        ids and when (the checker asks whether a call of theirs hung)."""
        for flag in self.dir.glob("interrupt-*"):
            flag.unlink(missing_ok=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        killed = {}
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed[self.client_of[proc.pid]] = time.time()
                proc.kill()
                proc.wait()
        return killed

    def started(self, cid: str) -> bool:
        """Whether the client logged its start (its signal handlers are in place)."""
        path = self.dir / f"{cid}.jsonl"
        return path.exists() and b'"start"' in path.read_bytes()[:300]

    def roundtrips(self) -> dict[str, Any] | None:
        """Redlock: the script calls per node of a quiet probe (roundtrips.py), or None when
        it failed (its error in ``roundtrips_error``)."""
        config = {
            "id": "probe", "backend": self.backend, "kind": "plain", "name": self.name,
            "ttl": TTL, "socket_timeout": SOCKET_TIMEOUT[self.backend],
            "restart_guard": RESTART_GUARD, "lock_urls": [p.url for p in self.proxies],
            "direct_urls": [s.url for s in self.servers], "database": None,
            "break": os.environ.get("CAMPAIGN_BREAK", ""),
        }  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "tests.campaign.roundtrips", json.dumps(config)],
            cwd=ROOT, env=env, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            self.roundtrips_error = done.stderr.decode("utf-8", "replace")[-2000:]
            return None
        return dict(json.loads(done.stdout.decode().strip().splitlines()[-1]))

    # -- faults ------------------------------------------------------------------------------

    def apply(self, fault: Fault) -> None:
        kind, target = fault.kind, fault.target
        if kind in CLOCK:
            self.apply_clock(fault)
            return
        if kind == "side_pause":
            return self.side_server.pause()
        if kind == "client_interrupt":
            self.interrupt(fault)
            return
        if fault.target == ("db",):
            proxy = self.database.proxy  # type: ignore[union-attr]
            if kind == "db_reset":
                fault.note = f"({proxy.cut()} connections cut)"
            elif kind == "commit_lost":
                proxy.fault_commit("cut")
            else:  # held; a time limit in every client halfway (commit_interrupted)
                during = self.interrupt_all if kind == "commit_interrupted" else None
                proxy.fault_commit("late", fault.arg / 2, during, after=fault.arg / 2)
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
            elif kind == "busy":
                busy(server, fault.duration)
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
        if kind == "side_pause":
            return self.side_server.resume()
        if kind == "client_interrupt":
            if fault.client:
                (self.dir / f"interrupt-{fault.client}").unlink(missing_ok=True)
            return
        if fault.target == ("db",):
            if kind != "db_reset":
                self.database.proxy.disarm()  # type: ignore[union-attr]
                fault.note = (
                    f"({self.database.proxy.commits_faulted} COMMIT replies faulted so far)"  # type: ignore[union-attr]
                )
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
            elif kind == "busy":
                fault.note = kill_script(server)
            elif kind == "lose_replies":
                lost = proxy.lost_replies
                proxy.heal()
                fault.note = f"({lost} replies lost through node{i} so far)"
            else:
                proxy.heal()

    def interrupt(self, fault: Fault) -> None:
        """An asynchronous exception in a client now (SIGUSR1), and more at random moments
        of its calls while the fault lasts (the flag file: see interrupts.py)."""
        with self._slots:
            proc = self.clients[fault.target]
            if proc is None or proc.poll() is not None:
                fault.note = "(client already gone)"
                return
            fault.client = fault.note = self.client_of[proc.pid]
            if not self.started(fault.client):  # no handler yet: the signal would kill it
                fault.note += " (not started)"
                return
            (self.dir / f"interrupt-{fault.client}").touch()
            proc.send_signal(signal.SIGUSR1)

    def interrupt_all(self) -> None:
        """A soft time limit (SIGUSR2: interrupts.TimeLimit) in every client that can take
        one, while a COMMIT is late."""
        for proc in list(self.procs):
            cid = self.client_of.get(proc.pid, "")
            if proc.poll() is None and cid and self.started(cid):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGUSR2)

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
        Redlock restart guard's node marker), with their PTTL. A hand-back marker (``:b:``,
        docs/topics/internals.md) is left 2 min by design (a hand-back, the release of a hold
        taken with a kept token): one with a TTL within that bound is no leak."""
        found: dict[int, dict[str, int]] = {}
        for i, server in enumerate(self.servers):
            client = server.client(socket_timeout=5)
            keys: dict[str, int] = {}
            for raw in client.scan_iter(match=f"{KEY_PREFIX}*", count=1000):
                key = raw.decode("utf-8", "replace")
                if key.endswith(":f") or key == f"{KEY_PREFIX}node":
                    continue
                pttl = int(client.pttl(raw))
                if ":b:" in key and 0 < pttl <= HANDED_BACK_MS:
                    continue
                keys[key] = pttl
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
        for server in [*self.servers, self.resource_server, self.side_server]:
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


#: A script that keeps a server busy (BUSY to everyone else) for ARGV[1] microseconds at most;
#: it writes nothing, so SCRIPT KILL ends it.
BUSY_SCRIPT = """
local t0 = redis.call('TIME')
local limit = tonumber(ARGV[1])
while true do
  local t = redis.call('TIME')
  if (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > limit then return 0 end
end
"""
#: How long a script runs before the server answers BUSY to others (its default: 5 s).
BUSY_THRESHOLD_MS = 50


def busy(server: RedisServer, seconds: float) -> None:
    """The ``busy`` fault: a long script on the lock server (its heal kills it)."""
    client = server.client(socket_timeout=2)
    client.config_set("lua-time-limit", BUSY_THRESHOLD_MS)
    runner = server.client(socket_timeout=seconds + 5)

    def run() -> None:
        with contextlib.suppress(Exception):  # killed: "ERR ... killed by user"
            runner.eval(BUSY_SCRIPT, 0, int((seconds + 1.0) * 1e6))

    threading.Thread(target=run, name="busy-script", daemon=True).start()
    time.sleep(BUSY_THRESHOLD_MS / 1000 + 0.02)  # BUSY from now on


def kill_script(server: RedisServer) -> str:
    """SCRIPT KILL until the server says no script runs."""
    client = server.client(socket_timeout=2)
    for _ in range(50):
        try:
            client.script_kill()
        except Exception as exc:
            if "NOTBUSY" in str(exc) or "No scripts in execution" in str(exc):
                return "(killed)"
        time.sleep(0.02)
    return "(still busy?)"


def skewed(backend: str) -> bool:
    """Whether a run skews its nodes' clocks (Redlock, when a server that starts under
    libfaketime is installed, unless CAMPAIGN_EXCLUDE names "skew")."""
    excluded = "skew" in os.environ.get("CAMPAIGN_EXCLUDE", "").split(",")
    return backend == "redlock" and not excluded and faketime_server() is not None


class Drivers:
    """Which clients run asyncio (aclient.py) and which a tracer with a small, busy pool
    (client.install_tracer), from a generator of the seed's own (the fault plan stays what
    it was): of the first CLIENTS, half are asyncio, on every kind with an async API (all but
    "database") and Redlock; one is traced (the Redis backend's kinds but "database": its
    ``max_connections``); a respawned client is each with the same odds. An asyncio client's
    loop is blocked now and then (aclient.LoopBlocks) unless CAMPAIGN_EXCLUDE names
    "loop_block". Neither under
    CAMPAIGN_BREAK (the self-tests' broken client is the sync one) nor when
    CAMPAIGN_EXCLUDE names "async" or "tracer". The moves of moves.py and the asyncio
    client's ``teardown``: every client (``teardown``: the asyncio ones), every kind but
    "database", unless CAMPAIGN_EXCLUDE names "wire", "retry" or "teardown" (or, for one
    kind, e.g. "teardown:semaphore"; not under CAMPAIGN_BREAK either)."""

    def __init__(self, seed: int, backend: str, kind: str, moves_off: frozenset[str]) -> None:
        self.rng = random.Random(seed * 104729 + 17)
        exclude = set(filter(None, os.environ.get("CAMPAIGN_EXCLUDE", "").split(",")))
        exclude |= moves_off
        broken = bool(os.environ.get("CAMPAIGN_BREAK"))
        self.asyncio = kind != "database" and "async" not in exclude and not broken
        self.traced = (
            backend == "redis" and kind != "database" and "tracer" not in exclude and not broken
        )
        self.loop_block = "loop_block" not in exclude  # aclient.LoopBlocks
        # moves.py's and aclient.Teardowns: the calls' own faults (reports asy3, wai2).
        # "move:kind" leaves a move out of one kind only.
        self.moves = {
            move: kind != "database" and not {move, f"{move}:{kind}"} & exclude and not broken
            for move in ("wire", "retry", "teardown")
        }
        slots = list(range(CLIENTS))
        self.rng.shuffle(slots)
        self.first_async = set(slots[: CLIENTS // 2])
        self.first_traced = slots[-1]

    def draw(self, spawned: int) -> dict[str, Any]:
        slot = spawned - 1  # the first CLIENTS spawns are the slots' first clients
        if slot < CLIENTS:
            is_async, traced = slot in self.first_async, slot == self.first_traced
        else:
            is_async, traced = self.rng.random() < 0.5, self.rng.random() < 0.25
        return {
            "driver": "async" if is_async and self.asyncio else "sync",
            "tracer": traced and self.traced,
            "loop_block": is_async and self.asyncio and self.loop_block,
            "wire": self.moves["wire"],
            "retry": self.moves["retry"],
            "teardown": is_async and self.asyncio and self.moves["teardown"],
        }


def skews(seed: int, nodes: int) -> list[float]:
    """Each node's clock offset (s) for a whole run: a few ms ahead or behind, as NTP leaves
    hosts; drawn from a generator of its own (the fault plan of a seed stays what it was)."""
    rng = random.Random(seed * 15485863 + 11)
    return [rng.choice((-1, 1)) * rng.uniform(0.001, 0.006) for _ in range(nodes)]


def clock_faults(kind: str) -> bool:
    """Whether a run of ``kind`` steps its servers' clocks: fenced transactions only (the
    database keeps order through a step; Redis's own holds and fences may not), on servers
    that start under libfaketime, unless CAMPAIGN_EXCLUDE names "clock"."""
    excluded = "clock" in os.environ.get("CAMPAIGN_EXCLUDE", "").split(",")
    return kind == "database" and not excluded and faketime_server() is not None


def run_campaign(
    backend: str, kind: str, seed: int, seconds: float, moves_off: frozenset[str] = frozenset()
) -> Report:
    """``moves_off``: moves left out of this run on top of CAMPAIGN_EXCLUDE's (the
    driver moves "async" and "tracer": make test's, while a defect they find is open)."""
    run = Run(backend, kind, seed, seconds, moves_off)
    nodes = len(run.servers)
    exclude = frozenset(filter(None, os.environ.get("CAMPAIGN_EXCLUDE", "").split(",")))
    plan = make_plan(seed, seconds, nodes, CLIENTS, TTL, RESTART_GUARD, exclude,
                     clock=clock_faults(kind), database=kind == "database")  # fmt: skip
    nemesis = Nemesis(plan, run)
    probe = stall.Recorder()  # the harness's own: its proxies carry the clients' requests
    try:
        if plan.phase is not None:
            run.throughput_flag.touch()  # the clients start in the throughput phase
        for slot in range(CLIENTS):
            run.spawn(slot)
        # The run's clock starts once the clients run (Django set up): on a loaded machine
        # their start-up took whole 8 s cases, which then did nothing. The throughput phase's
        # windows are timed from here too.
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
        killed = run.stop_clients(grace=4.0 + 2 * TTL)
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
        # Redlock: one script call per node per acquire and one per release, in quiet time.
        roundtrips = run.roundtrips() if backend == "redlock" else None
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
            socket_timeout=SOCKET_TIMEOUT[backend],
            killed_at_stop=killed,
            roundtrips=roundtrips,
            harness_stalls=probe.events,
        )
        if backend == "redlock" and roundtrips is None:
            report.harness_errors.append(f"round-trip probe failed: {run.roundtrips_error}")
        if run.skews:
            report.stats["skews"] = run.skews
        report.exclude = ",".join(sorted(exclude))
        rates = throughput.judge(plan.phase, events, started, plan.faults, report.stats["stalls"])
        if rates is not None:
            report.stats["throughput"] = rates
            if not rates["ok"]:
                report.violations.append(Violation(
                    "clogged-throughput", started + plan.phase.end,  # type: ignore[union-attr]
                    throughput.describe(rates).strip() + ": below the floor",
                ))  # fmt: skip
        return report
    finally:
        probe.stop.set()
        if nemesis.started:
            nemesis.stop()
        run.close()
