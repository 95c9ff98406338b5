"""acquire.lua's and release.lua's flat common paths (issue 46): a one-off try of a free plain
lock, and the release of a plain hold, run before any helper is defined, and do what the
helpers' path does (hold_take, fence_next, hold_mine, lock_freed in _hold.lua), whatever the
fence counter holds: missing, ahead of the clock, or a bare fence of the old format."""

from __future__ import annotations

import time
from typing import Any

import pytest

from django_redlock import locks, scripts
from django_redlock.backends.base import Kind
from django_redlock.testing import RedisServer

META = "host|1|MainThread"
AHEAD = 4_000_000_000_000_000  # a counter far past the clock (µs): a clock stepped back
PLAIN = Kind()


def _acquire(client: Any, name: str, token: str, flat: bool) -> list[Any]:
    """acquire.lua on ``name``: the flat path (a one-off try's 5 arguments), or the helpers'
    path (the same try with a waiter's arguments and wait -1: it never registers)."""
    backend = locks["redis"]
    waiter = None if flat else "p0.1"
    call = backend.op_acquire(name, token, 30_000, META, Kind(), waiter, -1).request
    assert len(call.args) == (5 if flat else 8)
    return client.eval(call.script.source, len(call.keys), *call.keys, *call.args)


def _release(client: Any, name: str, token: str, flat: bool) -> Any:
    """release.lua: the flat path (kind '0'), or the helpers' (no kind: its TYPE read)."""
    call = locks["redis"].op_release(name, token, Kind()).request
    args = list(call.args) if flat else list(call.args[:2])
    return client.eval(call.script.source, len(call.keys), *call.keys, *args)


def test_a_free_plain_lock_is_taken_and_released_before_any_helper_is_defined() -> None:
    acquire, release = scripts.script("acquire").source, scripts.script("release").source
    assert acquire.index("return {1, fence, 1, prior}") < acquire.index("local function")
    assert release.index("redis.call('DEL', lock)") < release.index("local function")


# The counter before the try: (value, the fence wanted: None for the clock's, prior wanted).
COUNTERS = {
    "missing": (None, None, ""),
    "behind the clock": ("5|old-token", None, "old-token"),
    "ahead of the clock": (f"{AHEAD}|old-token", AHEAD + 1, "old-token"),
    "a bare fence ahead (the old format)": (str(AHEAD), AHEAD + 1, ""),
    "a bare fence behind (the old format)": ("5", None, ""),
}


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "helpers"])
@pytest.mark.parametrize("counter", sorted(COUNTERS))
def test_a_one_off_plain_try_fences_as_the_helpers_do(
    redis_server: RedisServer, counter: str, flat: bool
) -> None:
    client, backend = redis_server.client(), locks["redis"]
    value, wanted, prior = COUNTERS[counter]
    name = f"fast:{counter}"
    if value is not None:
        client.set(backend.fence_key(name), value, px=5_000)
    before_us = int(time.time() * 1e6) - 1_000_000  # the server's clock, give or take a second
    reply = _acquire(client, name, "tok", flat)
    assert reply[0] == 1 and reply[2] == 1 and reply[3].decode() == prior, reply
    fence = reply[1]
    if wanted is None:
        assert fence > before_us
    else:
        assert fence == wanted
    # The hold's value and the counter: the fence as integer text, the counter's TTL at least
    # FENCE_MEMORY_MS (its 5 s before replaced), the lock's the hold's.
    held = client.get(backend.key(name)).decode().split("|")
    assert held[:2] == ["tok", str(fence)] and "|".join(held[3:]) == META
    assert abs(int(held[2]) - before_us // 1000 - 1_000) < 5_000  # taken at: the clock's ms
    assert client.get(backend.fence_key(name)) == f"{fence}|tok".encode()
    assert 55_000 < client.pttl(backend.fence_key(name)) <= 60_000
    assert 25_000 < client.pttl(backend.key(name)) <= 30_000
    # Held: a try of another's is refused with the hold's time left, and changes nothing;
    # the holder's own again (a lost reply) is answered as held, with the same fence.
    refused = _acquire(client, name, "other", flat)
    assert refused[0] == 0 and 25_000 < refused[1] <= 30_000
    assert client.get(backend.fence_key(name)) == f"{fence}|tok".encode()
    assert _acquire(client, name, "tok", flat)[:3] == [1, fence, 1]
    # Fences go up strictly, try after try (many in one µs: each one above the counter).
    assert _release(client, name, "tok", flat) == 0
    last = fence
    for i in range(50):
        reply = _acquire(client, name, f"t{i}", flat)
        assert reply[0] == 1 and reply[1] > last
        assert reply[3].decode() == ("tok" if i == 0 else f"t{i - 1}")
        last = reply[1]
        assert _release(client, name, f"t{i}", flat) == 0


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "helpers"])
def test_a_one_off_plain_try_on_a_queued_name_takes_the_queue_path(
    redis_server: RedisServer, flat: bool
) -> None:
    """A fair queue's waiter (alive: its deadline ahead) keeps a free lock from a plain try."""
    client, backend = redis_server.client(), locks["redis"]
    name = "fast:queued"
    client.rpush(backend.queue_key(name), "p9.1")
    client.zadd(backend.deadlines_key(name), {"p9.1": int(time.time() * 1000) + 60_000})
    reply = _acquire(client, name, "tok", flat)
    assert reply[0] == 0 and client.exists(backend.key(name)) == 0, reply


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "helpers"])
def test_a_plain_try_and_release_on_a_name_of_another_kind(
    redis_server: RedisServer, flat: bool
) -> None:
    """A semaphore's live lease holds the name: {-2, kind} (WRONGTYPE read), and the release
    finds no hold (-1) and leaves the lease."""
    client, backend = redis_server.client(), locks["redis"]
    name = "fast:kind"
    key = backend.key(name)
    client.zadd(key, {"lease": int(time.time() * 1000) + 60_000})
    client.hset(f"{key}:h", ":kind", "s")
    assert _acquire(client, name, "tok", flat) == [-2, b"semaphore"]
    assert _release(client, name, "tok", flat) == -1
    assert client.zcard(key) == 1


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "helpers"])
def test_a_plain_release_frees_only_its_own_hold_and_wakes_the_first_waiter(
    redis_server: RedisServer, flat: bool
) -> None:
    client, backend = redis_server.client(), locks["redis"]
    name = "fast:wake"
    assert _release(client, name, "tok", flat) == -1  # no hold
    assert _acquire(client, name, "tok", flat)[0] == 1
    assert _release(client, name, "other", flat) == -1  # another's: kept
    assert client.exists(backend.key(name)) == 1
    # A registered waiter: woken in its process's inbox at the release.
    client.zadd(backend.waiting_key(name), {"p7.1": 1})
    listener = client.pubsub()
    listener.subscribe(f"{backend.inbox_for(name)}p7")
    assert listener.get_message(timeout=1)["type"] == "subscribe"
    assert _release(client, name, "tok", flat) == 0
    assert client.exists(backend.key(name)) == 0
    message = listener.get_message(timeout=1)
    assert message is not None and message["data"] == b"p7.1", message
    listener.close()


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "helpers"])
def test_a_plain_release_announces_on_the_release_channel(
    redis_server: RedisServer, flat: bool
) -> None:
    """Where waiters listen on the release channel (a Redis 6 cluster, Redlock's nodes)."""
    client, backend = redis_server.client(), locks["redis"]
    name = "fast:announce"
    assert _acquire(client, name, "tok", flat)[0] == 1
    listener = client.pubsub()
    listener.subscribe("fast:channel")
    assert listener.get_message(timeout=1)["type"] == "subscribe"
    call = backend.op_release(name, "tok", Kind()).request
    keys = [call.keys[0], "fast:channel", *call.keys[2:]]
    args = list(call.args) if flat else list(call.args[:2])
    assert client.eval(call.script.source, len(keys), *keys, *args) == 0
    message = listener.get_message(timeout=1)
    assert message is not None and message["data"] == b"released", message
    listener.close()


def _hand_back(client: Any, name: str, token: str, flat: bool, kind: Kind = PLAIN) -> Any:
    """release.lua as a hand-back sends it (the marker's key too): flat or helpers' path."""
    call = locks["redis"].op_hand_back(name, token, kind).request
    args = list(call.args) if flat else list(call.args[:2])
    return client.eval(call.script.source, len(call.keys), *call.keys, *args)


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "helpers"])
def test_a_hand_back_that_finds_nothing_refuses_its_token_s_late_try(
    redis_server: RedisServer, flat: bool
) -> None:
    """A hand-back may reach the server before the try it hands back (review wai2, 3): it
    finds nothing, marks the token, and the try is refused when it lands, on either path;
    another token is not. A plain release of nothing writes no marker; a hand-back of a
    hold it finds frees it and writes none either."""
    client, backend = redis_server.client(), locks["redis"]
    name = "fast:handed"
    marker = backend.handed_back_key(name, "late")
    assert _release(client, name, "late", flat) == -1
    assert client.exists(marker) == 0  # a release's path writes nothing more
    assert _hand_back(client, name, "late", flat) == -1
    assert 115_000 < client.pttl(marker) <= 120_000  # longer than a try can be delayed
    assert _acquire(client, name, "late", flat) == [0, -1]
    assert _acquire(client, name, "late", flat) == [0, -1]  # a second late try too
    assert client.exists(backend.key(name)) == 0
    assert _acquire(client, name, "other", flat)[0] == 1  # the lock is free for others
    assert _hand_back(client, name, "other", flat) == 0  # found: freed, no marker
    assert client.exists(backend.handed_back_key(name, "other")) == 0
    assert client.exists(backend.key(name)) == 0


def test_a_late_fair_or_waiting_try_of_a_handed_back_token_takes_and_registers_nothing(
    redis_server: RedisServer,
) -> None:
    client, backend = redis_server.client(), locks["redis"]
    name = "fast:handed-fair"
    assert _hand_back(client, name, "late", True, Kind(fair=True)) == -1
    for kind in (Kind(fair=True), Kind()):
        call = backend.op_acquire(name, "late", 30_000, META, kind, "p3.1", 10_000).request
        assert client.eval(call.script.source, len(call.keys), *call.keys, *call.args) == [0, -1]
    assert client.exists(backend.key(name), backend.queue_key(name)) == 0
    assert client.exists(backend.waiting_key(name)) == 0


def test_a_reentrant_owner_s_settle_that_finds_nothing_refuses_only_its_older_writes(
    redis_server: RedisServer,
) -> None:
    """A reentrant owner's token is itself, taken again later: its hand-back (a settle to 0)
    that finds nothing marks the write's number, and refuses only the owner's older writes
    (-3: ran late) when they land; a newer one takes the lock."""
    client, backend, kind = redis_server.client(), locks["redis"], Kind(reentrant=True)
    name = "fast:handed-reentrant"

    def run(call: Any) -> Any:
        return client.eval(call.script.source, len(call.keys), *call.keys, *call.args)

    def acquire(seq: int) -> Any:
        return run(backend.op_acquire(name, "owner", 30_000, META, kind, order=(seq, 0)).request)

    assert run(backend.op_settle(name, "owner", 0, 10).request) == 0
    assert client.get(backend.handed_back_key(name, "owner")) == b"10"
    assert run(backend.op_settle(name, "owner", 0, 7).request) == 0  # an older one: kept 10
    assert client.get(backend.handed_back_key(name, "owner")) == b"10"
    assert acquire(9) == [-3] and client.exists(backend.key(name)) == 0
    assert acquire(11)[:3] == [1, acquire(12)[1], 1]  # taken, then re-taken (ordered: 0 + 1)
