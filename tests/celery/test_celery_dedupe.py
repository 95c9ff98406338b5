"""Queue markers that never outlive their message, canvas members of ``dedupe_queued`` tasks,
and a prefork child SIGKILLed mid-run: real workers and a real Redis broker."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import chord, group, shared_task
from kombu.exceptions import OperationalError

from django_redlock import LockError, lock, locks, single_instance
from django_redlock.backends import markers
from django_redlock.contrib.celery import SingleInstanceTask, note_call, skipped
from django_redlock.testing import RedisServer
from tests.support import celery_app, celery_tasks

from ..conftest import ROOT
from .test_celery import (
    NO_RETRY,
    NOBODY,
    Worker,
    broker,
    redis,
    start_worker,
    stop_all,
    wait_for,
)

__all__ = ["broker", "start_worker"]  # fixtures, imported to be used here


@pytest.fixture(scope="module")
def prefork(start_worker: Callable[..., Worker]) -> Iterator[Worker]:
    # Shared by the tests of this module, the ones that SIGKILL one of its children too
    # (billiard starts another): each leaves both children idle.
    worker = start_worker(pool="prefork", concurrency=2)
    yield worker
    worker.stop()


@pytest.mark.parametrize("task_name", ["lost_child", "lost_child_limited"])
def test_a_killed_prefork_child_s_requeued_message_runs(
    task_name: str, prefork: Worker, redis_server: RedisServer
) -> None:
    # acks_late + reject_on_worker_lost: the child is SIGKILLed mid-body, Celery requeues the
    # message (same id, retries 0) at once. The dead run's hold (TTL 60 s) must not make the
    # copy a "redelivery beside a live run": it runs, well before the TTL.
    worker = prefork
    died_before = worker.log.read_text().count("whose run died")
    task = getattr(celery_tasks, task_name)
    r = redis(redis_server)
    result = worker.send(task, task_name)
    (entry,) = wait_for(lambda: r.lrange(f"lost:{task_name}", 0, -1))
    task_id, pid = entry.rsplit(":", 1)
    assert task_id == result.id
    killed = time.monotonic()
    os.kill(int(pid), signal.SIGKILL)
    assert result.get(timeout=40) == "ran"
    assert time.monotonic() - killed < 40  # the hold's TTL is 60 s: not freed by expiry
    entries = r.lrange(f"lost:{task_name}", 0, -1)
    assert [e.rsplit(":", 1)[0] for e in entries] == [result.id, result.id]
    assert worker.log.read_text().count("whose run died") > died_before


def test_a_copy_beside_a_live_run_is_still_skipped(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # The liveness check does not turn a redelivery beside a live run into a second run.
    worker = prefork
    task_id = str(uuid.uuid4())
    first = worker.send(celery_tasks.redelivered, "live", 2.0, task_id=task_id)
    r = redis(redis_server)
    wait_for(lambda: r.lrange("redeliver:live:ran", 0, -1))
    worker.send(celery_tasks.redelivered, "live", 2.0, task_id=task_id)
    assert first.get(timeout=30) == "ran"
    time.sleep(0.5)
    assert r.lrange("redeliver:live:ran", 0, -1) == [task_id]


def test_a_failed_publish_leaves_no_marker(broker: None) -> None:
    task = celery_tasks.deduped
    dead = celery_app.app.connection_for_write("redis://127.0.0.1:1/1", transport_options=NO_RETRY)
    with pytest.raises(OperationalError):
        task.apply_async(("pub",), queue=NOBODY, countdown=60, task_id="never-queued",
                         connection=dead, retry=False)  # fmt: skip
    second = task.apply_async(("pub",), queue=NOBODY, countdown=60)
    assert second.id != "never-queued"  # queued, not the AsyncResult of a lost message
    assert task.apply_async(("pub",), queue=NOBODY).id == second.id  # deduped as usual


def test_a_coalesced_call_whose_publish_failed_leaves_no_note(broker: None) -> None:
    # coalesce + dedupe_queued: the call's arguments were noted before its publish and left
    # there when the publish raised: the running task's end then ran the failed call. The
    # note it replaced comes back; with none, none stays.
    task, key = celery_tasks.coalesced_deduped, "coalesce-dd:failed"
    config = task.single_instance_config()
    backend = locks["default"]
    dead = celery_app.app.connection_for_write("redis://127.0.0.1:1/1", transport_options=NO_RETRY)
    with pytest.raises(OperationalError):
        task.apply_async(("failed", "C"), queue=NOBODY, connection=dead, retry=False)
    assert markers.read(backend, f"{key}:coalesce") is None
    earlier, _ = note_call(config, key, ("failed", "B"), {}, None, None, task.name)
    with pytest.raises(OperationalError):
        task.apply_async(("failed", "C"), queue=NOBODY, connection=dead, retry=False)
    noted = markers.read(backend, f"{key}:coalesce")
    assert noted is not None and noted[0] == earlier
    assert json.loads(noted[0])["args"] == ["failed", "B"]


def test_an_expired_queued_task_no_longer_counts(broker: None) -> None:
    task = celery_tasks.deduped
    first = task.apply_async(("exp",), queue=NOBODY, expires=1)
    assert task.apply_async(("exp",), queue=NOBODY).id == first.id
    time.sleep(1.5)  # it cannot run any more: its marker went with it
    assert task.apply_async(("exp",), queue=NOBODY).id != first.id


def test_a_revoked_queued_task_no_longer_counts(prefork: Worker) -> None:
    task = celery_tasks.deduped
    first = prefork.send(task, "rev", 0.1, countdown=2)
    assert prefork.send(task, "rev", 0.1).id == first.id
    first.revoke()  # no terminate: the worker discards the message at its ETA
    wait_for(lambda: first.state == "REVOKED")
    again = prefork.send(task, "rev", 0.1)
    assert again.id != first.id
    assert again.get(timeout=30) == "ran"


def test_a_marker_of_a_task_with_a_final_state_is_stale(broker: None) -> None:
    # Revoked or finished while nothing cleared its marker (the worker died at that moment):
    # the result backend's final state makes the marker stale.
    task = celery_tasks.deduped
    first = task.apply_async(("final",), queue=NOBODY)
    assert task.apply_async(("final",), queue=NOBODY).id == first.id
    task.backend.mark_as_revoked(first.id, "revoked")
    assert task.apply_async(("final",), queue=NOBODY).id != first.id


def _members(worker: Worker, name: str, n: int) -> list[Any]:
    # Each runs 4 s: the worker's two children take the third member once one of the first
    # two is done (the duplicate, skipped at once), and on a loaded machine that start came
    # more than 1 s after the runner's, when the key was free again (a second "ran").
    return [celery_tasks.member.s(name, 4.0).set(queue=worker.queue) for _ in range(n)]


def test_a_group_of_deduplicated_calls_resolves(prefork: Worker, redis_server: RedisServer) -> None:
    result = group(_members(prefork, "g", 3)).apply_async()
    values = result.get(timeout=30)
    ran = [v for v in values if v == "ran"]
    skips = [skipped(v) for v in values if v != "ran"]
    assert len(ran) == 1 and len(skips) == 2
    runner = redis(redis_server).lrange("member:g:ran", 0, -1)
    assert all(s is not None and s["holder_task_id"] == runner[0] for s in skips)
    assert [r.id for r in result.results] == [r.id for r in result.results if r.ready()]


def test_a_chord_of_deduplicated_calls_runs_its_callback(prefork: Worker) -> None:
    callback = celery_tasks.collect.s().set(queue=prefork.queue)
    result = chord(_members(prefork, "c", 3))(callback)
    values = result.get(timeout=30)
    assert values.count("ran") == 1
    assert sum(1 for v in values if skipped(v)) == 2


def test_held_by_a_plain_lock_names_it(prefork: Worker) -> None:
    with lock("overlap:raise", ttl=30):
        failed = prefork.send(celery_tasks.overlap_raise, "x").get(timeout=30, propagate=False)
    assert "held by task None" not in str(failed)
    assert f"a lock() outside any task (pid {os.getpid()}" in str(failed)
    assert not locks["default"].is_locked("overlap:raise")


def test_coalesce_runs_once_more_with_the_last_duplicate_s_arguments(
    prefork: Worker, redis_server: RedisServer
) -> None:
    r = redis(redis_server)
    first = prefork.send(celery_tasks.coalesced, "c", "t0", 30.0)
    wait_for(lambda: r.lrange("coalesce:c:ran", 0, -1))
    # Five duplicates while it runs, one after another (so "the last" is well defined); it
    # runs until they are done.
    try:
        for i in range(1, 6):
            value = prefork.send(celery_tasks.coalesced, "c", f"t{i}", 0.5).get(timeout=30)
            assert skipped(value) is not None and value["coalesced"] is True
    finally:
        r.set("coalesce:c:t0:release", 1, ex=60)
    assert first.get(timeout=30) == "ran"
    wait_for(lambda: len(r.lrange("coalesce:c:ran", 0, -1)) == 2)
    wait_for(lambda: not locks["default"].is_locked("coalesce:c"))
    time.sleep(1.0)  # nothing more follows
    assert r.lrange("coalesce:c:ran", 0, -1) == ["t0", "t5"]  # exactly 2 runs, the last's args
    assert int(r.get("coalesce:c:peak")) == 1  # in sequence, never at once


def test_coalesce_with_no_duplicate_runs_once(prefork: Worker, redis_server: RedisServer) -> None:
    r = redis(redis_server)
    assert prefork.send(celery_tasks.coalesced, "one", "t0", 0.1).get(timeout=30) == "ran"
    time.sleep(1.0)
    assert r.lrange("coalesce:one:ran", 0, -1) == ["t0"]


def test_coalesce_does_not_combine_with_limit() -> None:
    with pytest.raises(ValueError, match="coalesce"):
        single_instance(on_duplicate="coalesce", limit=2)


@shared_task(bind=True, base=SingleInstanceTask, name="tests.celery.test_celery_dedupe.shared_x")
@single_instance(key="shared:{n}", ttl=5, dedupe_queued=True)
def shared_x(self: Any, n: int) -> str:
    return "x"


@shared_task(bind=True, base=SingleInstanceTask, name="tests.celery.test_celery_dedupe.shared_y")
@single_instance(key="shared:{n}", ttl=5, dedupe_queued=True)
def shared_y(self: Any, n: int) -> str:
    return "y"


def test_two_tasks_sharing_a_key_dedupe_each_other(broker: None) -> None:
    # Decided and documented: the key is the identity. Two task names whose key templates
    # give one key are one unit of work, queued and run once at a time (give each its own key
    # to keep them apart).
    queued = shared_x.apply_async((1,), queue=NOBODY)
    assert shared_y.apply_async((1,), queue=NOBODY).id == queued.id
    assert shared_y.apply_async((2,), queue=NOBODY).id != queued.id  # another key


def test_marker_read_and_list_ops(alias: str) -> None:
    _marker_read_and_list(alias)


def test_marker_read_and_list_ops_on_a_quorum(
    redis_factory: Callable[..., RedisServer],
) -> None:
    from ..redlock.test_redlock import quorum_alias

    nodes = [redis_factory() for _ in range(3)]
    with quorum_alias("quorum", nodes):
        _marker_read_and_list("quorum")
        locks["quorum"].execute(locks["quorum"].op_mark_queued("rm:q", "t9", 60_000))
        nodes[0].client().flushall()  # a minority forgot it: the majority still answers
        assert locks["quorum"].execute(locks["quorum"].op_read_queued("rm:q"))[0] == "t9"
        nodes[1].client().flushall()  # no majority any more
        assert locks["quorum"].execute(locks["quorum"].op_read_queued("rm:q")) is None
        # A swap a majority cannot make is put back where it was made.
        assert not locks["quorum"].execute(
            locks["quorum"].op_swap_queued("rm:q", "t9", "u", 60_000)
        )
        assert nodes[2].client().get(locks["quorum"].nodes[2].key("rm:q") + ":queued") == b"t9"


def _marker_read_and_list(alias: str) -> None:
    backend = locks[alias]
    assert backend.execute(backend.op_read_queued("rm:a")) is None
    assert backend.execute(backend.op_mark_queued("rm:a", "t1", 60_000)) is None
    assert backend.execute(backend.op_mark_queued("rm:b", "t2", 60_000)) is None
    task_id, left = backend.execute(backend.op_read_queued("rm:a"))
    assert task_id == "t1" and 50_000 < left <= 60_000
    assert backend.queued_names("rm:*") == ["rm:a", "rm:b"]
    assert backend.execute(backend.op_clear_queued("rm:a", "t1")) is True
    assert backend.execute(backend.op_read_queued("rm:a")) is None
    assert backend.queued_names("rm:*") == ["rm:b"]
    # swap: compare-and-set, in one step (a coalesced call's note replaced or claimed).
    assert backend.execute(backend.op_swap_queued("rm:b", "t1", "t3", 60_000)) is False
    assert backend.execute(backend.op_swap_queued("rm:c", "t1", "t3", 60_000)) is False
    assert backend.execute(backend.op_read_queued("rm:c")) is None
    assert backend.execute(backend.op_swap_queued("rm:b", "t2", "t3", 30_000)) is True
    task_id, left = backend.execute(backend.op_read_queued("rm:b"))
    assert task_id == "t3" and 20_000 < left <= 30_000
    backend.execute(backend.op_clear_queued("rm:b", "t3"))


def test_run_died_tells_a_live_holder_from_a_dead_one(
    child: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rule behind a requeued copy: a holder on this host is dead when its pid is gone;
    # one elsewhere when its watchdog stops renewing (a paused or dead process) and the hold
    # runs out. Real processes: SIGSTOP, SIGKILL.
    from django_redlock.contrib import single

    holder = child("hold", "--name", "died:x", "--ttl", "1")
    holder.expect("ACQUIRED")
    backend = locks["default"]
    info = backend.inspect("died:x")
    assert info is not None and str(info.holder["p"]) == str(holder.process.pid)
    assert single.run_died(backend, "died:x", info) is False  # this host, alive
    monkeypatch.setattr(single, "HOST", "another-host")  # from here, the holder is remote
    assert single.run_died(backend, "died:x", info) is False  # renewed: alive
    os.kill(holder.process.pid, signal.SIGSTOP)  # no renewal any more
    try:
        assert single.run_died(backend, "died:x", backend.inspect("died:x")) is True
    finally:
        os.kill(holder.process.pid, signal.SIGCONT)
    holder.process.kill()
    holder.process.wait()
    monkeypatch.undo()
    dead = child("hold", "--name", "died:y", "--ttl", "30")
    dead.expect("ACQUIRED")
    info = backend.inspect("died:y")
    dead.process.kill()  # SIGKILL
    dead.process.wait()
    assert single.run_died(backend, "died:y", info) is True  # this host: the pid is gone
    backend.force_release("died:y", info.token, None)


def test_coalesce_follows_a_run_whose_child_was_killed(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # The run's child is SIGKILLed: it never reaches its own follow-up. The worker's main
    # process, releasing the dead run's hold (WorkerLostError), queues the noted call.
    r = redis(redis_server)
    first = prefork.send(celery_tasks.coalesced_killed, "k", "t0", 30.0)
    (pid,) = wait_for(lambda: r.lrange("coalesce-killed:k:pids", 0, -1))
    value = prefork.send(celery_tasks.coalesced_killed, "k", "t1", 0.1).get(timeout=30)
    assert value["coalesced"] is True
    os.kill(int(pid), signal.SIGKILL)
    first.get(timeout=30, propagate=False)
    # The hold's TTL is 30 s: t1 runs well before it, queued by the main process.
    wait_for(lambda: r.lrange("coalesce-killed:k:ran", 0, -1) == ["t0", "t1"], timeout=20)


@pytest.mark.parametrize("late", [False, True], ids=["queued by the main process", "acks_late"])
def test_coalesce_a_killed_follow_up_s_call_outlives_dedupe_ttl_behind_a_backlog(
    late: bool, prefork: Worker, redis_server: RedisServer
) -> None:
    # The follow-up that claimed t1 is SIGKILLed; the next one (queued by the main process,
    # or, acks_late, its own message put back) waits behind another key's 2.5 s task. Nobody
    # renewed the claimed note (the main process's keeper stopped at "taken"): it expired
    # after dedupe_ttl (1 s), and t1 never ran. The runs the test waits on (t0, the killed
    # t1, b1) end when it says, not after fixed times: only b2's 2.5 s carries the property.
    worker = prefork
    task = celery_tasks.coalesced_waiting_late if late else celery_tasks.coalesced_waiting
    group = f"coalesce-wait{'-late' if late else ''}:{uuid.uuid4().hex[:8]}"
    name = group.rpartition(":")[2]
    r = redis(redis_server)
    worker.send(task, name, "t0", 30.0)
    wait_for(lambda: r.lrange(f"{group}:pids", 0, -1))
    assert worker.send(task, name, "t1", 30.0).get(timeout=30)["coalesced"] is True
    worker.send(celery_tasks.occupy, f"{name}-b1", 60.0)  # the other slot, busy
    wait_for(lambda: r.lrange(f"occupy:{name}-b1:started", 0, -1))
    r.set(f"{group}:t0:release", 1, ex=60)  # t0 ends: its follow-up runs t1
    pids = wait_for(lambda: (p := r.lrange(f"{group}:pids", 0, -1))[1:] and p, timeout=20)
    worker.send(celery_tasks.occupy, f"{name}-b2", 2.5)  # the next follow-up's wait
    time.sleep(0.5)
    os.kill(int(pids[1]), signal.SIGKILL)
    r.set(f"{group}:t1:release", 1, ex=60)  # t1's next run ends at once
    try:
        wait_for(lambda: r.lrange(f"{group}:done", 0, -1) == ["t0", "t1"], timeout=30)
        assert len(r.lrange(f"occupy:{name}-b2:started", 0, -1)) == 1
    finally:
        r.set(f"occupy:{name}-b1:release", 1, ex=60)
    wait_for(lambda: r.lrange(f"occupy:{name}-b1:ended", 0, -1))  # the worker idle again


def test_coalesce_a_note_outlives_the_child_that_queued_its_follow_up(
    start_worker: Callable[..., Worker], redis_server: RedisServer
) -> None:
    # --max-tasks-per-child=1: the child whose run queued the follow-up exits right after,
    # and its keeper thread with it. The follow-up waits behind a 2.5 s task of another key
    # (the other slot busy until the end): the note expired after dedupe_ttl (1 s), and t1
    # never ran (nothing was killed).
    worker = start_worker(pool="prefork", concurrency=2, REDLOCK_TEST_MAX_TASKS_PER_CHILD="1")
    name = uuid.uuid4().hex[:8]
    group = f"coalesce-wait:{name}"
    r = redis(redis_server)
    task = celery_tasks.coalesced_waiting
    first = worker.send(task, name, "t0", 30.0)
    wait_for(lambda: r.lrange(f"{group}:pids", 0, -1))
    assert worker.send(task, name, "t1", 0.1).get(timeout=30)["coalesced"] is True
    # Queued before the run's end queues the follow-up, which waits behind them: b1 until
    # the end, b2 2.5 s. (Each takes a new child, which billiard starts seconds late: b2
    # starts after t0 ended, whichever child b1 takes.)
    worker.send(celery_tasks.occupy, f"{name}-b1", 60.0)
    worker.send(celery_tasks.occupy, f"{name}-b2", 2.5)
    r.set(f"{group}:t0:release", 1, ex=60)
    try:
        assert first.get(timeout=30) == "ran"
        wait_for(lambda: r.lrange(f"{group}:done", 0, -1) == ["t0", "t1"], timeout=30)
        assert len(r.lrange(f"occupy:{name}-b2:started", 0, -1)) == 1
    finally:
        r.set(f"occupy:{name}-b1:release", 1, ex=60)
    wait_for(lambda: r.lrange(f"occupy:{name}-b1:ended", 0, -1))
    worker.stop()


@pytest.mark.parametrize("stop", ["hard time limit", "SIGKILL"])
def test_coalesce_a_run_stopped_as_its_end_publishes_the_follow_up(
    stop: str, prefork: Worker, redis_server: RedisServer
) -> None:
    # The run's end wrote the follow-up mark and was stopped in its publish. The main
    # process looked while the child still ran (a hard time limit fails the task before the
    # kill) or found the dead child's unsent mark: "a follow-up to come", for 30 s at least.
    # Nothing came: the coalesced call never ran.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    group = f"coalesce-pub:{name}"
    # t0's body ends once t1 was coalesced (a t1 that came late, from a child started late,
    # no longer finds t0 ended): under the hard time limit (4 s) when it is, so the limit
    # strikes in the 5 s publish; the SIGKILL case lifts the limit and kills in the publish.
    if stop == "SIGKILL":
        first = prefork.send(celery_tasks.coalesced_slow_publish, name, "t0", 30.0, time_limit=60)
    else:
        first = prefork.send(celery_tasks.coalesced_slow_publish, name, "t0", 3.0)
    (pid,) = wait_for(lambda: r.lrange(f"{group}:pids", 0, -1))
    value = prefork.send(celery_tasks.coalesced_slow_publish, name, "t1").get(timeout=30)
    assert value["coalesced"] is True
    r.set(f"{group}:release", 1, ex=60)
    wait_for(lambda: r.lrange(f"{group}:publishing", 0, -1))
    if stop == "SIGKILL":
        os.kill(int(pid), signal.SIGKILL)
    first.get(timeout=30, propagate=False)
    wait_for(lambda: r.lrange(f"{group}:ran", 0, -1) == ["t0", "t1"], timeout=20)
    time.sleep(0.5)
    assert r.lrange(f"{group}:ran", 0, -1) == ["t0", "t1"]


def test_coalesce_with_dedupe_queued_runs_a_call_made_during_a_run(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # dedupe_queued deduplicated a delay() made while the key ran to the running task: with
    # coalesce that call's arguments were never run (lost). A call during a run is queued
    # (one running plus one queued); calls while that one is queued dedupe to it.
    r = redis(redis_server)
    first = prefork.send(celery_tasks.coalesced_deduped, "d", "t0", 2.0)
    wait_for(lambda: r.lrange("coalesce-dd:d:ran", 0, -1))
    second = prefork.send(celery_tasks.coalesced_deduped, "d", "t1", 0.1)
    assert second.id != first.id  # queued, not the running task's result
    assert first.get(timeout=30) == "ran"
    wait_for(lambda: len(r.lrange("coalesce-dd:d:ran", 0, -1)) == 2)
    wait_for(lambda: not locks["default"].is_locked("coalesce-dd:d"))
    time.sleep(1.0)  # nothing more follows
    assert r.lrange("coalesce-dd:d:ran", 0, -1) == ["t0", "t1"]
    assert int(r.get("coalesce-dd:d:peak")) == 1


# -- a purged message's marker: the broker is asked (Redis) -----------------------------------


def _purge(how: str, queue: str, redis_server: RedisServer) -> None:
    if how == "control":
        # The default queue: another test's coalesced call there may have had its follow-up
        # queued by a worker's main process meanwhile (no worker here reads that queue).
        assert celery_app.app.control.purge() >= 1
        return
    if how == "channel":  # what `celery purge -Q` does, in this process
        with celery_app.app.connection_for_write() as connection:
            assert connection.default_channel.queue_purge(queue) == 1
        return
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.support.worker_settings",
        "REDLOCK_TEST_REDIS": redis_server.url,
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "celery", "-A", "tests.support.celery_app",
               "purge", "-Q", queue, "-f"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Purged 1 message" in done.stdout, done.stdout


@pytest.fixture
def look_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # A message found in the broker is not looked for again for message_check_every seconds
    # (a loop of delay() calls reads the queue once); these tests look at once.
    monkeypatch.setattr(SingleInstanceTask, "message_check_every", 0.0)


@pytest.mark.parametrize("how", ["control", "cli"])
def test_a_purged_queued_task_no_longer_counts(
    how: str, broker: None, redis_server: RedisServer, look_every_time: None
) -> None:
    # app.control.purge() empties the queues the app consumes from: the default one here
    # (no worker of the tests reads it); `celery purge -Q` the one named.
    task = celery_tasks.deduped
    name = f"purged-{how}"
    options = {"queue": name} if how == "cli" else {}
    first = task.apply_async((name,), **options)
    assert task.apply_async((name,), **options).id == first.id  # in its queue: deduplicated
    _purge(how, name, redis_server)
    again = task.apply_async((name,), **options)
    assert again.id != first.id  # not the AsyncResult of a message that will never run
    assert task.apply_async((name,), **options).id == again.id  # deduplicated as usual
    _purge(how, name, redis_server)


def test_a_message_a_worker_holds_for_its_eta_still_counts(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # Taken from the queue by a worker that waits for its ETA: in the broker's unacked hash,
    # not in the queue. Still queued: deduplicated, and run once.
    broker = redis_server.client(db=1, decode_responses=True)
    first = prefork.send(celery_tasks.deduped, "eta", 0.1, countdown=6)
    wait_for(lambda: any(first.id in v for v in broker.hvals("unacked")))
    assert broker.llen(prefork.queue) == 0
    assert prefork.send(celery_tasks.deduped, "eta", 0.1).id == first.id
    assert first.get(timeout=30) == "ran"
    assert redis(redis_server).lrange("dedupe:eta:ran", 0, -1) == [first.id]


def test_a_purged_message_found_moments_ago_counts_until_the_next_look(
    broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Longer than the default (2 s), so that a loaded machine's slow purge still falls inside.
    monkeypatch.setattr(SingleInstanceTask, "message_check_every", 4.0)
    task = celery_tasks.deduped
    first = task.apply_async(("recheck",))
    assert task.apply_async(("recheck",)).id == first.id  # found in the queue just now
    assert celery_app.app.control.purge() == 1
    assert task.apply_async(("recheck",)).id == first.id  # not looked for again yet
    time.sleep(SingleInstanceTask.message_check_every)
    again = task.apply_async(("recheck",))
    assert again.id != first.id
    celery_app.app.control.purge()


def test_a_marker_the_broker_cannot_vouch_for_is_obeyed(
    broker: None, monkeypatch: pytest.MonkeyPatch, look_every_time: None
) -> None:
    # Unknown is not gone: a marker whose message was sent to no queue by name (an exchange
    # or routing key of its own), or a queue too long to read, is obeyed (until its TTL).
    from django_redlock.contrib import broker as broker_check
    from django_redlock.contrib.celery import sent_name

    task = celery_tasks.deduped
    backend = locks["default"]
    key = task.lock_key("unnoted")
    backend.execute(backend.op_mark_queued(key, "published-elsewhere", 60_000))
    backend.execute(backend.op_mark_queued(sent_name(key, "published-elsewhere"), "", 60_000))
    assert task.apply_async(("unnoted",), queue="unnoted").id == "published-elsewhere"
    backend.execute(backend.op_clear_queued(key, "published-elsewhere"))
    monkeypatch.setattr(broker_check, "MOST_MESSAGES", 1)  # more than 1 message: not read
    first = task.apply_async(("long",))
    assert celery_app.app.control.purge() == 1
    task.apply_async(("other-1",))
    task.apply_async(("other-2",))
    assert task.apply_async(("long",)).id == first.id  # purged, but the queue is "too long"
    monkeypatch.setattr(broker_check, "MOST_MESSAGES", 1000)
    assert task.apply_async(("long",)).id != first.id  # read now: gone
    celery_app.app.control.purge()


def test_a_message_in_a_priority_list_counts(
    broker: None, redis_server: RedisServer, look_every_time: None
) -> None:
    # kombu keeps a Redis queue in one list per priority step ("<queue>\x06\x166"...): the
    # look covers them all, and a purge of them frees the key.
    task = celery_tasks.deduped
    queue = "prioritised"
    first = task.apply_async(("prio",), queue=queue, priority=6)
    lists = redis_server.client(db=1).keys(f"{queue}*")
    assert lists == [f"{queue}\x06\x166".encode()]  # not the base list
    assert task.apply_async(("prio",), queue=queue, priority=6).id == first.id
    _purge("channel", queue, redis_server)
    assert task.apply_async(("prio",), queue=queue, priority=6).id != first.id
    _purge("channel", queue, redis_server)


def test_only_a_plainly_routed_call_is_noted_as_sent(broker: None) -> None:
    # A routing key of the call's own may send the message to another queue than the one
    # routed by name: noted as sent to no queue, so the marker is obeyed (never taken for
    # gone).
    from django_redlock.contrib.celery import sent_name

    task = celery_tasks.deduped
    backend = locks["default"]
    plain = task.apply_async(("routed",), queue="routed")
    assert backend.execute(backend.op_read_queued(sent_name("dedupe:routed", plain.id)))[0] == (
        "routed"
    )
    keyed = task.apply_async(("keyed",), queue="routed", routing_key="elsewhere")
    assert backend.execute(backend.op_read_queued(sent_name("dedupe:keyed", keyed.id)))[0] == ""
    celery_app.app.control.purge()
    assert task.apply_async(("keyed",), queue="routed").id == keyed.id  # obeyed


def test_a_call_meeting_a_publish_in_progress_that_fails_is_queued(
    broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # P1 marked the key and publishes; P2's delay() meets that marker; P1's publish then
    # fails (P1 clears its marker and raises). P2 was deduplicated to P1's task, which was
    # never published: P2's call lost, silently.
    import threading

    from celery import Task

    task = celery_tasks.deduped
    name = uuid.uuid4().hex[:8]
    in_flight = threading.Event()
    real = Task.apply_async
    failed: list[BaseException] = []

    def publish(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if threading.current_thread().name == f"p1-{name}":
            in_flight.set()
            time.sleep(0.5)  # P2 meets the marker meanwhile
            raise OperationalError("the broker's connection was reset during the publish")
        return real(self, args, kwargs, **options)

    def producer() -> None:
        try:
            task.apply_async((name,), queue=NOBODY)
        except OperationalError as exc:
            failed.append(exc)

    monkeypatch.setattr(Task, "apply_async", publish)
    p1 = threading.Thread(target=producer, name=f"p1-{name}")
    p1.start()
    assert in_flight.wait(10)
    started = time.monotonic()
    second = task.apply_async((name,), queue=NOBODY)
    waited = time.monotonic() - started
    p1.join(10)
    monkeypatch.undo()
    assert failed  # P1 was told
    sent = [json.loads(raw)["headers"]["id"]
            for raw in redis_server.client(db=1).lrange(NOBODY, 0, -1)]  # fmt: skip
    assert second.id in sent  # P2's call was published
    assert waited < SingleInstanceTask.publish_wait  # it learned of the failure, not a timeout
    celery_app.app.control.purge()


def test_a_marker_never_published_is_queued_anew_after_the_publish_wait(
    broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The producer died between its mark and its publish: the marker names a message that
    # never comes. The next delay() waits for that publish (publish_wait), then queues; the
    # call after it deduplicates to that one. (Obeyed, every call was lost for the TTL.)
    monkeypatch.setattr(SingleInstanceTask, "publish_wait", 0.3, raising=False)
    task = celery_tasks.deduped
    backend = locks["default"]
    name = uuid.uuid4().hex[:8]
    backend.execute(backend.op_mark_queued(task.lock_key(name), "never-published", 60_000))
    started = time.monotonic()
    queued = task.apply_async((name,), queue=NOBODY)
    assert 0.3 <= time.monotonic() - started < 5
    assert queued.id != "never-published"
    sent = [json.loads(raw)["headers"]["id"]
            for raw in redis_server.client(db=1).lrange(NOBODY, 0, -1)]  # fmt: skip
    assert queued.id in sent
    assert task.apply_async((name,), queue=NOBODY).id == queued.id
    celery_app.app.control.purge()


def test_coalesce_runs_the_note_when_the_follow_up_cannot_be_published(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # The broker refused the follow-up at the run's end: the run's own outcome stands (no
    # OperationalError in its place), and the noted call still runs, with no other call of
    # the key (it waited, renewed for ever, for one): the worker's main process queues it.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    ran = f"coalesce-flaky:{name}:ran"
    first = prefork.send(celery_tasks.coalesced_flaky, name, "t0", 1.5)
    wait_for(lambda: r.lrange(ran, 0, -1))
    value = prefork.send(celery_tasks.coalesced_flaky, name, "t1", 0.1).get(timeout=30)
    assert value["coalesced"] is True
    r.set("flaky-publish", 1)
    assert first.get(timeout=30) == "ran"
    wait_for(lambda: not r.exists("flaky-publish"))  # the follow-up's publish was refused
    wait_for(lambda: r.lrange(ran, 0, -1) == ["t0", "t1"], timeout=15)
    wait_for(lambda: markers.read(locks["default"], f"coalesce-flaky:{name}:coalesce") is None)


def test_coalesce_a_revoked_follow_up_s_call_stays_cancelled_past_dedupe_ttl(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # F, the follow-up running B, is revoked (no terminate: it goes on), then killed by its
    # hard time limit; the follow-up queued then found F's revoke gone (it lasted
    # dedupe_ttl) while F's claimed note, renewed all along, still held B: B ran again.
    from django_redlock.contrib.celery import revoked_name

    r = redis(redis_server)
    task, name = celery_tasks.coalesced_hard_limited, uuid.uuid4().hex[:8]
    ran, backend = f"coalesce-hard:{name}:ran", locks["default"]
    note = f"coalesce-hard:{name}:coalesce"
    try:
        first = prefork.send(task, name, "A", 1.0)
        wait_for(lambda: r.lrange(ran, 0, -1) == ["A"])
        assert prefork.send(task, name, "B", 30.0).get(timeout=30)["coalesced"] is True
        assert first.get(timeout=30) == "ran"
        wait_for(lambda: r.lrange(ran, 0, -1) == ["A", "B"])  # F runs B
        noted = markers.read(backend, note)
        assert noted is not None
        follow_up = json.loads(noted[0])["taken"]
        celery_app.app.control.revoke(follow_up)
        revoke = wait_for(lambda: markers.read(backend, revoked_name(follow_up)))
        # As if noted dedupe_ttl (1 s) ago (the app's longest dedupe_ttl sets it: 1 h here).
        markers.swap(backend, revoked_name(follow_up), revoke[0], revoke[0], 1000)
        wait_for(lambda: markers.read(backend, note) is None, timeout=20)  # killed at 3 s
        time.sleep(1.0)
        assert r.lrange(ran, 0, -1) == ["A", "B"], "the revoked call ran again"
    finally:
        r.set(f"coalesce-hard:{name}:release", 1)


def test_coalesce_follow_up_of_a_call_routed_by_exchange_and_routing_key(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # Both calls reach the worker's queue through an exchange of their own, by a routing key
    # that names no queue: the follow-up was published with that routing key as a queue name
    # (a new list nobody reads), and the coalesced call never ran.
    from kombu import Exchange, Queue

    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    ran = f"coalesce:{name}:ran"
    exchange = Exchange(f"media-{name}", type="direct")
    with celery_app.app.connection_for_write() as connection:
        bound = Queue(prefork.queue, exchange, routing_key="media.video")
        bound(connection.default_channel).declare()
    route = {"exchange": exchange.name, "routing_key": "media.video"}
    try:
        first = celery_tasks.coalesced.apply_async((name, "t0", 1.5), **route)
        wait_for(lambda: r.lrange(ran, 0, -1) == ["t0"])
        second = celery_tasks.coalesced.apply_async((name, "t1", 0.1), **route)
        assert second.get(timeout=30)["coalesced"] is True
        assert first.get(timeout=30) == "ran"
        wait_for(lambda: r.lrange(ran, 0, -1) == ["t0", "t1"], timeout=15)
    finally:
        redis_server.client(db=1).delete("media.video")


@pytest.mark.parametrize("task_name", ["retry_slow_release", "retry_slow_release_limited"])
def test_a_retry_whose_earlier_attempt_releases_after_the_ttl_runs(
    task_name: str, prefork: Worker, redis_server: RedisServer
) -> None:
    # Attempt 0 publishes its retry, then cleans up for 2.5 s (TTL 1 s) on its way out. The
    # retry gave up its wait at the TTL and took itself for a copy of attempt 0: Ignore'd,
    # and the task stayed RETRY for ever.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    result = prefork.send(getattr(celery_tasks, task_name), name)
    assert result.get(timeout=20) == "done"
    group = "retry-slow-limited" if task_name.endswith("limited") else "retry-slow"
    assert r.lrange(f"{group}:{name}:ran", 0, -1) == ["0", "1"]


def test_callers_racing_past_a_purged_marker_get_one_new_task(
    broker: None, look_every_time: None
) -> None:
    # Six callers find the marker's message gone at once. Whoever replaces the marker first
    # queues; the others obey the new marker. None gets the purged task's id, and one new
    # message is queued.
    import threading

    task = celery_tasks.deduped
    first = task.apply_async(("race",))
    assert celery_app.app.control.purge() == 1
    got: list[str] = []
    start = threading.Barrier(6)

    def call() -> None:
        start.wait()
        got.append(task.apply_async(("race",)).id)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(got) == 6 and first.id not in got
    assert len(set(got)) == 1
    assert celery_app.app.control.purge() == 1


def test_a_message_the_broker_lost_no_longer_counts(
    broker: None, redis_server: RedisServer, look_every_time: None
) -> None:
    # The broker's Redis lost the queue (a restart without persistence, a failover to a
    # replica that had not got it, someone's DEL): nobody was told, as with a purge. (Only
    # that queue's list goes here: the module's worker keeps its own keys on that Redis.)
    task = celery_tasks.deduped
    first = task.apply_async(("lost",), queue="lost")
    assert task.apply_async(("lost",), queue="lost").id == first.id
    assert redis_server.client(db=1).delete("lost") == 1
    again = task.apply_async(("lost",), queue="lost")
    assert again.id != first.id
    assert task.apply_async(("lost",), queue="lost").id == again.id


@pytest.fixture(scope="module")
def wide(start_worker: Callable[..., Worker]) -> Worker:
    return start_worker(pool="prefork", concurrency=4)


def test_coalesce_duplicates_noting_after_the_run_ended_make_one_more_run(
    wide: Worker, redis_server: RedisServer
) -> None:
    # Two duplicates find the key held; the run ends before either wrote its note. The
    # first note (t1) queues the follow-up, which starts late (held back 0.3 s); the second
    # (t2) is written 0.15 s after the first, while that follow-up waits: it must not queue
    # another run. Exactly one more run follows, with the arguments of the note written last.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    first = wide.send(celery_tasks.coalesced_late, name, "t0", 0.5)
    wait_for(lambda: r.lrange(f"coalesce-late:{name}:ran", 0, -1))
    moment = time.time() + 1.5
    r.set("coalesce-late-pause-until:t1", moment)
    r.set("coalesce-late-pause-until:t2", moment + 0.15)
    try:
        duplicates = [wide.send(celery_tasks.coalesced_late, name, f"t{i}", 0.3) for i in (1, 2)]
        assert first.get(timeout=30) == "ran"
        time.sleep(0.5)  # both duplicates wait to write their notes
        r.set("coalesce-late-start-after", moment + 0.3)
        for each in duplicates:
            assert each.get(timeout=30)["coalesced"] is True
        wait_for(lambda: len(r.lrange(f"coalesce-late:{name}:ran", 0, -1)) >= 2)
    finally:
        r.delete("coalesce-late-pause-until:t1", "coalesce-late-pause-until:t2")
        r.delete("coalesce-late-start-after")
    wait_for(lambda: not locks["default"].is_locked(f"coalesce-late:{name}"))
    time.sleep(1.5)  # nothing more follows
    assert r.lrange(f"coalesce-late:{name}:ran", 0, -1) == ["t0", "t2"]
    assert r.lrange(f"coalesce-late:{name}:coalesce:noted", 0, -1) == ["t1", "t2"]
    assert int(r.get(f"coalesce-late:{name}:peak")) == 1


def test_coalesce_behind_a_plain_lock_runs_once_it_is_free(
    wide: Worker, redis_server: RedisServer
) -> None:
    # The key is held by a plain lock() (no run of the task, whose end would queue the
    # follow-up): the noted call runs once the lock is free (looked at every countdown).
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    with lock(f"coalesce-late:{name}", ttl=30):
        value = wide.send(celery_tasks.coalesced_late, name, "t1", 0.1).get(timeout=30)
        assert value["coalesced"] is True
        time.sleep(1.5)
        assert r.lrange(f"coalesce-late:{name}:ran", 0, -1) == []
    wait_for(lambda: r.lrange(f"coalesce-late:{name}:ran", 0, -1) == ["t1"], timeout=15)
    time.sleep(1.0)
    assert r.lrange(f"coalesce-late:{name}:ran", 0, -1) == ["t1"]


def test_coalesce_with_dedupe_queued_runs_the_last_call_s_arguments(
    wide: Worker, redis_server: RedisServer
) -> None:
    # While the key runs, one call is queued; later calls dedupe to it and their arguments
    # are not dropped: the queued run runs the last call's.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    first = wide.send(celery_tasks.coalesced_deduped, name, "t0", 2.0)
    wait_for(lambda: r.lrange(f"coalesce-dd:{name}:ran", 0, -1))
    # (A countdown keeps the queued call waiting while the next one is made.)
    second = wide.send(celery_tasks.coalesced_deduped, name, "t1", 0.1, countdown=1)
    third = wide.send(celery_tasks.coalesced_deduped, name, "t2", 0.1, countdown=1)
    assert third.id == second.id  # deduplicated to the queued call
    assert first.get(timeout=30) == "ran"
    wait_for(lambda: len(r.lrange(f"coalesce-dd:{name}:ran", 0, -1)) == 2)
    wait_for(lambda: not locks["default"].is_locked(f"coalesce-dd:{name}"))
    time.sleep(1.0)  # nothing more follows
    assert r.lrange(f"coalesce-dd:{name}:ran", 0, -1) == ["t0", "t2"]


def test_a_message_taken_by_a_worker_whose_run_starts_late_still_counts(
    prefork: Worker, redis_server: RedisServer, look_every_time: None
) -> None:
    # Acknowledged as its child took it, and its run takes the key 2.5 s later: meanwhile
    # the message is neither in the queue, nor unacknowledged, nor holding the key. Not gone:
    # a delay() then is deduplicated to it, and the body runs once.
    broker = redis_server.client(db=1, decode_responses=True)
    name = uuid.uuid4().hex[:8]
    first = prefork.send(celery_tasks.deduped_slow_start, name)
    # Its child took it (accepted: acknowledged) and waits 2.5 s before the run.
    wait_for(lambda: redis(redis_server).get(f"dedupe-slow-started:{first.id}"))
    assert broker.llen(prefork.queue) == 0
    # The worker acknowledges a moment after its child took the message.
    wait_for(lambda: not any(first.id in v for v in broker.hvals("unacked")), timeout=2)
    assert not locks["default"].is_locked(f"dedupe-slow:{name}")
    assert prefork.send(celery_tasks.deduped_slow_start, name).id == first.id
    assert first.get(timeout=30) == "ran"
    time.sleep(0.5)
    assert redis(redis_server).lrange(f"dedupe-slow:{name}:ran", 0, -1) == [first.id]


# -- coalesce: the follow-up mark never outlives the message it names --------------------------


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.nesting")
@single_instance(key="nesting:{name}", ttl=10, on_duplicate="coalesce")
def nesting(self: Any, name: str, tag: str, duplicate: str | None = None) -> str:
    if duplicate is not None:  # a duplicate arrives while the key runs (as from a 2nd worker)
        nesting.apply((name, duplicate), task_id=f"dup-{duplicate}-{uuid.uuid4().hex[:6]}")
    return tag


def follow_ups(redis_server: RedisServer, name: str) -> list[str]:
    """The ``nesting`` follow-ups of ``name`` waiting in the default queue (no worker reads
    it): their arguments' tags."""
    import json

    found = []
    for raw in redis_server.client(db=1).lrange("celery", 0, -1):
        message = json.loads(raw)
        headers = message["headers"]
        if headers.get("redlock_follow_up") and f"'{name}'" in headers.get("argsrepr", ""):
            found.append(headers["argsrepr"])
    return found


def test_coalesce_follow_up_purged_from_the_broker_no_longer_counts(
    broker: None, redis_server: RedisServer
) -> None:
    # A run's duplicate queued a follow-up; the queue is purged. Its mark names a message
    # that is gone: the next run's duplicate must queue one again, not obey it for an hour.
    name = uuid.uuid4().hex[:8]
    nesting.apply((name, "t0", "t1"))
    assert follow_ups(redis_server, name) == [f"('{name}', 't1')"]
    celery_app.app.control.purge()
    nesting.apply((name, "t2", "t3"))
    assert follow_ups(redis_server, name) == [f"('{name}', 't3')"]
    celery_app.app.control.purge()


def test_coalesce_soft_time_limit_between_the_mark_and_the_publish(
    broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SoftTimeLimitExceeded (a signal handler: any line) after the follow-up was marked and
    # before it was published: the mark must not stay naming a message never sent (every
    # later run would obey it, and the noted call would not run for an hour).
    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    strikes = [1]
    read_note = contrib.read_note

    def reading(text: str) -> Any:  # the first line after the mark reads the note
        if strikes:
            strikes.pop()
            raise SoftTimeLimitExceeded("soft time limit")
        return read_note(text)

    monkeypatch.setattr(contrib, "read_note", reading)
    failed = nesting.apply((name, "t0", "t1"))
    assert not strikes
    assert isinstance(failed.result, SoftTimeLimitExceeded)
    assert follow_ups(redis_server, name) == [f"('{name}', 't1')"]  # by the failure's handler
    celery_app.app.control.purge()


@pytest.mark.parametrize("outcome", ["written", "unknown"])
def test_coalesce_soft_time_limit_inside_the_follow_up_mark(
    outcome: str, broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SoftTimeLimitExceeded as the follow-up's mark is written (its reply not yet read): the
    # mark stood for no message, and the failure handler obeyed it: the noted call was lost.
    # "unknown": the mark's clear fails too; the same process must still not obey it.
    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers

    name = uuid.uuid4().hex[:8]
    mark_name = f"nesting:{name}:coalesce:next"
    strikes, clears = [1], [1] if outcome == "unknown" else []
    real_mark, real_clear = markers.mark, markers.clear

    def mark(backend: Any, name: str, *args: Any) -> Any:
        done = real_mark(backend, name, *args)
        if name == mark_name and strikes:
            strikes.pop()
            raise SoftTimeLimitExceeded("soft time limit")
        return done

    def clear(backend: Any, name: str, *args: Any) -> Any:
        if name == mark_name and clears:
            clears.pop()
            raise LockError("no reply")
        return real_clear(backend, name, *args)

    monkeypatch.setattr(markers, "mark", mark)
    monkeypatch.setattr(markers, "clear", clear)
    failed = nesting.apply((name, "t0", "t1"))
    assert not strikes and not clears
    assert isinstance(failed.result, SoftTimeLimitExceeded)
    assert follow_ups(redis_server, name) == [f"('{name}', 't1')"]  # by the failure's handler
    celery_app.app.control.purge()


def test_coalesce_follow_up_that_ran_leaves_no_sent_note(
    broker: None, redis_server: RedisServer
) -> None:
    # The note that a follow-up's message was sent only vouches for its mark: once the
    # follow-up took the key (its mark cleared), it stayed for dedupe_ttl (an hour) anyway.
    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    nesting.apply((name, "t0", "t1"))
    (raw,) = redis_server.client(db=1).lrange("celery", 0, -1)
    follow_id = json.loads(raw)["headers"]["id"]
    sent = contrib.sent_name(f"nesting:{name}:coalesce:next", follow_id)
    assert markers.read(locks["default"], sent) is not None
    celery_app.app.control.purge()
    ran = nesting.apply((name, "t1"), task_id=follow_id, headers={contrib.FOLLOW_UP: "1"})
    assert ran.result == "t1"
    assert markers.read(locks["default"], sent) is None


def test_coalesce_mark_of_a_follow_up_never_sent_goes_stale(
    broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A queuer SIGKILLed between the mark and the publish: no handler runs. A mark never noted
    # as sent is stale after FOLLOW_UP_PUBLISH_GRACE: a later run queues the noted call.
    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    key = f"nesting:{name}"
    backend = locks["default"]
    contrib.note_call(nesting.run.__redlock__, key, [name, "t1"], {}, None, None)
    markers.mark(backend, f"{key}:coalesce:next", "never-sent", 3_600_000)
    nesting.apply((name, "t2"))  # a run's end: the mark is young, obeyed
    assert follow_ups(redis_server, name) == []
    monkeypatch.setattr(contrib, "FOLLOW_UP_PUBLISH_GRACE", 0.0)
    time.sleep(0.01)
    nesting.apply((name, "t3"))
    assert follow_ups(redis_server, name) == [f"('{name}', 't1')"]
    celery_app.app.control.purge()


RETRIED: list[str] = []


@shared_task(bind=True, max_retries=1, name="tests.celery.test_celery_dedupe.retrying")
@single_instance(key="retrying:{name}", ttl=10, on_duplicate="coalesce")
def retrying(self: Any, name: str, tag: str) -> str:
    RETRIED.append(f"{tag}:{self.request.retries}")
    if self.request.retries == 0:
        raise self.retry(countdown=0)  # a transient error: run this call again
    return tag


def test_coalesce_follow_up_s_retry_runs_the_noted_call(broker: None) -> None:
    # A follow-up queued with call B runs the call noted last, D. Its self.retry() must run D
    # again, not its own message's superseded B.
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    RETRIED.clear()
    config = retrying.run.__redlock__
    contrib.note_call(config, f"retrying:{name}", [name, "D"], {}, None, None)
    retrying.apply((name, "B"), headers={"redlock_follow_up": "1"})
    assert RETRIED == ["D:0", "D:1"]


def test_coalesce_note_of_a_run_whose_whole_worker_was_killed_runs(
    start_worker: Callable[..., Worker], redis_server: RedisServer, tmp_path: Any
) -> None:
    # The whole worker (main process and children) is SIGKILLed while the run holds the key
    # and a duplicate's call is noted: no end of the run, no main process queues it. A worker
    # started later on that queue finds the note left and runs it (once the dead hold, TTL
    # 3 s, is gone).
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    task = celery_tasks.coalesced_short_ttl
    dead = start_worker(pool="prefork", concurrency=2)
    first = dead.send(task, name, "t0", 40.0)
    wait_for(lambda: r.lrange(f"coalesce-short:{name}:ran", 0, -1))
    value = dead.send(task, name, "t1", 0.1).get(timeout=30)
    assert value["coalesced"] is True
    dead.kill()
    assert first.id
    later = Worker(redis_server.url, "solo", 1, dead.queue, tmp_path / "later.log")
    try:
        ran = f"coalesce-short:{name}:ran"
        wait_for(lambda: r.lrange(ran, 0, -1) == ["t0", "t1"], timeout=45)
    finally:
        later.stop()


def test_a_queued_task_revoked_no_longer_counts(broker: None, look_every_time: None) -> None:
    # Revoked while it waits in the queue (no worker has reached it: a busy worker discards it
    # only after its run): the next delay() queues, not returns the revoked task's result.
    task = celery_tasks.deduped
    name = uuid.uuid4().hex[:8]
    first = task.apply_async((name,))
    assert task.apply_async((name,)).id == first.id
    celery_app.app.control.revoke(first.id)
    again = task.apply_async((name,))
    assert again.id != first.id
    assert task.apply_async((name,)).id == again.id
    again.revoke()  # AsyncResult.revoke goes through the app's control too
    assert task.apply_async((name,)).id not in (first.id, again.id)
    celery_app.app.control.purge()


@pytest.mark.parametrize("sent_by", ["this app", "elsewhere"])
def test_a_queued_task_revoked_by_stamped_headers_no_longer_counts(
    sent_by: str, request: pytest.FixtureRequest, look_every_time: None
) -> None:
    # A stamped revoke (no terminate) of a queued message stores nothing and notes no id: the
    # next delay() was deduplicated to the revoked message, which the worker discards: the
    # new call never ran. "elsewhere": the command reaches a worker (celery control, another
    # app), which notes the stamps.
    task = celery_tasks.deduped
    name, stamp = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    first = task.apply_async((name,), stamped_headers=["rlstamp"], rlstamp=stamp, queue=NOBODY)
    assert task.apply_async((name,), queue=NOBODY).id == first.id
    if sent_by == "this app":
        celery_app.app.control.revoke_by_stamped_headers({"rlstamp": stamp})
    else:
        request.getfixturevalue("prefork")  # a worker of the app, idle between tests
        replies = celery_app.app.control.broadcast(
            "revoke_by_stamped_headers", arguments={"headers": {"rlstamp": stamp}}, reply=True
        )
        assert replies, "no worker answered"
    again = task.apply_async((name,), queue=NOBODY)
    assert again.id != first.id, "deduplicated to the revoked message"
    assert task.apply_async((name,), queue=NOBODY).id == again.id  # the new one counts
    celery_app.app.control.purge()


@pytest.mark.parametrize("how", ["revoke", "revoke by a worker", "stamp", "stamp by a worker"])
def test_a_revoke_of_a_call_waiting_longer_than_dedupe_ttl_lasts_as_its_marker(
    how: str, broker: None, request: pytest.FixtureRequest
) -> None:
    # Its countdown is longer than dedupe_ttl: the revoke's note lasted dedupe_ttl, its
    # marker countdown + dedupe_ttl; in between, a delay() was folded into the revoked call
    # (discarded at its ETA: the new call never ran). "by a worker": the command reaches a
    # worker (celery control, another app), which notes it.
    from django_redlock.contrib.celery import revoked_name, revoked_stamp_name

    task = celery_tasks.deduped
    name, stamp = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    first = task.apply_async(
        (name,), countdown=7200, queue=NOBODY, stamped_headers=["rlstamp"], rlstamp=stamp
    )
    key = task.lock_key(name)
    marker = markers.read(locks["default"], key)
    assert marker is not None and marker[0] == first.id
    if how.endswith("by a worker"):
        request.getfixturevalue("prefork")  # a worker of the app, idle between tests
        command, arguments = (
            ("revoke", {"task_id": first.id})
            if how.startswith("revoke")
            else ("revoke_by_stamped_headers", {"headers": {"rlstamp": stamp}})
        )
        assert celery_app.app.control.broadcast(command, arguments=arguments, reply=True)
    elif how == "revoke":
        celery_app.app.control.revoke(first.id)
    else:
        celery_app.app.control.revoke_by_stamped_headers({"rlstamp": stamp})
    note = revoked_name(first.id) if how.startswith("revoke") else revoked_stamp_name(
        "rlstamp", stamp
    )  # fmt: skip
    revoke = wait_for(lambda: markers.read(locks["default"], note))
    assert revoke[1] >= marker[1] - 60_000, "the revoke ends before its marker"
    again = task.apply_async((name,), queue=NOBODY)
    assert again.id != first.id
    celery_app.app.control.purge()


EAGER_RUNS: list[str] = []


@shared_task(bind=True, acks_late=True, name="tests.celery.test_celery_dedupe.late_eager")
@single_instance(key="late-eager:{name}", ttl=10)
def late_eager(self: Any, name: str) -> str:
    EAGER_RUNS.append(self.request.id)
    return "ran"


def test_an_eager_run_of_an_acks_late_task_runs_again_under_its_id(broker: None) -> None:
    # apply() has no message the broker could put back: the "done" note of acks_late runs
    # does not make a second apply() of the same id a redelivered copy.
    EAGER_RUNS.clear()
    task_id = f"eager-{uuid.uuid4().hex[:6]}"
    assert late_eager.apply(("e",), task_id=task_id).result == "ran"
    assert late_eager.apply(("e",), task_id=task_id).result == "ran"
    assert [task_id, task_id] == EAGER_RUNS


# -- coalesce: a noted call survives until a follow-up's body ran it --------------------------


def _interrupt_after_note_writes(monkeypatch: pytest.MonkeyPatch, key: str) -> list[int]:
    """Raise SoftTimeLimitExceeded (as a signal handler does: at any line) right after the
    first write (a delete or a replace) of ``key``'s coalesce note; the list empties then."""
    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers

    strikes = [1]
    for op in ("clear", "swap"):
        real = getattr(markers, op, None)
        if real is None:
            continue

        def interrupted(backend: Any, name: str, *args: Any, real: Any = real) -> Any:
            done = real(backend, name, *args)
            if name == f"{key}:coalesce" and strikes:
                strikes.pop()
                raise SoftTimeLimitExceeded("soft time limit")
            return done

        monkeypatch.setattr(markers, op, interrupted)
    return strikes


def test_coalesce_a_note_replaced_by_a_later_one_is_never_gone_in_between(
    broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # D1 was coalesced (its caller told so); D2's note replaces it, and a soft time limit
    # strikes in between: one of the two calls must stay noted (it was: neither).
    import json

    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    key = f"nesting:{name}"
    config = nesting.run.__redlock__
    contrib.note_call(config, key, [name, "d1"], {}, None, "d1")
    strikes = _interrupt_after_note_writes(monkeypatch, key)
    with pytest.raises(SoftTimeLimitExceeded):
        contrib.note_call(config, key, [name, "d2"], {}, None, "d2")
    assert not strikes
    monkeypatch.undo()
    noted = markers.read(locks["default"], f"{key}:coalesce")
    assert noted is not None, "both calls lost"
    assert json.loads(noted[0])["args"] in ([name, "d1"], [name, "d2"])


def test_coalesce_follow_up_interrupted_before_its_body_leaves_the_call_to_run(
    broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A follow-up takes the noted call, then a soft time limit strikes before its body ran:
    # the call must stay noted, with a follow-up queued to run it (it was deleted: lost).
    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    key = f"nesting:{name}"
    contrib.note_call(nesting.run.__redlock__, key, [name, "d1"], {}, None, "d1")
    strikes = _interrupt_after_note_writes(monkeypatch, key)
    failed = nesting.apply((name, "f"), task_id=f"f-{name}", headers={contrib.FOLLOW_UP: "1"})
    assert not strikes
    assert isinstance(failed.result, SoftTimeLimitExceeded)
    monkeypatch.undo()
    assert markers.read(locks["default"], f"{key}:coalesce") is not None
    assert follow_ups(redis_server, name) == [f"('{name}', 'd1')"]
    celery_app.app.control.purge()


@pytest.mark.parametrize(
    "where", [("_run.<locals>.body_for", "return func("), ("_settling.<locals>.run", "body()")]
)
def test_coalesce_follow_up_interrupted_on_the_way_into_its_body_keeps_the_call(
    where: tuple[str, str], broker: None, redis_server: RedisServer
) -> None:
    # A soft time limit at a library line between taking the note and the body's first
    # frame (the follow-up's body_for, the call of it): the body never ran, so the call must
    # stay noted, with a follow-up queued (it was deleted: lost).
    import linecache

    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    key = f"nesting:{name}"
    qualname, text = where
    strikes = [1]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_qualname != qualname or frame.f_code.co_filename != contrib.__file__:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            if event == "line" and text in line and strikes:
                strikes.pop()
                raise SoftTimeLimitExceeded("soft time limit")
            return local

        return local

    contrib.note_call(nesting.run.__redlock__, key, [name, "d1"], {}, None, "d1")
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        failed = nesting.apply((name, "f"), task_id=f"f-{name}", headers={contrib.FOLLOW_UP: "1"})
    finally:
        sys.settrace(previous)
    assert not strikes
    assert isinstance(failed.result, SoftTimeLimitExceeded)
    assert markers.read(locks["default"], f"{key}:coalesce") is not None
    assert follow_ups(redis_server, name) == [f"('{name}', 'd1')"]
    celery_app.app.control.purge()


COUNTED_RUNS: list[str] = []


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.counted")
@single_instance(key="counted:{name}", ttl=10, on_duplicate="coalesce")
def counted(self: Any, name: str, tag: str) -> str:
    COUNTED_RUNS.append(tag)
    return tag


@pytest.mark.parametrize("where", ["drop", "returned"])
def test_coalesce_time_limit_after_the_follow_up_s_body_returned_runs_the_call_once(
    broker: None, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A soft time limit once the follow-up's body returned: on the note's delete ("drop"), or
    # on the line right after the body ("returned"). The traceback had no frame of the body,
    # so it "never started": the note was kept, and the next follow-up ran the call again.
    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    key = f"counted:{name}"
    COUNTED_RUNS.clear()
    contrib.note_call(counted.run.__redlock__, key, [name, "d1"], {}, None, "d1")
    monkeypatch.setattr(contrib, "_queue_follow_up", lambda *args, **kwargs: None)
    strikes = [1]
    if where == "drop":
        clear = markers.clear

        def interrupted(backend: Any, marker: str, *args: Any) -> Any:
            if marker == f"{key}:coalesce" and strikes:
                strikes.pop()
                raise SoftTimeLimitExceeded("soft time limit")  # before the delete is sent
            return clear(backend, marker, *args)

        monkeypatch.setattr(markers, "clear", interrupted)
        tracer = None
    else:
        run = contrib._settling(counted.run.__redlock__, lambda: None, contrib._Ending())
        code = run.__code__
        source, first = inspect.getsourcelines(code)
        line = first + next(i for i, text in enumerate(source) if "ending.returned = True" in text)

        def on_line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == line and strikes:
                strikes.pop()
                raise SoftTimeLimitExceeded("soft time limit")
            return on_line

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            # By name: in a full run the task's module object may not be this one (seen).
            found = frame.f_code
            same = (found.co_qualname, found.co_filename) == (code.co_qualname, code.co_filename)
            return on_line if same and strikes else None

    sys.settrace(tracer)
    try:
        first_run = counted.apply((name, "f"), task_id=f"f1-{name}",
                                  headers={contrib.FOLLOW_UP: "1"})  # fmt: skip
    finally:
        sys.settrace(None)
    assert not strikes and isinstance(first_run.result, SoftTimeLimitExceeded), first_run.result
    counted.apply((name, "f"), task_id=f"f2-{name}", headers={contrib.FOLLOW_UP: "1"})
    assert COUNTED_RUNS == ["d1"]
    assert markers.read(locks["default"], f"{key}:coalesce") is None


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.fenced_coalesced")
@single_instance(key="fenced-coalesced:{name}", ttl=10, on_duplicate="coalesce", atomic="default")
def fenced_coalesced(self: Any, name: str, tag: str) -> bool:
    from ..support.fenced_child import sell_one

    return sell_one("default", 1, tag)


@pytest.mark.django_db(transaction=True)
def test_coalesce_fenced_follow_up_stopped_at_its_commit_leaves_the_call_to_run(
    broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fenced follow-up runs the noted call d1; its process stops as Django sends the
    # COMMIT (SIGKILL, OOM: here SystemExit, the transaction rolled back): nothing committed.
    # It had deleted the note inside its transaction, before the COMMIT: the next follow-up
    # found nothing to run, and d1 was lost.
    from django.db.backends.base.base import BaseDatabaseWrapper

    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    from ..support.fenced_child import open_shop, sales

    open_shop("default", 1, 5)
    name = uuid.uuid4().hex[:8]
    note = f"fenced-coalesced:{name}:coalesce"
    contrib.note_call(fenced_coalesced.run.__redlock__, note[: -len(":coalesce")],
                      [name, "d1"], {}, None, "d1", fenced_coalesced.name)  # fmt: skip
    at_commit: list[bool] = []

    def stopped(self: Any) -> None:
        at_commit.append(markers.read(locks["default"], note) is not None)
        self.connection.rollback()  # as the server does for a process that died
        raise SystemExit(1)

    monkeypatch.setattr(BaseDatabaseWrapper, "commit", stopped)
    with pytest.raises(SystemExit):
        fenced_coalesced.apply((name, "f1"), task_id=f"f1-{name}", headers={contrib.FOLLOW_UP: "1"})
    monkeypatch.undo()
    assert at_commit == [True] and sales("default") == []
    assert markers.read(locks["default"], note) is not None  # still noted: it runs
    celery_app.app.control.purge()
    fenced_coalesced.apply((name, "f2"), task_id=f"f2-{name}", headers={contrib.FOLLOW_UP: "1"})
    assert sales("default") == [("d1", 5)]
    assert markers.read(locks["default"], note) is None  # committed: the note went with it
    celery_app.app.control.purge()


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.stopping")
@single_instance(key="stopping:{name}", ttl=10, on_duplicate="coalesce")
def stopping(self: Any, name: str, tag: str) -> str:
    if tag == "stop":
        raise SystemExit(1)  # sys.exit() in a signal handler, mid-body
    return tag


def test_coalesce_follow_up_stopped_mid_body_leaves_the_call_to_run(
    broker: None, redis_server: RedisServer
) -> None:
    # SystemExit mid-body: Celery records nothing, the child exits (its message comes back,
    # or the main process queues a follow-up). The follow-up had deleted the note on its way
    # out: the next one found nothing, and the call was lost.
    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    note = f"stopping:{name}:coalesce"
    contrib.note_call(stopping.run.__redlock__, f"stopping:{name}", [name, "stop"], {}, None,
                      "d1", stopping.name)  # fmt: skip
    with pytest.raises(SystemExit):
        stopping.apply((name, "f"), task_id=f"f1-{name}", headers={contrib.FOLLOW_UP: "1"})
    assert markers.read(locks["default"], note) is not None
    celery_app.app.control.purge()


def test_coalesce_follow_up_whose_child_was_killed_runs_again(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # acks_late + reject_on_worker_lost: the follow-up's child is SIGKILLed mid-body; its
    # message comes back (as a plain task's does) and must find the call it was running.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    group = f"coalesce-lost:{name}"
    run = prefork.send(celery_tasks.coalesced_lost, name, "t0", 1.5)
    wait_for(lambda: r.lrange(f"{group}:ran", 0, -1))
    value = prefork.send(celery_tasks.coalesced_lost, name, "slow1").get(timeout=30)
    assert value["coalesced"] is True
    assert run.get(timeout=30) == "ran"
    slow = wait_for(lambda: [p for p in r.lrange(f"{group}:pids", 0, -1) if p.startswith("slow1:")])
    time.sleep(0.3)
    os.kill(int(slow[0].split(":")[1]), signal.SIGKILL)
    wait_for(lambda: r.lrange(f"{group}:ran", 0, -1).count("slow1") == 2, timeout=40)
    wait_for(lambda: not locks["default"].is_locked(group), timeout=10)
    assert r.lrange(f"{group}:ran", 0, -1) == ["t0", "slow1", "slow1"]


def _settled(worker: Worker) -> int:
    """How many tasks ``worker`` has finished (a skipped copy is "ignored")."""
    log = worker.log.read_text()
    return sum(log.count(end) for end in ("] succeeded in ", "] ignored\n", "] raised "))


@pytest.fixture(scope="module")
def redelivering(start_worker: Callable[..., Worker]) -> Iterator[tuple[Worker, Worker]]:
    # acks_late with a 2 s visibility timeout, one child each: shared by the tests below,
    # each of which leaves them idle (every copy taken).
    env = {"REDLOCK_TEST_REDELIVER": "1"}
    pair = (start_worker(pool="prefork", concurrency=1, **env),
            start_worker(pool="prefork", concurrency=1, **env))  # fmt: skip
    yield pair
    stop_all(pair)


def test_coalesce_copy_of_a_finished_follow_up_leaves_a_later_call_noted(
    redelivering: tuple[Worker, Worker], redis_server: RedisServer
) -> None:
    # acks_late: follow-up F1's message is put back while it runs; its copy is taken once F1
    # ended, after a later duplicate D2 noted its call. The copy is F1 again (skipped): it
    # must not take D2's note first (D2's call was lost). The runs end when the test says:
    # r once d1 was coalesced, F1 once D2 was noted and F1's copy is back in a's queue, the
    # blocker F2 waits behind once a has taken that copy.
    r = redis(redis_server)
    broker = redis_server.client(db=1)
    a, b = redelivering
    name = uuid.uuid4().hex[:8]
    ran = f"coalesce:{name}:ran"
    run = b.send(celery_tasks.coalesced, name, "r", 30.0)
    wait_for(lambda: r.lrange(ran, 0, -1))
    assert a.send(celery_tasks.coalesced, name, "d1", 30.0).get(timeout=30)["coalesced"]
    r.set(f"coalesce:{name}:r:release", 1, ex=60)
    wait_for(lambda: "d1" in r.lrange(ran, 0, -1), timeout=30)  # F1 runs d1 on a
    assert b.send(celery_tasks.coalesced, name, "d2", 0.1).get(timeout=30)["coalesced"]
    b.send(celery_tasks.occupy, f"{name}-blocker", 30.0)  # F2 waits behind
    wait_for(lambda: broker.llen(a.queue), timeout=30)  # F1's copy, put back
    settled = _settled(a)
    r.set(f"coalesce:{name}:d1:release", 1, ex=60)
    try:
        wait_for(lambda: _settled(a) >= settled + 2)  # F1 ended; a took its copy and settled it
    finally:
        r.set(f"occupy:{name}-blocker:release", 1, ex=60)
    wait_for(lambda: "d2" in r.lrange(ran, 0, -1), timeout=40)
    assert r.lrange(ran, 0, -1) == ["r", "d1", "d2"]
    assert run.get(timeout=5) == "ran"
    wait_for(lambda: r.lrange(f"occupy:{name}-blocker:ended", 0, -1))
    wait_for(lambda: not locks["default"].is_locked(f"coalesce:{name}"))


# One mode: the copy is recognised before on_duplicate is looked at, so "retry" and "skip"
# take the same line as "coalesce" (test_celery's acks_late copy is the default, "skip").
@pytest.mark.parametrize("mode", ["coalesce"])
def test_acks_late_copy_of_a_finished_run_meeting_another_holder_does_not_run_again(
    redelivering: tuple[Worker, Worker], redis_server: RedisServer, mode: str
) -> None:
    # The copy the broker put back while the run went on is taken after it ended, while a
    # plain lock() holds the key: it is that finished run (skipped), not a duplicate to note,
    # retry, or skip over the run's stored result.
    from celery.result import AsyncResult

    r = redis(redis_server)
    late = redelivering[0]
    task = getattr(celery_tasks, f"late_copy_{mode}")
    name = uuid.uuid4().hex[:8]
    group = f"late-copy-{mode}:{name}"
    result = late.send(task, name)
    wait_for(lambda: r.lrange(f"{group}:ran", 0, -1))
    other = lock(group, ttl=10)
    assert other.acquire(timeout=20)  # the moment the run releases
    assert result.get(timeout=10) == "ran"
    # The copy arrives and meets this lock(): known as the run that ended.
    wait_for(lambda: f"task {result.id} ran already" in late.log.read_text(), timeout=20)
    other.release()
    # A follow-up or retry of it (countdown 0.5 s) would run now: the same queue's next
    # task, due 1.5 s after the release, runs after it (one child); then a moment more.
    sentinel = late.send(celery_tasks.occupy, f"{name}-after", 0.0, countdown=1.5)
    assert sentinel.get(timeout=30) == "ran"
    time.sleep(1.0)
    assert r.lrange(f"{group}:ran", 0, -1) == [result.id]
    assert AsyncResult(result.id).get(timeout=5) == "ran"


# -- dedupe_queued: a marker whose write's reply was lost --------------------------------------


@shared_task(bind=True, base=SingleInstanceTask, name="tests.celery.test_celery_dedupe.deduped_cut")
@single_instance(key="dedupe-cut:{name}", ttl=5, using="cut", dedupe_queued=True)
def deduped_cut(self: Any, name: str) -> str:
    return name


def test_a_marker_whose_write_s_reply_was_lost_is_not_obeyed(
    broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server wrote the queue marker; its reply was lost with the connection: delay()
    # raises and publishes nothing. The marker names a message never sent: the next delay()
    # must queue (it returned that phantom's AsyncResult for the marker's hour).
    from django.conf import settings
    from django.test import override_settings

    from django_redlock.backends import markers
    from django_redlock.exceptions import LockError

    from ..support.proxy import LossyProxy

    proxy = LossyProxy(redis_server.port)
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": proxy.url}
    name = uuid.uuid4().hex[:8]
    real = markers.mark

    def lossy(backend: Any, marked: str, *args: Any) -> Any:
        if marked == f"dedupe-cut:{name}" and not proxy.lost:
            proxy.lose_replies(1)
        return real(backend, marked, *args)

    try:
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "cut": config}):
            # Connected, the script loaded: the reply lost is the mark's.
            assert markers.mark(locks["cut"], f"warm:{name}", "w", 1000) is None
            monkeypatch.setattr(markers, "mark", lossy)
            with pytest.raises(LockError):
                deduped_cut.apply_async((name,), queue=NOBODY)
            assert proxy.lost == 1
            monkeypatch.undo()
            second = deduped_cut.apply_async((name,), queue=NOBODY)
            assert markers.read(locks["cut"], f"dedupe-cut:{name}")[0] == second.id
            import json

            sent = [json.loads(raw)["headers"]["id"]
                    for raw in redis_server.client(db=1).lrange(NOBODY, 0, -1)]  # fmt: skip
            assert second.id in sent  # published: not the AsyncResult of a message never sent
    finally:
        proxy.close()


@shared_task(bind=True, base=SingleInstanceTask, name="tests.celery.test_celery_dedupe.refusing")
@single_instance(key="refusing:{name}", ttl=10, on_duplicate="coalesce", dedupe_queued="raise")
def refusing(self: Any, name: str, tag: str) -> str:
    return tag


def test_coalesce_with_dedupe_queued_raise_a_refused_call_never_replaces_the_queued_one(
    broker: None, redis_server: RedisServer
) -> None:
    # Call A is queued as the key's follow-up; call B is refused (AlreadyQueued): A must run
    # with its own arguments (B's replaced them in the note A's follow-up runs).
    from django_redlock.backends import markers
    from django_redlock.contrib.celery import AlreadyQueued

    name = uuid.uuid4().hex[:8]
    queued = refusing.apply_async((name, "a"), queue=NOBODY)
    with pytest.raises(AlreadyQueued) as caught:
        refusing.apply_async((name, "b"), queue=NOBODY)
    assert caught.value.task_id == queued.id
    note = f"refusing:{name}:coalesce"
    noted = markers.read(locks["default"], note)
    assert noted is not None
    markers.clear(locks["default"], note, noted[0])
    assert json.loads(noted[0])["args"] == [name, "a"]
    celery_app.app.control.purge()


def test_coalesce_poll_interrupted_as_its_mark_is_written_leaves_no_mark(
    broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A soft time limit as the poll's mark is written (its reply read, the message not yet
    # published): the mark named a poll never sent, and no poll was queued for its TTL.
    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    key = f"nesting:{name}"
    config = nesting.run.__redlock__
    contrib.note_call(config, key, [name, "d1"], {}, None, "d1")
    real_mark, strikes = markers.mark, [1]

    def mark(backend: Any, marker: str, *args: Any) -> Any:
        written = real_mark(backend, marker, *args)
        if marker == f"{key}:coalesce:poll" and strikes:
            strikes.pop()
            raise SoftTimeLimitExceeded("soft time limit")
        return written

    monkeypatch.setattr(markers, "mark", mark)
    with pytest.raises(SoftTimeLimitExceeded):
        contrib._queue_poll(config, nesting, key)
    monkeypatch.undo()
    assert not strikes
    assert markers.read(locks["default"], f"{key}:coalesce:poll") is None
    noted = markers.read(locks["default"], f"{key}:coalesce")
    assert noted is not None
    markers.clear(locks["default"], f"{key}:coalesce", noted[0])


@pytest.mark.parametrize("task_name", ["deduped", "coalesced_deduped"])
def test_an_interrupt_at_any_line_after_the_publish_leaves_the_call_deduplicated(
    task_name: str, broker: None, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The message was published; an interrupt (a soft time limit, a signal handler's
    # exception) at any later line of the delay() (noting it sent) left the marker without
    # its "sent" note: the next delay() took it for a publish in progress, waited
    # publish_wait and published a second message while the first was queued.
    from django_redlock.contrib.broker import PublishWatch
    from django_redlock.contrib.celery import SingleInstanceTask as Base
    from tests.support.line_interrupts import (
        LineInterrupter,
        every_point,
        interrupted,
        publish_path,
    )

    monkeypatch.setattr(SingleInstanceTask, "publish_wait", 0.3, raising=False)
    monkeypatch.setattr(SingleInstanceTask, "message_check_pause", 0.05, raising=False)
    task = getattr(celery_tasks, task_name)
    apply = Base.apply_async.__code__
    watched = {apply, Base._note_sent.__code__, markers.mark.__code__, *publish_path()}
    sender = celery_app.app.amqp.send_task_message.__code__
    queue = redis_server.client(db=1)

    def published(frame: Any) -> bool:  # from the moment the producer is entered
        if frame.f_code is PublishWatch.publish.__code__:
            return bool(frame.f_locals["self"].entered)
        return frame.f_code is sender and "ret" in frame.f_locals  # kombu's publish returned

    def case(tracer: LineInterrupter) -> None:
        # Inside kombu's publish the message may or may not be queued: either way the next
        # delay() leaves exactly one message (deduplicated to it, or queued as the only one).
        name = uuid.uuid4().hex[:8]
        before = queue.llen(NOBODY)
        extra = () if task_name == "deduped" else ("t1",)
        interrupted(lambda: task.apply_async((name, *extra), queue=NOBODY), tracer)
        taken = queue.llen(NOBODY) - before
        assert taken in (0, 1), tracer.fired
        first = json.loads(queue.lindex(NOBODY, 0))["headers"]["id"] if taken else None
        again = task.apply_async((name, *extra), queue=NOBODY)
        if taken:
            assert again.id == first, f"a second message, at {tracer.fired}"
        assert queue.llen(NOBODY) == before + 1, tracer.fired

    try:
        points = every_point(case, lambda at: LineInterrupter(at, watched, published))
    finally:
        celery_app.app.control.purge()
    assert len(points) >= 3, points


@pytest.mark.parametrize("follow_up_ends", ["during the publish", "across the take-back", ""])
def test_coalesce_a_failed_publish_never_puts_back_the_note_of_a_follow_up_that_ran(
    follow_up_ends: str, broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Follow-up A claimed its note and runs; B's delay() notes its call over A's claim and
    # publishes; A ends meanwhile (its drop finds B's note: nothing dropped); B's publish
    # raises, and B took its note back by putting A's claim back: A's call, which ran, was
    # noted again and the next worker start ran it a second time. A follow-up that did not
    # end (killed mid-run) must still find its claim put back (at least once). "across the
    # take-back": A's drop reads B's note (A's claim kept inside it) during the publish, and
    # drops its claim only once B took its note back.
    import threading

    from celery import Task

    from django_redlock.contrib.celery import _claim_note, _dropping_note, _Ending, _settle_claim

    task = celery_tasks.coalesced_deduped
    config = task.single_instance_config()
    name = uuid.uuid4().hex[:8]
    key, backend = f"coalesce-dd:{name}", locks["default"]
    note_call(config, key, (name, "A"), {}, None, None, task.name)
    claimed = _claim_note(config, key, "follow-up-a")
    assert claimed is not None
    ended = _Ending()
    ended.steps.append(_dropping_note(config, key, claimed[1], ended))

    drop = _settle_claim.__code__
    at_mark, go_on = threading.Event(), threading.Event()

    def held_at_the_mark(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not drop:
            return None

        def line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and "note" in frame.f_locals and not at_mark.is_set():
                at_mark.set()  # it read B's note: held before it drops its claim
                go_on.wait(10)
            return line

        return line

    def end_across() -> None:
        sys.settrace(held_at_the_mark)
        try:
            ended()
        finally:
            sys.settrace(None)

    ending = threading.Thread(target=end_across)

    def publish(self: Any, *args: Any, **options: Any) -> Any:
        if follow_up_ends == "during the publish":
            ended()  # A's run ends while B's publish hangs
        elif follow_up_ends:
            ending.start()
            assert at_mark.wait(10)
        raise OperationalError("the broker's connection was reset during the publish")

    monkeypatch.setattr(Task, "apply_async", publish)
    with pytest.raises(OperationalError):
        task.apply_async((name, "B"), queue=NOBODY)
    monkeypatch.undo()
    if follow_up_ends == "across the take-back":
        go_on.set()
        ending.join(10)
    noted = markers.read(backend, f"{key}:coalesce")
    if follow_up_ends:
        assert noted is None, json.loads(noted[0])  # A ran: nothing left to run
    else:
        assert noted is not None and noted[0] == claimed[1]  # A's call still to run
        ended()  # it ends later: its claim goes
        assert markers.read(backend, f"{key}:coalesce") is None


def test_coalesce_a_call_revoked_with_terminate_does_not_run_again(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # coalesce + dedupe_queued: every call is a follow-up that claims its own note. A revoke
    # with terminate=True stopped it; its claimed note stayed (as for a killed run, at least
    # once), and the stopped run's end queued a follow-up that ran the revoked call again
    # under a new task id. A revoke is a cancel: the call does not come back.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    first = prefork.send(celery_tasks.coalesced_deduped, name, "A", 4.0)
    wait_for(lambda: r.lrange(f"coalesce-dd:{name}:ran", 0, -1))
    celery_app.app.control.revoke(first.id, terminate=True)
    wait_for(lambda: not locks["default"].is_locked(f"coalesce-dd:{name}"))
    time.sleep(2.0)  # a follow-up, if queued, runs meanwhile
    assert r.lrange(f"coalesce-dd:{name}:ran", 0, -1) == ["A"]
    assert markers.read(locks["default"], f"coalesce-dd:{name}:coalesce") is None
    after = prefork.send(celery_tasks.coalesced_deduped, name, "B", 0.1)
    assert after.get(timeout=30) == "ran"  # the key works on


def test_coalesce_a_queued_call_revoked_before_it_runs_leaves_no_note(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # Revoked while queued (held for its countdown): the worker discards it, and its noted
    # call stayed, for the next run's end or the next worker start to run.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    queued = prefork.send(celery_tasks.coalesced_deduped, name, "Q", 0.1, countdown=1.5)
    celery_app.app.control.revoke(queued.id)
    wait_for(lambda: markers.read(locks["default"], f"coalesce-dd:{name}") is None)
    assert markers.read(locks["default"], f"coalesce-dd:{name}:coalesce") is None
    assert r.lrange(f"coalesce-dd:{name}:ran", 0, -1) == []


def test_coalesce_an_interrupt_at_any_line_of_the_take_back_never_restores_a_call_that_ran(
    broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above (A's follow-up ends during B's failing publish), with an interrupt at any
    # line of B's take-back of its note: the note left is none, or B's own (a take-back cut
    # short runs the failed call once: at least once), never A's claim (A ran).
    from celery import Task

    from django_redlock.contrib import celery as contrib
    from tests.support.line_interrupts import LineInterrupter, every_point, interrupted

    task = celery_tasks.coalesced_deduped
    config = task.single_instance_config()
    backend = locks["default"]
    window = contrib.unnote_call.__code__
    watched = {window, markers.swap.__code__, markers.read.__code__, markers.clear.__code__}
    if hasattr(contrib, "_drop_ended_claim"):  # (the test runs against older code too)
        watched.add(contrib._drop_ended_claim.__code__)

    def case(tracer: LineInterrupter) -> None:
        name = uuid.uuid4().hex[:8]
        key = f"coalesce-dd:{name}"
        note_call(config, key, (name, "A"), {}, None, None, task.name)
        claimed = contrib._claim_note(config, key, "follow-up-a")
        assert claimed is not None
        ended = contrib._Ending()
        ended.steps.append(contrib._dropping_note(config, key, claimed[1], ended))

        def publish(self: Any, *args: Any, **options: Any) -> Any:
            ended()  # A's run ends while B's publish hangs
            raise OperationalError("the broker's connection was reset during the publish")

        monkeypatch.setattr(Task, "apply_async", publish)
        try:
            interrupted(lambda: task.apply_async((name, "B"), queue=NOBODY), tracer)
        except OperationalError:
            pass  # not interrupted (the window's end)
        finally:
            monkeypatch.undo()
        noted = markers.read(backend, f"{key}:coalesce")
        assert noted is None or "taken" not in json.loads(noted[0]), tracer.fired

    every_point(case, lambda at: LineInterrupter(at, watched, lambda f: f.f_code is window))


@pytest.fixture(scope="module")
def revoking(start_worker: Callable[..., Worker]) -> Iterator[tuple[Worker, Worker]]:
    # acks_late: the running call keeps the first worker's one prefetch slot. (Only the
    # first is slowed: every worker stores REVOKED for a revoked id it is not running.) The
    # second idles on a queue of its own. Shared by both ways to revoke below.
    slow = {"REDLOCK_TEST_SLOW_REVOKE": "4", "REDLOCK_TEST_ACKS_LATE": "1"}
    pair = (start_worker(pool="prefork", concurrency=1, **slow),
            start_worker(pool="solo", concurrency=1))  # fmt: skip
    yield pair
    stop_all(pair)


@pytest.mark.parametrize("revoke", ["by id", "by stamped headers"])
def test_coalesce_a_call_revoked_with_terminate_never_runs_again(
    revoke: str, revoking: tuple[Worker, Worker], redis_server: RedisServer
) -> None:
    # Celery's Request.terminate stops the child, then stores REVOKED (slow here: a database
    # result backend under load), then sends task_revoked, where the revoked call was
    # dropped. Meanwhile the child's exit queued a follow-up for its claimed note; another
    # worker took it, claimed the note again and ran the revoked call.
    r = redis(redis_server)
    first, second = revoking
    name = uuid.uuid4().hex[:8]
    ran = f"coalesce-dd:{name}:ran"
    stamp = uuid.uuid4().hex[:8]
    revoked = celery_tasks.coalesced_deduped.apply_async(  # (stopped)
        (name, "A", 60.0), queue=first.queue, stamped_headers=["rlstamp"], rlstamp=stamp
    )
    wait_for(lambda: r.lrange(ran, 0, -1) == ["A"])
    # Now the second worker takes the first one's queue too: the follow-up goes to it.
    node = next(n for p in celery_app.app.control.ping(timeout=2) for n in p
                if n.startswith(f"{second.queue}@"))  # fmt: skip
    assert celery_app.app.control.add_consumer(first.queue, destination=[node], reply=True)
    try:
        if revoke == "by id":
            celery_app.app.control.revoke(revoked.id, terminate=True)
        else:  # Celery 5.3+: no redlock note was written before the kill
            celery_app.app.control.revoke_by_stamped_headers({"rlstamp": stamp}, terminate=True)
        time.sleep(2.5)  # the follow-up ran within 0.5 s of the kill, before the fix
        assert r.lrange(ran, 0, -1) == ["A"], "the revoked call ran again"
        wait_for(lambda: markers.read(locks["default"], f"coalesce-dd:{name}:coalesce") is None)
        wait_for(lambda: not locks["default"].is_locked(f"coalesce-dd:{name}"))
        after = first.send(celery_tasks.coalesced_deduped, name, "B", 0.1)
        assert after.get(timeout=30) == "ran"  # the key works on
    finally:  # the second worker back on its own queue only, for the next case
        celery_app.app.control.cancel_consumer(first.queue, destination=[node], reply=True)


# -- coalesce: a claimed call replaced by a later note; two tasks sharing a key ----------------

STOPPED_RUNS: list[str] = []


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.stopped_once")
@single_instance(key="stopped-once:{name}", ttl=10, on_duplicate="coalesce")
def stopped_once(self: Any, name: str, tag: str) -> str:
    STOPPED_RUNS.append(tag)
    if tag == "d1" and STOPPED_RUNS.count("d1") == 1:
        # A later duplicate notes while this follow-up runs (as from a 2nd worker), then the
        # run is stopped (sys.exit() in a signal handler, mid-body).
        stopped_once.apply((name, "d2"), task_id=f"d2-{name}")
        raise SystemExit(1)
    return tag


def test_coalesce_a_stopped_follow_up_s_call_survives_a_later_note(broker: None) -> None:
    # The claim lived only in the note, which D2's note replaced: the next follow-up ran D2's
    # call alone, and D1's (claimed, never settled) was lost. D1 runs again, then D2.
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    STOPPED_RUNS.clear()
    with lock(f"stopped-once:{name}", ttl=10):  # D1 finds the key held: noted
        assert stopped_once.apply((name, "d1")).result["coalesced"] is True
    celery_app.app.control.purge()
    follow = {"headers": {contrib.FOLLOW_UP: "1"}}
    with pytest.raises(SystemExit):
        stopped_once.apply((name, "d1"), task_id=f"f1-{name}", **follow)
    assert stopped_once.apply((name, "x"), task_id=f"f2-{name}", **follow).result == "d1"
    assert stopped_once.apply((name, "x"), task_id=f"f3-{name}", **follow).result == "d2"
    assert stopped_once.apply((name, "x"), task_id=f"f4-{name}", **follow).result["coalesced"]
    assert STOPPED_RUNS == ["d1", "d1", "d2"]
    assert markers.read(locks["default"], f"stopped-once:{name}:coalesce") is None
    celery_app.app.control.purge()


PAIR_RUNS: list[tuple[str, str]] = []


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.pair_x")
@single_instance(key="pair:{name}", ttl=10, on_duplicate="coalesce")
def pair_x(self: Any, name: str, tag: str) -> str:
    PAIR_RUNS.append(("x", tag))
    return tag


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.pair_y")
@single_instance(key="pair:{name}", ttl=10, on_duplicate="coalesce")
def pair_y(self: Any, name: str, label: str) -> str:
    PAIR_RUNS.append(("y", label))
    return label


def _queued_follow_ups(redis_server: RedisServer, name: str) -> list[tuple[str, str]]:
    found = []
    for raw in redis_server.client(db=1).lrange("celery", 0, -1):
        headers = json.loads(raw)["headers"]
        if headers.get("redlock_follow_up") and f"'{name}'" in headers.get("argsrepr", ""):
            found.append((headers["task"], headers["argsrepr"]))
    return found


def test_coalesce_two_tasks_sharing_a_key_run_each_call_with_its_own_function(
    broker: None, redis_server: RedisServer
) -> None:
    # Y's call is noted last; X's follow-up claimed it and ran X's function with Y's
    # arguments (a call nobody made). It must run nothing, and queue Y's follow-up instead.
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    PAIR_RUNS.clear()
    celery_app.app.control.purge()
    with lock(f"pair:{name}", ttl=10):
        assert pair_x.apply((name, "x1")).result["coalesced"] is True
        assert pair_y.apply((name, "y2")).result["coalesced"] is True
    celery_app.app.control.purge()  # the follow-ups the duplicates queued (countdown)
    follow = {"headers": {contrib.FOLLOW_UP: "1"}}
    assert pair_x.apply((name, "x1"), task_id=f"fx-{name}", **follow).result["coalesced"]
    assert PAIR_RUNS == []
    assert _queued_follow_ups(redis_server, name) == [(pair_y.name, f"('{name}', 'y2')")]
    celery_app.app.control.purge()
    assert pair_y.apply((name, "y2"), task_id=f"fy-{name}", **follow).result == "y2"
    assert PAIR_RUNS == [("y", "y2")]
    assert markers.read(locks["default"], f"pair:{name}:coalesce") is None
    celery_app.app.control.purge()


# -- coalesce: a note outlives dedupe_ttl while its run runs, or its follow-up waits ----------


@shared_task(bind=True, name="tests.celery.test_celery_dedupe.kept_note")
@single_instance(key="kept:{name}", ttl=10, on_duplicate="coalesce", dedupe_ttl=1.0)
def kept_note(self: Any, name: str, tag: str, duplicate: str | None = None) -> str:
    if duplicate is not None:  # a duplicate arrives while the key runs (as from a 2nd worker)
        kept_note.apply((name, duplicate), task_id=f"dup-{duplicate}-{uuid.uuid4().hex[:6]}")
        time.sleep(2.0)  # the run outlasts dedupe_ttl (1 s) twice over
    return tag


def test_coalesce_a_note_outlives_dedupe_ttl_while_its_run_runs_and_its_follow_up_waits(
    broker: None, redis_server: RedisServer
) -> None:
    # The note's TTL was dedupe_ttl, never renewed: gone before the run's end (which queued
    # nothing), or before its follow-up ran (which ran nothing). Each call was told
    # "coalesced": one more run follows.
    from django_redlock.contrib import celery as contrib

    name = uuid.uuid4().hex[:8]
    celery_app.app.control.purge()
    assert kept_note.apply((name, "t0", "t1")).result == "t0"
    found = [
        json.loads(raw)["headers"]
        for raw in redis_server.client(db=1).lrange("celery", 0, -1)
        if f"'{name}'" in json.loads(raw)["headers"].get("argsrepr", "")
    ]
    assert [h["argsrepr"] for h in found] == [f"('{name}', 't1')"]  # its follow-up, queued
    time.sleep(2.0)  # it waits in a busy queue past dedupe_ttl, twice over
    celery_app.app.control.purge()
    follow = {"task_id": found[0]["id"], "headers": {contrib.FOLLOW_UP: "1"}}
    assert kept_note.apply((name, "t1"), **follow).result == "t1"
    assert markers.read(locks["default"], f"kept:{name}:coalesce") is None
    celery_app.app.control.purge()
