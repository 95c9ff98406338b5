"""Re-fencing on a real PostgreSQL (READ COMMITTED), with a redis-server whose clock the test
steps (libfaketime): the fresh holder's block re-fences while it keeps the fence row locked,
and a stale holder waiting on that row is refused once it commits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections

from django_redlock import StaleFence, lock, locks
from django_redlock.testing import FakeClock, RedisServer, faketime_server

from ..support.fenced_child import open_shop, sales, sell_one
from .test_clock import alias_on
from .test_fenced_postgres import eventually, waiting_on_a_row

PG = "postgres"
pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)


@pytest.fixture
def clocked() -> Iterator[tuple[FakeClock, RedisServer]]:
    clock = FakeClock()
    server = RedisServer(executable=faketime_server(), env=clock.env()).start()
    try:
        with alias_on("clocked", [server.url]):
            yield clock, server
    finally:
        server.stop()
        clock.close()


def test_a_fresh_holder_re_fences_on_postgresql_and_a_stale_one_waits_then_is_refused(
    clocked: tuple[FakeClock, RedisServer], name: str
) -> None:
    clock, server = clocked
    open_shop(PG, 1, 10)
    stale = lock(name, using="clocked", ttl=30, auto_renew=False, atomic=PG)
    assert stale.acquire()
    clock.step(3600)  # the stale hold expires
    with lock(name, using="clocked", atomic=PG, timeout=5) as first:
        sell_one(PG, 1, "first")
        top = first.fence
    assert top is not None
    server.client().flushall()  # a restart or failover to an empty replica
    clock.step(-7200)  # an hour behind: every new fence is below `top`
    outcome: list[Any] = []

    def stale_block() -> None:
        try:
            with stale.atomic():
                sell_one(PG, 1, "stale")
            outcome.append("committed")
        except StaleFence as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    fresh = lock(name, using="clocked", ttl=30, atomic=PG, timeout=5)
    with fresh as held:
        fence = held.fence
        assert fence is not None and fence > top  # re-fenced at the block's start
        thread = threading.Thread(target=stale_block)
        thread.start()
        eventually(lambda: waiting_on_a_row() >= 1, "the stale block waits on the fence row")
        sell_one(PG, 1, "fresh")
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], StaleFence)
    # Released after its commit, or not yet: either way the stale hold is not current.
    assert "a later hold has the lock" in str(outcome[0]) or "not current" in str(outcome[0])
    assert outcome[0].recorded == fence
    assert [b for b, _ in sales(PG)] == ["first", "fresh"]


def test_on_postgresql_an_expired_holder_s_unrecorded_fence_is_refused_after_a_re_fence(
    clocked: tuple[FakeClock, RedisServer], name: str
) -> None:
    """A holder paused past its TTL holds a fence never recorded; the counter is flushed and
    the server's clock goes back an hour. The fresh holder is re-fenced above the client's
    clock, so above that fence: the paused holder's block is refused, not committed after."""
    clock, server = clocked
    open_shop(PG, 1, 10)
    with lock(name, using="clocked", atomic=PG):
        sell_one(PG, 1, "first")
    stale = lock(name, using="clocked", ttl=1, auto_renew=False, atomic=PG)
    assert stale.acquire()
    clock.step(2)  # its key expires (read now, while expired: Redis deletes it)
    assert not server.client().exists(locks["clocked"].key(name))
    server.client().flushall()
    clock.step(-3602)
    with lock(name, using="clocked", ttl=30, atomic=PG, timeout=5) as fresh:
        sell_one(PG, 1, "fresh")
        assert fresh.fence is not None and stale.fence is not None
        assert fresh.fence > stale.fence
    with pytest.raises(StaleFence), stale.atomic():
        pytest.fail("the stale holder's body ran")
    assert [b for b, _ in sales(PG)] == ["first", "fresh"]
