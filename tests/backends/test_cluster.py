"""Cluster (slots, failovers, paused masters, slot migrations): real servers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from redis.exceptions import ResponseError

from django_redlock import (
    BackendUnavailable,
    LockError,
    fast_path,
    lock,
    locks,
    read_write_lock,
    semaphore,
    wire,
)
from django_redlock.testing import RedisServer
from django_redlock.testing.server import create_cluster

from ..conftest import stop_all
from ..support.quiet_cluster import QUIET_ARGS, QuietCluster
from ..support.warm import warm_up


@pytest.mark.redis_py
def test_cluster_keeps_a_semaphore_in_one_slot(
    cluster_nodes: list[RedisServer], _cluster_alias: None, name: str
) -> None:
    from django_redlock import read_write_lock, semaphore

    backend = locks["cluster"]  # the session's cluster, never flushed: names of this test's own
    keys = [backend.key(name), backend.details_key(name), backend.fence_key(name),
            backend.waiting_key(name), backend.writers_key(name)]  # fmt: skip
    slots = {cluster_nodes[0].client().execute_command("CLUSTER", "KEYSLOT", k) for k in keys}
    assert len(slots) == 1
    rw = read_write_lock(f"{name}:rw", using="cluster")
    with semaphore(name, 2, using="cluster"), rw.write():
        assert backend.inspect(name) is not None


def test_cluster_keeps_each_lock_in_one_slot(
    cluster_nodes: list[RedisServer], _cluster_alias: None
) -> None:
    backend = locks["cluster"]
    for name in ("invoice:42", "}odd", "~tilde", "{braces}"):
        keys = [backend.key(name), backend.fence_key(name), backend.queue_key(name),
                backend.deadlines_key(name)]  # fmt: skip
        slots = {cluster_nodes[0].client().execute_command("CLUSTER", "KEYSLOT", k) for k in keys}
        assert len(slots) == 1, (name, keys)
        with lock(name, using="cluster", fair=True) as held:
            assert held.fence is not None and backend.name_from_key(backend.key(name)) == name


@pytest.mark.redis_py
def test_cluster_commands_never_take_the_single_node_fast_path(
    cluster_nodes: list[RedisServer], _cluster_alias: None, name: str
) -> None:
    """The fast path's per-thread and kept connections (fast_path.py) are checked for a
    Sentinel's master switch, not for a slot move: a Cluster's commands, renewals included,
    must never go through them, only through redis-py's cluster client (its slot table,
    MOVED and ASK) and each node's own pool."""
    backend = locks["cluster"]
    with lock(name, using="cluster", ttl=1):
        time.sleep(0.6)  # renewed meanwhile
    assert not fast_path.on_thread_connection(backend.client)
    pools = [node.redis_connection.connection_pool for node in backend.client.get_nodes()
             if node.redis_connection is not None]  # fmt: skip
    assert pools and all(wire.planted_pool_threads(pool) is None for pool in pools)


def test_cluster_spreads_locks_over_the_masters(
    cluster_nodes: list[RedisServer], _cluster_alias: None, name: str
) -> None:
    held = [lock(f"{name}:spread:{i}", using="cluster") for i in range(60)]
    for each in held:
        assert each.acquire(blocking=False)
    pattern = f"redlock:{{{name}:spread:*}}"  # the session's cluster keeps other tests' keys
    per_node = [len(node.client().keys(pattern)) for node in cluster_nodes]
    assert sum(per_node) == 60 and all(count > 0 for count in per_node), per_node
    for each in held:
        each.release()


def test_a_paused_cluster_master_is_unavailable_within_the_socket_timeout(name: str) -> None:
    """redis-py's cluster client retried a timed-out command three times, re-reading the slots
    in between: 22 s for a paused master with a 2 s socket timeout. A cluster of its own: a
    paused master must not disturb the session's cluster (its node timeout is long enough
    that nobody marks the paused one failed)."""
    from django_redlock import lock_all

    with _own_cluster() as nodes:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 1.0}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            with lock(name, using="c"):
                pass  # the slots are known, the scripts loaded
            key = locks["c"].key(name)
            _, owner = _slot_and_master(nodes, key)
            owner.pause()
            try:
                attempts = (
                    lambda: lock(name, using="c", ttl=2, timeout=1).acquire(),
                    lambda: lock_all(name, using="c", ttl=2, timeout=1).__enter__(),
                )
                for attempt in attempts:
                    began = time.monotonic()
                    with pytest.raises(BackendUnavailable):
                        attempt()
                    assert time.monotonic() - began < 3.0  # one socket timeout, not four
            finally:
                owner.resume()
            # Back once it answers. The paused server may still run what it was sent: a hold
            # of a token nobody knows, for its TTL (unknown is not lost).
            with lock(name, using="c", timeout=10) as held:
                assert held.fence is not None
            locks["c"].close()


def _make_quiet() -> list[RedisServer]:
    nodes = [RedisServer(args=QUIET_ARGS).start() for _ in range(3)]
    try:
        create_cluster(nodes)
        _FIRST_EPOCHS[:] = [_config_epoch(node) for node in nodes]
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


_QUIET = QuietCluster(_make_quiet)
_FIRST_EPOCHS: list[int] = []  # its masters' config epochs as create_cluster left them


@pytest.fixture(scope="module", autouse=True)
def _stop_the_quiet_cluster() -> Iterator[None]:
    yield
    _QUIET.stop()


def _own_cluster() -> contextlib.AbstractContextManager[list[RedisServer]]:
    """Three masters apart from the session's cluster (a pause or a slot move must not
    disturb it), whose node timeout is long enough that nobody marks a paused one failed:
    this file's quiet cluster (tests/support/quiet_cluster.py), shared by its tests."""
    return _QUIET.use()


def _config_epoch(node: RedisServer) -> int:
    lines = node.client().execute_command("CLUSTER", "NODES").decode().splitlines()
    return int(next(line for line in lines if "myself" in line).split()[6])


def test_a_new_cluster_s_masters_have_config_epochs_of_their_own() -> None:
    """create_cluster left every master at config epoch 0, made unique over the cluster bus
    afterwards: on a loaded machine still under way when a test moved a slot, the target
    took it without a bump (its epoch the greatest it knew), the source's collision bump
    won it back, and each node named the other as its owner for good (redis-py: "TTL
    exhausted", seen in test_a_cancelled_cluster_take_is_handed_back_after_it_lands). Each
    master has an epoch of its own from the start, as redis-cli gives. (The quiet cluster's,
    read as create_cluster returned: it may have been made for an earlier test.)"""
    with _own_cluster() as nodes:
        epochs = _FIRST_EPOCHS
        assert len(epochs) == len(nodes)
        assert 0 not in epochs and len(set(epochs)) == len(nodes), epochs


@contextlib.contextmanager
def _lost_names() -> Iterator[list[str]]:
    """The names of the holds declared lost (lock_lost) meanwhile."""
    from django_redlock.signals import lock_lost

    lost: list[str] = []

    def on_lost(sender: Any, lock: Any, **kwargs: Any) -> None:
        lost.append(lock.name)

    lock_lost.connect(on_lost, weak=False)
    try:
        yield lost
    finally:
        lock_lost.disconnect(on_lost)


def _slot_and_master(nodes: list[RedisServer], key: str) -> tuple[int, RedisServer]:
    """``key``'s slot, and the node of ``nodes`` that is its master."""
    slot = int(nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key))
    return slot, next(n for n in nodes if _serves(n, slot))


def _serves(node: RedisServer, slot: int) -> bool:
    """Whether ``node`` is the master of ``slot``, as it says."""
    return _master_port(node, slot) == node.port


def _master_port(node: RedisServer, slot: int) -> int | None:
    """The port of ``slot``'s master as ``node`` knows it (CLUSTER SLOTS: start, end,
    [host, port, id], ...)."""
    for start, end, master, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return int(master[1])
    return None


def _take_over(replica: RedisServer, watcher: RedisServer, slot: int) -> None:
    """A manual failover of ``slot``'s shard to ``replica``, until ``watcher`` knows it. Asked
    again every 3 s: one asked right after the cluster was made (a node not yet knowing the
    replica's role), or on a loaded machine past its own timeout, can stall and never end."""
    deadline, asked = time.monotonic() + 30, 0.0
    while _master_port(watcher, slot) != replica.port:
        assert time.monotonic() < deadline, "the replica never took over"
        if time.monotonic() - asked > 3.0:
            with contextlib.suppress(ResponseError):
                replica.client().execute_command("CLUSTER", "FAILOVER")
            asked = time.monotonic()
        time.sleep(0.1)


def _end_of_move(
    nodes: list[RedisServer], slot: int, source: RedisServer, target: RedisServer
) -> None:
    """End a move begun by hand (only the lock's key migrated) as redis-cli does: the slot's
    other keys migrated too, then every node told. The fence counter stays a minute after
    its hold, and a source that still has a key of the slot refuses to give it up ("Can't
    assign hashslot ... while I still hold keys"): unless the target's claim reached it
    over the cluster bus first, which deletes those keys (on a loaded machine, not always)."""
    from ..waiting.test_sharded import migrate_slot

    migrate_slot(nodes, slot, source, target)


@pytest.mark.redis_py
def test_a_cluster_failover_costs_no_call_and_a_cluster_down_is_unavailable(name: str) -> None:
    """A command is tried once on a Cluster (above), but after a failover a master's old
    address refuses the connection: nothing was sent, the client re-read the slots, and the
    call is tried again, so the first lock after a failover is not an error. A cluster that is
    down (CLUSTERDOWN) is BackendUnavailable, never redis-py's own ClusterDownError."""
    # No diskless-sync delay: Redis 7 waits 5 s for more replicas before the first sync.
    args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
            "--repl-diskless-sync-delay", "0")  # fmt: skip
    masters = [RedisServer(args=args).start() for _ in range(3)]
    replicas = [RedisServer(args=args).start() for _ in range(3)]
    try:
        create_cluster(masters, replicas=replicas)
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": masters[0].url, "OPTIONS": {"socket_timeout": 1.0}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            with lock(name, using="c"):
                pass  # the client knows the slots
            slot = masters[0].client().execute_command("CLUSTER", "KEYSLOT", locks["c"].key(name))
            i = next(i for i, m in enumerate(masters) if _serves(m, slot))
            old, new, other = masters[i], replicas[i], masters[(i + 1) % 3]
            _take_over(new, other, slot)  # the others know the new master
            old.stop()  # the client still has it as the slot's master: refused
            with lock(name, using="c", timeout=5) as held:
                assert held.fence is not None
            # Down: the new master gives its slot up (the cluster needs every slot served).
            new.client().execute_command("CLUSTER", "DELSLOTS", slot)
            deadline = time.monotonic() + 30
            while b"cluster_state:fail" not in new.client().execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the cluster never went down"
                time.sleep(0.1)
            with pytest.raises(BackendUnavailable):
                lock(name, using="c").acquire(blocking=False)
            locks["c"].close()
    finally:
        stop_all([*masters, *replicas])


def test_a_paused_cluster_master_costs_no_hold_on_the_other_masters(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shard is a backend for the watchdog: one master paused longer than the TTL (a
    fork for BGSAVE, a VM pause) never costs a hold on another master. The renewal of a
    batch spanning every shard went through redis-py's cluster pipeline, which re-sent each
    timed-out command on its own (7 socket timeouts per try): every hold of the healthy
    masters expired behind the paused one and was declared lost; the failed try was logged
    as a watchdog bug (a raw redis TimeoutError)."""
    import logging

    with _own_cluster() as nodes, _lost_names() as lost:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 0.5,
                  "socket_connect_timeout": 0.5}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            backend = locks["c"]
            held = [lock(f"{name}:{i}", using="c", ttl=3) for i in range(300)]
            for each in held:
                assert each.acquire(blocking=False)
            owners = {each.name: _slot_and_master(nodes, backend.key(each.name))[1]
                      for each in held}  # fmt: skip
            paused = owners[held[0].name]
            healthy = [each for each in held if owners[each.name] is not paused]
            assert len(healthy) > 100
            caplog.set_level(logging.WARNING, logger="django_redlock")
            paused.pause()
            try:
                # One batch over every master (as after a resharding): each master's part at
                # once, the paused one's no answer (None) within one socket timeout.
                from django_redlock.backends.base import Renewal

                batch = [Renewal(e.name, e.current_hold()[1].token, 3000) for e in held]
                began = time.monotonic()
                results = backend.renew_many(batch)
                # One socket timeout for this try; the watchdog's own try to the paused master
                # (these holds are renewed) may be ahead of it on that master's worker: a
                # second. (Before: 3.4-3.7 s, each command re-sent on its own.)
                assert time.monotonic() - began < 2 * 0.5 + 0.4
                for each, result in zip(held, results, strict=True):
                    assert result is (None if owners[each.name] is paused else True)
                time.sleep(4.5)  # 1.5 TTLs
                gone = [
                    each.name
                    for each in healthy
                    if owners[each.name].client().pttl(backend.key(each.name)) < 0
                ]
                assert not gone, f"{len(gone)} holds on healthy masters expired"
            finally:
                paused.resume()
            assert not [n for n in lost if n in {each.name for each in healthy}]
            assert all(each.owned() for each in healthy)
            bugs = [r for r in caplog.records if r.exc_info]
            assert not bugs, f"logged as the watchdog's bugs: {bugs[0].getMessage()}"
            for each in held:
                with contextlib.suppress(LockError):
                    each.release()
            backend.close()


def _names_on(node: RedisServer, prefix: str, count: int) -> list[str]:
    """``count`` lock names whose keys live on ``node`` (a master)."""
    from redis.crc import key_slot

    backend = locks["c"]
    slots = node.client().execute_command("CLUSTER", "SLOTS")
    ranges = [(r[0], r[1]) for r in slots if int(r[2][1]) == node.port]
    names = []
    for i in itertools.count():
        at = key_slot(backend.key(f"{prefix}:{i}").encode())
        if any(start <= at <= end for start, end in ranges):
            names.append(f"{prefix}:{i}")
            if len(names) == count:
                return names
    raise AssertionError("unreachable")


@pytest.mark.redis_py
def test_a_cluster_client_is_made_while_the_master_of_slot_0_is_paused(name: str) -> None:
    """Making redis-py's cluster client asks a node for COMMAND (the commands' key
    positions), and redis-py asks its default node: the master of slot 0. While that master
    was paused, every client made failed after a socket timeout, so a process started or
    forked then took no lock at all, not even one of a healthy master. Any master that
    answers does now, within one socket timeout."""
    import os
    import signal

    with _own_cluster() as nodes:
        first = next(node for node in nodes if _serves(node, 0))
        healthy = next(node for node in nodes if node is not first)
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": healthy.url, "OPTIONS": {"socket_timeout": 2.0,
                  "socket_connect_timeout": 2.0}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            backend = locks["c"]
            names = _names_on(healthy, name, 3)
            with lock(names[0], using="c"):
                pass  # the parent's client made before the pause
            first.pause()
            try:
                backend.close()  # its client made again, as in a new process
                began = time.monotonic()
                held = lock(names[1], using="c")
                assert held.acquire(blocking=False)
                assert time.monotonic() - began < 2.0  # the socket timeout
                held.release()
                pid = os.fork()
                if pid == 0:  # the child makes a client of its own
                    signal.alarm(5)
                    try:
                        child_hold = lock(names[2], using="c")
                        code = 0 if child_hold.acquire(blocking=False) else 2
                        child_hold.release()
                    except BaseException:
                        code = 1
                    os._exit(code)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0
            finally:
                first.resume()
            backend.close()


def test_a_closed_cluster_backend_s_holds_stay_renewed_while_a_master_is_paused(
    name: str,
) -> None:
    """close() (locks.reset(), a settings override ending) leaves its holds to the watchdog.
    Each master's worker made the client again first, which asks the seed for the slots and
    the master of slot 0 for COMMAND: with that master paused no renewal reached any
    master, and the healthy masters' holds expired while reported held (a second holder
    could take them). Each worker renews through the client it had."""
    with _own_cluster() as nodes, _lost_names() as lost:
        first = next(node for node in nodes if _serves(node, 0))
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": first.url, "OPTIONS": {"socket_timeout": 1.0,
                  "socket_connect_timeout": 1.0}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            backend = locks["c"]
            others = [node for node in nodes if node is not first]
            healthy = [
                (lock(each, using="c", ttl=1.5), node)
                for node in others
                for each in _names_on(node, f"{name}:{node.port}", 4)
            ]
            paused = [lock(each, using="c", ttl=1.5) for each in _names_on(first, name, 2)]
            for each in [*(held for held, _ in healthy), *paused]:
                assert each.acquire(blocking=False)
            backend.close()
            first.pause()
            lowest = 99999
            try:
                ends = time.monotonic() + 3.0  # two TTLs
                while time.monotonic() < ends:
                    for held, node in healthy:
                        lowest = min(lowest, node.client().pttl(backend.key(held.name)))
                    time.sleep(0.05)
            finally:
                first.resume()
            assert lowest > 0, f"a hold on a healthy master ran down to {lowest} ms"
            first.client().ping()  # back (owned() below makes a client: the seed's slots)
            assert all(held.owned() for held, _ in healthy)
            assert not [n for n in lost if n not in {each.name for each in paused}]
            for each in [*(held for held, _ in healthy), *paused]:
                with contextlib.suppress(LockError):
                    each.release()
            backend.close()


@pytest.mark.redis_py
def test_lock_calls_during_a_slot_migration_wait_for_it(name: str) -> None:
    """Resharding is not an outage. While a lock's slot is MIGRATING, every lock script names
    a key the source does not have (a queue), so Redis answers TRYAGAIN; redis-py gave up
    after 16 redirections (about 0.1 s) and a try on a held lock, the holder's release and
    owned() raised BackendUnavailable ("TTL exhausted"). Each call, refused at least once,
    answers once the move ends: its script run by the slot's new master (a take that gave up
    at its socket timeout says False too, with no script run), soon after the end. (It was
    timed from the call's start, a 0.6 s sleep and the move within the 2 s socket timeout:
    2.0013 s on a loaded CI machine.)"""
    import threading

    from ..waiting.test_sharded import migrate_slot

    with _own_cluster() as nodes:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 2.0}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            backend = locks["c"]
            slot = nodes[0].client().execute_command("CLUSTER", "KEYSLOT", backend.key(name))
            # Not renewed: the new master's scripts are the calls' own.
            holder = lock(name, using="c", ttl=30, auto_renew=False)
            assert holder.acquire(blocking=False)

            def tryagains(node: RedisServer) -> int:
                stats = node.client().info("errorstats").get("errorstat_TRYAGAIN", {})
                return int(stats.get("count", 0))

            def finish(
                source: RedisServer, target: RedisServer, refusals: int, ended: list[float]
            ) -> None:
                """The move ends once the call was refused: it waits during a move."""
                deadline = time.monotonic() + 10
                while tryagains(source) == refusals and time.monotonic() < deadline:
                    time.sleep(0.01)
                migrate_slot(nodes, slot, source, target)
                ended.append(time.monotonic())

            for call, expected in (
                (lambda: lock(name, using="c").acquire(blocking=False), False),
                (holder.owned, True),
                (lambda: holder.release() or True, True),
            ):
                source = next(n for n in nodes if _serves(n, slot))
                target = next(n for n in nodes if n is not source)
                src, dst = source.client(), target.client()
                src_id = src.execute_command("CLUSTER", "MYID").decode()
                dst_id = dst.execute_command("CLUSTER", "MYID").decode()
                dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
                src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
                refusals, scripts = tryagains(source), target.script_calls()
                ended: list[float] = []

                mover = threading.Thread(target=finish, args=(source, target, refusals, ended))
                mover.start()
                try:
                    assert call() is expected
                    answered = time.monotonic()
                finally:
                    mover.join(15)
                assert tryagains(source) > refusals, "the call was never refused: no move seen"
                assert target.script_calls() > scripts, "no answer from the new master"
                # From the move's end (the new master answers from its first SETSLOT on):
                # a try each MIGRATION_PAUSE, however long the move took.
                assert answered - ended[0] < 1.0
            assert not lock(name, using="c").locked()
            backend.close()


def test_the_watchdog_follows_a_moved_slot_and_a_failover(name: str) -> None:
    """Each master's renewals go straight to it: a hold whose slot moved to another master
    (MOVED), then whose master failed over and stopped (refused: the slots are read again),
    is renewed where it is now, never declared lost."""
    from django_redlock.signals import lock_lost

    from ..waiting.test_sharded import migrate_slot

    # No diskless-sync delay: Redis 7 waits 5 s for more replicas before the first sync.
    args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
            "--repl-diskless-sync-delay", "0")  # fmt: skip
    masters = [RedisServer(args=args).start() for _ in range(3)]
    replicas = [RedisServer(args=args).start() for _ in range(3)]
    lost: list[Any] = []

    def on_lost(sender: Any, lock: Any, **kwargs: Any) -> None:
        lost.append(lock)

    lock_lost.connect(on_lost)
    try:
        create_cluster(masters, replicas=replicas)
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": masters[0].url, "OPTIONS": {"socket_timeout": 0.5,
                  "socket_connect_timeout": 0.5}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            backend = locks["c"]
            key = backend.key(name)
            slot = masters[0].client().execute_command("CLUSTER", "KEYSLOT", key)
            held = lock(name, using="c", ttl=2)
            assert held.acquire(blocking=False)
            i = next(i for i, m in enumerate(masters) if _serves(m, slot))
            j = (i + 1) % 3
            migrate_slot(masters, slot, masters[i], masters[j])
            _renewed_on(masters[j], key)  # on the new owner, after a MOVED
            assert not lost
            _take_over(replicas[j], masters[(j + 1) % 3], slot)
            masters[j].stop()
            _renewed_on(replicas[j], key)  # refused: the slots read again, the new master
            assert not lost
            assert held.owned()
            held.release()
            backend.close()
    finally:
        lock_lost.disconnect(on_lost)
        stop_all([*masters, *replicas])


def _renewed_on(node: RedisServer, key: str, times: int = 2) -> None:
    """Returns once the hold of ``key`` was renewed on ``node`` ``times`` times (its PTTL
    went up), never gone there meanwhile: polled, not a fixed sleep of a TTL or more."""
    _renewed(lambda: int(node.client().pttl(key)), f"node {node.port}", times)


def _renewed(pttl: Callable[[], int], where: str, times: int = 2) -> None:
    deadline = time.monotonic() + 15
    last, renewals = pttl(), 0
    while renewals < times:
        assert last > 0, f"the hold is gone from {where} ({last})"
        assert time.monotonic() < deadline, f"never renewed {times} times on {where}"
        time.sleep(0.05)
        now = pttl()
        renewals += now > last
        last = now


@pytest.mark.redis_py
def test_a_cluster_no_node_of_which_answers_is_unavailable(name: str) -> None:
    """redis-py's cluster client raises its own RedisClusterUnreachableError (no RedisError)
    when it cannot read the slots from any node: at the first call of a backend whose nodes
    are down, and for a command's timeout while every node is paused. Both raised it raw
    from every call (acquire, locked, lock_all, the admin's pages). BackendUnavailable; a
    timeout stays a timeout (the server may still run what it was sent)."""
    from django_redlock import lock_all

    dead = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
            "LOCATION": "redis://127.0.0.1:9/0", "OPTIONS": {"socket_timeout": 0.5}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "dead": dead}):
        for call in (
            lambda: lock(name, using="dead").acquire(blocking=False),
            lambda: lock(name, using="dead").locked(),
            lambda: lock_all(name, f"{name}:2", using="dead", blocking=False).__enter__(),
            lambda: locks["dead"].page("*", None, 10),
        ):
            with pytest.raises(BackendUnavailable, match="cannot be connected"):
                call()
        locks["dead"].close()
    with _own_cluster() as nodes:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 0.5,
                  "socket_connect_timeout": 0.5}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            warm_up("c", name)  # the slots are known (retried: a loaded machine, 0.5 s)
            for node in nodes:
                node.pause()
            try:
                for _ in range(3):  # the third runs the refresh the others asked for
                    with pytest.raises(BackendUnavailable) as raised:
                        lock(name, using="c").acquire(blocking=False)
                    assert raised.value.timed_out
            finally:
                for node in nodes:
                    node.resume()
            locks["c"].close()


def test_a_take_during_a_long_slot_migration_waits_within_its_timeout(name: str) -> None:
    """A move longer than the socket timeout: a one-off try says False (not taken: nothing
    ran), and a waiter keeps waiting within its own timeout and takes the lock once the
    move ended and the holder let go. Both raised BackendUnavailable ("TTL exhausted")."""
    import threading

    from ..waiting.test_sharded import migrate_slot

    with _own_cluster() as nodes:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 1.0}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            backend = locks["c"]
            slot = nodes[0].client().execute_command("CLUSTER", "KEYSLOT", backend.key(name))
            holder = lock(name, using="c", ttl=30)
            assert holder.acquire(blocking=False)
            source = next(n for n in nodes if _serves(n, slot))
            target = next(n for n in nodes if n is not source)
            src, dst = source.client(), target.client()
            src_id = src.execute_command("CLUSTER", "MYID").decode()
            dst_id = dst.execute_command("CLUSTER", "MYID").decode()
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            got: list[bool] = []
            waiter = threading.Thread(
                target=lambda: got.append(lock(name, using="c").acquire(timeout=15))
            )
            try:
                waiter.start()
                assert lock(name, using="c").acquire(blocking=False) is False
                time.sleep(2.5)  # 2.5 socket timeouts into the move
            finally:
                migrate_slot(nodes, slot, source, target)
            holder.release()
            waiter.join(15)
            assert got == [True]
            backend.close()


def _cluster_config(nodes: list[RedisServer], socket_timeout: float) -> Any:
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": socket_timeout,
              "socket_connect_timeout": socket_timeout}}  # fmt: skip
    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config})


def test_a_paused_master_a_slot_moved_to_costs_no_hold_on_the_master_it_came_from(
    name: str,
) -> None:
    """A hold's master was fixed when it joined the watchdog: after a resharding its batches
    stayed with the master the slot came from, and that master's worker followed the MOVED
    to the new owner, a socket timeout per try while it was paused, with its own holds
    queued behind: every hold of the healthy old master expired and was declared lost. Now
    the moved hold goes to its new master's batches and worker."""
    from redis.crc import key_slot

    from ..waiting.test_sharded import migrate_slot

    with _own_cluster() as nodes, _lost_names() as lost, _cluster_config(nodes, 1.0):
        backend = locks["c"]
        source, target = nodes[0], nodes[1]
        first = source.client().execute_command("CLUSTER", "SLOTS")
        ranges = [(r[0], r[1]) for r in first if int(r[2][1]) == source.port]
        slot, moved, staying = None, [], []
        for i in itertools.count():  # three names on one slot of source's, twelve on others
            each = f"{name}:{i}"
            at = key_slot(backend.key(each).encode())
            if not any(start <= at <= end for start, end in ranges):
                continue
            slot = at if slot is None else slot
            if at == slot and len(moved) < 3:
                moved.append(each)
            elif at != slot and len(staying) < 12:
                staying.append(each)
            if len(moved) == 3 and len(staying) == 12:
                break
        held = []
        for i in range(3):  # three batches, each with a hold of the slot that moves
            for each in (moved[i], *staying[3 * i : 3 * i + 3]):
                held.append(lock(each, using="c", ttl=3))
                assert held[-1].acquire(blocking=False)
            time.sleep(0.7)  # a new batch (one takes holds for TTL/6 s)
        for each in staying[9:]:
            held.append(lock(each, using="c", ttl=3))
            assert held[-1].acquire(blocking=False)
        time.sleep(1.5)
        migrate_slot(nodes, slot, source, target)
        time.sleep(2.0)  # renewed on the new master, after a MOVED
        assert not lost
        lowest = 99999
        target.pause()
        try:
            ends = time.monotonic() + 6
            while time.monotonic() < ends:
                for each in staying:
                    lowest = min(lowest, source.client().pttl(backend.key(each)))
                time.sleep(0.05)
        finally:
            target.resume()
        time.sleep(1.0)
        assert lowest > 0, f"a hold on the healthy master ran down to {lowest} ms"
        assert not [n for n in lost if n in staying]
        for each in held:
            with contextlib.suppress(LockError):
                each.release()
        backend.close()


@pytest.mark.redis_py
def test_an_ask_to_a_node_that_serves_no_slot_yet_is_followed(name: str) -> None:
    """Scale-out: a new node joins and a slot with a held lock starts moving to it (the key
    migrated, the slot still open). The source answers ASK with a node that is in no CLUSTER
    SLOTS reply: the watchdog did not follow it (the hold ran out, never declared lost) and
    owned(), extend() and release() raised redis-py's AttributeError. The hold is renewed
    on the new node, each call answers or raises a LockError, and once the move ends the
    hold is still there."""
    from django_redlock.signals import lock_lost

    args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "30000")
    nodes = [RedisServer(args=args).start() for _ in range(3)]
    # Its node timeout is 30 s once it has joined: a master waits min(node timeout, 5 s) after
    # it last saw itself in a minority before it says the cluster is ok (5 s for every run).
    new = RedisServer(args=(*args[:3], "1000")).start()
    lost: list[str] = []

    def on_lost(sender: Any, lock: Any, **kwargs: Any) -> None:
        lost.append(lock.name)

    lock_lost.connect(on_lost)
    try:
        create_cluster(nodes)
        with _cluster_config(nodes, 0.5):
            backend = locks["c"]
            held = lock(name, using="c", ttl=2)
            assert held.acquire(blocking=False)
            key = backend.key(name)
            slot, source = _slot_and_master(nodes, key)
            new.client().execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
            deadline = time.monotonic() + 30
            while any(n.client().execute_command("CLUSTER", "NODES").count(b"master") < 4
                      for n in (*nodes, new)) or b"cluster_state:ok" not in new.client(
                      ).execute_command("CLUSTER", "INFO"):  # fmt: skip
                assert time.monotonic() < deadline, "the new node never joined"
                time.sleep(0.1)
            new.client().config_set("cluster-node-timeout", 30000)
            source_id = source.client().execute_command("CLUSTER", "MYID").decode()
            new_id = new.client().execute_command("CLUSTER", "MYID").decode()
            new.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", new_id)
            source.client().execute_command(
                "MIGRATE", "127.0.0.1", new.port, "", 0, 5000, "KEYS", key
            )

            def pttl() -> int:
                pipe = new.client().pipeline(transaction=False)
                pipe.execute_command("ASKING")
                pipe.pttl(key)
                return int(pipe.execute()[1])

            _renewed(pttl, "the new node")  # (it ran out there, unrenewed)
            assert not lost
            for call in (held.owned, held.extend):
                # The slot half moved: an answer, or no answer (a LockError); nothing else.
                with contextlib.suppress(LockError):
                    call()
            _end_of_move([*nodes, new], slot, source, new)
            assert held.owned()
            held.release()
            assert not lost
            backend.close()
    finally:
        lock_lost.disconnect(on_lost)
        stop_all([*nodes, new])


def test_a_waiter_s_timeout_bounds_its_tries_during_a_slot_migration(name: str) -> None:
    """A held lock's slot is half moved (its key migrated, the slot open): every take is
    answered TRYAGAIN. Each was tried again for a whole socket timeout (2 s), then the wait
    tried once more after its deadline and left, another socket timeout each:
    acquire(timeout=0.2) took 7.3 s. The tries stop at the caller's deadline."""
    with _own_cluster() as nodes, _cluster_config(nodes, 2.0):
        backend = locks["c"]
        holder = lock(name, using="c", ttl=30)
        assert holder.acquire(blocking=False)
        key = backend.key(name)
        slot, source = _slot_and_master(nodes, key)
        target = next(n for n in nodes if n is not source)
        source_id = source.client().execute_command("CLUSTER", "MYID").decode()
        target_id = target.client().execute_command("CLUSTER", "MYID").decode()
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        source.client().execute_command(
            "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", key
        )
        for timeout in (0.2, 0.5, 1.0):
            began = time.monotonic()
            assert lock(name, using="c").acquire(timeout=timeout) is False
            assert time.monotonic() - began < timeout + 0.5
        _end_of_move(nodes, slot, source, target)
        holder.release()
        backend.close()


@pytest.mark.parametrize("close", [False, True], ids=["", "closed-between"])
def test_a_cancelled_cluster_take_is_handed_back_after_it_lands(name: str, close: bool) -> None:
    """An asyncio call on a Cluster runs in a worker thread, which a cancel does not stop: a
    take retried there during a slot migration (TRYAGAIN) was cancelled, its hand-back was
    answered at once (nothing held yet), then the take landed once the move ended: the name
    was held by nobody for its TTL. The hand-back now waits for the take's thread, also after
    a close() between the cancel and the hand-back (it looked like a fork, which forgot the
    take's thread)."""
    from ..waiting.test_sharded import migrate_slot

    with _own_cluster() as nodes, _cluster_config(nodes, 2.0):
        backend = locks["c"]
        with lock(name, using="c"):
            pass  # leaves its fence key: a take during the move answers TRYAGAIN
        key = backend.key(name)
        slot, source = _slot_and_master(nodes, key)
        target = next(n for n in nodes if n is not source)
        src_id = source.client().execute_command("CLUSTER", "MYID").decode()
        dst_id = target.client().execute_command("CLUSTER", "MYID").decode()
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)

        async def main() -> None:
            task = asyncio.create_task(lock(name, using="c", ttl=20).aacquire(timeout=5))
            await asyncio.sleep(0.2)  # its take is being retried in its thread
            task.cancel()
            if close:
                backend.close()  # (locks.close_all() racing the task's hand-back)
            await asyncio.sleep(0.3)  # (the hand-back was answered by now)
            ending = asyncio.create_task(
                asyncio.to_thread(migrate_slot, nodes, slot, source, target)
            )
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await ending
            await asyncio.sleep(0.5)  # (a take not waited for lands by now)

        asyncio.run(main())
        from redis.cluster import RedisCluster

        cluster = RedisCluster(host="127.0.0.1", port=target.port)  # wherever it is now
        assert cluster.pttl(key) == -2  # handed back where it landed
        cluster.close()
        other = lock(name, using="c")
        assert other.acquire(blocking=False)
        other.release()
        backend.close()


def test_asyncio_calls_to_a_paused_cluster_master_do_not_delay_another_master_s(
    name: str,
) -> None:
    """Asyncio calls on a Cluster ran on the loop's default executor (min(32, cpus + 4)
    threads): tasks trying names on a paused master filled it, and a one-off try on a
    healthy master waited behind them for socket timeouts. Each master has threads of its
    own now."""
    with _own_cluster() as nodes, _cluster_config(nodes, 1.0):
        backend = locks["c"]
        with lock(name, using="c"):
            pass  # the slots are known, the scripts loaded

        def owner(each: str) -> RedisServer:
            return _slot_and_master(nodes, backend.key(each))[1]

        paused = owner(name)
        names = (f"{name}:{i}" for i in itertools.count())
        on_paused = [each for each in itertools.islice(names, 300) if owner(each) is paused]
        healthy = next(each for each in names if owner(each) is not paused)

        async def main() -> float:
            async def attempt(each: str) -> None:
                with contextlib.suppress(BackendUnavailable):
                    await lock(each, using="c", ttl=5).aacquire(blocking=False)

            tasks = [asyncio.create_task(attempt(each)) for each in on_paused[:40]]
            await asyncio.sleep(0.05)  # every thread the loop has is waiting on it
            began = time.monotonic()
            other = lock(healthy, using="c", ttl=5)
            assert await other.aacquire(blocking=False)
            took = time.monotonic() - began
            await other.arelease()
            await asyncio.gather(*tasks)
            return took

        paused.pause()
        try:
            took = asyncio.run(main())
        finally:
            paused.resume()
        assert took < 0.5, f"the healthy master's take took {took:.2f} s"
        backend.close()


def test_an_old_ask_note_does_not_make_the_watchdog_declare_a_live_hold_lost(name: str) -> None:
    """The watchdog noted where an ASK sent a lock's key (per name), and the note outlived
    the hold and the migration: hold 1's slot moved A -> B (renewed on B after ASKING), hold
    1 released, the slot moved back, hold 2 taken on A, then a new move A -> B began (B
    importing, the key still on A): hold 2 was renewed on B after ASKING, B answered 0, and
    hold 2 was declared lost while its key sat on A. The note is the hold's now, and a 0
    after ASKING is checked on the slot's owner before a loss is declared."""

    from ..waiting.test_sharded import migrate_slot

    with _own_cluster() as nodes, _lost_names() as lost, _cluster_config(nodes, 0.5):
        backend = locks["c"]
        key = backend.key(name)
        slot, a = _slot_and_master(nodes, key)
        b = next(n for n in nodes if n is not a)
        id_a = a.client().execute_command("CLUSTER", "MYID").decode()
        id_b = b.client().execute_command("CLUSTER", "MYID").decode()

        def start_moving() -> None:  # A -> B, no key moved yet
            b.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", id_a)
            a.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", id_b)

        first = lock(name, using="c", ttl=1.5)
        assert first.acquire(blocking=False)
        start_moving()
        a.client().execute_command("MIGRATE", "127.0.0.1", b.port, "", 0, 5000, "KEYS", key)
        time.sleep(1.2)  # renewed once: A answered ASK, renewed on B after ASKING
        _end_of_move(nodes, slot, a, b)
        first.release()
        migrate_slot(nodes, slot, b, a)  # back, with its fence counter
        second = lock(name, using="c", ttl=1.5)
        assert second.acquire(blocking=False)
        start_moving()
        time.sleep(2.0)  # four renewal periods
        assert lost == [] and a.client().pttl(key) > 0
        for node in (a, b):  # the move called off
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        assert second.owned()
        second.release()
        backend.close()


def test_a_hold_gone_from_the_node_importing_its_slot_is_still_declared_lost(name: str) -> None:
    """The other side of the rule above: a 0 after ASKING is checked on the slot's owner,
    whose ASK then makes the next 0 a loss: a hold whose key is gone during a migration is
    declared lost a renewal or two later, not left unknown."""

    with _own_cluster() as nodes, _lost_names() as lost, _cluster_config(nodes, 0.5):
        backend = locks["c"]
        key = backend.key(name)
        slot, a = _slot_and_master(nodes, key)
        b = next(n for n in nodes if n is not a)
        id_a = a.client().execute_command("CLUSTER", "MYID").decode()
        id_b = b.client().execute_command("CLUSTER", "MYID").decode()
        held = lock(name, using="c", ttl=1.5)
        assert held.acquire(blocking=False)
        b.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", id_a)
        a.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", id_b)
        a.client().execute_command("MIGRATE", "127.0.0.1", b.port, "", 0, 5000, "KEYS", key)
        time.sleep(1.0)  # renewed on B after ASKING
        assert lost == []
        pipe = b.client().pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.delete(key)
        assert pipe.execute()[1] == 1  # the hold is gone
        deadline = time.monotonic() + 3.0
        while not lost:
            assert time.monotonic() < deadline, "never declared lost"
            time.sleep(0.05)
        assert lost == [name]
        for node in (a, b):
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        backend.close()


def test_permits_of_one_semaphore_are_renewed_on_the_node_importing_their_slot(
    name: str,
) -> None:
    """Several holds of one name (a semaphore's permits) share its key: an ASK for one is
    where the others are too, and renewing them there, each in turn, loses none."""

    with _own_cluster() as nodes, _lost_names() as lost, _cluster_config(nodes, 0.5):
        backend = locks["c"]
        key = backend.key(name)
        slot, a = _slot_and_master(nodes, key)
        b = next(n for n in nodes if n is not a)
        id_a = a.client().execute_command("CLUSTER", "MYID").decode()
        id_b = b.client().execute_command("CLUSTER", "MYID").decode()
        permits = [semaphore(name, 3, using="c", ttl=1.5) for _ in range(3)]
        for permit in permits:
            assert permit.acquire(blocking=False)
        b.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", id_a)
        a.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", id_b)
        while keys := a.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            a.client().execute_command("MIGRATE", "127.0.0.1", b.port, "", 0, 5000, "KEYS", *keys)
        time.sleep(2.5)  # five renewal periods
        assert lost == []
        for node in (b, a, *[n for n in nodes if n not in (a, b)]):
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", id_b)
        for permit in permits:
            assert permit.owned()
            permit.release()
        backend.close()


def test_a_write_hold_whose_slot_move_stalls_between_its_keys_admits_no_reader_unannounced(
    name: str,
) -> None:
    """A reshard moves a slot key by key: the write lease's details hash (its ':writer' mark)
    moved first, the leases key left on the source for longer than the TTL. Renewals declared
    the leases key only, ran half their script there and renewed the leases, never the hash,
    which ran out: after the move a reader was admitted beside a writer that still believed
    it held. Renewals declare both keys now (TRYAGAIN meanwhile): the write lease runs out
    with its mark and the writer is told (review wdc3, 4)."""
    from ..waiting.test_sharded import migrate_slot

    with _own_cluster() as nodes, _cluster_config(nodes, 0.5):
        backend = locks["c"]
        rw = read_write_lock(name, using="c", ttl=1.0)
        writer = rw.write()
        assert writer.acquire(blocking=False)
        slot, source = _slot_and_master(nodes, backend.key(name))
        target = next(n for n in nodes if n is not source)
        src, dst = source.client(), target.client()
        dst.execute_command(
            "CLUSTER", "SETSLOT", slot, "IMPORTING", src.execute_command("CLUSTER", "MYID")
        )
        src.execute_command(
            "CLUSTER", "SETSLOT", slot, "MIGRATING", dst.execute_command("CLUSTER", "MYID")
        )
        details = backend.details_key(name)
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", details)
        time.sleep(1.6)  # the move stalls past the TTL
        migrate_slot(nodes, slot, source, target)  # the other keys, then every node told
        time.sleep(0.8)  # renewed on the target meanwhile
        reader = rw.read()
        got = reader.acquire(blocking=False)
        assert not got or writer.lost is not None, "a reader beside a writer that holds"
        if got:
            reader.release()
        with contextlib.suppress(LockError):
            writer.release()
        backend.close()


@pytest.mark.redis_py
def test_a_burst_beyond_a_cluster_s_max_connections_waits_for_a_connection(name: str) -> None:
    """redis-py's cluster node pools refuse a caller past max_connections: a burst of 40
    callers (threads, or asyncio tasks, as many worker threads as max_connections) on a
    healthy cluster got BackendUnavailable ("Too many connections"). A caller now waits for
    a free connection, as on one Redis."""
    import threading

    with _own_cluster() as nodes:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 2.0,
                  "socket_connect_timeout": 2.0, "max_connections": 4}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            errors: list[Exception] = []

            def take() -> None:
                try:
                    with lock(name, using="c", ttl=5, timeout=20):
                        time.sleep(0.002)
                except LockError as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=take) for _ in range(40)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)

            async def atake() -> None:
                try:
                    async with lock(name, using="c", ttl=5, timeout=20):
                        await asyncio.sleep(0.002)
                except LockError as exc:
                    errors.append(exc)

            async def main() -> None:
                await asyncio.gather(*(atake() for _ in range(40)))

            asyncio.run(main())
            assert errors == []
            locks["c"].close()


def test_asyncio_calls_queued_for_a_paused_cluster_master_are_unavailable_in_time(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asyncio calls to one master run on its threads: with the master paused they came out
    in rounds of a socket timeout (40 calls over 4 threads: 5 s for 0.5 s). A call that waited
    a socket timeout without starting is now unavailable (never sent)."""
    from django_redlock.backends import cluster

    monkeypatch.setattr(cluster, "ASYNC_THREADS", 4)  # (32 by default: the same in rounds)
    with _own_cluster() as nodes, _cluster_config(nodes, 0.5):
        backend = locks["c"]
        with lock(name, using="c"):
            pass  # the slots are known, the scripts loaded

        def owner(each: str) -> RedisServer:
            return _slot_and_master(nodes, backend.key(each))[1]

        paused = owner(name)
        names = (f"{name}:{i}" for i in itertools.count())
        on_paused = [each for each in itertools.islice(names, 200) if owner(each) is paused]
        assert len(on_paused) >= 40
        outcomes: list[tuple[str, float]] = []

        async def one(i: int, began: float) -> None:
            try:
                await lock(on_paused[i], using="c").aacquire(blocking=False)
                outcome = "granted"
            except BackendUnavailable:
                outcome = "unavailable"
            outcomes.append((outcome, time.monotonic() - began))

        async def main() -> None:
            began = time.monotonic()
            await asyncio.gather(*(one(i, began) for i in range(40)))

        paused.pause()
        try:
            asyncio.run(main())
        finally:
            paused.resume()
        assert {outcome for outcome, _ in outcomes} == {"unavailable"}
        assert max(took for _, took in outcomes) < 2 * 0.5 + 0.4  # queued, then sent
        backend.close()


@pytest.mark.redis_py
@pytest.mark.parametrize("how", ["sync", "asyncio"])
def test_a_script_is_taught_to_its_own_master_only_while_another_is_paused(
    name: str, how: str
) -> None:
    """A master that forgot the scripts (restarted, SCRIPT FLUSH) answers NOSCRIPT; the
    script was then loaded through the cluster client, which sends SCRIPT LOAD to every
    primary: with another master paused, a take, release or owned() on a healthy master
    failed after a socket timeout. It is loaded on the key's node only."""
    with _own_cluster() as nodes:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 0.5}}  # fmt: skip
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "c": config}):
            backend = locks["c"]

            def owner(each: str) -> RedisServer:
                return _slot_and_master(nodes, backend.key(each))[1]

            healthy = owner(name)
            paused = next(n for n in nodes if n is not healthy)
            held = lock(name, using="c", ttl=10)

            def flush_pause_and_use() -> float:
                healthy.client().script_flush()  # as after a restart
                paused.pause()
                began = time.monotonic()
                if how == "sync":
                    assert held.acquire(blocking=False)
                    assert held.owned()
                    held.release()
                return began

            try:
                if how == "sync":
                    with lock(f"{name}:warm", using="c"):  # the client and its slots, made
                        pass
                    began = flush_pause_and_use()
                else:

                    async def main() -> float:
                        async with lock(f"{name}:warm", using="c"):  # the loop's client
                            pass
                        began = flush_pause_and_use()
                        assert await held.aacquire(blocking=False)
                        assert await held.aowned()
                        await held.arelease()
                        return began

                    began = asyncio.run(main())
                assert time.monotonic() - began < 0.4
            finally:
                paused.resume()
            backend.close()


@pytest.mark.redis_py
@pytest.mark.usefixtures("_cluster_alias")
def test_a_child_forked_while_a_thread_reads_the_slots_has_a_client_of_its_own(
    name: str,
) -> None:
    """redis-py's cluster client holds its slot map's lock while it reads the slots over the
    network (the watchdog after a try with no answer, a waiter's hub after a failover). A
    child forked then inherited the lock held for good: its first slot refresh (a refused
    connection, a failover) waited forever. Here the lock is held at the fork, as by that
    thread; the child's client, and every call through it, must be its own."""
    import os
    import signal
    import threading as threads

    backend = locks["cluster"]
    with lock(name, using="cluster"):
        pass  # the client made, the slots known
    held, done = threads.Event(), threads.Event()

    nodes = backend.client.nodes_manager  # redis-py's lock, held while it reads (below 8: _lock)
    slots_lock = getattr(nodes, "_initialization_lock", None) or nodes._lock

    def reading_the_slots() -> None:
        with slots_lock:
            held.set()
            done.wait(10)

    reader = threads.Thread(target=reading_the_slots)
    reader.start()
    try:
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:  # the child: a call stuck on the parent's lock is ended by the alarm
            signal.alarm(5)
            try:
                wire.refresh_slots(locks["cluster"].client)  # as after a refused connection
                first = lock(name, using="cluster")
                assert first.acquire(timeout=2)
                threads.Timer(0.2, first.release).start()
                with lock(name, using="cluster", timeout=3) as child_hold:  # woken: its hub
                    assert child_hold.fence is not None
            except BaseException:
                os._exit(1)
            os._exit(0)
    finally:
        done.set()
        reader.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.redis_py
def test_a_cluster_whose_first_seed_node_is_gone_is_reached_through_another(
    cluster_nodes: list[RedisServer], name: str
) -> None:
    """LOCATION named one node, whose slots a new process read first: that node gone (its
    replica promoted, the cluster healthy), every new process was unavailable. LOCATION may
    list several seeds; the first that answers tells the rest."""
    from django.core.exceptions import ImproperlyConfigured

    gone = "redis://127.0.0.1:9"  # nothing listens there: refused, as a dead node's port
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": [gone, cluster_nodes[1].url, cluster_nodes[2].url],
              "OPTIONS": {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}}  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "seeds": config}):
        try:
            names = [f"{name}:{i}" for i in range(12)]  # on every master
            for each in names:
                with lock(each, using="seeds", timeout=2) as held:
                    assert held.fence is not None
            nodes = {locks["seeds"].renewal_shard(each) for each in names}
            assert len(nodes) == 3
        finally:
            locks["seeds"].close()
    bad = [([], "non-empty list"), ([cluster_nodes[0].url, "redis://u:p@127.0.0.1:1"], "first's")]
    for location, why in bad:
        wrong = override_settings(
            DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "seeds": {**config, "LOCATION": location}}
        )
        with pytest.raises(ImproperlyConfigured, match=why), wrong:  # raised as it changes
            locks["seeds"]


def test_asyncio_threads_of_a_master_replaced_by_another_end(name: str) -> None:
    """asyncio calls run in a thread pool per master. A pool was kept for every node that
    had ever been a master: each failover (a node replaced under a new address, as pods are)
    added up to 32 threads for the life of the process. The old master's pool ends once
    another node took its slots over."""
    import threading as threads

    args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
            "--repl-diskless-sync-delay", "0")  # fmt: skip
    masters = [RedisServer(args=args).start() for _ in range(3)]
    replica = RedisServer(args=args).start()
    try:
        create_cluster(masters, replicas=[replica])
        with _cluster_config(masters, 1.0):
            backend, client = locks["c"], masters[0].client()

            def slot_of(candidate: str) -> int:
                return int(client.execute_command("CLUSTER", "KEYSLOT", backend.key(candidate)))

            held_name = next(
                f"{name}:{i}" for i in range(200) if _serves(masters[0], slot_of(f"{name}:{i}"))
            )  # on the master that fails over
            slot = slot_of(held_name)

            async def take() -> None:
                async with lock(held_name, using="c", timeout=5) as held:
                    assert held.fence is not None

            def pool_threads(port: int) -> int:
                prefix = f"redlock-cluster c 127.0.0.1:{port}"
                return sum(t.name.startswith(prefix) for t in threads.enumerate())

            asyncio.run(take())
            assert pool_threads(masters[0].port) >= 1
            _take_over(replica, masters[1], slot)
            wire.refresh_slots(backend.client)  # as after the old master's refusal
            asyncio.run(take())  # on the new master, in a pool of its own
            assert pool_threads(replica.port) >= 1
            deadline = time.monotonic() + 5
            while pool_threads(masters[0].port):
                assert time.monotonic() < deadline, "the old master's threads never ended"
                time.sleep(0.05)
            backend.close()
    finally:
        stop_all([*masters, replica])


@contextlib.contextmanager
def _busy_pool(pool: Any, count: int) -> Iterator[None]:
    """``count`` threads each keep one of ``pool``'s connections checked out (as callers in
    the middle of their commands) until the block ends."""
    import threading

    stop, taken = threading.Event(), threading.Semaphore(0)

    def busy() -> None:
        connection = pool.get_connection()
        taken.release()
        try:
            stop.wait()
        finally:
            pool.release(connection)

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert taken.acquire(timeout=5)
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)


def _slot_reads(nodes: list[RedisServer]) -> int:
    """How many CLUSTER SLOTS (and CLUSTER SHARDS) the nodes have answered."""
    total = 0
    for node in nodes:
        stats = node.client().info("commandstats")
        total += sum(v["calls"] for k, v in stats.items() if k in (
            "cmdstat_cluster|slots", "cmdstat_cluster|shards"))  # fmt: skip
    return total


@pytest.mark.redis_py
def test_a_cluster_master_s_busy_pool_never_holds_up_its_renewals(name: str) -> None:
    """With max_connections, a master's pool is a blocking one, and the renewals took their
    connection from it: with every connection busy with callers' commands, each renewal
    waited a socket timeout, was taken for an outage (the slots read again, the epoch
    bumped) and tried again into the same queue; the hold expired and a second client took
    it while the first was never told (two holders). The renewals have connections of their
    own; a caller that gets no connection is unavailable within the socket timeout, not
    sent, and no outage: nothing read again."""
    with _own_cluster() as nodes, _lost_names() as lost:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 0.5,
                  "socket_connect_timeout": 0.5, "max_connections": 3}}  # fmt: skip
        aliases = {**settings.DJANGO_REDLOCK, "c": config, "c2": dict(config)}
        with override_settings(DJANGO_REDLOCK=aliases):
            backend = locks["c"]
            held = lock(name, using="c", ttl=1)
            assert held.acquire(blocking=False)
            master = _slot_and_master(nodes, backend.key(name))[1]
            client = backend.client
            pool = client.get_redis_connection(client.get_node_from_key(backend.key(name)))
            assert locks["c2"].client is not None  # (its slots read: not counted below)
            epoch, reads = backend.renewal_epoch, _slot_reads(nodes)
            with _busy_pool(pool.connection_pool, 3):
                began = time.monotonic()
                with pytest.raises(BackendUnavailable) as caught:
                    lock(name, using="c").acquire(blocking=False)
                assert time.monotonic() - began < 0.5 + 0.3
                assert not caught.value.timed_out  # never sent
                second = []
                until = time.monotonic() + 2.5  # 2.5 TTLs
                while time.monotonic() < until:
                    thief = lock(name, using="c2", ttl=5, auto_renew=False)
                    if thief.acquire(blocking=False):
                        second.append(time.monotonic() - began)
                        thief.release()
                    assert master.client().pttl(backend.key(name)) > 0
                    time.sleep(0.05)
                assert not second, f"a second holder took it at {second[0]:.2f} s"
                assert backend.renewal_epoch == epoch
            assert not lost
            assert held.owned()  # (a read of the slots redis-py asked for ran here)
            import redis.cluster

            if hasattr(redis.cluster, "MaxConnectionsError"):  # (no outage to redis-py)
                assert _slot_reads(nodes) == reads
            held.release()
            backend.close()
            locks["c2"].close()


def test_a_cluster_s_waiters_take_no_connection_of_the_master_s_pool(name: str) -> None:
    """The waiters' pub/sub connection was one of the master's max_connections, kept while
    anyone waited (and its subscribe queued behind busy callers for a socket timeout): with
    max_connections 3, a waiter left callers 2. It has a connection of its own."""
    import threading

    with _own_cluster() as nodes:
        config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                  "LOCATION": nodes[0].url, "OPTIONS": {"socket_timeout": 0.5,
                  "socket_connect_timeout": 0.5, "max_connections": 3}}  # fmt: skip
        aliases = {**settings.DJANGO_REDLOCK, "c": config, "c2": dict(config)}
        with override_settings(DJANGO_REDLOCK=aliases):
            backend = locks["c"]
            holder = lock(name, using="c2", ttl=10)
            assert holder.acquire(blocking=False)
            got: list[bool] = []

            def wait() -> None:
                waiting = lock(name, using="c", ttl=5)
                got.append(waiting.acquire(timeout=5))
                if got[-1]:
                    waiting.release()

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.5)  # waiting (subscribed), its take and any check done
            client = backend.client
            pool = client.get_redis_connection(client.get_node_from_key(backend.key(name)))
            with _busy_pool(pool.connection_pool, 3):
                pass  # every one of the 3 free for callers
            holder.release()
            waiter.join(5)
            assert got == [True]
            backend.close()
            locks["c2"].close()
