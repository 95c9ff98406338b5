"""`make demo` smoke test: it starts, serves the shop and the admin, runs the experiment, stops."""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

from django_redlock.testing import free_port

from .conftest import ROOT


def test_demo_starts_serves_and_stops(tmp_path: object) -> None:
    port = free_port()
    env = {**os.environ, "DEMO_PORT": str(port), "SHOP_DB": f"{tmp_path}/shop.sqlite3"}
    env.pop("REDIS_URL", None)  # the demo must bring its own Redis
    demo = subprocess.Popen(
        [sys.executable, "example_project/demo.py"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert demo.stdout is not None
        lines = []
        for line in demo.stdout:
            lines.append(line)
            if "the shop is at" in line:
                break
        else:
            raise AssertionError("".join(lines))
        redis_url = next(re.search(r"redis://\S+", x) for x in lines if "embedded" in x)
        assert redis_url is not None
        base = f"http://127.0.0.1:{port}"
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        deadline = time.monotonic() + 30
        while True:
            try:
                home = opener.open(f"{base}/", timeout=5).read().decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert "Tickets left: <strong>100</strong>" in home
        assert "Log in" in opener.open(f"{base}/admin/login/", timeout=5).read().decode()
        page = opener.open(f"{base}/experiment/", timeout=5).read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token is not None
        body = urllib.parse.urlencode({"csrfmiddlewaretoken": token.group(1)}).encode()
        request = urllib.request.Request(
            f"{base}/experiment/", data=body, headers={"Referer": base}
        )
        result = opener.open(request, timeout=60).read().decode()
        locked = re.search(
            r"with django-redlock</th><td>50</td><td>(\d+)</td><td>(\d+)</td>", result
        )
        assert locked is not None, result
        assert locked.groups() == ("50", "0")  # exactly the stock sold, nothing oversold
        # The worker: two nightly syncs sent at once, one runs.
        request = urllib.request.Request(f"{base}/sync/", data=body, headers={"Referer": base})
        assert "only one of them runs" in opener.open(request, timeout=30).read().decode()
        import redis as redis_py

        shop_redis = redis_py.Redis.from_url(redis_url.group(0))
        deadline = time.monotonic() + 30
        while not shop_redis.llen("shop:sync:runs"):
            assert time.monotonic() < deadline, "the demo's Celery worker ran no sync"
            time.sleep(0.2)
        time.sleep(1.0)
        assert shop_redis.llen("shop:sync:runs") == 1
        # At most 2 exports at once: five sent, the first two run, the others retry.
        request = urllib.request.Request(f"{base}/exports/", data=body, headers={"Referer": base})
        assert "at most 2 run at once" in opener.open(request, timeout=30).read().decode()
        while shop_redis.llen("shop:exports:runs") < 2:
            assert time.monotonic() < deadline + 30, "the demo's Celery worker ran no export"
            time.sleep(0.2)
        runs = [r.decode() for r in shop_redis.lrange("shop:exports:runs", 0, -1)]
        assert all(int(r.rsplit(" with ", 1)[1].split()[0]) <= 2 for r in runs), runs
    finally:
        demo.send_signal(signal.SIGINT)
        output, _ = demo.communicate(timeout=30)
    assert "demo: stopped" in output
    assert demo.returncode == 0
    import redis

    port_of_redis = int(redis_url.group(0).rsplit(":", 1)[1].split("/")[0])
    try:
        redis.Redis(port=port_of_redis, socket_connect_timeout=0.5).ping()
        still_up = True
    except redis.ConnectionError:
        still_up = False
    assert not still_up  # the embedded Redis went down with the demo
