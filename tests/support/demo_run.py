"""Run ``example_project/demo.py`` (what ``make demo`` runs) for a test, and talk to it."""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ..conftest import ROOT


class Shop:
    """The demo's shop, over HTTP, with a session (its cookies) of its own."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def wait_answering(self, lines: list[str]) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.get("/")
                return
            except OSError:
                assert time.monotonic() < deadline, "".join(lines)
                time.sleep(0.2)

    def get(self, path: str) -> str:
        return str(self.opener.open(f"{self.base}{path}", timeout=60).read().decode())

    def post(self, path: str, follow: bool = True) -> Any:
        """A form POST with the page's CSRF token; the response (after redirects if
        ``follow``, else the redirect itself)."""
        page = self.get("/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token is not None
        body = urllib.parse.urlencode({"csrfmiddlewaretoken": token.group(1)}).encode()
        request = urllib.request.Request(
            f"{self.base}{path}", data=body, headers={"Referer": self.base}
        )
        if follow:
            return self.opener.open(request, timeout=60)
        # New handlers: build_opener makes each handler given its own (a shared one would
        # stop following redirects in self.opener too).
        opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect()
        )
        try:
            return opener.open(request, timeout=60)
        except urllib.error.HTTPError as redirect:
            return redirect


class Demo(Shop):
    def __init__(self, port: int, state: Path, **env: str) -> None:
        super().__init__(port)
        # PYTHONPATH: this checkout's django_redlock, whatever the venv has installed.
        self.state = state
        environ = {**os.environ, "DEMO_PORT": str(port), "DEMO_STATE": str(state),
                   "SHOP_DB": f"{state}/shop.sqlite3", "PYTHONPATH": str(ROOT)}  # fmt: skip
        environ.pop("REDIS_URL", None)  # the demo must bring its own Redis
        environ.pop("DJANGO_SETTINGS_MODULE", None)
        self.process = subprocess.Popen(
            [sys.executable, "example_project/demo.py"],
            cwd=ROOT, env={**environ, **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # no terminal: the tmux test is the one with a terminal
        )  # fmt: skip
        self.lines: list[str] = []
        self.output = ""

    def wait_ready(self) -> str:
        """Until the demo says where the shop is and the page answers; the Redis URL."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if "the shop is at" in line:
                break
        else:
            raise AssertionError("".join(self.lines))
        self.wait_answering(self.lines)
        url = next(re.search(r"redis://\S+", x) for x in self.lines if "embedded" in x)
        assert url is not None
        return url.group(0)

    def stop(self) -> str:
        """Ctrl-C, as a terminal sends it: to the demo's process group (its own session)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        rest, _ = self.process.communicate(timeout=90)
        self.output = "".join(self.lines) + rest
        return self.output


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None
