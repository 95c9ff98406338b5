"""One Redlock hold, one fence: the nodes of a hold whose fences differed at the acquire (a
node restarted empty grants its data's start + 2 s, the others the proposal) carry the fence
the holder got once the acquire lifted them, and a release by the fence an operator was
shown finds that hold whichever node is silent (review rio2, 4)."""

from __future__ import annotations

import time
from collections.abc import Callable
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import lock, locks
from django_redlock.backends.base import Released
from django_redlock.backends.redlock import RedlockBackend
from django_redlock.locking.base import BaseLock
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias, running_long_since

FAST = {"socket_timeout": 0.1, "socket_connect_timeout": 0.1}


def restarted_empty(server: RedisServer) -> None:
    """The node's data began now: a new name's fence there is now + 2 s, above the
    acquirer's proposal (its clock + 1 s), so the other nodes are lifted to it."""
    seconds, micros = server.client().time()
    server.client().set("redlock:node", str(seconds * 1000 + micros // 1000))


def stored_fence(server: RedisServer, backend: RedlockBackend, name: str) -> int | None:
    value = server.client().get(backend.key(name))
    return None if value is None else int(value.split(b"|")[1])


def lifted_hold(servers: list[RedisServer], alias: str, name: str) -> BaseLock:
    """A 1-hour hold whose nodes 1 and 2 were lifted to node 0's fence. Node 0's grant
    counted: one that came after the grace (a loaded machine) is left there uncounted, with
    its larger fence, and the acquire is taken again (a late grant is not lifted)."""
    backend = locks[alias]
    assert isinstance(backend, RedlockBackend)
    for attempt in range(5):
        restarted_empty(servers[0])
        held = lock(f"{name}:{attempt}", using=alias, ttl=3600, auto_renew=False)
        assert held.acquire(blocking=False) and held.fence is not None
        if (stored_fence(servers[0], backend, held.name) or 0) <= held.fence:
            return held
        held.release()
    pytest.fail("node 0's grant came late at every try")


def test_the_lift_gives_every_node_of_the_hold_the_holders_fence(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The lift raised the lagging nodes' counters, not their holds' fences: with the node
    that granted the largest silent, inspect() and the listing showed a smaller fence than
    the holder's, and force_release(fence=<listed>) said "held by another hold"."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("lifted", servers, **FAST):
        backend = locks["lifted"]
        assert isinstance(backend, RedlockBackend)
        held = lifted_hold(servers, "lifted", name)
        name = held.name
        assert [stored_fence(s, backend, name) for s in servers] == [held.fence] * 3
        listed = backend.inspect(name)
        assert listed is not None and listed.fence == held.fence
        servers[0].pause()
        try:
            info = backend.inspect(name)
            assert info is not None and info.token == listed.token
            assert info.fence == held.fence
            assert [i.fence for i in backend.iter_locks(name)] == [held.fence]
            assert backend.force_release(name, fence=held.fence) is Released.RELEASED
        finally:
            servers[0].resume()
        assert not held.locked()


def settled(backend: RedlockBackend) -> None:
    """Every node counted up again and paid what it was owed (a paused node was skipped)."""
    deadline = time.monotonic() + 10
    while backend.io.health.down() or backend.io.debts.unpaid():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _take_with_fences(
    backend: RedlockBackend, servers: list[RedisServer], name: str, largest: int
) -> tuple[int, int]:
    """A hold whose node 0 carries a larger fence than nodes 1 and 2 (taken by a version
    whose lift raised counters only, or a node the lift did not reach), with the counters
    of a majority at the largest, as the acquire leaves them. Returns (largest, smaller)."""
    settled(backend)
    held = lock(name, using=backend.alias, ttl=3600, auto_renew=False)
    assert held.acquire(blocking=False) and held.fence is not None
    big = held.fence + largest
    deadline = time.monotonic() + 5  # node 0's grant may come late (a loaded machine)
    while not (value := servers[0].client().get(backend.key(name)) or b"").startswith(
        f"{held.token}|".encode()
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    token, _, rest = value.split(b"|", 2)
    servers[0].client().set(backend.key(name), b"|".join([token, b"%d" % big, rest]), keepttl=True)
    for server in servers:
        server.client().set(backend.fence_key(name), b"%d|%s" % (big, token), px=60000)
    return big, held.fence


def test_a_fence_release_finds_a_hold_whose_nodes_carry_different_fences(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """`--fence F` names the majority's hold when F is one of its answering nodes' fences,
    or above all of them while a node is silent (that node may carry F); a later hold has a
    larger fence on a node of every majority, so it is never taken for the one shown."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("differ", servers, **FAST):
        backend = locks["differ"]
        assert isinstance(backend, RedlockBackend)
        # Shown with every node answering (the largest), released with node 0 silent.
        big, small = _take_with_fences(backend, servers, name, 1000)
        servers[0].pause()
        try:
            assert backend.force_release(name, fence=big) is Released.RELEASED
        finally:
            servers[0].resume()
        # The same, by the fence shown while node 0 was silent, released with it answering.
        big, small = _take_with_fences(backend, servers, name, 1000)
        for wrong in (big + 1, small - 1, small + 1):  # every node answers: exact only
            assert backend.force_release(name, fence=wrong) is Released.CHANGED
        assert backend.force_release(name, fence=small) is Released.RELEASED
        # Another hold now, node 0 silent: the earlier hold's fence names nothing held.
        big, small = _take_with_fences(backend, servers, name, 1000)
        assert backend.force_release(name, fence=big) is Released.RELEASED
        settled(backend)
        again = lock(name, using="differ", ttl=3600, auto_renew=False)
        assert again.acquire(blocking=False) and (again.fence or 0) > big
        servers[0].pause()
        try:
            for old in (big, small):
                assert backend.force_release(name, fence=old) is Released.CHANGED
        finally:
            servers[0].resume()
        assert again.owned()


@pytest.mark.django_db(transaction=True)
def test_redlock_release_by_the_listed_fence_with_the_largest_fence_s_node_silent(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """`redlock list` shows the holder's fence; with the node that granted it silent,
    `redlock release NAME --fence <listed>` said "held by another hold ...; not released"
    (exit 1) while that hold kept the lock for the hour."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("cli", servers, **FAST):
        backend = locks["cli"]
        held = lifted_hold(servers, "cli", name)
        name = held.name
        servers[0].pause()
        out, err = StringIO(), StringIO()
        try:
            call_command("redlock", "list", "--backend", "cli", "--json", stdout=out)
            assert f'"fence": {held.fence}' in out.getvalue()
            try:
                call_command(
                    "redlock", "release", name, "--backend", "cli", "--fence", str(held.fence),
                    stdout=out, stderr=err,
                )  # fmt: skip
                code = 0
            except CommandError as exc:
                pytest.fail(f"exit {exc.returncode}: {exc}")
            except SystemExit as exc:  # node 0 silent throughout: named, exit 3
                code = int(exc.code or 0)
        finally:
            servers[0].resume()
        assert f"released {name!r} on 'cli'" in out.getvalue()
        assert code == 3 and "node 0" in err.getvalue()
        assert not held.locked()
        backend.force_release(name)
