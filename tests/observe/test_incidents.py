"""Lock incidents: recorded off the hot path for each kind of event, kept, pruned."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from django_redlock import QuorumNotReached, lock, locks
from django_redlock.incidents import Recorder, prune, recorder
from django_redlock.models import LockIncident
from django_redlock.signals import lock_lost

from ..support.factories import LockIncidentFactory

pytestmark = pytest.mark.django_db(transaction=True)


def incidents(kind: str) -> list[LockIncident]:
    recorder.flush()
    return list(LockIncident.objects.filter(kind=kind))


def test_a_lost_hold_is_recorded(name: str) -> None:
    signalled = threading.Event()

    def noticed(**kwargs: Any) -> None:  # runs after the recorder's receiver queued it
        signalled.set()

    lock_lost.connect(noticed)
    try:
        held = lock(name, using="redis", ttl=0.3)
        held.acquire()
        locks["redis"].force_release(name)
        assert signalled.wait(3)
    finally:
        lock_lost.disconnect(noticed)
    (incident,) = [i for i in incidents("lost") if i.name == name]  # (an earlier file's too)
    assert incident.backend == "redis"
    assert "released by someone else" in incident.detail


def test_an_acquire_that_timed_out_is_recorded(name: str) -> None:
    with lock(name, using="local"):
        assert not lock(name, using="local").acquire(timeout=0.05)
        assert not lock(name, using="local").acquire(blocking=False)  # a try is no timeout
    (incident,) = incidents("acquire_timeout")
    assert incident.name == name and "0.05" in incident.detail


def test_a_quorum_failure_is_recorded(redis_factory: Any) -> None:
    from django.conf import settings

    servers = [redis_factory() for _ in range(3)]
    for server in servers[:2]:
        server.kill()
    config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend",
              "LOCATION": [s.url for s in servers]}  # fmt: skip
    aliases = {**settings.DJANGO_REDLOCK, "q": config}
    with override_settings(DJANGO_REDLOCK=aliases), pytest.raises(QuorumNotReached):
        lock("quorum:x", using="q").acquire()
    (incident,) = incidents("quorum_failure")
    # 0 of 3 when a loaded machine's live node answered after the dead ones decided it.
    assert incident.backend == "q" and re.search(r"only [01] of 3 nodes answered", incident.detail)


def test_a_skipped_duplicate_is_recorded() -> None:
    from django_redlock.contrib.celery import duplicate_skipped

    duplicate_skipped.send(sender=None, key="sync:1", task_id="t2", holder_task_id="t1",
                           using="default")  # fmt: skip
    (incident,) = incidents("duplicate_skipped")
    assert incident.name == "sync:1" and "held by task t1" in incident.detail


def test_kinds_can_be_switched_off(name: str) -> None:
    with override_settings(DJANGO_REDLOCK_INCIDENTS={"KINDS": ["lost"]}), lock(name, using="local"):
        assert not lock(name, using="local").acquire(timeout=0.01)
    assert incidents("acquire_timeout") == []


def test_recording_is_off_the_hot_path(name: str) -> None:
    """Acquire and release never touch the database, even with every kind recorded."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        for _ in range(20):
            with lock(name, using="redis"):
                pass
        with lock(name + ":busy", using="local"):  # an incident, recorded in the background
            assert not lock(name + ":busy", using="local").acquire(timeout=0.01)
    assert len(queries) == 0
    assert len(incidents("acquire_timeout")) == 1


def test_prune_keeps_recent_and_at_most_max_rows() -> None:
    old = LockIncidentFactory.create_batch(3)
    LockIncident.objects.filter(pk__in=[i.pk for i in old]).update(
        created_at=timezone.now() - timedelta(days=40)
    )
    LockIncidentFactory.create_batch(5)
    with override_settings(DJANGO_REDLOCK_INCIDENTS={"KEEP_DAYS": 30, "MAX_ROWS": 4}):
        assert prune() == 3 + 1
    assert LockIncident.objects.count() == 4


def test_prune_beyond_max_rows_goes_by_age_not_by_id() -> None:
    # Two hosts whose clocks differ: the later row (higher id) says it happened earlier.
    newest = LockIncidentFactory.create()
    behind = LockIncidentFactory.create()
    older = LockIncidentFactory.create()
    now = timezone.now()
    LockIncident.objects.filter(pk=newest.pk).update(created_at=now)
    LockIncident.objects.filter(pk=behind.pk).update(created_at=now - timedelta(seconds=20))
    LockIncident.objects.filter(pk=older.pk).update(created_at=now - timedelta(seconds=10))
    with override_settings(DJANGO_REDLOCK_INCIDENTS={"KEEP_DAYS": 30, "MAX_ROWS": 2}):
        assert prune() == 1
    assert set(LockIncident.objects.values_list("pk", flat=True)) == {newest.pk, older.pk}


def test_a_writer_behind_drops_beyond_the_limit_and_never_blocks() -> None:
    """The database is slow: incidents beyond the queue's bound are dropped and counted, and
    ``record`` (called on the lock path) returns at once."""
    slow = Recorder(limit=3)
    release, written = threading.Event(), []

    def write(batch: list[dict[str, Any]]) -> None:
        release.wait(10)
        written.extend(batch)

    slow._write = write  # type: ignore[method-assign]
    started = time.monotonic()
    for i in range(20):
        slow.record("lost", f"slow:{i}", "redis")
    assert time.monotonic() - started < 1
    assert 20 - 3 - 1 <= slow.dropped <= 20 - 3  # 3 queued, and maybe 1 taken by the writer
    release.set()
    slow.flush(5)
    assert len(written) == 20 - slow.dropped


def test_a_forked_child_records_though_the_fork_came_mid_record() -> None:
    """The parent's queue lock was held at the fork (another thread was recording): the
    child gets a fresh queue and writer, instead of a lock nobody will ever release."""
    with recorder._queue.mutex:
        pid = os.fork()
        if pid == 0:  # the child: a stuck record would be ended by the alarm
            signal.alarm(5)
            recorder.record("lost", "forked", "redis")
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
