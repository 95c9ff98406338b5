"""Start, pause, kill and stop a real PostgreSQL server on a free loopback port.

Used by this project's test suite (fenced transactions on a real database), and usable in
yours. ``initdb`` makes a throwaway cluster in a temporary folder (trust authentication, no
fsync: a test database, not a safe one); when the tests run as root, the server runs as the
``postgres`` system user, as PostgreSQL refuses to run as root. The binaries come from
``$PG_BIN``, else ``initdb`` on PATH, else the newest ``/usr/lib/postgresql/*/bin`` (Debian's
``postgresql`` package). The server dies with the process that started it.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .server import ServerProcess, free_port, popen


def find_postgres_bin() -> Path:
    """The folder of ``initdb`` and ``postgres``, or a RuntimeError that says how to get them."""
    explicit = os.environ.get("PG_BIN")
    if explicit:
        return Path(explicit)
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent  # Debian links some binaries into PATH, not all
    versions = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    if versions:
        return max(versions, key=lambda b: int(b.parent.name) if b.parent.name.isdigit() else 0)
    raise RuntimeError(
        "no PostgreSQL server found: install it (Debian: `apt-get install postgresql`, or"
        " `make postgresql`), or set $PG_BIN to the folder of initdb and postgres"
    )


class PostgresServer(ServerProcess):
    """One ``postgres`` process with its own throwaway cluster; superuser ``postgres``, no
    password, on 127.0.0.1."""

    user = "postgres"
    stop_signal = signal.SIGINT  # "fast" shutdown: clients cut off
    stop_wait = 20.0

    def __init__(self, *, port: int | None = None, bindir: str | Path | None = None) -> None:
        self.bin = Path(bindir) if bindir else find_postgres_bin()
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"redlock-postgres-{self.port}-"))
        self.data = self.dir / "data"
        self.process: subprocess.Popen[bytes] | None = None
        # PostgreSQL refuses to run as root: then it runs as the postgres system user.
        self.run_as = "postgres" if os.geteuid() == 0 else None
        if self.run_as:
            shutil.chown(self.dir, user=self.run_as)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def settings(self, name: str = "postgres", **extra: Any) -> dict[str, Any]:
        """A ``DATABASES`` entry for database ``name`` on this server."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": self.user,
            "HOST": self.host,
            "PORT": str(self.port),
            **extra,
        }

    def _run(self, *command: str) -> None:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=False, user=self.run_as
        )
        if done.returncode:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stderr[-2000:]}")

    def start(self, timeout: float = 60.0) -> PostgresServer:
        if not (self.data / "PG_VERSION").exists():
            self._run(
                str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user,
                "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync",
            )  # fmt: skip
        log = (self.dir / "postgres.log").open("ab")
        self.process = popen(
            [
                str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
                "-h", self.host, "-k", str(self.dir),
                # A test database: speed over durability.
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "max_connections=200",
            ],
            stdout=log, stderr=subprocess.STDOUT, user=self.run_as,
        )  # fmt: skip
        log.close()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        ready = [str(self.bin / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port)]
        while subprocess.run(ready, check=False, timeout=30).returncode != 0:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"postgres on port {self.port} exited: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres on port {self.port} is not ready: {self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        path = self.dir / "postgres.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    # -- faults (the rest in ServerProcess) --------------------------------------------------

    def pause(self) -> None:
        """SIGSTOP the postmaster (its backends, serving connections, run on)."""
        super().pause()

    def kill(self) -> None:
        """SIGKILL the postmaster: its backends notice and exit; uncommitted work is gone."""
        super().kill()
