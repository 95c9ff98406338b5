"""One Redlock hold, one fence: the nodes of a hold whose fences differed at the acquire (a
node restarted empty grants its data's start + 2 s, the others the proposal) carry the fence
the holder got once the acquire lifted them, and a release by the fence an operator was
shown finds that hold whichever node is silent (review rio2, 4): by a fence that a copy
answering carries, never by one above them all."""

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


def copy_on(server: RedisServer, backend: RedlockBackend, held: BaseLock) -> bytes:
    """The node's copy of ``held``'s hold, once its grant landed (late on a loaded machine)."""
    deadline = time.monotonic() + 5
    while not (value := server.client().get(backend.key(held.name)) or b"").startswith(
        f"{held.token}|".encode()
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return value


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
        if int(copy_on(servers[0], backend, held).split(b"|")[1]) <= held.fence:
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
        backend.is_locked("settled")  # a fan-out probes a node down for a breaker period
        time.sleep(0.05)


def _take_with_fences(
    backend: RedlockBackend, servers: list[RedisServer], name: str
) -> tuple[BaseLock, int, int]:
    """A hold whose copy on node 0 carries a larger fence than on nodes 1 and 2: node 0's
    grant came after the acquire had decided (not counted, not lifted), from a counter an
    hour ahead. Returns the lock, node 0's fence and the holder's."""
    settled(backend)
    held = lock(name, using=backend.alias, ttl=3600, auto_renew=False)
    assert held.acquire(blocking=False) and held.fence is not None
    value = copy_on(servers[0], backend, held)
    big = held.fence + 3_600_000_000
    token, _, rest = value.split(b"|", 2)
    servers[0].client().set(backend.key(name), b"|".join([token, b"%d" % big, rest]), keepttl=True)
    servers[0].client().set(backend.fence_key(name), b"%d|%s" % (big, token), px=3_600_000)
    return held, big, held.fence


def test_a_fence_release_names_the_hold_by_a_fence_an_answering_copy_carries(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """`--fence F` names the majority's hold when one of its answering copies carries F:
    shown with node 0 silent (the holder's fence), it released nothing once node 0 answered
    again (the largest was compared). Never F above every answering copy's: a later hold
    taken while node 0 is silent has fences below node 0's late one, and would go."""
    servers = [redis_factory() for _ in range(3)]
    running_long_since(servers)
    with quorum_alias("differ", servers, **FAST):
        backend = locks["differ"]
        assert isinstance(backend, RedlockBackend)
        # Shown while node 0 was silent, released with every node answering.
        held, big, small = _take_with_fences(backend, servers, name)
        info = backend.inspect(name)
        assert info is not None and info.fence == big  # (the late copy's, every node up)
        for wrong in (big + 1, small - 1, small + 1):  # every node answers: exact only
            assert backend.force_release(name, fence=wrong) is Released.CHANGED
        assert backend.force_release(name, fence=small) is Released.RELEASED
        assert not held.locked()
        # Shown with every node answering (node 0's), node 0 silent: no copy that answers
        # carries it (refused); with node 0 answering again, released.
        held, big, small = _take_with_fences(backend, servers, name)
        servers[0].pause()
        try:
            assert backend.force_release(name, fence=big) is Released.CHANGED
        finally:
            servers[0].resume()
        settled(backend)
        assert backend.force_release(name, fence=big) is Released.RELEASED
        # Node 0 silent, and another hold on nodes 1 and 2 since: the earlier hold's
        # fences name nothing held, though node 0's is above the later hold's.
        held, big, small = _take_with_fences(backend, servers, name)
        held.release()
        settled(backend)
        servers[0].pause()
        try:
            again = lock(name, using="differ", ttl=3600, auto_renew=False)
            assert again.acquire(blocking=False) and small < (again.fence or 0) < big
            for old in (big, small):
                assert backend.force_release(name, fence=old) is Released.CHANGED
            assert again.owned()
        finally:
            servers[0].resume()
        again.release()


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
