"""``dedupe_queued`` inside a fenced block (``lock(..., atomic="tasks")``), review rf (session
20): the ``on_commit`` callback that keeps the key taken until the COMMIT (``_Uncommitted``) is
dropped unrun in more cases than a rollback, and it must neither take "dropped" for "rolled
back" (a committed run queued twice) nor keep the key past the transaction's end.

The queue is the suite's SQLite "tasks" database; the fence table is made there for these
tests. A lost COMMIT reply is the driver's COMMIT made, then an ``OperationalError`` (a reset
connection's), as the reviewer's script simulated it: the queue lives on SQLite."""

from __future__ import annotations

import datetime
import gc
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType, SimpleNamespace
from typing import Any

import pytest
from django.conf import settings
from django.db import IntegrityError, OperationalError, connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_redlock import lock, locks
from django_redlock.contrib import tasks as contrib_tasks
from django_redlock.contrib.tasks import lock_key
from django_redlock.locking import finisher
from django_redlock.models import Fence
from django_redlock.testing import RedisServer
from tests.support import tasks_jobs

pytestmark = pytest.mark.django_db(databases=["tasks"], transaction=True)

DB = "tasks"


class TimeLimit(Exception):
    """Celery's ``SoftTimeLimitExceeded``: an ``Exception`` a signal handler raises."""


@pytest.fixture
def fences() -> Iterator[str]:
    """The fence table, on the queue's database (the suite's router keeps it off there)."""
    connection = connections[DB]
    made = Fence._meta.db_table not in connection.introspection.table_names()
    if made:
        with connection.schema_editor() as editor:
            editor.create_model(Fence)
    try:
        yield DB
    finally:
        if made:
            with connection.schema_editor() as editor:
                editor.delete_model(Fence)


@pytest.fixture
def queue() -> Iterator[Callable[[], set[str]]]:
    """The ids of the runs queued since the test began (deleted after it)."""
    from django_tasks_db.models import DBTaskResult

    before = {str(i) for i in DBTaskResult.objects.values_list("id", flat=True)}
    try:
        yield lambda: {str(i) for i in DBTaskResult.objects.values_list("id", flat=True)} - before
    finally:
        DBTaskResult.objects.exclude(id__in=before).delete()


def later() -> Any:
    """``deduped`` due in an hour: no worker takes it, its row stays queued."""
    return tasks_jobs.deduped.using(run_after=timezone.now() + datetime.timedelta(hours=1))


def commit_lock_held(key: str) -> bool:
    return bool(locks["default"].is_locked(f"{key}{contrib_tasks.COMMIT_SUFFIX}"))


def _boom() -> None:
    raise RuntimeError("mail server down")


@pytest.mark.parametrize("how", ["a plain callback raised", "the COMMIT's reply was lost"])
def test_a_committed_run_whose_callback_was_dropped_is_not_queued_twice(
    name: str, fences: str, queue: Callable[[], set[str]], how: str, monkeypatch: Any
) -> None:
    """review rf, defect 3: the block committed (and returned), but Django dropped the run's
    callback unrun: after an earlier plain callback raised (Django's rule), or with the
    connection after a COMMIT whose reply was lost (the block proved it, and ran only its
    ``on_commit_or_proved`` callbacks). Its finalizer took that for a rollback and cleared
    the queue marker: the next ``enqueue()`` of the key queued a second run."""
    key, n = lock_key(tasks_jobs.deduped, 3600), 3600
    connection = connections[DB]
    lose: list[bool] = []
    if how == "the COMMIT's reply was lost":
        real = type(connection)._commit

        def lossy(self: Any = connection) -> None:
            real(self)  # committed on the "server"
            if lose:
                raise OperationalError("server closed the connection unexpectedly")

        monkeypatch.setattr(connection, "_commit", lossy)
    with lock(name, ttl=30, atomic=DB):
        if how == "a plain callback raised":
            transaction.on_commit(_boom, using=DB)
        first = later().enqueue(n)
        lose.append(True)
    lose.clear()
    assert queue() == {str(first.id)}  # committed
    started = time.monotonic()
    assert str(later().enqueue(n).id) == str(first.id), "a second run was queued"
    assert time.monotonic() - started < 2.0
    assert queue() == {str(first.id)}
    assert not commit_lock_held(key)


def test_a_fenced_block_whose_commit_fails_frees_the_key_at_once(
    name: str, fences: str, queue: Callable[[], set[str]], monkeypatch: Any
) -> None:
    """review rf, defect 4: the COMMIT failed (a deferred constraint, a serialization
    failure): rolled back, nothing queued. The block's frame, kept by the exception's
    traceback (and a reference cycle), kept the dropped callback alive, and with it
    ``<key>:enqueue:commit``: every other ``enqueue()`` of the key waited 30 s and failed.
    It goes at once, as with a plain ``atomic()``, while the exception is still kept."""
    key, n = lock_key(tasks_jobs.deduped, 3601), 3601
    connection = connections[DB]
    fail: list[bool] = []
    real = type(connection)._commit

    def failing(self: Any = connection) -> None:
        if fail:
            raise IntegrityError("FOREIGN KEY constraint failed")
        real(self)

    monkeypatch.setattr(connection, "_commit", failing)
    with pytest.raises(IntegrityError) as kept, lock(name, ttl=30, atomic=DB):
        later().enqueue(n)
        fail.append(True)
    fail.clear()
    assert kept.value is not None  # (kept, with its traceback)
    assert queue() == set()  # rolled back
    assert not commit_lock_held(key)
    started = time.monotonic()
    again = later().enqueue(n)
    assert time.monotonic() - started < 2.0
    assert queue() == {str(again.id)}


def _cut_in_the_callback(nth: int) -> tuple[Any, list[str]]:
    """Trace function: ``TimeLimit`` at the ``nth`` line of the run's ``on_commit`` callback
    (``_Uncommitted.__call__``, and the release it calls); the lines reached, in a list."""
    codes = {contrib_tasks._Uncommitted.__call__.__code__, contrib_tasks._let_go.__code__}
    seen: list[str] = []

    def called(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code not in codes:
            return None

        def line(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                seen.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                if len(seen) == nth:
                    sys.settrace(None)
                    raise TimeLimit("soft time limit")
            return line

        return line

    return called, seen


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "atomic"])
def test_a_time_limit_in_the_commit_callback_still_frees_the_key_at_once(
    name: str, fences: str, queue: Callable[[], set[str]], fenced: bool
) -> None:
    """review rf, defect 5: a soft time limit at any line of the run's ``on_commit`` callback
    (robust: Django logs it and goes on; the block committed). Cut after it detached its
    finalizer and before the release, nothing ever released ``<key>:enqueue:commit``: the
    next ``enqueue()`` of the key waited out the lock's 30 s TTL."""
    cuts: list[str] = []
    for nth in range(1, 20):
        n = 3610 + nth
        key = lock_key(tasks_jobs.deduped, n)
        tracer, seen = _cut_in_the_callback(nth)
        block = lock(name, ttl=30, atomic=DB) if fenced else transaction.atomic(using=DB)
        try:
            with block:
                first = later().enqueue(n)
                sys.settrace(tracer)
        finally:
            sys.settrace(None)
        if len(seen) < nth:
            break  # no line left to cut
        cuts.append(seen[-1])
        assert str(first.id) in queue()
        assert not commit_lock_held(key), f"held after a cut at {seen[-1]}"
        started = time.monotonic()
        assert str(later().enqueue(n).id) == str(first.id)
        assert time.monotonic() - started < 2.0, f"waited after a cut at {seen[-1]}"
    assert len(cuts) >= 3, cuts


def test_a_dropped_callback_collected_while_the_server_is_paused_does_not_wait_for_it(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """A run's ``on_commit`` callback in a reference cycle (a traceback's frames keep it) is
    dropped by the garbage collector, at any allocation, in any thread: its release goes to
    the finisher thread, not there. Before: the collection waited for the paused server."""
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 3.0},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "gcpaused": config}):
        held = lock(f"{name}{contrib_tasks.COMMIT_SUFFIX}", ttl=30, using="gcpaused")
        assert held.acquire(blocking=False)
        gc.collect()  # (the test's own cycle is the only one for the collection below)
        dropped = contrib_tasks._Uncommitted(SimpleNamespace(using="gcpaused"), name, held)  # type: ignore[arg-type]
        dropped.cycle = dropped  # type: ignore[attr-defined]  # freed by the collector only
        del dropped
        server.client().execute_command("CLIENT", "PAUSE", 1500, "ALL")
        began = time.monotonic()
        gc.collect()
        took = time.monotonic() - began
        assert took < 1.4, f"the collection took {took:.2f} s"  # (waiting: the 1.5 s pause)
        assert finisher.wait_finished(5)
        assert not held.locked()  # released by the finisher, once the server answered
