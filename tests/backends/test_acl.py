"""Least privilege: django-redlock as a Redis user limited to its keys, its channels and the
commands ``django_redlock.acl`` names (the README's ACL line), on every backend; a permission
the user lacks is named (MissingPermission at run time, W003 at startup, never a raw
ResponseError nor a hang); a password never shows.

The plain RedisBackend runs the whole alias-parametrised suite as such a user too (the "acl"
alias in conftest); here: the other backends, each permission taken away in turn, passwords.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.test import override_settings

from django_redlock import (
    BackendUnavailable,
    MissingPermission,
    acl,
    incidents,
    lock,
    locks,
    read_write_lock,
    semaphore,
)
from django_redlock.backends.base import BaseLockBackend
from django_redlock.backends.cluster import RedisClusterBackend
from django_redlock.backends.redis import RedisBackend
from django_redlock.backends.sentinel import SentinelBackend
from django_redlock.checks import MISSING_PERMISSION
from django_redlock.contrib import beat
from django_redlock.health import ping
from django_redlock.testing import RedisServer, SentinelServer

from ..conftest import ROOT
from ..observe.test_tracing import spans  # noqa: F401 - the in-memory span exporter, a fixture

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = "admin-pw"  # the servers' default user: the test's own
SECRET = "s3cret-Pa55w0rd"  # the restricted users' password: must never show
REDIS = "django_redlock.backends.redis.RedisBackend"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """This module's Redis: a password on the default user, restricted users added per test."""
    started = RedisServer(password=ADMIN).start()
    yield started
    started.stop()


def rule_of(cls: type[RedisBackend], **params: Any) -> str:
    return acl.rule(cls("probe", {"LOCATION": ["redis://h"], **params}))


@contextmanager
def aliases(**configs: dict[str, Any]) -> Iterator[None]:
    from django.conf import settings

    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, **configs}):
        yield


def as_user(server: RedisServer, rule: str, db: int = 1) -> dict[str, Any]:
    """A RedisBackend alias as the user 'locks', which has only ``rule``."""
    server.add_user("locks", SECRET, *rule.split())
    return {"BACKEND": REDIS, "LOCATION": server.url_for("locks", SECRET, db)}


# -- what an operator reads ----------------------------------------------------------------


def test_the_docs_give_each_backend_s_acl_line() -> None:
    page = (ROOT / "docs" / "topics" / "backends.md").read_text()
    section = page.split("## Redis users, ACLs and TLS", 1)[1].split("\n## ", 1)[0]
    start = "ACL SETUSER locks reset resetchannels on >PASSWORD"
    readme = (ROOT / "README.md").read_text()
    short = readme.split("## Redis users, ACLs and TLS", 1)[1].split("\n## ", 1)[0]
    assert f"{start} {rule_of(RedisBackend)}" in short
    for cls in (RedisBackend, SentinelBackend, RedisClusterBackend):
        params = {"OPTIONS": {"service_name": "m"}} if cls is SentinelBackend else {}
        line = f"{start} {rule_of(cls, **params)}"
        assert line in section, f"{cls.__name__}: {line}"
    sentinel_own = " ".join(acl.SENTINEL_OWN_RULES)
    assert f"ACL SETUSER sentinel-locks reset resetchannels on >PASSWORD {sentinel_own}" in section
    for forbidden in ("@all", "@dangerous", "@admin", "+keys", "+flush", "+config", "+info"):
        assert forbidden not in rule_of(RedisClusterBackend)


def test_the_scripts_run_only_commands_the_rule_gives() -> None:
    """Redis checks a script's every command against the user's ACL: each one the Lua runs
    (ours, and the beat scheduler's) must be in the rule."""
    lua = [p.read_text() for p in Path(acl.__file__).with_name("lua").glob("*.lua")]
    lua += [beat.CLAIM.source, beat.UNCLAIM.source]
    used = {m.lower() for text in lua for m in re.findall(r"redis\.p?call\('(\w+)'", text)}
    assert used - {"spublish"} <= set(acl.COMMANDS)
    assert "spublish" in acl.CLUSTER_COMMANDS  # sharded wake-ups: clusters only


# -- every kind, every backend, as the restricted user -------------------------------------


def waiter_woken(
    take: Callable[[], Any], release: Callable[[], None], backend: Any, name: str
) -> Any:
    """Start ``take`` (a blocking acquire) in a thread, wait until it waits, release: what it
    returns once woken. Its error is raised here."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(take())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # Redlock's waiters register nowhere (they listen on each node's release channel).
    deadline = time.monotonic() + (10 if backend.wakes_one else 0.5)
    while not result and time.monotonic() < deadline:
        info = backend.inspect(name)
        if info is not None and info.waiters:
            break
        time.sleep(0.01)
    try:
        release()
    finally:
        thread.join(15)
    assert result, "the waiter never returned"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def got(held: Any) -> bool:
    """Whether ``held`` was acquired within 10 s (then released)."""
    if not held.acquire(timeout=10):
        return False
    held.release()
    return True


def elsewhere(call: Callable[[], Any]) -> Any:
    """``call()`` in another thread (another owner); its error is raised here."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(15)
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def exercise(alias: str, kinds: bool = True, tag: str = "") -> None:
    """Every operation of every kind on ``alias``: what a permission taken away must break
    with a MissingPermission (each one needed is used here; the ones that fail the first
    try come first, so a waiter never waits for a release that fails)."""
    backend = locks[alias]
    held = lock(f"{tag}plain", using=alias, ttl=20, auto_renew=False)
    assert held.acquire(blocking=False)
    assert held.owned() and held.locked() and 0 < (held.ttl() or 0) <= 20
    held.extend(30)
    info = backend.inspect(f"{tag}plain")
    assert info is not None and info.fence == held.fence
    held.release()
    assert not lock(f"{tag}plain", using=alias).locked()
    if kinds:
        again = lock(f"{tag}re", using=alias, reentrant=True, auto_renew=False)
        again.acquire()
        again.acquire()
        assert again.hold_count() == 2
        assert backend.inspect(f"{tag}re") is not None
        again.release()
        again.release()
        permits = [semaphore(f"{tag}sem", 2, using=alias, auto_renew=False) for _ in range(3)]
        assert permits[0].acquire(blocking=False) and permits[1].acquire(blocking=False)
        assert not permits[2].acquire(blocking=False)  # full: the expired ones are looked for
        assert permits[0].available() == 0 and len(permits[0].holders()) == 2
        permits[1].release()
        reader = read_write_lock(f"{tag}rw", using=alias, auto_renew=False).read()
        assert reader.acquire(blocking=False)
        assert not elsewhere(
            lambda: read_write_lock(f"{tag}rw", using=alias).write().acquire(timeout=0.05)
        )
        reader.release()
        fair = lock(f"{tag}fair", using=alias, fair=True, auto_renew=False)
        assert fair.acquire(blocking=False)
        assert not lock(f"{tag}fair", using=alias, fair=True).acquire(timeout=0.05)  # queued, left
        fair.release()
        # A waiter's leaving is best effort (its place lapses anyway): asked for directly.
        backend.execute(backend.op_leave(f"{tag}fair", "nobody.1"))
        backend.execute(backend.op_lease_leave(f"{tag}sem", "nobody.1"))
    assert backend.execute(backend.op_mark_queued(f"{tag}task", "t1", 5000)) is None
    assert backend.execute(backend.op_clear_queued(f"{tag}task", "t1"))
    if kinds:  # beat's leader lock and send records
        leader = lock(f"{tag}beat", using=alias, ttl=20, auto_renew=False)
        leader.acquire()
        token = str(leader.token)
        assert (
            backend.execute(beat.claim_op(backend, f"{tag}beat", token, "e", None, 1, 9000))[0] == 2
        )
        assert backend.execute(beat.read_op(backend, f"{tag}beat", "e")) == 1
        assert backend.execute(beat.unclaim_op(backend, f"{tag}beat", token, "e", None, 1, 9000))
        leader.release()
    renewed = lock(f"{tag}renewed", using=alias, ttl=0.6)  # the watchdog's batches
    renewed.acquire()
    time.sleep(1.0)
    assert renewed.owned()
    renewed.release()
    listed = lock(f"{tag}listed", using=alias, ttl=20, auto_renew=False)
    listed.acquire()
    assert [i.name for i in backend.iter_locks(f"{tag}list*")] == [f"{tag}listed"]
    assert [i.name for i in backend.page(f"{tag}list*", None, 10)[0]] == [f"{tag}listed"]
    out = StringIO()
    call_command("redlock", "list", "--backend", alias, stdout=out)
    assert f"{tag}listed" in out.getvalue()
    call_command("redlock", "top", "--once", "--backend", alias, stdout=StringIO())
    assert backend.force_release(f"{tag}listed")
    assert not listed.owned() and listed.lost  # a lost hold: an incident
    lock(f"{tag}purged", using=alias, ttl=20, auto_renew=False).acquire()
    call_command("redlock", "purge", "--match", "*", "--backend", alias, "--yes", stdout=out)
    assert not lock(f"{tag}purged", using=alias).locked()
    assert ping(backend).up

    async def in_a_loop() -> None:
        held = lock(f"{tag}async", using=alias, ttl=20, auto_renew=False)
        assert await held.aacquire(timeout=1)
        assert await held.aowned()
        await held.arelease()

    asyncio.run(in_a_loop())
    # Waiters, woken by a release (never by the TTL: 20 s here, well past the wait).
    first = lock(f"{tag}wait", using=alias, ttl=20, auto_renew=False)
    first.acquire()
    assert waiter_woken(
        lambda: got(lock(f"{tag}wait", using=alias)), first.release, backend, f"{tag}wait"
    )
    if not kinds:
        return
    head = lock(f"{tag}fair-wait", using=alias, fair=True, ttl=20, auto_renew=False)
    head.acquire()
    behind = lock(f"{tag}fair-wait", using=alias, fair=True, ttl=20, auto_renew=False)
    assert waiter_woken(lambda: got(behind), head.release, backend, f"{tag}fair-wait")
    one = semaphore(f"{tag}sem-wait", 1, using=alias, auto_renew=False)
    one.acquire()
    other = semaphore(f"{tag}sem-wait", 1, using=alias, auto_renew=False)
    assert waiter_woken(lambda: got(other), one.release, backend, f"{tag}sem-wait")
    reading = read_write_lock(f"{tag}rw-wait", using=alias, auto_renew=False).read()
    reading.acquire()
    writing = read_write_lock(f"{tag}rw-wait", using=alias, auto_renew=False).write()
    assert waiter_woken(lambda: got(writing), reading.release, backend, f"{tag}rw-wait")


@pytest.fixture(scope="module")
def sentinel_group(server: RedisServer) -> Iterator[SentinelServer]:
    """A sentinel (with its own admin password) watching this module's server."""
    sentinel = SentinelServer(server, password=ADMIN).start()
    yield sentinel
    sentinel.stop()


def test_a_redis_user_with_only_the_rule_on_another_db(server: RedisServer) -> None:
    with aliases(mine=as_user(server, rule_of(RedisBackend), db=1)):
        assert locks["mine"].check_permissions() is None
        exercise("mine")


def test_django_redis_with_its_cache_s_user(server: RedisServer) -> None:
    # The cache's user has the cache's keys; ours are added to them.
    server.add_user(
        "locks", SECRET, "~:1:*", "+@all", "-@dangerous", *rule_of(RedisBackend).split()
    )
    url = server.url_for("locks", SECRET, 2)
    caches = {"locks": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}}
    config = {
        "BACKEND": "django_redlock.backends.django_redis.DjangoRedisBackend",
        "CACHE": "locks",
    }
    from django.conf import settings

    with override_settings(CACHES={**settings.CACHES, **caches}), aliases(mine=config):
        assert locks["mine"].check_permissions() is None
        exercise("mine")


def test_sentinel_with_its_own_users(server: RedisServer, sentinel_group: SentinelServer) -> None:
    rule = rule_of(SentinelBackend, OPTIONS={"service_name": "m"})
    server.add_user("locks", SECRET, *rule.split())
    sentinel_group.add_user("sentinel-locks", SECRET, *acl.SENTINEL_OWN_RULES)
    config = {
        "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
        "LOCATION": [sentinel_group.url_for("sentinel-locks", SECRET).replace("/0", "")],
        "OPTIONS": {"service_name": "mymaster", "username": "locks", "password": SECRET,
                    "db": 3, "min_replicas": 0},
    }  # fmt: skip
    with aliases(mine=config):
        assert locks["mine"].check_permissions() is None
        exercise("mine")
        # ... and it listens to the sentinel's announcements of a switch, as that user.
        deadline = time.monotonic() + 5
        admin = sentinel_group.client()
        while not any(
            c["user"] == "sentinel-locks" and "P" in c["flags"] for c in admin.client_list()
        ):
            assert time.monotonic() < deadline, "not listening to the sentinel"
            time.sleep(0.05)


def test_redlock_nodes_with_only_the_rule(server: RedisServer) -> None:
    urls = [server.url_for("locks", SECRET, db) for db in (4, 5, 6)]
    server.add_user("locks", SECRET, *rule_of(RedisBackend).split())
    config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend", "LOCATION": urls,
              "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2}}  # fmt: skip
    with aliases(mine=config):
        assert all(node.check_permissions() is None for node in locks["mine"].nodes)
        exercise("mine", kinds=False)
        # A quorum refused is the refusal, not "too few nodes answered".
        server.add_user("locks", SECRET, *rule_of(RedisBackend).split(), "-time")
        with pytest.raises(MissingPermission, match=r"ACL SETUSER locks \+time\."):
            lock("refused", using="mine").acquire(blocking=False)


def test_a_cluster_with_only_the_rule(cluster_nodes: list[RedisServer]) -> None:
    rule = rule_of(RedisClusterBackend)
    for node in cluster_nodes:
        node.add_user("locks", SECRET, *rule.split())
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": cluster_nodes[0].url_for("locks", SECRET)}  # fmt: skip
    with aliases(mine=config):
        backend = locks["mine"]
        assert backend.check_permissions() is None and backend.sharded  # type: ignore[attr-defined]
        exercise("mine")
    # A waiter whose SSUBSCRIBE is refused says so (it would wait for the TTL instead).
    for node in cluster_nodes:
        node.add_user("locks", SECRET, *rule.replace(" +ssubscribe", "").split())
    with aliases(mine=config):
        held = lock("cluster-wait", using="mine", ttl=20, auto_renew=False)
        held.acquire()
        started = time.monotonic()
        with pytest.raises(MissingPermission, match=r"ACL SETUSER locks \+ssubscribe\."):
            lock("cluster-wait", using="mine").acquire(timeout=10)
        assert time.monotonic() - started < 5
        held.release()


def test_a_cluster_user_with_only_the_rule_follows_an_ask(cluster_nodes: list[RedisServer]) -> None:
    """A slot on the move answers ASK for a key already moved: redis-py then sends ASKING to
    the node the slot moves to. The rule lacked +asking, so a hold on a moving slot could not
    be renewed (MissingPermission: the hold ran out) until the move ended."""
    for node in cluster_nodes:
        node.add_user("locks", SECRET, *rule_of(RedisClusterBackend).split())
    config = {"BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
              "LOCATION": cluster_nodes[0].url_for("locks", SECRET)}  # fmt: skip
    with aliases(mine=config):
        key = locks["mine"].key("moving")
        slot = cluster_nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key)
        owner = next(
            n for n in cluster_nodes
            for start, end, *_ in n.client().execute_command("CLUSTER", "SLOTS")
            if start <= slot <= end and int(_[0][1]) == n.port
        )  # fmt: skip
        target = next(n for n in cluster_nodes if n is not owner)
        ids = {
            n.port: n.client().execute_command("CLUSTER", "MYID").decode() for n in cluster_nodes
        }
        held = lock("moving", using="mine", ttl=1)
        assert held.acquire(blocking=False)
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[owner.port])
        owner.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port])
        try:
            owner.client().execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", key
            )
            time.sleep(1.5)  # the watchdog renews it on the target, after ASKING
            pipe = target.client().pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.pttl(key)
            assert pipe.execute()[1] > 0
            assert held.lost is None
        finally:
            for node in cluster_nodes:  # the move ends: the slot is the target's
                node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])
            for name in owner.client().keys("*{moving}*"):  # left behind: not moved
                owner.client().delete(name)
        held.release()
    for name in target.client().keys("*{moving}*"):  # the slot goes back where it was
        target.client().delete(name)
    for node in cluster_nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[owner.port])


# -- each permission taken away ------------------------------------------------------------


def _refusal_of(alias: str, tag: str) -> MissingPermission:
    try:
        exercise(alias, tag=tag)
    except MissingPermission as exc:
        return exc
    raise AssertionError("nothing was refused")


def test_each_permission_taken_away_is_named_at_startup_and_when_used(
    server: RedisServer,
) -> None:
    rule = rule_of(RedisBackend)
    # Taken away in turn: each command, the keys, the channels.
    missing = [f"+{name}" for name in acl.COMMANDS] + ["~redlock:*", "&redlock:*"]
    unused_here = {"+unsubscribe", "+ping"}  # released channels: Redlock's; PING: health
    for needed in missing:
        server.client(db=1).flushdb()  # what a refused operation left behind
        server.client().script_flush()  # SCRIPT LOAD is needed again
        reduced = [part for part in rule.split() if part != needed]
        with aliases(mine=as_user(server, " ".join(reduced))):
            backend = locks["mine"]
            found = backend.check_permissions()
            assert found is not None and needed in found.needs.split(), (needed, str(found))
            assert found.rule == rule and needed in str(found)
            warned = [m for m in run_checks() if m.id == MISSING_PERMISSION]
            assert [m.obj for m in warned] == ["DJANGO_REDLOCK['mine']"], needed
            if needed in unused_here:
                continue
            refused = _refusal_of("mine", needed)
            assert needed in refused.needs.split(), (needed, str(refused))
            assert f"ACL SETUSER locks {refused.needs}." in str(refused)
            assert f"ACL SETUSER locks {rule} " in str(refused)
    # PING (health) taken away: the backend shows down, and why.
    with aliases(mine=as_user(server, rule.replace(" +ping", ""))):
        health = ping(locks["mine"])
        assert not health.up and "'ping'" in health.detail


def test_a_refusal_in_asyncio_is_named_too(server: RedisServer) -> None:
    with aliases(mine=as_user(server, rule_of(RedisBackend).replace(" +time", ""))):

        async def main() -> None:
            await lock("a", using="mine").aacquire(blocking=False)

        with pytest.raises(MissingPermission, match=r"may not run TIME \(in the script acquire"):
            asyncio.run(main())


def test_the_startup_check_runs_when_the_app_gets_ready(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with aliases(mine=as_user(server, rule_of(RedisBackend).replace(" +zadd", ""))):
        backend = locks["mine"]
        backend.prepare()
        assert backend.missing_permission is not None  # type: ignore[attr-defined]
        assert "may not run ZADD" in caplog.text


# -- passwords never show ------------------------------------------------------------------


def test_a_wrong_password_is_backend_unavailable_without_the_password(server: RedisServer) -> None:
    server.add_user("locks", "right", *rule_of(RedisBackend).split())
    with aliases(mine={"BACKEND": REDIS, "LOCATION": server.url_for("locks", SECRET)}):
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as caught:
            lock("x", using="mine").acquire(timeout=5)
        assert time.monotonic() - started < 3  # never a hang, never a wait for the timeout
        assert "invalid username-password" in str(caught.value)
        assert SECRET not in str(caught.value) and SECRET not in repr(caught.value)
        health = ping(locks["mine"])
        assert not health.up and SECRET not in health.detail


def test_settings_errors_mask_the_password() -> None:
    from django_redlock.handler import LockHandler

    bad = {"x": {"BACKEND": REDIS, "LOCATION": f"redis://u:{SECRET}@h:99999/0"}}
    with pytest.raises(Exception, match=r"redis://u:\*\*\*@h:99999/0") as caught:
        LockHandler(bad).settings  # noqa: B018
    assert SECRET not in str(caught.value)
    with pytest.raises(Exception) as caught:
        LockHandler({"x": f"redis://:{SECRET}@h/0?password={SECRET}"}).settings  # noqa: B018
    assert SECRET not in str(caught.value) and "***" in str(caught.value)
    assert acl.mask_url(f"rediss://u:{SECRET}@h:1/0?ssl_ca_certs=/c") == (
        "rediss://u:***@h:1/0?ssl_ca_certs=/c"
    )


def test_no_password_in_pages_listings_logs_metrics_or_spans(
    server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    spans: Any,  # noqa: F811 - test_tracing's fixture
) -> None:
    from django.test import Client
    from prometheus_client import REGISTRY, generate_latest

    from ..support.factories import UserFactory

    caplog.set_level("DEBUG")
    server.add_user("locks", SECRET, *rule_of(RedisBackend).split())
    good = as_user(server, rule_of(RedisBackend))
    wrong = {"BACKEND": REDIS, "LOCATION": server.url_for("locks", "not-" + SECRET)}
    with aliases(mine=good, wrong=wrong):
        held = lock("shown", using="mine", ttl=20)
        held.acquire()
        locks["mine"].force_release("shown")
        assert not held.owned()  # lost: logged, an incident, a span
        held = lock("shown", using="mine", ttl=20)
        held.acquire()
        with pytest.raises(BackendUnavailable) as caught:
            lock("x", using="wrong").acquire(blocking=False)
        # The lost hold's incident is written by a thread of its own: written first (two
        # writers of the in-memory SQLite: "database table is locked").
        incidents.recorder.flush()
        client = Client()
        client.force_login(UserFactory(is_superuser=True))
        shown = [str(caught.value), generate_latest(REGISTRY).decode(), caplog.text]
        for url in ("/admin/django_redlock/heldlock/", "/admin/django_redlock/lockincident/"):
            response = client.get(url)
            assert response.status_code == 200
            shown.append(response.content.decode())
        for action in (("list",), ("top", "--once")):
            out = StringIO()
            try:
                call_command("redlock", *action, stdout=out, stderr=out)
            except BaseException as exc:  # a backend down: exit code 3
                shown.append(str(exc))
            shown.append(out.getvalue())
        held.release()
        shown += [str(span.attributes) + span.name for span in spans.get_finished_spans()]
    assert "shown" in shown[3]  # the admin page did list the lock
    for text in shown:
        assert SECRET not in text


def test_base_backend_has_no_acl() -> None:
    # LocMem and other in-process backends have no Redis user to check.
    assert not isinstance(locks["local"], RedisBackend)
    assert isinstance(locks["local"], BaseLockBackend)
    assert [m for m in run_checks() if m.id == MISSING_PERMISSION] == []
