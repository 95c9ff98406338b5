"""django_redlock.testing's servers, as users' own test suites start them: they live as long as
the process that started them, whichever of its threads started them, and no longer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from django_redlock.testing import RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_started_from_a_thread_outlives_that_thread() -> None:
    started: list[RedisServer] = []
    thread = threading.Thread(target=lambda: started.append(RedisServer().start()))
    thread.start()
    thread.join()
    with ThreadPoolExecutor(1) as pool:  # and from a pool's thread, which ends with the pool
        started.append(pool.submit(lambda: RedisServer().start()).result())
    try:
        time.sleep(0.3)  # a parent-death signal would have killed them by now
        for server in started:
            assert server.client().ping()
        restarter = threading.Thread(target=started[0].restart)  # restarted from a thread too
        restarter.start()
        restarter.join()
        time.sleep(0.3)
        assert started[0].client().ping()
    finally:
        for server in started:
            server.stop()


def test_a_server_started_from_a_thread_dies_with_its_process() -> None:
    script = (
        "import threading, sys, time\n"
        "from django_redlock.testing import RedisServer\n"
        "box = []\n"
        "t = threading.Thread(target=lambda: box.append(RedisServer().start()))\n"
        "t.start(); t.join()\n"
        "print(box[0].process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=ROOT, text=True
    )
    try:
        assert child.stdout is not None
        server_pid = int(child.stdout.readline())
        assert _alive(server_pid)
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 5
        while _alive(server_pid):
            assert time.monotonic() < deadline, "the server outlived the process that started it"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
