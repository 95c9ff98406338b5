"""Queue-time dedupe of an ``enqueue()`` made inside an open transaction: django-tasks-db saves
the run's row on the caller's connection, which no other connection sees before the COMMIT.
The queue is the suite's SQLite "tasks" database; the second enqueue runs in another thread
(its own connection, as another request's would be)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections, transaction
from django.utils import timezone

from django_redlock import locks
from django_redlock.contrib.tasks import lock_key
from tests.support import tasks_jobs

pytestmark = pytest.mark.django_db(databases=["tasks"], transaction=True)


def later() -> Any:
    """``deduped`` due in an hour: no worker takes it, its row stays queued."""
    return tasks_jobs.deduped.using(run_after=timezone.now() + datetime.timedelta(hours=1))


def queued_ids() -> set[str]:
    from django_tasks_db.models import DBTaskResult

    return {str(i) for i in DBTaskResult.objects.values_list("id", flat=True)}


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` in a thread of its own (its own database connection); its outcome in the
    list once the thread ended: ``[("ok", value)]`` or ``[("error", exception)]``."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", call()))
        except BaseException as exc:  # reported to the test
            out.append(("error", exc))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_an_enqueue_in_an_open_transaction_dedupes_another_connection_s_enqueue() -> None:
    # The first enqueue() runs in an open atomic() block: its row is invisible to other
    # connections until the COMMIT. Another connection's enqueue() of the same key took the
    # run for gone (its marker naming a row it cannot see), cleared the marker and queued a
    # second run once the first committed: two runs. It must get the first run instead.
    job, key = later(), lock_key(tasks_jobs.deduped, 3500)
    before = queued_ids()
    try:
        with transaction.atomic(using="tasks"):
            first = job.enqueue(3500)
            thread, out = in_thread(lambda: job.enqueue(3500))
            # The other enqueue() has its turn on the key: what it does next, it does while
            # this transaction is open (0.5 s to do it; a duplicate it would queue waits for
            # SQLite's write lock, so it is still under way at the COMMIT).
            deadline = time.monotonic() + 10
            while not locks["default"].is_locked(f"{key}:enqueue"):
                assert time.monotonic() < deadline, "the other enqueue() never took its turn"
                time.sleep(0.01)
            time.sleep(0.5)
        thread.join(40)
        assert not thread.is_alive()
        assert out and out[0][0] == "ok", out
        assert str(out[0][1].id) == str(first.id), "a second run was queued"
        assert queued_ids() - before == {str(first.id)}
        assert not locks["default"].is_locked(f"{key}:enqueue:commit")  # gone at the COMMIT
        assert job.enqueue(3500).id == first.id  # committed: the key stays taken by the run
    finally:
        from django_tasks_db.models import DBTaskResult

        DBTaskResult.objects.exclude(id__in=before).delete()


def test_two_enqueues_in_one_transaction_are_one_run() -> None:
    job = later()
    before = queued_ids()
    try:
        with transaction.atomic(using="tasks"):
            first = job.enqueue(3501)
            assert job.enqueue(3501).id == first.id
        assert queued_ids() - before == {str(first.id)}
    finally:
        from django_tasks_db.models import DBTaskResult

        DBTaskResult.objects.exclude(id__in=before).delete()


class Rollback(Exception):
    pass


@pytest.mark.parametrize("where", ["transaction", "savepoint"])
def test_a_rolled_back_enqueue_leaves_the_key_free_at_once(where: str) -> None:
    # Rolled back (the whole transaction, or the savepoint the enqueue was made in), nothing is
    # queued: the next enqueue() of the key, here or on another connection (one waiting for
    # the transaction's end meanwhile), queues a run at once.
    job, key = later(), lock_key(tasks_jobs.deduped, 3502)
    before = queued_ids()
    try:
        with transaction.atomic(using="tasks"):
            try:
                with transaction.atomic(using="tasks"):
                    first = job.enqueue(3502)
                    thread, out = in_thread(lambda: job.enqueue(3502))
                    time.sleep(0.3)
                    raise Rollback
            except Rollback:
                pass
            if where == "transaction":
                transaction.set_rollback(True, using="tasks")
        thread.join(10)
        assert not thread.is_alive(), "the other enqueue() still waits"
        assert out and out[0][0] == "ok", out
        other = str(out[0][1].id)
        assert other != str(first.id)
        assert queued_ids() - before == {other}
        assert not locks["default"].is_locked(f"{key}:enqueue:commit")
        started = time.monotonic()
        assert str(job.enqueue(3502).id) == other
        assert time.monotonic() - started < 2.0
    finally:
        from django_tasks_db.models import DBTaskResult

        DBTaskResult.objects.exclude(id__in=before).delete()


class SoftTimeLimit(Exception):
    """Celery's soft time limit: an ``Exception`` a signal handler raises."""


@pytest.mark.parametrize("kept", [False, True])
def test_a_time_limit_as_the_turn_s_exit_began_leaves_the_turn_free(kept: bool) -> None:
    # A soft time limit handled as the turn's ``with`` called its ``__exit__`` (CPython looks
    # for signals at the function's entry, before its one-line ``try:``) propagated with the
    # turn held: the block rolled back (nothing queued), and every later enqueue() of the key
    # waited the turn's TTL (30 s), or raised LockNotAcquired while the exception was kept and
    # the watchdog renewed the turn (review rc, 2). The turn must be let go at once.
    import sys

    from django_redlock.locking.base import BaseLock

    exit_code = BaseLock.__dict__["__exit__"].func.__code__
    job, key = later(), lock_key(tasks_jobs.deduped, 3503)
    fired: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is exit_code and not fired:
            name = getattr(frame.f_locals.get("self"), "name", "")
            if name == f"{key}:enqueue":
                fired.append(name)
                raise SoftTimeLimit
        return None

    before = queued_ids()
    held: list[BaseException] = []
    try:
        try:
            with transaction.atomic(using="tasks"):
                sys.settrace(tracer)
                try:
                    job.enqueue(3503)
                finally:
                    sys.settrace(None)
        except SoftTimeLimit as exc:
            if kept:  # an error reporter keeps the traceback (and the turn's lock object)
                held.append(exc)
        assert fired, "the turn's exit was never entered"
        assert queued_ids() == before  # rolled back
        started = time.monotonic()
        run = job.enqueue(3503)
        assert time.monotonic() - started < 2.0, "the next enqueue waited for the turn"
        assert queued_ids() - before == {str(run.id)}
        assert not locks["default"].is_locked(f"{key}:enqueue")
        assert job.enqueue(3503).id == run.id
    finally:
        from django_tasks_db.models import DBTaskResult

        DBTaskResult.objects.exclude(id__in=before).delete()


def test_an_enqueue_after_the_commit_gets_the_run_while_an_earlier_callback_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The commit lock goes as Django reaches the library's on_commit callback, after every
    # callback registered before it: a slow one (a mail, an HTTP call) kept another
    # connection's enqueue() waiting past the COMMIT, then LockNotAcquired ("a transaction
    # still open") once its wait (ENQUEUE_TTL) was up, the run committed and visible all along
    # (review rc, 3). It must return the committed run (here the wait is 2 s, the callback 4).
    from django_redlock.contrib import tasks

    monkeypatch.setattr(tasks, "ENQUEUE_TTL", 2.0)
    job = later()
    before = queued_ids()
    other: list[Any] = []
    started: list[float] = []

    def slow() -> None:  # registered before the enqueue's own callback
        started.append(time.monotonic())
        other.extend(in_thread(lambda: (time.sleep(0.3), job.enqueue(3504))[1]))
        time.sleep(4.0)

    try:
        with transaction.atomic(using="tasks"):
            transaction.on_commit(slow, using="tasks")
            first = job.enqueue(3504)
        thread, out = other
        thread.join(10)
        assert out and out[0][0] == "ok", out
        assert str(out[0][1].id) == str(first.id), "a second run was queued"
        assert queued_ids() - before == {str(first.id)}
    finally:
        from django_tasks_db.models import DBTaskResult

        DBTaskResult.objects.exclude(id__in=before).delete()


def test_a_rolled_back_enqueue_lets_a_waiting_enqueue_queue_its_own_run_between_looks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The look between waits takes no row it cannot see for committed: rolled back after
    # several looks, the waiting enqueue() queues its own run.
    from django_redlock.contrib import tasks

    monkeypatch.setattr(tasks, "COMMIT_LOOK", 0.1)
    job, key = later(), lock_key(tasks_jobs.deduped, 3505)
    before = queued_ids()
    try:
        with transaction.atomic(using="tasks"):
            first = job.enqueue(3505)
            thread, out = in_thread(lambda: job.enqueue(3505))
            time.sleep(1.0)  # 0.1, 0.2, 0.4 s: three looks at a row it cannot see
            assert thread.is_alive(), out
            transaction.set_rollback(True, using="tasks")
        thread.join(10)
        assert out and out[0][0] == "ok", out
        assert str(out[0][1].id) != str(first.id)
        assert queued_ids() - before == {str(out[0][1].id)}
        assert not locks["default"].is_locked(f"{key}:enqueue:commit")
    finally:
        from django_tasks_db.models import DBTaskResult

        DBTaskResult.objects.exclude(id__in=before).delete()
