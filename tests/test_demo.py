"""`make demo` smoke test: it starts, serves the shop and the admin, runs the experiment, stops."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from django_redlock.testing import free_port

from .conftest import ROOT
from .demo_run import Demo


def test_demo_starts_serves_and_stops(tmp_path: Path) -> None:
    demo = Demo(free_port(), tmp_path)
    try:
        redis_url = demo.wait_ready()
        home = demo.get("/")
        assert 'data-live="left">100<' in home and 'id="live-locks"' in home
        assert "Log in" in demo.get("/admin/login/")
        # The experiment: a POST answers with a redirect, so a reload never runs it again.
        redirect = demo.post("/experiment/", follow=False)
        assert redirect.status == 302 and redirect.headers["Location"] == "/experiment/"
        result = demo.get("/experiment/")
        locked = re.search(
            r"with django-redlock</th><td>50</td><td>(\d+)</td><td>(\d+)</td>", result
        )
        assert locked is not None, result
        assert locked.groups() == ("50", "0")  # exactly the stock sold, nothing oversold
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
        assert live["experiment"][1][1] == {"tickets": 50, "confirmed": 50, "oversold": 0}
        assert any(h["name"] == "nightly-sync" for h in live["handoffs"])
        time.sleep(1.0)
        assert locks_db.llen("demo:sync:runs") == 1
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
        assert any("queued once" in x and ", the same)" in x for x in demo.lines), demo.lines
        while locks_db.llen("demo:counts") < 1:
            assert time.monotonic() < deadline + 30, "the demo's db_worker ran no stock count"
            time.sleep(0.2)
        assert locks_db.llen("demo:counts") == 1
    finally:
        output = demo.stop()
    assert "demo: stopped" in output
    assert demo.process.returncode == 0
    # Locks have a database of their own (no W001); no setting is misspelt (no W002).
    assert "django_redlock.W00" not in output, output
    # One line per log record: the worker's root handler does not print ours again.
    skipped = [line for line in output.splitlines() if "skipped duplicate" in line]
    assert len(skipped) == 1, skipped
    port_of_redis = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    try:
        redis.Redis(port=port_of_redis, socket_connect_timeout=0.5).ping()
        still_up = True
    except redis.ConnectionError:
        still_up = False
    assert not still_up  # the embedded Redis went down with the demo


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


def test_demo_fails_loudly_when_a_process_dies(tmp_path: Path) -> None:
    """A child that exits (here: the dev server, killed) stops the rest of the demo, which
    says so and exits non-zero (it used to exit 0)."""
    demo = Demo(free_port(), tmp_path)
    try:
        demo.wait_ready()
        children = Path(f"/proc/{demo.process.pid}/task/{demo.process.pid}/children")
        for pid in map(int, children.read_text().split()):
            if "runserver" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        demo.process.wait(30)
    finally:
        output = demo.stop()
    assert demo.process.returncode == 1, output
    assert "manage.py runserver 127.0.0.1" in output and "stopping the rest" in output
