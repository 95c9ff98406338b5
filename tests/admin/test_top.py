"""``manage.py redlock top``: the most contended locks first, from Redis alone; live under
tmux (a real terminal), once with ``--once``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import call_command

from django_redlock import lock, locks, semaphore
from django_redlock.testing import RedisServer

from ..conftest import ROOT


@pytest.fixture
def contended() -> Iterator[None]:
    """'top:idle' held first with nobody waiting; 'top:busy' held with two waiters."""
    idle = lock("top:idle", using="redis")
    idle.acquire()
    busy = lock("top:busy", using="redis")
    busy.acquire()

    def wait() -> None:
        with lock("top:busy", using="redis", timeout=30):
            pass

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while (info := locks["redis"].inspect("top:busy")) is None or info.waiters < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield
    busy.release()
    for thread in threads:
        thread.join()
    idle.release()


def lock_lines(text: str) -> list[str]:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"BACKEND +NAME", line)]
    assert starts, text
    start = starts[0]
    return [line for line in lines[start + 1 :] if line.strip() and not line.startswith("...")]


def test_once_prints_the_contended_lock_first(contended: None) -> None:
    out = StringIO()
    with pytest.raises(SystemExit) as exited:  # the settings' "down" backend: exit code 3
        call_command("redlock", "top", "--once", stdout=out)
    assert exited.value.code == 3
    text = out.getvalue()
    # default, redis and cache are one server in these settings: each lists both locks.
    # (other backends of these settings may list other tests' locks, and the "acl" alias,
    # once a test added it, the same server's: only these three are judged)
    ours = ("default", "redis", "cache")
    rows = [
        line.split()
        for line in lock_lines(text)
        if line.split()[1].startswith("top:") and line.split()[0] in ours
    ]
    assert [row[1] for row in rows] == ["top:busy"] * 3 + ["top:idle"] * 3
    assert {row[0] for row in rows[:3]} == {"default", "redis", "cache"}
    assert all(row[2:4] == ["plain", "2"] and re.fullmatch(r"\d+\.\ds", row[4]) for row in rows[:3])
    assert re.search(r"^down\s+down\s", text, re.M)
    assert re.search(r"^redis\s+up\s+[\d.]+ms\s+2\s+2\s", text, re.M)  # 2 held, 2 waiting


def test_a_semaphore_row_names_its_first_holder_and_how_many_more() -> None:
    permits = [semaphore("top:sem", 3, using="redis") for _ in range(2)]
    for permit in permits:
        assert permit.acquire(blocking=False)
    try:
        out = StringIO()
        call_command("redlock", "top", "--once", "--backend", "redis", stdout=out)
        row = next(line for line in lock_lines(out.getvalue()) if "top:sem" in line)
        assert re.search(rf"\S+:{os.getpid()} \+1 more$", row), row
    finally:
        for permit in permits:
            permit.release()


def test_once_on_one_backend_exits_0(contended: None) -> None:
    out = StringIO()
    call_command("redlock", "top", "--once", "--backend", "redis", "--limit", "1", stdout=out)
    assert [line.split()[1] for line in lock_lines(out.getvalue())] == ["top:busy"]
    assert "... and 1 more held locks" in out.getvalue()


def test_live_under_tmux_refreshes_and_shows_the_contended_lock_first(
    contended: None, redis_server: RedisServer
) -> None:
    tmux = shutil.which("tmux")
    assert tmux, "tmux is missing: `make test` installs it (apt-get install tmux)"
    session = f"redlock-top-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "DJANGO_SETTINGS_MODULE": "tests.support.worker_settings",
           "REDLOCK_TEST_REDIS": redis_server.url}  # fmt: skip
    command = f"{sys.executable} -m django redlock top --backend redis --interval 0.5"
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "40", command],
                   check=True, env=env, cwd=ROOT)  # fmt: skip
    try:

        def screen() -> str:
            return subprocess.run([tmux, "capture-pane", "-p", "-t", session], check=True,
                                  capture_output=True, text=True).stdout  # fmt: skip

        deadline = time.monotonic() + 30
        while "top:busy" not in (first := screen()):
            assert time.monotonic() < deadline, first
            time.sleep(0.2)
        assert lock_lines(first)[0].split()[:4] == ["redis", "top:busy", "plain", "2"]
        clock = re.search(r"\d\d:\d\d:\d\d UTC", first)
        assert clock is not None and first.count("redlock top") == 1  # one view, not a scroll
        while clock.group(0) in (later := screen()):  # it refreshes by itself
            assert time.monotonic() < deadline, later
            time.sleep(0.2)
        assert lock_lines(later)[0].split()[1] == "top:busy"
        subprocess.run([tmux, "send-keys", "-t", session, "C-c"], check=True)
        while subprocess.run([tmux, "has-session", "-t", session]).returncode == 0:
            assert time.monotonic() < deadline, "Ctrl-C did not end redlock top"
            time.sleep(0.1)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
