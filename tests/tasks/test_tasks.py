"""@single_instance under Django's Tasks framework: real db_worker processes (django-tasks-db,
the ORM-backed backend) on the suite's Redis and a SQLite queue they share with the tests;
the ImmediateBackend in this process for what needs no worker."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from django_redlock import locks, single_instance
from django_redlock.admin import Row
from django_redlock.contrib.single import skipped
from django_redlock.contrib.tasks import lock_key
from django_redlock.testing import RedisServer
from tests.support import tasks_jobs

from ..conftest import ROOT

try:
    from django.tasks import TaskResultStatus, task
except ImportError:
    from django_tasks import TaskResultStatus, task

pytestmark = pytest.mark.django_db(databases=["tasks"], transaction=True)

WORKERS = 3


def tasks_test_db() -> str:
    from django.db import connections

    return str(connections["tasks"].settings_dict["NAME"])


class Worker:
    """``manage.py db_worker`` in its own session, so a test can SIGKILL it."""

    def __init__(self, url: str, worker_id: str, log: Path) -> None:
        self.worker_id, self.log = worker_id, log
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.support.worker_settings",
            "REDLOCK_TEST_REDIS": url,
            "PYTHONPATH": str(ROOT),
            # The queue is the test database pytest-django made (under pytest-xdist its name
            # has the test process's suffix): tests/support/settings.py reads it from this variable.
            f"REDLOCK_TASKS_DB{os.environ.get('PYTEST_XDIST_WORKER', '')}": tasks_test_db(),
        }
        command = [
            sys.executable, "-m", "django", "db_worker", "--backend", "default",
            "--interval", "0.05", "--no-startup-delay", "--no-reload", "--worker-id", worker_id,
        ]  # fmt: skip
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while b"Starting worker" not in self.log.read_bytes():
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.05)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def workers(
    django_db_setup: Any, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    """Three workers for the module (started at once): two runs of a key can overlap, and a
    third worker is free while two hold a limit=2 key."""
    logs = tmp_path_factory.mktemp("db_worker")
    started = [Worker(redis_server.url, f"w{i}", logs / f"w{i}.log") for i in range(WORKERS)]
    try:
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            worker.stop()


def redis(server: RedisServer) -> Any:
    return server.client(decode_responses=True)


def wait_for(what: Callable[[], Any], message: str, seconds: float = 60) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := what()):
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
    return value


def finished(result: Any) -> Any:
    """``result`` once its run ended (refreshed from the queue's database)."""

    def done() -> bool:
        result.refresh()
        return bool(result.is_finished)

    wait_for(done, f"task result {result.id} did not finish")
    return result


def running(r: Any, group: str, count: int) -> list[str]:
    """The tags of the runs of ``group`` that started, once ``count`` did."""
    return wait_for(lambda: (ran := r.lrange(f"{group}:ran", 0, -1)) and len(ran) >= count and ran,
                    f"{count} runs of {group} did not start")  # fmt: skip


# -- one run at a time, on real workers -----------------------------------------------------


def test_a_second_run_of_a_held_key_is_skipped(
    workers: list[Worker], redis_server: RedisServer
) -> None:
    r = redis(redis_server)
    first = tasks_jobs.overlap_skip.enqueue("first")
    running(r, "skip", 1)
    # The holder of the key names the task result id: the admin and `redlock list` show it.
    info = locks["default"].inspect("tasks:overlap:skip")
    assert info is not None and info.holder["k"] == str(first.id)
    assert info.holder["n"] == "tests.support.tasks_jobs.overlap_skip"
    assert str(first.id) in Row(info).holder_title
    out = io.StringIO()
    call_command("redlock", "list", "--backend", "default", stdout=out)
    assert f"task {first.id}" in out.getvalue()

    seconds = [tasks_jobs.overlap_skip.enqueue(f"second{i}") for i in range(2)]
    for second in seconds:
        finished(second)
        assert second.status == TaskResultStatus.SUCCESSFUL
        assert skipped(second.return_value) == {
            "redlock": "duplicate_skipped", "key": "tasks:overlap:skip",
            "task_id": str(second.id), "holder_task_id": str(first.id),
        }  # fmt: skip
    r.set("skip:open", 1)
    assert finished(first).return_value == "ran"
    assert r.lrange("skip:ran", 0, -1) == ["first"] and int(r.get("skip:peak")) == 1
    assert locks["default"].inspect("tasks:overlap:skip") is None  # released

    again = finished(tasks_jobs.overlap_skip.enqueue("again"))  # the key is free again
    assert again.return_value == "ran"


def test_a_second_run_of_a_held_key_raises(
    workers: list[Worker], redis_server: RedisServer
) -> None:
    r = redis(redis_server)
    first = tasks_jobs.overlap_raise.enqueue("first")
    running(r, "raise", 1)
    second = finished(tasks_jobs.overlap_raise.enqueue("second"))
    assert second.status == TaskResultStatus.FAILED
    assert second.errors[0].exception_class_path == "django_redlock.exceptions.LockNotAcquired"
    assert str(first.id) in second.errors[0].traceback  # names the holder
    r.set("raise:open", 1)
    assert finished(first).status == TaskResultStatus.SUCCESSFUL
    assert r.lrange("raise:ran", 0, -1) == ["first"]


def test_limit_2_of_6_runs_has_peak_2(workers: list[Worker], redis_server: RedisServer) -> None:
    r = redis(redis_server)
    results = [tasks_jobs.limited.enqueue(str(i)) for i in range(6)]
    running(r, "limited", 2)
    # The third worker runs the other four meanwhile: all permits are taken, so it skips them.
    wait_for(lambda: sum(_skipped(x) for x in results) == 4, "the other four were not skipped")
    info = locks["default"].inspect("tasks:limited")
    assert info is not None and len(info.holders) == 2
    r.set("limited:open", 1)
    outcomes = [finished(x).return_value for x in results]
    assert outcomes.count("ran") == 2 and int(r.get("limited:peak")) == 2
    holders = {str(x.id) for x in results if x.return_value == "ran"}
    for outcome in outcomes:
        if outcome != "ran":  # a skipped run names the two holders
            assert set(outcome["holder_task_id"].split(", ")) == holders


def _skipped(result: Any) -> bool:
    result.refresh()
    return result.is_finished and skipped(result.return_value) is not None


# -- queue-time dedupe ------------------------------------------------------------------------


def test_dedupe_queued_returns_the_first_result_while_queued_and_running(
    workers: list[Worker], redis_server: RedisServer
) -> None:
    r = redis(redis_server)
    blockers = [tasks_jobs.blocker.enqueue(str(i)) for i in range(WORKERS)]
    running(r, "block", WORKERS)  # every worker is busy: what is enqueued now stays queued

    first = tasks_jobs.deduped.enqueue(1)
    again = tasks_jobs.deduped.enqueue(n=1)  # the same key (f(1) and f(n=1) are one)
    assert again.id == first.id and again.status == TaskResultStatus.READY
    other = tasks_jobs.deduped.enqueue(2)  # another key is queued
    assert other.id != first.id

    r.set("block:open", 1)
    running(r, "dedupe", 2)
    assert sorted(r.lrange("dedupe:ran", 0, -1)) == ["1", "2"]
    while_running = tasks_jobs.deduped.enqueue(1)
    assert while_running.id == first.id and while_running.status == TaskResultStatus.RUNNING

    r.set("dedupe:open", 1)
    assert finished(first).return_value == "ran" and finished(other).return_value == "ran"
    assert all(finished(b).return_value == "ran" for b in blockers)
    # The run ended: the next enqueue is queued, and runs.
    later = tasks_jobs.deduped.enqueue(1, fail=True)
    assert later.id != first.id
    assert finished(later).status == TaskResultStatus.FAILED
    # A failed run frees the key as well.
    last = finished(tasks_jobs.deduped.enqueue(1))
    assert last.id not in (first.id, later.id) and last.return_value == "ran"
    assert r.lrange("dedupe:ran", 0, -1)[2:] == ["1", "1"]


def test_aenqueue_dedupes_as_enqueue(workers: list[Worker], redis_server: RedisServer) -> None:
    first = asyncio.run(tasks_jobs.deduped.aenqueue(9))
    again = asyncio.run(tasks_jobs.deduped.aenqueue(n=9))  # queued or running: the same run
    assert again.id == first.id
    redis(redis_server).set("dedupe:open", 1)
    assert finished(first).return_value == "ran"


def test_enqueues_in_open_transactions_run_once_on_the_workers(
    workers: list[Worker], redis_server: RedisServer
) -> None:
    # Two requests enqueue the key, the first inside its transaction (ATOMIC_REQUESTS), the
    # second (another thread, its own connection) before that COMMIT. The second took the
    # first run, invisible to it, for gone and queued another: both ran. One run, whose
    # result both get.
    from django.db import transaction

    from .test_tasks_atomic import in_thread

    r = redis(redis_server)
    r.set("dedupe:open", 1)  # the runs return at once
    key = lock_key(tasks_jobs.deduped, 12)
    with transaction.atomic(using="tasks"):
        first = tasks_jobs.deduped.enqueue(12)
        thread, out = in_thread(lambda: tasks_jobs.deduped.enqueue(12))
        wait_for(lambda: locks["default"].is_locked(f"{key}:enqueue"), "no turn taken", 10)
        time.sleep(0.5)  # (its duplicate's INSERT would wait for SQLite's lock: our COMMIT)
    thread.join(40)
    assert out and out[0][0] == "ok", out
    second = out[0][1]
    assert finished(first).return_value == "ran"
    finished(second)
    assert r.lrange("dedupe:ran", 0, -1) == ["12"], "the key's body ran twice"
    assert second.id == first.id, "a second run was queued"


@pytest.mark.parametrize("state", ["running", "finished"])
def test_an_enqueue_after_the_commit_gets_the_started_run_or_queues_once_it_ended(
    state: str, workers: list[Worker], redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The commit lock goes as Django reaches the library's on_commit callback, after a slow
    # one registered before it. Meanwhile a worker took the committed run (its marker cleared
    # as it took the key), or ran it to its end: another connection's enqueue() found no
    # marker to prove the COMMIT, waited ENQUEUE_TTL, then raised LockNotAcquired ("queued in
    # a transaction still open") (review c2, 1). It must return the running run, or queue a
    # new one once the run ended, at once (the wait here is 3 s; the callback outlasts it).
    from django.db import transaction

    from django_redlock.backends import markers
    from django_redlock.contrib import tasks

    from .test_tasks_atomic import in_thread

    monkeypatch.setattr(tasks, "ENQUEUE_TTL", 3.0)
    r = redis(redis_server)
    if state == "running":
        r.delete("dedupe:open")  # the run stays in its body, holding the key
    else:
        r.set("dedupe:open", 1)
    n = 40 if state == "running" else 41
    key = lock_key(tasks_jobs.deduped, n)
    first: list[Any] = []
    other: list[Any] = []

    def slow() -> None:  # registered before the enqueue's own callback
        if state == "running":
            wait_for(
                lambda: (info := locks["default"].inspect(key)) and info.holder.get("k"),
                "the committed run never took the key",
                20,
            )
        else:
            finished(first[0])
        assert markers.read(locks["default"], key) is None  # cleared by the run
        started = time.monotonic()
        thread, out = in_thread(lambda: tasks_jobs.deduped.enqueue(n))
        thread.join(tasks.ENQUEUE_TTL + 10)
        other.extend([out, time.monotonic() - started])

    try:
        with transaction.atomic(using="tasks"):
            transaction.on_commit(slow, using="tasks")
            first.append(tasks_jobs.deduped.enqueue(n))
        out, took = other
        assert out and out[0][0] == "ok", out
        assert took < 2.0, f"the enqueue waited {took:.1f} s"
        second = out[0][1]
        if state == "running":
            assert second.id == first[0].id, "a second run was queued"
            assert second.status == TaskResultStatus.RUNNING
        else:
            assert second.id != first[0].id, "the finished run was returned"
            assert finished(second).return_value == "ran"
    finally:
        r.set("dedupe:open", 1)
    assert finished(first[0]).return_value == "ran"
    assert r.lrange("dedupe:ran", 0, -1).count(str(n)) == (1 if state == "running" else 2)


def test_an_enqueue_in_a_transaction_after_the_commit_and_the_run_waits_for_the_commit_lock(
    workers: list[Worker], redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, the committed run ended while an earlier callback still runs; but the other
    # enqueue() is in a transaction of its own. Queued at once, its run's row is invisible to
    # others and the commit lock (the first transaction's) is not its own: a third enqueue()
    # would take that row for rolled back and queue a duplicate. It waits for the lock, then
    # queues its run holding the lock (its holder names that run).
    from django.db import transaction

    from django_redlock.contrib import tasks
    from django_redlock.contrib.single import task_id_of

    from .test_tasks_atomic import in_thread

    monkeypatch.setattr(tasks, "ENQUEUE_TTL", 10.0)
    r = redis(redis_server)
    r.set("dedupe:open", 1)
    n, hold = 42, 2.0
    key = lock_key(tasks_jobs.deduped, n)
    first: list[Any] = []
    other: list[Any] = []

    def in_own_transaction() -> tuple[Any, str | None, float]:
        started = time.monotonic()
        with transaction.atomic(using="tasks"):
            run = tasks_jobs.deduped.enqueue(n)
            info = locks["default"].inspect(f"{key}:enqueue:commit")
            return run, task_id_of(info.holder) if info else None, time.monotonic() - started

    def slow() -> None:  # registered before the enqueue's own callback
        finished(first[0])
        other.extend(in_thread(in_own_transaction))
        time.sleep(hold)

    with transaction.atomic(using="tasks"):
        transaction.on_commit(slow, using="tasks")
        first.append(tasks_jobs.deduped.enqueue(n))
    thread, out = other
    thread.join(20)
    assert out and out[0][0] == "ok", out
    second, holder, took = out[0][1]
    assert second.id != first[0].id
    assert holder == str(second.id), "its transaction did not hold the commit lock"
    assert took >= hold - 0.5
    assert finished(second).return_value == "ran"
    assert r.lrange("dedupe:ran", 0, -1).count(str(n)) == 2


# -- killed workers (last: each kills one of the module's workers) ---------------------------


def test_a_killed_worker_s_key_frees_at_its_ttl(
    workers: list[Worker], redis_server: RedisServer
) -> None:
    r = redis(redis_server)
    first = tasks_jobs.killed.enqueue(7)
    running(r, "killed", 1)
    first.refresh()
    (victim,) = [w for w in workers if w.worker_id in first.worker_ids]
    victim.kill()
    killed_at = time.monotonic()
    key = lock_key(tasks_jobs.killed, 7)
    info = locks["default"].inspect(key)
    assert info is not None and info.holder["k"] == str(first.id)  # held on, until its TTL
    assert tasks_jobs.killed.enqueue(7).id == first.id  # still its run: deduplicated
    wait_for(lambda: locks["default"].inspect(key) is None, "the key was not freed", 30)
    assert time.monotonic() - killed_at < 2 + 5  # ttl=2, plus the slack of a busy machine

    r.set("killed:open", 1)
    after = tasks_jobs.killed.enqueue(7)  # the key is free: a new run
    assert after.id != first.id
    assert finished(after).return_value == "ran"


def test_a_worker_killed_before_its_run_took_the_key_frees_it_at_the_lock_s_ttl(
    workers: list[Worker], redis_server: RedisServer
) -> None:
    # Killed between its claim (the row RUNNING, for good) and the run's take, which clears
    # the marker: the marker (dedupe_ttl, 1 h) named a run that would never end, and every
    # enqueue() of the key returned it. (Kills the module's second worker: last but one.)
    r = redis(redis_server)
    r.set("killed-early:hold", 1)
    first = tasks_jobs.killed_early.enqueue(8)
    wait_for(lambda: r.lrange("killed-early:claimed", 0, -1), "the run was not claimed")
    first.refresh()
    assert first.status == TaskResultStatus.RUNNING
    (victim,) = [w for w in workers if w.worker_id in first.worker_ids]
    victim.kill()
    killed_at = time.monotonic()
    r.delete("killed-early:hold")
    assert locks["default"].inspect(lock_key(tasks_jobs.killed_early, 8)) is None  # never taken
    assert tasks_jobs.killed_early.enqueue(8).id == first.id  # within its TTL: still its run
    after = wait_for(
        lambda: (run := tasks_jobs.killed_early.enqueue(8)).id != first.id and run,
        "the dead run's key was not freed", 30,
    )  # fmt: skip
    assert time.monotonic() - killed_at < 2 + 5  # ttl=2, plus the slack of a busy machine
    assert finished(after).return_value == "ran"


# -- in this process (ImmediateBackend) ------------------------------------------------------


def test_the_holder_names_the_task_result_id_with_and_without_context() -> None:
    result = tasks_jobs.with_context.enqueue(1)
    seen = result.return_value
    assert seen["key"] == 'tests.support.tasks_jobs.with_context:{"a":1,"b":2}'  # no context in it
    assert seen["holder"]["k"] == seen["id"] == str(result.id)
    assert seen["holder"]["n"] == "tests.support.tasks_jobs.with_context"
    assert lock_key(tasks_jobs.with_context, a=1) == seen["key"]  # defaults applied

    plain = tasks_jobs.without_context.enqueue(3)
    assert plain.return_value["holder"]["k"] == str(plain.id)
    assert locks["default"].inspect(seen["key"]) is None  # released


def test_a_run_inside_a_run_of_the_same_key_raises() -> None:
    outer = tasks_jobs.nested.enqueue(False)
    status, errors = json.loads(outer.return_value)
    assert status == TaskResultStatus.FAILED
    assert errors == ["django_redlock.exceptions.LockNotAcquired"]


def test_a_direct_call_runs_under_the_lock_without_a_task_id() -> None:
    seen = tasks_jobs.without_context.func(5)
    assert seen["holder"] is not None and "k" not in seen["holder"]


def test_retry_and_an_unwrapped_dedupe_fail_the_run_with_the_reason() -> None:
    for job, reason in [(tasks_jobs.retrying, "has none"), (tasks_jobs.dedupe_unwrapped, "WRAPS")]:
        result = job.enqueue()
        assert result.status == TaskResultStatus.FAILED
        assert result.errors[0].exception_class_path == "builtins.TypeError"
        assert reason in result.errors[0].traceback


# -- bad input, at import ---------------------------------------------------------------------


def module_level(customer_id: int) -> None:
    """A function for the tests below to decorate (Tasks refuse functions in functions)."""


def test_above_task_is_a_type_error_naming_the_right_order() -> None:
    built = task(backend="immediate")(module_level)
    with pytest.raises(TypeError, match=r"directly under Django's @task(.|\n)*@task\(\)\n"):
        single_instance()(built)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"on_duplicate": "ignore"}, ValueError, "on_duplicate must be one of"),
        ({"key": "sync:{user_id}"}, ValueError, "'user_id', which is not an argument"),
        ({"key": "sync:{}"}, ValueError, "use argument names"),
        ({"ttl": 0}, ValueError, "ttl"),
        ({"limit": 2, "dedupe_queued": True}, ValueError, "does not combine"),
    ],
)
def test_bad_options_fail_at_import(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        task(backend="immediate")(single_instance(**options)(module_level))


def test_retry_on_a_deduping_backend_fails_at_import() -> None:
    with pytest.raises(TypeError, match="has none"):
        task()(single_instance(on_duplicate="retry")(module_level))


def test_a_coroutine_function_is_refused() -> None:
    async def coroutine() -> None: ...

    with pytest.raises(TypeError, match="coroutine"):
        single_instance()(coroutine)


def test_lock_key_refuses_an_undecorated_task() -> None:
    with pytest.raises(TypeError, match="not a Django task decorated"):
        lock_key(task(backend="immediate")(module_level), 1)


# -- the dedupe wrapper: transparent, and no wait for its own turn -----------------------------

IMMEDIATE = f"{task.__module__.rsplit('.', 1)[0]}.backends.immediate.ImmediateBackend"


@pytest.fixture
def dedupe_immediate(settings: Any) -> Iterator[str]:
    settings.TASKS = {
        **settings.TASKS,
        "dedupe_immediate": {
            "BACKEND": "django_redlock.contrib.tasks.DedupeQueuedBackend",
            "WRAPS": IMMEDIATE,
        },
    }
    yield "dedupe_immediate"


def test_a_task_enqueuing_its_own_key_under_immediate_is_already_queued(
    dedupe_immediate: str,
) -> None:
    # The outer enqueue() runs the task inside its turn on the key: the inner enqueue() of the
    # same key must not wait for that turn (30 s, then LockNotAcquired).
    result = tasks_jobs.next_page.using(backend=dedupe_immediate).enqueue(1)
    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert result.return_value == ["AlreadyQueued", str(result.id)]  # the run that holds it
    assert locks["default"].inspect("tasks:next-page") is None
    again = tasks_jobs.next_page.using(backend=dedupe_immediate).enqueue(2)
    assert again.return_value == ["ran", 2]  # nothing left queued or held


def test_the_dedupe_wrapper_keeps_the_backend_s_class(dedupe_immediate: str) -> None:
    # Receivers connected with sender=<the wrapped backend class> still fire.
    from django.utils.module_loading import import_string

    immediate = import_string(IMMEDIATE)
    signals = import_string(f"{IMMEDIATE.split('.backends.')[0]}.signals")
    backends = import_string(f"{IMMEDIATE.split('.backends.')[0]}.task_backends")
    seen: list[Any] = []

    def receiver(sender: Any, task_result: Any, **_: Any) -> None:
        seen.append((sender, task_result.id))

    signals.task_enqueued.connect(receiver, sender=immediate)
    try:
        for job in (tasks_jobs.next_page, tasks_jobs.without_context):
            args = (2,) if job is tasks_jobs.next_page else (1,)
            result = job.using(backend=dedupe_immediate).enqueue(*args)
            assert (immediate, result.id) in seen, job
    finally:
        signals.task_enqueued.disconnect(receiver, sender=immediate)
    assert type(backends[dedupe_immediate]) is immediate
    from django_tasks_db import DatabaseBackend

    assert type(backends["default"]) is DatabaseBackend  # the db_worker's wrapped backend


def test_coalesce_is_refused_on_django_tasks() -> None:
    with pytest.raises(TypeError, match="coalesce"):
        task()(single_instance(on_duplicate="coalesce")(module_level))


def test_a_deleted_queued_run_no_longer_counts() -> None:
    # The Tasks analog of a purge: the queued row is deleted (prune_db_task_results, the
    # admin). Its marker would last an hour past run_after; the next enqueue() asks the
    # backend, finds no such result, and queues anew.
    import datetime

    from django.utils import timezone
    from django_tasks_db.models import DBTaskResult

    later = tasks_jobs.deduped.using(run_after=timezone.now() + datetime.timedelta(hours=1))
    first = later.enqueue(31)
    assert later.enqueue(31).id == first.id  # queued: deduplicated
    DBTaskResult.objects.filter(id=first.id).delete()
    again = later.enqueue(31)
    assert again.id != first.id
    assert later.enqueue(31).id == again.id
    DBTaskResult.objects.filter(id=again.id).delete()


def test_an_exception_right_after_the_take_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    # An asynchronous exception (a signal handler's, KeyboardInterrupt) landing between the
    # take and the run's own guard must not leave the key held and renewed.
    from django_redlock.contrib import tasks as contrib

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(contrib, "run_held", interrupted)
    key = lock_key(tasks_jobs.without_context, 11)
    with pytest.raises(KeyboardInterrupt):
        tasks_jobs.without_context.enqueue(11)  # a run of the task (the immediate backend)
    assert not locks["default"].is_locked(key)


def test_an_interrupt_as_the_enqueue_s_turn_is_taken_leaves_it_free() -> None:
    # An interrupt (Ctrl-C, a SIGALRM handler that raises) as the enqueue's turn on the key is
    # taken (at the return of the ``with``'s take): the turn must go with the call, not block
    # every enqueue() of the key, in any process, for its 30 s TTL.
    import datetime

    from django.utils import timezone
    from django_tasks_db.models import DBTaskResult

    from django_redlock.locking.base import BaseLock

    acquire = BaseLock._entered.__code__
    strikes = [1]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not acquire or not frame.f_locals["self"].name.endswith(":enqueue"):
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "return" and arg is frame.f_locals["self"] and strikes:
                strikes.pop()
                raise KeyboardInterrupt("as the enqueue's turn was taken")
            return local

        return local

    later = tasks_jobs.deduped.using(run_after=timezone.now() + datetime.timedelta(hours=1))
    key = lock_key(tasks_jobs.deduped, 32)
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            later.enqueue(32)
    finally:
        sys.settrace(previous)
    assert not strikes
    assert not locks["default"].is_locked(f"{key}:enqueue"), "the turn is still held"
    started = time.monotonic()
    queued = later.enqueue(32)
    assert time.monotonic() - started < 2.0
    DBTaskResult.objects.filter(id=queued.id).delete()


def test_an_interrupt_as_the_enqueue_notes_its_key_leaves_later_enqueues_alone() -> None:
    # An interrupt as the enqueue noted, in this context, that it is enqueuing the key (at the
    # return of the context variable's set(), before its token was kept): the note stayed,
    # and every later enqueue() of the key in this thread was refused as its own re-entry.
    import datetime

    from django.utils import timezone
    from django_tasks_db.models import DBTaskResult

    from django_redlock.contrib import tasks as contrib

    strikes = [1]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "c_return" and strikes and getattr(arg, "__name__", "") == "set"
            and getattr(arg, "__self__", None) is contrib._enqueuing
        ):  # fmt: skip
            strikes.pop()
            raise KeyboardInterrupt("as the key was noted")

    later = tasks_jobs.deduped.using(run_after=timezone.now() + datetime.timedelta(hours=1))
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        with pytest.raises(KeyboardInterrupt):
            later.enqueue(33)
    finally:
        sys.setprofile(previous)
    assert not strikes
    assert contrib._enqueuing.get() == ()
    queued = later.enqueue(33)  # not AlreadyQueued ("enqueued or run by this very call")
    DBTaskResult.objects.filter(id=queued.id).delete()


def test_an_interrupt_as_a_run_names_its_task_leaves_later_holds_unnamed() -> None:
    # An interrupt as the run's take named its task for the hold (at the return of the context
    # variable's set(), before its token was kept): the name stayed, and every later hold in
    # this thread (a plain lock() too) named that task as its holder.
    from django_redlock import identity, lock

    strikes = [1]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "c_return" and strikes and getattr(arg, "__name__", "") == "set"
            and getattr(arg, "__self__", None) is identity.current_task
        ):  # fmt: skip
            strikes.pop()
            raise KeyboardInterrupt("as the run's task was named")

    key = lock_key(tasks_jobs.without_context, 12)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        with pytest.raises(KeyboardInterrupt):
            tasks_jobs.without_context.enqueue(12)  # a run of the task (the immediate backend)
    finally:
        sys.setprofile(previous)
    assert not strikes
    assert not locks["default"].is_locked(key)
    try:
        assert identity.current_task.get() is None
        with lock(f"{key}:plain", ttl=5) as held:
            info = locks["default"].inspect(held.name)
            assert info is not None and not info.holder.get("k"), info.holder
    finally:
        identity.current_task.set(None)  # failed: the later tests' holds not named either


def test_an_interrupt_at_any_line_after_the_backend_enqueued_leaves_the_run_deduplicated() -> None:
    # An interrupt (Ctrl-C, a signal handler's exception) at any line from the moment the
    # backend's enqueue() is entered: inside it (the row saved, then task_enqueued sent: its
    # receivers), or after it returned (naming the run in the marker, the finished-run check,
    # the turn's release). Taken as "nothing queued" inside the backend, the reservation was
    # cleared and the next enqueue() queued a second run; a reservation left after it
    # returned was taken for abandoned: the same. Queued or not, the next enqueue() leaves
    # exactly one run.
    import datetime

    from django.dispatch import Signal
    from django.utils import timezone
    from django_tasks_db import DatabaseBackend
    from django_tasks_db.models import DBTaskResult

    from django_redlock.backends import markers
    from django_redlock.contrib import tasks as contrib
    from tests.support.line_interrupts import LineInterrupter, every_point, interrupted

    later = tasks_jobs.deduped.using(run_after=timezone.now() + datetime.timedelta(hours=1))
    window = contrib._enqueue_in_turn.__code__
    watched = {window, contrib._enqueue_once.__code__, markers.swap.__code__, markers.mark.__code__}
    if hasattr(contrib, "_name_run"):  # (the test runs against the code before the fix too)
        watched.add(contrib._name_run.__code__)
    inside = DatabaseBackend.enqueue.__code__
    watched |= {inside, Signal.send.__code__}

    def enqueued(frame: Any) -> bool:  # from the moment the backend's enqueue() is entered
        return frame.f_code is inside or (
            frame.f_code is window and frame.f_locals.get("result") is not None
        )

    runs: list[int] = [3400]

    def case(tracer: LineInterrupter) -> None:
        runs[0] += 1
        before = set(DBTaskResult.objects.values_list("id", flat=True))
        interrupted(lambda: later.enqueue(runs[0]), tracer)
        queued = set(DBTaskResult.objects.values_list("id", flat=True)) - before
        assert len(queued) <= 1, tracer.fired
        again = later.enqueue(runs[0])
        if queued:
            assert {str(again.id)} == {str(q) for q in queued}, f"a second run, at {tracer.fired}"
        after = set(DBTaskResult.objects.values_list("id", flat=True)) - before
        assert len(after) == 1, f"{len(after)} runs, at {tracer.fired}"
        DBTaskResult.objects.filter(id__in=after).delete()

    points = every_point(case, lambda at: LineInterrupter(at, watched, enqueued))
    assert len(points) >= 3, points


@pytest.mark.parametrize("receiver", ["connected first", "connected last"])
def test_a_task_enqueued_receiver_that_raises_leaves_the_run_deduplicated(receiver: str) -> None:
    # django-tasks-db saves the run, then sends task_enqueued, whose receivers' exceptions
    # pass out of enqueue(): taken as "nothing queued", the key's reservation was cleared
    # and the next enqueue() queued a second run. Connected before ours, the receiver's
    # error stops the signal before we see it: the run is found in the raising frames.
    import datetime

    from django.utils import timezone
    from django_tasks_db.models import DBTaskResult

    from django_redlock.contrib import tasks as contrib

    try:
        from django.tasks import signals
    except ImportError:
        from django_tasks import signals

    class Boom(Exception):
        pass

    def boom(sender: Any, task_result: Any, **_: Any) -> None:
        raise Boom("a receiver failed")

    later = tasks_jobs.deduped.using(run_after=timezone.now() + datetime.timedelta(hours=1))
    uid = f"redlock:{signals.__name__.rpartition('.')[0]}"
    if receiver == "connected first":
        assert signals.task_enqueued.disconnect(dispatch_uid=uid)
    signals.task_enqueued.connect(boom, weak=False, dispatch_uid="test-boom")
    if receiver == "connected first":
        signals.task_enqueued.connect(contrib._enqueued, weak=False, dispatch_uid=uid)
    before = set(DBTaskResult.objects.values_list("id", flat=True))
    try:
        with pytest.raises(Boom):
            later.enqueue(3390)
    finally:
        signals.task_enqueued.disconnect(dispatch_uid="test-boom")
    queued = set(DBTaskResult.objects.values_list("id", flat=True)) - before
    assert len(queued) == 1  # saved before the signal
    again = later.enqueue(3390)
    after = set(DBTaskResult.objects.values_list("id", flat=True)) - before
    DBTaskResult.objects.filter(id__in=after).delete()
    assert {str(again.id)} == {str(q) for q in queued}, "a second run queued"


def test_an_interrupt_at_any_line_after_an_immediate_run_leaves_the_key_free(
    dedupe_immediate: str,
) -> None:
    # The ImmediateBackend runs the task inside enqueue(): an interrupt at any line after it
    # returned (naming the run in the marker, the finished-run check) left a marker naming a
    # finished run that backend cannot look up: every enqueue() of the key raised
    # AlreadyQueued for dedupe_ttl (an hour), nothing queued or running.
    from django_redlock.backends import markers
    from django_redlock.contrib import tasks as contrib
    from tests.support.line_interrupts import LineInterrupter, every_point, interrupted

    job = tasks_jobs.slow_immediate.using(backend=dedupe_immediate)
    window = contrib._enqueue_in_turn.__code__
    watched = {window, contrib._name_run.__code__, markers.swap.__code__, markers.mark.__code__}
    watched.add(contrib._already_finished.__code__)

    def enqueued(frame: Any) -> bool:
        return frame.f_code is window and frame.f_locals.get("result") is not None

    def case(tracer: LineInterrupter) -> None:
        interrupted(lambda: job.enqueue(0.0), tracer)
        assert job.enqueue(0.0).return_value == "ran", tracer.fired
        assert markers.read(locks["default"], "tasks:slow-immediate") is None, tracer.fired

    points = every_point(case, lambda at: LineInterrupter(at, watched, enqueued))
    assert len(points) >= 3, points


def test_an_enqueue_meeting_a_run_inside_another_enqueue_is_already_queued(
    dedupe_immediate: str,
) -> None:
    # An ImmediateBackend runs the task inside enqueue(), so inside that call's turn on the
    # key: a second enqueue() from another thread waited the turn's 30 s, then raised
    # LockNotAcquired. The docs: a backend that keeps no results raises AlreadyQueued.
    import threading

    from django_redlock.contrib.single import AlreadyQueued

    job = tasks_jobs.slow_immediate.using(backend=dedupe_immediate)
    first = threading.Thread(target=lambda: job.enqueue(2.0))
    first.start()
    try:
        wait_for(lambda: locks["default"].is_locked("tasks:slow-immediate"), "the first run")
        started = time.monotonic()
        with pytest.raises(AlreadyQueued):
            job.enqueue(0.1)
        assert time.monotonic() - started < 1.5
    finally:
        first.join(40)
    assert job.enqueue(0.1).return_value == "ran"  # nothing left queued or held


def test_a_run_interrupted_anywhere_is_no_longer_the_current_run() -> None:
    # The ImmediateBackend passes a KeyboardInterrupt on without task_finished: the run stayed
    # "current" in this thread for good, and every later direct call of the function ran as a
    # run of that dead task (its hold naming the dead result id), the stack growing by one
    # per interrupted run. In the body, and at every line of the backend's run of it.
    from django_redlock.contrib import tasks as contrib
    from tests.support.line_interrupts import LineInterrupter, every_point, interrupted

    job = tasks_jobs.holder_seen
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            job.enqueue(True)
    direct = job.func(False)
    assert not direct.get("k"), direct  # a direct call: no task named
    assert contrib._current.get() == ()

    execute = type(job.get_backend())._execute_task.__code__

    def case(tracer: LineInterrupter) -> None:
        interrupted(lambda: job.enqueue(False), tracer)
        direct = job.func(False)
        assert not direct.get("k"), f"{direct} at {tracer.fired}"
        assert contrib._current.get() == (), tracer.fired

    points = every_point(
        case, lambda at: LineInterrupter(at, {execute}, lambda f: "task_start_time" in f.f_locals)
    )
    assert len(points) >= 5, points
