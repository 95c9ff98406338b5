"""A release or an undo written to a node and never answered (its connection closed when
the fan-out gave up on it) may still run there at any later time: TCP delivers what was
written before the close (a retransmission, a slow network, a proxy). Nothing may be granted
under a token such a write could delete: the Lock's next try takes a new token, and its hold
survives the late write (redlock_io ``Debts.burn``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from django_redlock import lock
from django_redlock.backends.redlock import RedlockBackend
from django_redlock.exceptions import LockError
from django_redlock.testing import RedisServer
from tests.support.grant_cut import cut_after_the_grant, cut_then_retry
from tests.support.proxy import LossyProxy
from tests.support.warm import warm_up

from .test_redlock import quorum_alias
from .test_redlock_io import backend_of


@pytest.fixture
def proxied(redis_factory: Callable[..., RedisServer]) -> Iterator[list[LossyProxy]]:
    servers = [redis_factory() for _ in range(3)]
    proxies = [LossyProxy(server.port) for server in servers]
    for proxy, server in zip(proxies, servers, strict=True):
        proxy.server = server  # type: ignore[attr-defined]
    yield proxies
    for proxy in proxies:
        proxy.let_go()
        proxy.close()


def _tokens(proxies: list[LossyProxy], backend: RedlockBackend, name: str) -> list[bytes]:
    key = backend.nodes[0].key(name)
    return [(p.server.client().get(key) or b"-").split(b"|")[0] for p in proxies]  # type: ignore[attr-defined]


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_hand_back_release_delayed_past_its_closed_connection_never_deletes_the_retry_s_grant(
    proxied: list[LossyProxy], name: str, driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt after the grant: the hand-back's release to nodes 1 and 2 is held on the
    wire (the proxies), the fan-out gives up on it, closes those connections and owes it
    again; the Lock kept its token. Before: the retry voided the owed release and was
    granted that token on every node, then the held release landed and deleted it on nodes 1
    and 2 (the Lock believed it held; a second Lock took the name). Now the retry takes a
    new token, and whatever it holds survives the late write."""
    with quorum_alias("late", proxied, socket_timeout=0.3):  # type: ignore[arg-type]
        backend = backend_of("late")
        warm_up("late", name, rounds=3)  # a connection to each node, the scripts loaded
        mine = lock(name, using="late", ttl=30, auto_renew=False)
        seen: list[str] = []

        def delay(token: str) -> None:
            seen.append(token)
            for proxy in proxied[1:]:  # the hand-back's release: late on the wire
                proxy.delay_from(token.encode())

        cut_after_the_grant(monkeypatch, mine, delay)
        got = cut_then_retry(mine, driver)
        (first,) = seen
        assert all(p.delayed.is_set() for p in proxied[1:]), "the releases were held"
        for proxy in proxied[1:]:
            proxy.let_go()  # the late writes land
        tokens = _tokens(proxied, backend, name)
        other = lock(name, using="late", ttl=30, auto_renew=False)
        if got:
            held = mine.token.encode()
            assert sum(t == held for t in tokens) >= 2, f"the late write deleted it: {tokens}"
            assert not other.acquire(blocking=False), "two holders at once"
            assert held != first.encode(), "a token a late write may delete was granted again"
            mine.release()
        else:  # refused by the old hold: free once the owed releases are paid
            assert other.acquire(blocking=True, timeout=5)
            other.release()


def test_a_burnt_token_stays_burnt_when_the_backend_closes(
    proxied: list[LossyProxy], name: str
) -> None:
    """Nodes 1 and 2 black-holed: the acquire gets no quorum, the Lock keeps its token and
    owes its undo there. The nodes come back; the probe writes the undo, held on the wire
    (the proxies) until its read times out: the token is burnt. Then the backend closes
    (``locks.close_all()``, a settings change) and is used again. Before: the close forgot
    the burnt tokens, the retry was granted the same token on every node, and the held undo
    then deleted it on nodes 1 and 2 (two holders). Now the retry takes a new token."""
    with quorum_alias("late", proxied, socket_timeout=0.3):  # type: ignore[arg-type]
        backend = backend_of("late")
        warm_up("late", name, rounds=3)  # a connection to each node, the scripts loaded
        mine = lock(name, using="late", ttl=30, auto_renew=False)
        for proxy in proxied[1:]:
            proxy.blackhole()
        with pytest.raises(LockError):
            mine.acquire(blocking=False)
        first = mine._unsure_token
        assert first is not None, "the token is kept for the next try"
        # The undo's fan-out, a quorum needing them, connects to nodes 1 and 2 in threads.
        # One finishing after the heal (the proxy's accept starved) counts its node up
        # without the probe, and the undo waits for the next request there instead (seen
        # under load: "the undos were held" failed). Healed once those connects gave up.
        io = backend.io
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
            io.health.is_down(i) and i not in io._connectors and io.debts.owes(i) for i in (1, 2)
        ):
            time.sleep(0.02)
        assert all(io.debts.owes(i) for i in (1, 2)), "the undos are owed to the down nodes"
        for proxy in proxied[1:]:
            proxy.delay_from(first.encode())  # the owed undo: late on the wire
            proxy.heal()
        deadline = time.monotonic() + 10
        # The probe pays the undo, held on the wire, and gets no answer: burnt (the token
        # may be burnt already, by the black-holed acquire itself: the undo still comes).
        while time.monotonic() < deadline and (
            backend.token_reusable(first) or not all(p.delayed.is_set() for p in proxied[1:])
        ):
            time.sleep(0.02)
        assert all(p.delayed.is_set() for p in proxied[1:]), "the undos were held"
        assert not backend.token_reusable(first)
        backend.close()
        assert not backend.token_reusable(first), "a write of it may still land"
        got = mine.acquire(blocking=False)
        for proxy in proxied[1:]:
            proxy.let_go()  # the late undos land
        tokens = _tokens(proxied, backend, name)
        other = lock(name, using="late", ttl=30, auto_renew=False)
        assert got, f"the retry was refused: {tokens}"
        held = mine.token.encode()
        assert sum(t == held for t in tokens) >= 2, f"the late undo deleted it: {tokens}"
        assert not other.acquire(blocking=False), "two holders at once"
        assert held != first.encode(), "a token a late write may delete was granted again"
        mine.release()


def test_a_release_left_in_a_lane_is_burnt_when_the_backend_closes(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """Node 2 paused: the release is decided by nodes 0 and 1, and node 2's, written and
    unanswered, is left in a lane for the drainer. The backend closes, which closes that
    lane's connection: the write may still run (the node reads it once it resumes), so its
    token is burnt. Before: the close dropped the lane and forgot it (never burnt)."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("lanes", servers, socket_timeout=2.0, socket_connect_timeout=2.0):
        backend = backend_of("lanes")
        mine = lock(name, using="lanes", ttl=30, auto_renew=False)
        assert mine.acquire(blocking=False)
        token = mine.token
        servers[2].pause()
        try:
            mine.release()  # nodes 0 and 1 answer; node 2's release waits in a lane
            assert backend.token_reusable(token), "nothing burnt yet: its reply may come"
            backend.close()
            assert not backend.token_reusable(token), "its release may still run on node 2"
        finally:
            servers[2].resume()
