"""The scheduling-stall probe (``stall.py``) in real processes: what it counts as a stall,
and that the interrupt move's signals never reach it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: A process with the probe: it says "ready", then burns the CPU with the GIL held in C
#: (``sum`` over a range never lets another thread run) for about ``argv[1]`` s, then sleeps.
PROGRAM = """
import json, sys, time
from tests.campaign.stall import watch

events = []
watch(lambda e, **f: events.append({"t": time.time(), "e": e, **f}))
n, spent = 100_000, 0.0
while spent < 0.02:  # size the CPU burn to this machine
    n *= 2
    t = time.process_time(); sum(range(n)); spent = time.process_time() - t
n = int(n * float(sys.argv[1]) / spent)
burn, cpu = time.time(), time.process_time()
sum(range(n))
burn, cpu = (burn, time.time()), time.process_time() - cpu
print("ready", flush=True)
sys.stdin.readline()  # stopped and continued meanwhile
time.sleep(0.1)
print(json.dumps({"burn": burn, "cpu": cpu, "events": events}), flush=True)
"""


def test_a_stopped_process_stalls_and_its_own_cpu_burn_does_not() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, "0.3"], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.time()
        time.sleep(0.4)
        os.kill(proc.pid, signal.SIGCONT)
        resumed = time.time()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    stalls = [e for e in out["events"] if e["e"] == "stall"]
    # The stop: about 0.4 s late, all of it idle (on a loaded machine, maybe a little more).
    stop = [e for e in stalls if e["s"] < resumed and e["t"] > stopped]
    assert len(stop) == 1 and 0.35 < stop[0]["idle"] <= stop[0]["late"] < 5.0, stalls
    # The burn: the probe woke late (the GIL held), but the process ran: the CPU it burnt is
    # not idle (on a loaded machine the burn is descheduled too: that part is).
    a, b = out["burn"]
    burn = [e for e in stalls if e["s"] < b and e["t"] > a]
    assert burn and max(e["late"] for e in burn) > 0.1, stalls
    ran = sum(e["late"] - e["idle"] for e in burn)
    assert ran > 0.7 * out["cpu"], (out["cpu"], burn)


#: A campaign client's signal handling (interrupts.py) and the probe: 300 SIGUSR1 in bursts.
SIGNALS = """
import json, os, signal, threading, time
from tests.campaign.stall import watch

events, caught, where = [], 0, set()
def handler(signum, frame):
    where.add(threading.current_thread().name)
    raise KeyboardInterrupt
signal.signal(signal.SIGUSR1, handler)
watch(lambda e, **f: events.append(e))
time.sleep(0.05)
probe = next(t for t in threading.enumerate() if t.name == "stall-probe")
with open(f"/proc/self/task/{probe.native_id}/status") as f:
    blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
for _ in range(300):
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.001)
    except KeyboardInterrupt:
        caught += 1
time.sleep(0.05)
print(json.dumps({"blocked": blocked, "caught": caught, "where": sorted(where),
                  "alive": probe.is_alive()}))
"""


def test_the_interrupt_move_s_signals_never_reach_the_probe_thread() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SIGNALS], cwd=ROOT, capture_output=True, text=True, check=True,
        timeout=30,
    )  # fmt: skip
    out = json.loads(run.stdout)
    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGTERM):
        assert out["blocked"] & (1 << (signum - 1)), signum
    assert out["caught"] == 300 and out["where"] == ["MainThread"] and out["alive"]
