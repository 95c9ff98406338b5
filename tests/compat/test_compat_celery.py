"""The migration shims (``django_redlock.compat.celery_singleton`` and ``.celery_once``): the
behaviours celery-singleton's and celery-once's own tests check, as our tests, on real Redis
and a real worker; then the guarantees the originals lacked."""

from __future__ import annotations

import json
import pickle
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, Task, states
from celery.result import EagerResult
from kombu.exceptions import OperationalError

from django_redlock import locks
from django_redlock.compat import celery_once, celery_singleton
from django_redlock.compat.celery_once import AlreadyQueued, QueueOnce
from django_redlock.compat.celery_singleton import (
    Config,
    DuplicateTaskError,
    Singleton,
    clear_locks,
)
from django_redlock.compat.markers import marker
from django_redlock.contrib import celery as contrib_celery
from django_redlock.testing import RedisServer
from tests.support import celery_app
from tests.support import celery_compat_tasks as tasks

from ..celery.test_celery import NO_RETRY, NOBODY, Worker, broker, redis, start_worker, wait_for

__all__ = ["broker", "start_worker"]  # fixtures, imported to be used here

PREFIX = "lock_prefix:"


@pytest.fixture
def app(broker: None) -> Iterator[Celery]:
    yield celery_app.app
    clear_locks(celery_app.app)  # as celery-singleton's scoped_app flushes its Redis


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., Worker]) -> Worker:
    return start_worker(pool="prefork", concurrency=2)


def send(task: Any, *args: Any, **options: Any) -> Any:
    return task.apply_async(args, options.pop("kwargs", None), queue=NOBODY, **options)


# -- celery-singleton: what its own tests check ---------------------------------------------


def test_singleton_duplicates_get_the_same_id(app: Celery) -> None:
    sent = [send(tasks.singleton_simple, 1, 2, 3) for _ in range(10)]
    assert {r.id for r in sent} == {sent[0].id}


def test_singleton_different_arguments_get_different_ids(app: Celery) -> None:
    sent = [send(tasks.singleton_simple, i, i + 1, i + 2) for i in range(5)]
    assert len({r.id for r in sent}) == 5


def test_singleton_duplicate_after_success_or_error_is_queued(app: Celery, worker: Worker) -> None:
    first = worker.send(tasks.singleton_simple, 1, 2, 3)
    assert first.get(timeout=30) == [1, 2, 3]
    second = worker.send(tasks.singleton_simple, 1, 2, 3)
    assert second.id != first.id and second.get(timeout=30) == [1, 2, 3]
    failed = worker.send(tasks.singleton_fails, 1, 2, 3)
    with pytest.raises(Exception) as caught:  # Celery rebuilds the class: match its name
        failed.get(timeout=30)
    assert type(caught.value).__name__ == "ExpectedTaskFail"
    again = worker.send(tasks.singleton_fails, 1, 2, 3)
    assert again.id != failed.id


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("singleton", DuplicateTaskError, "Attempted to queue a duplicate of task ID t-1"),
        ("once", AlreadyQueued, "Expires in 12.5 seconds"),
        ("contrib", contrib_celery.AlreadyQueued, "x not queued: 'k' is queued or running"),
    ],
)
def test_a_duplicate_error_raised_by_a_task_keeps_its_fields(
    app: Celery, worker: Worker, kind: str, error: type, message: str
) -> None:
    # Celery's JSON result backend stores an exception's args and rebuilds it as
    # cls(*args): the error a caller gets from .get() must be the same type, with its
    # task_id (and countdown) and its message.
    result = worker.send(tasks.raise_duplicate, kind)
    with pytest.raises(error) as caught:
        result.get(timeout=30)
    assert type(caught.value) is error
    assert caught.value.task_id == "t-1"
    assert str(caught.value).startswith(message)
    if kind == "once":
        assert caught.value.countdown == 12.5 and caught.value.message == message
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is error and again.task_id == "t-1" and str(again) == str(caught.value)


def test_singleton_get_existing_task_id(app: Celery) -> None:
    task = tasks.singleton_simple
    lock = task.generate_lock(task.name, task_args=[1, 2, 3])
    assert task.get_existing_task_id(lock) is None
    assert task.aquire_lock(lock, "test_task_id") is True
    assert task.aquire_lock(lock, "another") is False
    assert task.get_existing_task_id(lock) == "test_task_id"
    task.unlock(lock)
    assert task.get_existing_task_id(lock) is None


def test_singleton_aquire_lock_by_hand_holds_the_key(app: Celery) -> None:
    # celery-singleton: a delay() of a key taken by aquire_lock(lock, id) returns that id.
    # Its marker had no "sent" note: delay() took it for a publish whose producer died,
    # waited publish_wait (5 s) and queued a second message.
    task = tasks.singleton_simple
    lock = task.generate_lock(task.name, task_args=[4, 5, 6])
    assert task.aquire_lock(lock, "by-hand") is True
    began = time.monotonic()
    result = send(task, 4, 5, 6)
    assert time.monotonic() - began < 2.0, "it waited for a publish"
    assert result.id == "by-hand"
    assert task.get_existing_task_id(lock) == "by-hand"


def test_singleton_failed_publish_clears_the_lock_and_reraises(app: Celery) -> None:
    task = tasks.singleton_simple
    lock = task.generate_lock(task.name, task_args=[1, 2, 3])  # the name the task uses
    dead = app.connection_for_write("redis://127.0.0.1:1/1", transport_options=NO_RETRY)
    with pytest.raises(OperationalError):
        task.apply_async(args=[1, 2, 3], connection=dead, retry=False)
    assert task.get_existing_task_id(lock) is None
    assert marker("default", lock) is None


def test_singleton_raise_on_duplicate(app: Celery) -> None:
    first = send(tasks.singleton_raises, 1, 2, 3)
    with pytest.raises(DuplicateTaskError) as caught:
        send(tasks.singleton_raises, 1, 2, 3)
    assert caught.value.task_id == first.id
    assert isinstance(caught.value, contrib_celery.AlreadyQueued)
    again = pickle.loads(pickle.dumps(caught.value))  # a task may raise it: it pickles
    assert again.task_id == first.id and str(again) == str(caught.value)


def test_singleton_clear_locks(app: Celery) -> None:
    sent = [send(tasks.singleton_simple, i) for i in range(5)]
    assert locks["default"].queued_names(f"{PREFIX}*")
    clear_locks(app)
    assert locks["default"].queued_names(f"{PREFIX}*") == []
    assert send(tasks.singleton_simple, 0).id != sent[0].id


@pytest.mark.parametrize(
    ("task_name", "args", "kwargs", "unique"),
    [
        ("unique_on_args", (2, 3, 4, 5), {}, {"a": 2, "c": 4}),
        ("unique_on_kwargs", (2,), {"b": 3, "c": 4, "d": 5}, {"b": 3, "d": 5}),
        ("unique_on_empty", (2,), {"b": 3, "c": 4, "d": 5}, {}),
        ("unique_on_string", (2,), {"b": 3, "c": 4, "d": 5}, {"c": 4}),
        ("unique_on_default", (2,), {"b": 3, "c": 4}, {"d": 4}),
    ],
)
def test_singleton_unique_on(
    app: Celery, worker: Worker, task_name: str, args: tuple, kwargs: dict, unique: dict
) -> None:
    task = getattr(tasks, task_name)
    expected = celery_singleton.generate_lock(task.name, [], unique, key_prefix=PREFIX)
    assert task.generate_lock(task.name, list(args), kwargs) == expected
    assert task.lock_key(*args, **kwargs) == expected  # the key the engine uses
    first = worker.send(task, *args, kwargs=kwargs, countdown=1)
    assert task.get_existing_task_id(expected) == first.id
    first.get(timeout=30)
    wait_for(lambda: task.get_existing_task_id(expected) is None)  # freed after the run


def test_singleton_raise_on_duplicate_config(broker: None) -> None:
    default = Celery(set_as_current=False)

    @default.task(base=Singleton)
    def plain() -> None: ...

    assert plain._raise_on_duplicate is False
    configured = Celery(set_as_current=False)
    configured.conf.singleton_raise_on_duplicate = False

    @configured.task(base=Singleton, raise_on_duplicate=True)
    def overrides() -> None: ...

    assert overrides._raise_on_duplicate is True
    assert overrides.singleton_config.raise_on_duplicate is False
    raising = Celery(set_as_current=False)
    raising.conf.singleton_raise_on_duplicate = True

    @raising.task(base=Singleton)
    def from_app() -> None: ...

    assert from_app._raise_on_duplicate is True


def test_singleton_config_defaults_and_settings() -> None:
    app = Celery(set_as_current=False)
    config = Config(app)
    assert config.key_prefix == "SINGLETONLOCK_"
    assert config.raise_on_duplicate is None and config.lock_expiry is None
    assert config.using == "default" and config.backend_url is None
    app.conf.singleton_backend_url = "redis://nowhere:1/0"  # accepted, never connected to
    app.conf.singleton_lock_expiry = 5
    app.conf.singleton_using = "local"
    assert Config(app).backend_url == "redis://nowhere:1/0"
    assert Config(app).lock_expiry == 5 and Config(app).using == "local"


def test_singleton_lock_expiry_bounds_the_marker(app: Celery) -> None:
    task = tasks.singleton_expiry
    result = send(task, 1, 2, 3)
    lock = task.generate_lock(task.name, [1, 2, 3])
    noted = marker("default", lock)
    assert noted is not None and noted[0] == result.id and 50 < noted[1] <= 60
    other = send(tasks.singleton_simple, 9)
    noted = marker(
        "default", tasks.singleton_simple.generate_lock(tasks.singleton_simple.name, [9])
    )
    assert noted is not None and noted[0] == other.id and 3000 < noted[1] <= 3600


class MyJSONEncoder(json.JSONEncoder):
    def default(self, o: Any) -> Any:
        if isinstance(o, uuid.UUID):
            return str(o)
        return super().default(o)


@pytest.mark.parametrize(
    "encoder", [MyJSONEncoder, "tests.compat.test_compat_celery.MyJSONEncoder"]
)
def test_singleton_custom_json_encoder(app: Celery, encoder: Any) -> None:
    app.conf.singleton_json_encoder_class = encoder
    try:
        value = uuid.uuid4()
        task = tasks.singleton_simple
        lock = task.generate_lock(task.name, [value])
        assert lock == celery_singleton.generate_lock(task.name, [str(value)], key_prefix=PREFIX)
    finally:
        app.conf.singleton_json_encoder_class = None


# -- celery-singleton: our guarantees ---------------------------------------------------------


def test_singleton_retry_is_never_a_duplicate(app: Celery, worker: Worker) -> None:
    # celery-singleton deduplicated a task's own retry to itself: it never ran again.
    result = worker.send(tasks.singleton_retry, "r")
    assert result.get(timeout=30) == "ran"
    assert redis_list("singleton-retry:r") == ["0", "1"]


def test_singleton_two_runs_of_a_key_never_overlap(
    app: Celery, worker: Worker, redis_server: RedisServer
) -> None:
    # A second message of a running key (its marker gone: expired, cleared by hand) is
    # skipped, not run beside it: celery-singleton had no exclusion while running.
    first = worker.send(tasks.singleton_slow, "o", 2.0)
    wait_for(lambda: redis(redis_server).lrange("singleton:o:ran", 0, -1))
    bypass = Task.apply_async(tasks.singleton_slow, ("o", 2.0), queue=worker.queue)  # same key
    value = bypass.get(timeout=30)
    assert value["redlock"] == "duplicate_skipped" and value["holder_task_id"] == first.id
    assert first.get(timeout=30) == "ran"
    assert int(redis(redis_server).get("singleton:o:peak")) == 1


def test_singleton_a_revoked_queued_task_frees_its_key(app: Celery, worker: Worker) -> None:
    first = worker.send(tasks.singleton_slow, "rev", 0.1, countdown=2)
    assert worker.send(tasks.singleton_slow, "rev", 0.1).id == first.id
    first.revoke()
    wait_for(lambda: first.state == states.REVOKED)
    again = worker.send(tasks.singleton_slow, "rev", 0.1)
    assert again.id != first.id and again.get(timeout=30) == "ran"


def test_singleton_a_duplicate_is_logged_and_signalled(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    contrib_celery.duplicate_not_queued.connect(receiver)
    try:
        first = send(tasks.singleton_simple, "loud")
        caplog.set_level("INFO", logger="django_redlock")
        assert send(tasks.singleton_simple, "loud").id == first.id
    finally:
        contrib_celery.duplicate_not_queued.disconnect(receiver)
    assert seen and seen[0]["holder_task_id"] == first.id
    assert f"not queued: {seen[0]['key']!r} is queued or running as task {first.id}" in caplog.text


# -- celery-once: what its own tests check ----------------------------------------------------


def test_once_keys() -> None:
    assert tasks.simple_example.get_key() == "qo_simple_example"
    assert tasks.args_example.get_key(kwargs={"a": 1, "b": 2}) == "qo_args_example_a-1_b-2"
    assert tasks.args_example.get_key(args=(1, 2)) == "qo_args_example_a-1_b-2"
    assert (
        tasks.select_args_example.get_key(kwargs={"a": 1, "b": 2}) == "qo_select_args_example_a-1"
    )
    assert tasks.bound_task.get_key(kwargs={"a": 1, "b": 2}) == "qo_bound_task_a-1_b-2"
    assert tasks.autoretry_for_example.get_key(kwargs={"a": 1, "b": 2}) == (
        "qo_autoretry_for_example_a-1_b-2"
    )
    assert tasks.args_example._get_call_args((1, 2), {}) == {"a": 1, "b": 2}
    assert tasks.bound_task._get_call_args((1, 2), {}) == {"a": 1, "b": 2}
    # Dicts and lists: celery-once's text of them (sorted keys, str values).
    assert tasks.args_example.get_key(args=({"b": 1, "a": [2]}, 3)) == (
        "qo_args_example_a-{'a': [2], 'b': 1}_b-3"
    )


def test_once_config(app: Celery) -> None:
    task = tasks.simple_example
    assert task.config == app.conf
    assert task.once_config["settings"]["default_timeout"] == 3600
    assert task.default_timeout == 3600
    assert task.once_backend.using == "default"
    bare = Celery(set_as_current=False)

    @bare.task(base=QueueOnce)
    def unset() -> None: ...

    assert unset.default_timeout == 3600  # celery-once's default: an hour


def test_once_apply_async_takes_the_key_for_the_timeout(app: Celery) -> None:
    first = send(tasks.simple_example)
    noted = marker("default", "qo_simple_example")
    assert noted is not None and noted[0] == first.id and 3500 < noted[1] <= 3600
    with pytest.raises(AlreadyQueued) as caught:
        send(tasks.simple_example)
    assert 3500 < caught.value.countdown <= 3600
    assert caught.value.message == f"Expires in {caught.value.countdown} seconds"
    assert str(caught.value) == caught.value.message and caught.value.task_id == first.id
    assert isinstance(caught.value, contrib_celery.AlreadyQueued)
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.countdown == caught.value.countdown and again.task_id == first.id


def test_once_per_call_timeout(app: Celery) -> None:
    send(tasks.args_example, 1, 2, once={"timeout": 120})
    noted = marker("default", "qo_args_example_a-1_b-2")
    assert noted is not None and 100 < noted[1] <= 120


def test_once_graceful_per_call_and_on_the_task(app: Celery) -> None:
    send(tasks.args_example, 5, 6)
    result = send(tasks.args_example, 5, 6, once={"graceful": True})
    assert isinstance(result, EagerResult) and result.result is None
    send(tasks.once_graceful, "g")
    graceful = send(tasks.once_graceful, "g")
    assert isinstance(graceful, EagerResult) and graceful.result is None
    with pytest.raises(AlreadyQueued):
        send(tasks.once_graceful, "g", once={"graceful": False})


def test_once_retry_is_never_a_duplicate(app: Celery, worker: Worker) -> None:
    result = worker.send(tasks.once_retry)
    assert result.get(timeout=30) == "ran"
    assert redis_list("once-retry") == ["0:0", "1:1"]
    wait_for(lambda: marker("default", tasks.once_retry.get_key()) is None)
    assert not locks["default"].is_locked(tasks.once_retry.get_key())


def test_once_key_is_free_after_success_and_failure(app: Celery, worker: Worker) -> None:
    assert worker.send(tasks.once_slow, "done", 0.1).get(timeout=30) == "ran"
    assert worker.send(tasks.once_slow, "done", 0.1).get(timeout=30) == "ran"  # not AlreadyQueued
    failed = worker.send(tasks.once_fails, "f")
    failed.get(timeout=30, propagate=False)
    worker.send(tasks.once_fails, "f").get(timeout=30, propagate=False)  # queued again


def test_once_unlock_before_run_queues_one_more_and_never_overlaps(
    app: Celery, worker: Worker, redis_server: RedisServer
) -> None:
    r = redis(redis_server)
    first = worker.send(tasks.once_unlock_before_run, "u", "t0", 2.0)
    wait_for(lambda: r.lrange("once-ubr:u:ran", 0, -1))
    # The key was freed when the run started: the next call is queued, not AlreadyQueued...
    second = worker.send(tasks.once_unlock_before_run, "u", "t1", 0.1)
    assert second.id != first.id
    # ...and runs after the first, never beside it.
    assert first.get(timeout=30) == "ran"
    second.get(timeout=30)
    wait_for(lambda: r.lrange("once-ubr:u:ran", 0, -1) == ["t0", "t1"])
    assert int(r.get("once-ubr:u:peak")) == 1


def test_once_backend_raise_or_lock_and_clear_lock(app: Celery) -> None:
    backend = tasks.simple_example.once_backend
    backend.raise_or_lock("qo_by_hand", timeout=60)
    with pytest.raises(AlreadyQueued) as caught:
        backend.raise_or_lock("qo_by_hand", timeout=60)
    assert 50 < caught.value.countdown <= 60
    backend.clear_lock("qo_by_hand")
    backend.raise_or_lock("qo_by_hand", timeout=60)  # free again
    backend.clear_lock("qo_by_hand")


def test_once_raise_or_lock_by_hand_holds_the_key(app: Celery) -> None:
    # celery-once: a key taken by raise_or_lock(key, timeout) makes delay() of that key
    # raise AlreadyQueued. Its marker had no "sent" note: delay() took it for a publish whose
    # producer died, waited publish_wait (5 s) and queued the call.
    task = tasks.args_example
    key = task.get_key(kwargs={"a": 3, "b": 4})
    task.once_backend.raise_or_lock(key, timeout=60)
    began = time.monotonic()
    with pytest.raises(AlreadyQueued) as caught:
        send(task, 3, 4)
    assert time.monotonic() - began < 2.0, "it waited for a publish"
    assert 50 < caught.value.countdown <= 60
    task.once_backend.clear_lock(key)
    send(task, 3, 4)  # free again: queued


def test_once_a_failed_publish_frees_the_key(app: Celery) -> None:
    dead = app.connection_for_write("redis://127.0.0.1:1/1", transport_options=NO_RETRY)
    with pytest.raises(OperationalError):
        tasks.args_example.apply_async((7, 8), connection=dead, retry=False)
    assert marker("default", "qo_args_example_a-7_b-8") is None
    send(tasks.args_example, 7, 8)  # not AlreadyQueued


def test_the_compat_package_keeps_its_module_api() -> None:
    from django_redlock.compat import Redis, RedisPyLock  # the module this package was

    assert RedisPyLock.__name__ == "RedisPyLock" and Redis.__name__ == "Redis"
    assert celery_once.QueueOnce.abstract and celery_singleton.Singleton.abstract


def redis_list(name: str) -> list[str]:
    client = locks["default"].client  # type: ignore[attr-defined]
    return [v.decode() for v in client.lrange(name, 0, -1)]


TTL = 5.0  # the killed worker's default TTL


def test_singleton_a_killed_worker_frees_the_key_within_its_ttl(
    app: Celery, start_worker: Callable[..., Worker], redis_server: RedisServer
) -> None:
    # celery-singleton kept a killed worker's key until lock_expiry, or for ever. Here the
    # running task holds a lock renewed by its watchdog: killed, the lock runs out at its TTL
    # (the backend's default: this worker's alias sets 5 s, where the backend's own is 30 s),
    # and the key is free again.
    victim = start_worker(pool="prefork", concurrency=1, REDLOCK_TEST_DEFAULT_TTL=str(TTL))
    task = tasks.singleton_slow
    first = victim.send(task, "kill", 120.0)
    wait_for(lambda: redis(redis_server).lrange("singleton:kill:ran", 0, -1))
    lock = task.generate_lock(task.name, ["kill", 120.0])
    assert task.get_existing_task_id(lock) == first.id  # running: its hold names it
    victim.kill()  # SIGKILL, main process and child
    killed = time.monotonic()
    info = locks["default"].inspect(lock)
    assert info is not None and 0 < (info.ttl or 0) <= TTL  # held with the alias's TTL
    wait_for(lambda: task.get_existing_task_id(lock) is None, timeout=60)
    assert time.monotonic() - killed < TTL + 5
    assert send(task, "kill", 120.0).id != first.id  # queued anew


def test_a_group_of_singleton_duplicates_finishes(app: Celery, worker: Worker) -> None:
    # Canvas picks every member's id in advance: the duplicates' ids resolve too (skipped).
    from celery import group

    from django_redlock.contrib.celery import skipped

    # The first runs 4 s: long enough that the others reach the worker while it runs, even
    # on a loaded machine (one that came after it ended would rightly run: seen at 1 s).
    members = [tasks.singleton_slow.s("grp", 4.0).set(queue=worker.queue) for _ in range(3)]
    values = group(members).apply_async().get(timeout=60)
    assert values.count("ran") == 1
    assert sum(1 for v in values if skipped(v)) == 2


def test_existing_task_id_decodes_an_encoded_holder() -> None:
    # A running task whose id the holder field carries encoded ("\x1f" in it): the shims'
    # existing_task_id() names the task, not its encoded form.
    from django_redlock import lock
    from django_redlock.compat.markers import existing_task_id
    from django_redlock.contrib.single import holder_id
    from django_redlock.identity import current_task

    task_id = f"odd\x1fid-{uuid.uuid4().hex[:6]}"
    key = f"encoded-holder:{task_id[-6:]}"
    marker_ = current_task.set((holder_id(task_id), "tests.odd"))
    try:
        with lock(key, ttl=10):
            assert existing_task_id("default", key) == task_id
    finally:
        current_task.reset(marker_)


@pytest.mark.parametrize("graceful", [False, True])
def test_once_unlock_before_run_a_refused_call_never_replaces_the_queued_call(
    app: Celery, graceful: bool
) -> None:
    # Call A is queued; call B of the same key is refused (AlreadyQueued, or graceful None).
    # A must run with its own arguments: B's replaced them in the note its follow-up runs.
    from django_redlock.backends import markers

    name = uuid.uuid4().hex[:8]
    task = tasks.once_unlock_before_run
    send(task, name, "a")
    if graceful:
        refused = send(task, name, "b", once={"graceful": True})
        assert isinstance(refused, EagerResult) and refused.result is None
    else:
        with pytest.raises(AlreadyQueued):
            send(task, name, "b")
    note = f"{task.get_key((name, 'a'))}:coalesce"
    noted = markers.read(locks["default"], note)
    assert noted is not None
    markers.clear(locks["default"], note, noted[0])
    assert json.loads(noted[0])["args"] == [name, "a"]


def _once_follow_ups(redis_server: RedisServer, name: str) -> list[str]:
    """The follow-ups of ``name`` waiting in the default queue (no worker reads it)."""
    found = []
    for raw in redis_server.client(db=1).lrange("celery", 0, -1):
        headers = json.loads(raw)["headers"]
        if headers.get(contrib_celery.FOLLOW_UP) and f"'{name}'" in headers.get("argsrepr", ""):
            found.append(headers["argsrepr"])
    return found


@pytest.mark.parametrize("where", ["wrapper", "task-call", "body"])
def test_once_unlock_before_run_follow_up_limited_on_the_way_into_its_body_keeps_the_call(
    where: str, app: Celery, redis_server: RedisServer
) -> None:
    # A soft time limit in the shim's way into the task's run() (its follow-up wrapper, the
    # entry of the task class's __call__): the body never ran, so the call must stay noted,
    # with a follow-up queued (it was deleted: lost). In the body ("body"), the call is done.
    import sys

    from celery.exceptions import SoftTimeLimitExceeded

    from django_redlock.backends import markers
    from django_redlock.compat import celery_once as shim

    task = tasks.once_unlock_before_run
    name = uuid.uuid4().hex[:8]
    key = task.get_key((name, "d1"))
    run_code = task.run.__func__.__code__
    strikes = [1]

    def struck() -> None:
        strikes.pop()
        raise SoftTimeLimitExceeded("soft time limit")

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        back = frame.f_back
        if not strikes:
            return None
        if where == "wrapper" and frame.f_code.co_filename == shim.__file__:
            if frame.f_code.co_name == "<lambda>" and frame.f_code.co_varnames[:2] == ("a", "k"):
                struck()
        elif where == "task-call" and back is not None and back.f_code.co_filename == shim.__file__:
            if back.f_code.co_name == "<lambda>" and frame.f_code is not run_code:
                struck()
        elif where == "body" and frame.f_code is run_code:
            return lambda frame, event, arg: struck() if event == "line" and strikes else None
        return None

    contrib_celery.note_call(task.single_instance_config(), key, [name, "d1", 0], {}, None, "d1")
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        failed = task.apply((name, "f", 0), task_id=f"f-{name}",
                            headers={contrib_celery.FOLLOW_UP: "1"})  # fmt: skip
    finally:
        sys.settrace(previous)
    assert not strikes
    assert isinstance(failed.result, SoftTimeLimitExceeded)
    noted = markers.read(locks["default"], f"{key}:coalesce")
    if where == "body":
        assert noted is None
        assert _once_follow_ups(redis_server, name) == []
        return
    assert noted is not None and json.loads(noted[0])["args"] == [name, "d1", 0]
    markers.clear(locks["default"], f"{key}:coalesce", noted[0])
    assert _once_follow_ups(redis_server, name) == [f"('{name}', 'd1', 0)"]
    celery_app.app.control.purge()


@pytest.mark.parametrize("shim", ["singleton", "once"])
def test_an_interrupt_at_any_line_after_the_publish_leaves_the_call_deduplicated(
    shim: str, app: Celery, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shims queue through SingleInstanceTask.apply_async: an interrupt at any line after
    # the publish (before the message was noted as sent) made the next call publish a
    # second message after publish_wait, beside the queued one.
    from django_redlock.backends import markers
    from django_redlock.contrib.broker import PublishWatch
    from django_redlock.contrib.celery import SingleInstanceTask
    from tests.support.line_interrupts import (
        LineInterrupter,
        every_point,
        interrupted,
        publish_path,
    )

    monkeypatch.setattr(SingleInstanceTask, "publish_wait", 0.3, raising=False)
    apply = SingleInstanceTask.apply_async.__code__
    watched = {
        apply,
        SingleInstanceTask._note_sent.__code__,
        markers.mark.__code__,
        *publish_path(),
    }
    sender = celery_app.app.amqp.send_task_message.__code__
    queue = redis_server.client(db=1)
    calls = [0]

    def published(frame: Any) -> bool:  # from the broker's publish on
        if frame.f_code is PublishWatch.publish.__code__:
            return bool(frame.f_locals["self"].published)
        return frame.f_code is sender and "ret" in frame.f_locals  # kombu's publish returned

    def case(tracer: LineInterrupter) -> None:
        calls[0] += 1
        args = (calls[0], 1000 + calls[0], 7) if shim == "singleton" else (calls[0], 1000)
        task = tasks.singleton_simple if shim == "singleton" else tasks.args_example
        before = queue.llen(NOBODY)
        interrupted(lambda: task.apply_async(args, queue=NOBODY), tracer)
        assert queue.llen(NOBODY) == before + 1, tracer.fired
        first = json.loads(queue.lindex(NOBODY, 0))["headers"]["id"]  # (pushed at the head)
        if shim == "singleton":
            assert task.apply_async(args, queue=NOBODY).id == first, tracer.fired
        else:
            with pytest.raises(AlreadyQueued):
                task.apply_async(args, queue=NOBODY)
        assert queue.llen(NOBODY) == before + 1, f"a second message, at {tracer.fired}"

    try:
        points = every_point(case, lambda at: LineInterrupter(at, watched, published))
    finally:
        app.control.purge()
    assert len(points) >= 3, points
