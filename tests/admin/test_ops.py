"""Operators' tools on every backend: force-release of the hold that was shown, and the
Redlock backend's pages of held locks (SCAN, not a round trip per lock)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlencode

import pytest
from django.conf import settings
from django.test import Client, override_settings

from django_redlock import lock, locks
from django_redlock.backends.base import Released
from django_redlock.backends.redlock import RedlockBackend
from django_redlock.exceptions import BackendUnavailable
from django_redlock.testing import RedisServer

from ..support.factories import UserFactory


@pytest.fixture
def nodes(redis_factory: Callable[..., RedisServer]) -> list[RedisServer]:
    return [redis_factory() for _ in range(5)]


@pytest.fixture
def quorum(nodes: list[RedisServer]) -> Iterator[RedlockBackend]:
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in nodes],
        # A healthy node must not look down on a loaded machine (a SCAN timed out mid-node
        # fails that page: test_a_node_that_stops_answering_mid_listing_...).
        "OPTIONS": {"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "quorum": config}):
        backend = locks["quorum"]
        assert isinstance(backend, RedlockBackend)
        yield backend


@pytest.mark.parametrize("alias", ["redis", "cache", "local"])
def test_force_release_of_a_plain_hold_compares_its_token(alias: str) -> None:
    held = lock("shown", using=alias, auto_renew=False)
    held.acquire()
    backend = locks[alias]
    info = backend.inspect("shown")
    assert info is not None and info.token
    assert backend.force_release("shown", token="someone-else") is Released.CHANGED
    assert held.owned()
    assert backend.force_release("shown", fence=(held.fence or 0) + 1) is Released.CHANGED
    assert backend.force_release("shown", token=info.token) is Released.RELEASED
    assert not held.locked()
    assert backend.force_release("shown", token=info.token) is Released.NOT_HELD
    assert not backend.force_release("shown")  # falsy: nothing was released


@pytest.mark.parametrize("alias", ["redis", "local"])
def test_force_release_of_a_reentrant_hold_compares_its_fence(alias: str) -> None:
    held = lock("shown:r", using=alias, reentrant=True, auto_renew=False)
    held.acquire()
    held.acquire()
    backend = locks[alias]
    info = backend.inspect("shown:r")
    assert info is not None and info.token is None and info.fence == held.fence
    assert backend.force_release("shown:r", fence=info.fence - 1) is Released.CHANGED
    assert backend.force_release("shown:r", token="a-plain-token") is Released.CHANGED
    assert held.owned()
    assert backend.force_release("shown:r", fence=info.fence) is Released.RELEASED
    assert not held.locked()


def test_a_fence_is_compared_exactly_however_large(redis_server: RedisServer) -> None:
    """Fences near 2e15 are compared as the exact digits stored, never as a Lua float
    (which prints 2000000000000000 as '2e+15' and cannot tell it from ...001)."""
    backend = locks["redis"]
    redis_server.client().set(backend.fence_key("big"), 1_999_999_999_999_999)
    held = lock("big", using="redis", reentrant=True, auto_renew=False)
    held.acquire()
    assert held.fence == 2_000_000_000_000_000
    assert backend.force_release("big", fence=2_000_000_000_000_001) is Released.CHANGED
    assert backend.force_release("big", fence=1_999_999_999_999_999) is Released.CHANGED
    assert held.owned()
    assert backend.force_release("big", fence=2_000_000_000_000_000) is Released.RELEASED


def test_a_plain_lock_takes_a_fence_above_a_counter_ahead_of_the_clock(
    redis_server: RedisServer,
) -> None:
    """A plain lock is written with the clock's fence first; a counter at or past it (raised by
    Redlock, or a clock gone back) gives the fence above the counter, in the lock's value too."""
    backend, client = locks["redis"], redis_server.client()
    client.set(backend.fence_key("ahead"), 1_999_999_999_999_999)
    held = lock("ahead", using="redis", auto_renew=False)
    held.acquire()
    assert held.fence == 2_000_000_000_000_000
    # The counter keeps the last hold's token beside the fence ('fence|token').
    assert client.get(backend.fence_key("ahead")) == f"2000000000000000|{held.token}".encode()
    info = backend.inspect("ahead")
    assert info is not None and info.fence == held.fence and info.token == held.token
    assert 0 < client.pttl(backend.key("ahead")) <= round(held.lock_ttl * 1000)
    held.release()
    with lock("ahead", using="redis", auto_renew=False) as again:
        assert again.fence == 2_000_000_000_000_001
    # The clock's fence when the counter is behind it: now x 1000, as integer text.
    client.set(backend.fence_key("behind"), 5)
    with lock("behind", using="redis", auto_renew=False) as behind:
        assert behind.fence is not None and behind.fence > 10**15
        assert client.get(backend.fence_key("behind")) == f"{behind.fence}|{behind.token}".encode()


@pytest.mark.django_db
def test_the_admin_releases_a_hold_with_a_large_fence(redis_server: RedisServer) -> None:
    from .test_admin import RELEASE, URL, form_values

    redis_server.client().set(locks["redis"].fence_key("big:admin"), 1_999_999_999_999_999)
    held = lock("big:admin", using="redis", reentrant=True, auto_renew=False)
    held.acquire()
    client = Client()
    client.force_login(UserFactory(is_superuser=True))
    listed = form_values(client.get(URL, {"backend": "redis", "q": "big"}).content.decode())
    assert listed and "2000000000000000" in listed[0]
    confirmed = form_values(client.post(RELEASE, {"lock": listed}).content.decode())
    client.post(RELEASE, {"lock": confirmed, "confirm": "yes"})
    assert not held.locked()


def test_redlock_force_release_compares_the_majority_s_hold(
    quorum: RedlockBackend, nodes: list[RedisServer]
) -> None:
    # Node 2's counter is ahead: the hold's fence is the largest of the majority's.
    ahead = int(time.time() * 1000 + 3_600_000) * 1000  # above any clock-based fence
    nodes[2].client().set(quorum.fence_key("q"), ahead)
    held = lock("q", using="quorum", auto_renew=False)
    held.acquire()
    assert held.fence == ahead + 1
    info = quorum.inspect("q")
    assert info is not None and info.fence == ahead + 1 and info.token
    assert quorum.force_release("q", token="other") is Released.CHANGED
    assert quorum.force_release("q", fence=1) is Released.CHANGED
    assert held.owned()
    assert quorum.force_release("q", fence=ahead + 1) is Released.RELEASED
    assert not any(node.client().exists(quorum.key("q")) for node in nodes)
    again = lock("q", using="quorum", auto_renew=False)
    again.acquire()
    assert quorum.force_release("q", token=info.token) is Released.CHANGED
    assert again.owned()
    now = quorum.inspect("q")
    assert now is not None and now.token != info.token
    assert quorum.force_release("q", token=now.token)
    assert not again.locked()


def _page_costs(backend: RedlockBackend) -> tuple[int, int]:
    before = sum(node.round_trips for node in backend.nodes)
    found, _ = backend.page("*", None, 100)
    return len(found), sum(node.round_trips for node in backend.nodes) - before


def _every_page(backend: RedlockBackend, match: str = "*") -> list[str]:
    names: list[str] = []
    cursor: str | None = None
    while True:
        found, cursor = backend.page(match, cursor, 100)
        names += [info.name for info in found]
        if cursor is None:
            return names


def test_a_redlock_page_costs_the_same_with_many_locks_held(quorum: RedlockBackend) -> None:
    held = [lock(f"p:{i:04}", using="quorum", auto_renew=False) for i in range(1200)]
    for each in held[:40]:
        assert each.acquire(blocking=False)
    few, cost_few = _page_costs(quorum)
    for each in held[40:]:
        assert each.acquire(blocking=False)
    many, cost_many = _page_costs(quorum)
    assert few == 40 and many >= 100
    # A few SCANs and one inspect per node, however many locks are held.
    assert cost_few <= 15 and cost_many <= 15, (cost_few, cost_many)
    before = quorum.round_trips
    names = _every_page(quorum)
    assert sorted(names) == [f"p:{i:04}" for i in range(1200)]  # each once
    assert quorum.round_trips - before <= 40  # fan-outs: a page's worth each, not a lock's


def test_redlock_pages_list_every_lock_once_with_a_node_down_and_stale_keys(
    quorum: RedlockBackend, nodes: list[RedisServer]
) -> None:
    held = [lock(f"d:{i:03}", using="quorum", auto_renew=False) for i in range(150)]
    for each in held:
        assert each.acquire(blocking=False)
    # A stale minority hold on node 0 (someone else's token), and one minority-only hold.
    nodes[0].client().set(quorum.key("d:000"), "other|9|0|", px=30_000)
    nodes[3].client().set(quorum.key("minority"), "other|1|0|", px=30_000)
    assert sorted(_every_page(quorum)) == [f"d:{i:03}" for i in range(150)]
    assert sorted(_every_page(quorum, "d:00*")) == [f"d:00{i}" for i in range(10)]
    # Node 0 skipped by the scan (it did not answer then) but back for the inspection:
    # its locks are listed from the next node, not taken as listed already.
    found: list[str] = []
    cursor: str | None = "1:0:0"
    while cursor is not None:
        page, cursor = quorum.page("*", cursor, 100)
        found += [info.name for info in page]
    assert sorted(found) == [f"d:{i:03}" for i in range(150)]
    nodes[0].stop()
    assert sorted(_every_page(quorum)) == [f"d:{i:03}" for i in range(150)]
    assert sorted(info.name for info in quorum.iter_locks("d:*")) == [
        f"d:{i:03}" for i in range(150)
    ]


@pytest.mark.django_db
def test_a_node_that_stops_answering_mid_listing_is_asked_again_not_skipped(
    quorum: RedlockBackend, nodes: list[RedisServer]
) -> None:
    """A node whose SCAN stopped answering after part of it was listed: skipping it listed its
    locks a second time from the next node (none of them listed from it could be told apart).
    The page says the node is unavailable instead, and the same cursor asks it again."""
    held = [lock(f"m:{i:03}", using="quorum", auto_renew=False) for i in range(60)]
    for each in held:
        assert each.acquire(blocking=False)
    first, cursor = quorum.page("*", None, 5)
    assert cursor is not None and cursor.split(":")[:2] != ["0", "0"], cursor  # node 0, partly
    assert cursor.startswith("0:")
    nodes[0].pause()
    try:
        with pytest.raises(BackendUnavailable, match="in the middle of its listing"):
            quorum.page("*", cursor, 5)
        # The admin: a banner, and a next page that asks from the same cursor.
        from .test_admin import URL

        client = Client()
        client.force_login(UserFactory(is_superuser=True))
        link = json.dumps({"quorum": cursor})
        response = client.get(URL, {"backend": "quorum", "cursor": link})
        assert "in the middle of its listing" in response.content.decode()
        assert response.context["next_url"].endswith(urlencode({"cursor": link}))
    finally:
        nodes[0].resume()
    names = [info.name for info in first]
    while cursor is not None:
        page, cursor = quorum.page("*", cursor, 5)
        names += [info.name for info in page]
    assert sorted(names) == [f"m:{i:03}" for i in range(60)]  # each once


CRAFTED = ['{"quorum": "9:0:0"}', '{"quorum": "0:0:99"}', '{"quorum": "5:0:0"}',
           '{"quorum": "0"}', '{"quorum": "0:-1:0"}', '{"quorum": "a:b:c"}']  # fmt: skip


@pytest.mark.django_db
def test_a_crafted_redlock_cursor_gives_the_first_page(quorum: RedlockBackend) -> None:
    """Each crafted cursor, on one set of five nodes (a case each started its own five)."""
    from .test_admin import URL

    client = Client()
    client.force_login(UserFactory(is_superuser=True))
    with lock("crafted:q", using="quorum"):
        for cursor in CRAFTED:
            response = client.get(URL, {"backend": "quorum", "cursor": cursor})
            assert response.status_code == 200, cursor
            page = response.content.decode()
            assert "crafted:q" in page and "That page link is not valid" in page, cursor
