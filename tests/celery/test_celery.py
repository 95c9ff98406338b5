"""@single_instance with real Celery workers (subprocesses on the suite's Redis); eager mode
with the LocMem backend at the end."""

from __future__ import annotations

import datetime
import decimal
import enum
import gc
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Task, shared_task
from celery.result import AsyncResult

from django_redlock import LockNotAcquired, lock, locks, single_instance
from django_redlock.contrib.celery import (
    AlreadyQueued,
    SingleInstanceTask,
    hold_of,
    release_lock,
    skipped,
)
from django_redlock.testing import RedisServer
from tests.support import celery_app, celery_tasks

from ..conftest import ROOT
from ..redlock.test_redlock import quorum_alias

_queues = itertools.count()


class Worker:
    """``celery worker`` in its own session, so a test can SIGKILL the whole pool."""

    def __init__(
        self, url: str, pool: str, concurrency: int, queue: str, log: Path,
        env: dict[str, str] | None = None, name: str | None = None,
    ) -> None:  # fmt: skip
        self.queue, self.log = queue, log
        env = {
            **os.environ,
            **(env or {}),
            "DJANGO_SETTINGS_MODULE": "tests.support.worker_settings",
            "REDLOCK_TEST_REDIS": url,
            "PYTHONPATH": str(ROOT),
        }
        command = [
            sys.executable, "-m", "celery", "-A", "tests.support.celery_app", "worker",
            "-P", pool, "-c", str(concurrency), "-Q", queue, "-n", f"{name or queue}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info",
        ]  # fmt: skip
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while b" ready." not in log.read_bytes():
            assert self.process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)

    def send(self, task: Any, *args: Any, **options: Any) -> AsyncResult:
        kwargs = options.pop("kwargs", {})
        return task.apply_async(args, kwargs, queue=self.queue, **options)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def terminate(self) -> None:
        """Start a warm shutdown (``stop`` waits for it)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def stop_all(workers: Iterable[Worker]) -> None:
    """Stop ``workers``, their warm shutdowns at once rather than one after another."""
    workers = list(workers)
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.stop()


@pytest.fixture(scope="session")
def start_worker(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Worker]]:
    celery_app.configure(redis_server.url)
    started: list[Worker] = []

    def start(pool: str = "prefork", concurrency: int = 4, **env: str) -> Worker:
        queue = f"q{next(_queues)}"
        log = tmp_path_factory.mktemp("celery") / f"{queue}.log"
        worker = Worker(redis_server.url, pool, concurrency, queue, log, env)
        started.append(worker)
        return worker

    yield start
    stop_all(started)


@pytest.fixture(scope="module")
def plain_workers(start_worker: Callable[..., Worker]) -> Callable[[str], Worker]:
    """The module's plain worker of a pool (4 children or threads), started at its first use
    and shared by the fixtures below: each test leaves it idle."""
    started: dict[str, Worker] = {}

    def get(pool: str) -> Worker:
        if pool not in started:
            started[pool] = start_worker(pool=pool, concurrency=4)
        return started[pool]

    return get


@pytest.fixture(scope="module", params=["prefork", "threads"])
def worker(request: pytest.FixtureRequest, plain_workers: Callable[[str], Worker]) -> Worker:
    return plain_workers(request.param)


@pytest.fixture
def prefork(start_worker: Callable[..., Worker], _prefork: list[Worker]) -> Worker:
    return _prefork[0]


@pytest.fixture(scope="module")
def _prefork(plain_workers: Callable[[str], Worker]) -> list[Worker]:
    return [plain_workers("prefork")]


def redis(server: RedisServer) -> Any:
    return server.client(decode_responses=True)


def settle(results: list[AsyncResult]) -> list[Any]:
    return [r.get(timeout=60, propagate=False) for r in results]


def test_six_concurrent_duplicates_skip(worker: Worker, redis_server: RedisServer) -> None:
    sent = [worker.send(celery_tasks.overlap_skip, str(i)) for i in range(6)]
    results = settle(sent)
    r = redis(redis_server)
    ran = r.lrange("skip:ran", 0, -1)
    assert int(r.get("skip:peak")) == 1  # never two bodies at once
    assert results.count("ran") == len(ran) >= 1
    # The others were skipped, not lost: .get() returned at once, naming the holder.
    runners = {res.id for res, value in zip(sent, results, strict=True) if value == "ran"}
    skips = [skipped(value) for value in results if value != "ran"]
    assert len(skips) == 6 - len(ran)
    for res, value in zip(sent, results, strict=True):
        info = skipped(value)
        if info is not None:
            assert info["key"] == "overlap:skip" and info["task_id"] == res.id
            assert info["holder_task_id"] in runners
            assert res.state == "SUCCESS"
    assert not locks["default"].is_locked("overlap:skip")


def test_six_concurrent_duplicates_raise(worker: Worker, redis_server: RedisServer) -> None:
    sent = [worker.send(celery_tasks.overlap_raise, str(i)) for i in range(6)]
    results = settle(sent)
    r = redis(redis_server)
    assert int(r.get("raise:peak")) == 1
    failed = [res for res in results if isinstance(res, Exception)]
    assert failed and all(isinstance(exc, LockNotAcquired) for exc in failed)
    assert "held by task" in str(failed[0])
    assert results.count("ran") == 6 - len(failed) == len(r.lrange("raise:ran", 0, -1))


def test_six_concurrent_duplicates_retry_until_all_ran(
    worker: Worker, redis_server: RedisServer
) -> None:
    results = settle([worker.send(celery_tasks.overlap_retry, str(i)) for i in range(6)])
    r = redis(redis_server)
    assert results == ["ran"] * 6  # each duplicate waited its turn by retrying
    assert int(r.get("retry:peak")) == 1
    assert sorted(r.lrange("retry:ran", 0, -1)) == [str(i) for i in range(6)]


def test_equal_arguments_are_one_key(worker: Worker, redis_server: RedisServer) -> None:
    calls = [((1,), {}), ((), {"a": 1}), ((1, 2), {}), ((), {"a": 1, "b": 2})]
    results = settle([worker.send(celery_tasks.keyed, *a, kwargs=k) for a, k in calls])
    assert int(redis(redis_server).get("keyed:peak")) == 1
    assert results.count("ran") == len(redis(redis_server).lrange("keyed:ran", 0, -1))
    assert sum(map(bool, map(skipped, results))) >= 1  # f(1), f(a=1), f(1, 2): one key
    other = worker.send(celery_tasks.keyed, 2).get(timeout=30)  # another key runs freely
    assert other == "ran"


def test_a_task_running_five_ttls_keeps_its_lock(worker: Worker, redis_server: RedisServer) -> None:
    first = worker.send(celery_tasks.long_task, "a", 5.0)  # TTL 1 s
    r = redis(redis_server)
    deadline = time.monotonic() + 30
    while not r.lrange("long:a:ran", 0, -1):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2.5)  # 2.5 TTLs in: the watchdog has renewed it
    info = locks["default"].inspect("long:a")
    assert info is not None and info.holder["k"] == first.id
    assert info.holder["n"] == "tests.support.celery_tasks.long_task"
    duplicate = worker.send(celery_tasks.long_task, "a", 0.1).get(timeout=30)
    assert skipped(duplicate)["holder_task_id"] == first.id  # skipped: still held
    assert first.get(timeout=30) == "ran"
    assert r.lrange("long:a:ran", 0, -1) == [first.id]


@pytest.mark.parametrize(
    ("mode", "options", "expected"),
    [
        ("ok", {}, ["ok:0"]),
        ("fail", {}, ["fail:0"]),
        ("retry", {}, ["retry:0", "retry:1"]),  # the retry ran: it could take the lock
        ("ignore", {}, ["ignore:0"]),
        ("reject", {}, ["reject:0"]),
        ("soft", {"soft_time_limit": 1}, ["soft:0"]),
        ("hard", {"time_limit": 1}, ["hard:0"]),
    ],
)
def test_released_on_every_outcome(
    prefork: Worker, redis_server: RedisServer, mode: str, options: dict[str, Any],
    expected: list[str],
) -> None:  # fmt: skip
    result = prefork.send(celery_tasks.outcome, mode, **options)
    key = f"outcome:{mode}"
    deadline = time.monotonic() + 30
    # Done when the body ran as often as expected and the lock is free again (its TTL is
    # 30 s: a lock freed within seconds was released, not expired).
    while redis(redis_server).lrange("outcome", 0, -1) != expected or locks["default"].is_locked(
        key
    ):
        assert time.monotonic() < deadline, (redis(redis_server).lrange("outcome", 0, -1), key)
        time.sleep(0.05)
    if mode in ("ok",):
        assert result.get(timeout=10) == "ok"


def test_revoke_with_terminate_releases(prefork: Worker, redis_server: RedisServer) -> None:
    result = prefork.send(celery_tasks.outcome, "revoke")
    deadline = time.monotonic() + 30
    while not locks["default"].is_locked("outcome:revoke"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    result.revoke(terminate=True)
    terminated = time.monotonic()
    while locks["default"].is_locked("outcome:revoke"):
        assert time.monotonic() - terminated < 10  # the TTL is 30 s: this is a release
        time.sleep(0.05)


def test_a_killed_worker_frees_the_key_within_its_ttl(
    start_worker: Callable[..., Worker], prefork: Worker, redis_server: RedisServer
) -> None:
    # The rescuer is the module's running worker: a rescuer started after the kill took
    # 5-10 s to start on a loaded machine, past the bound below.
    victim = start_worker(pool="prefork", concurrency=1)
    first = victim.send(celery_tasks.crash, "k", 60.0)
    r = redis(redis_server)
    deadline = time.monotonic() + 30
    while not r.lrange("crash:k", 0, -1):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    victim.kill()  # SIGKILL, parent and pool child together: nothing gets to clean up
    killed = time.monotonic()
    assert locks["default"].is_locked("crash:k")
    second = prefork.send(celery_tasks.crash, "k", 0.1)
    assert second.get(timeout=30) == "ran"
    ran_at = time.monotonic()
    assert r.lrange("crash:k", 0, -1) == [first.id, second.id]
    assert ran_at - killed < 2 + 5  # TTL 2 s (its retries every 0.1 s), and room for load


def test_dedupe_queued_returns_the_queued_task(prefork: Worker, redis_server: RedisServer) -> None:
    first = prefork.send(celery_tasks.deduped, "d", 1.0, countdown=0.5)
    second = prefork.send(celery_tasks.deduped, "d", 1.0)
    assert second.id == first.id  # queued already: not enqueued again
    deadline = time.monotonic() + 30
    while not locks["default"].is_locked("dedupe:d"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    third = prefork.send(celery_tasks.deduped, "d", 1.0)
    assert third.id == first.id  # running: not enqueued either
    assert first.get(timeout=30) == "ran"
    fourth = prefork.send(celery_tasks.deduped, "d", 0.1)
    assert fourth.id != first.id and fourth.get(timeout=30) == "ran"
    assert redis(redis_server).lrange("dedupe:d:ran", 0, -1) == [first.id, fourth.id]


@pytest.mark.parametrize("kind", ["stale", "unavailable", "refused"])
def test_a_lock_error_raised_by_a_task_keeps_its_fields(prefork: Worker, kind: str) -> None:
    # The default result serializer (JSON) stores an exception's args and rebuilds it as
    # cls(*args): the fields must be among them, and str() the message alone as before.
    assert celery_app.app.conf.result_serializer == "json"
    raised = celery_tasks.lock_errors()[kind]
    with pytest.raises(type(raised)) as caught:
        prefork.send(celery_tasks.raise_lock_error, kind).get(timeout=30)
    assert type(caught.value) is type(raised)
    assert vars(caught.value) == vars(raised) and vars(raised)  # the fields: fence, timed_out...
    assert str(caught.value) == str(raised) == raised.args[0]
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is type(raised) and vars(again) == vars(raised)
    assert str(again) == str(raised)


def test_the_test_app_used_before_its_configuration_stores_results(
    redis_server: RedisServer,
) -> None:
    """An eager apply in this test process (tests/interrupts/) makes the app's result backend
    before configure() ran: configure() must not leave the disabled one for later tests."""
    celery_app.forget_backend()  # as in a process where nothing used the app yet
    celery_app.app.conf.result_backend = None
    try:
        assert type(celery_app.app.backend).__name__ == "DisabledBackend"
    finally:
        celery_app.configure(redis_server.url)
    assert type(celery_app.app.backend).__name__ == "RedisBackend"


def test_every_lock_error_survives_the_json_result_backend() -> None:
    # Celery's own conversion, in process, for every exception class of the app (and the
    # Redlock's kinds of BackendUnavailable, which take its constructor).
    from django_redlock import exceptions
    from django_redlock.backends import redlock_io

    backend = celery_app.app.backend
    with_fields = [
        *celery_tasks.lock_errors().values(),
        exceptions.BackendUnavailable("cut"),  # not timed out
        exceptions.BackendRefused("lock 'x': the server refused: OOM command not allowed", "OOM"),
        redlock_io.Unasked("node 'a' was not asked", True),
        redlock_io.Unawaited("node 'b' was not waited for"),
    ]
    classes = [c for c in vars(exceptions).values() if isinstance(c, type)
               and issubclass(c, Exception) and c.__module__ == exceptions.__name__]  # fmt: skip
    assert exceptions.InvalidLockBackendError in classes and len(classes) >= 10
    tested = {type(e) for e in with_fields}
    plain = [c(f"{c.__name__}: the message") for c in classes if c not in tested]
    for raised in with_fields + plain:
        assert vars(raised) == {} or type(raised) in tested, f"{raised!r} has fields: test them"
        again = backend.exception_to_python(
            json.loads(json.dumps(backend.prepare_exception(raised, "json")))
        )
        assert type(again) is type(raised) and vars(again) == vars(raised)
        assert str(again) == str(raised)


def test_bad_single_instance_arguments_fail_at_decoration() -> None:
    from django_redlock import single_instance

    with pytest.raises(ValueError, match="on_duplicate"):
        single_instance(on_duplicate="ignore")
    with pytest.raises(ValueError, match="ttl"):
        single_instance(ttl=0)
    with pytest.raises(ValueError, match="not an argument"):

        @single_instance(key="x:{missing}")
        def task(self: Any, a: int) -> None: ...


def test_release_task_hold_matches_the_exact_task_id() -> None:
    from django_redlock.contrib.celery import release_task_hold

    # Task "abc.1" holds outcome:x (its token is "abc.1.0.<random>": attempt 0); stopping
    # task "abc" must not release it, though "abc." starts that token.
    task = celery_tasks.outcome._get_current_object()
    held = lock("outcome:x", ttl=30, token_prefix="abc.1.0.", auto_renew=False)
    assert held.acquire(blocking=False)
    assert not release_task_hold(task, "abc", ["x"], {})
    assert not release_task_hold(task, "abc.", ["x"], {})
    assert held.owned()
    assert release_task_hold(task, "abc.1", ["x"], {})
    assert not locks["default"].is_locked("outcome:x")


def test_single_instance_above_the_task_decorator_fails_at_decoration() -> None:
    from celery import shared_task

    from django_redlock import single_instance

    def body(a: int) -> None: ...

    for make in (shared_task, celery_app.app.task, shared_task(bind=True)):
        task = make(body)
        with pytest.raises(TypeError, match="directly under"):
            single_instance()(task)
    with pytest.raises(TypeError, match="directly under"):
        single_instance()(celery_tasks.keyed._get_current_object())


BOUND_KEY = 'tests.support.celery_tasks.bound_other_name:{"customer_id":7,"seconds":1.0}'


def test_bound_task_key_comes_from_celery_not_the_parameter_name(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # The worker's key leaves the task object out (its repr, an address, differs per process).
    result = prefork.send(celery_tasks.bound_other_name, 7, 1.0)
    deadline = time.monotonic() + 30
    while not redis(redis_server).lrange("bound:ran", 0, -1):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert locks["default"].is_locked(BOUND_KEY)
    assert result.get(timeout=30) == "ran"


def test_default_keys_follow_how_celery_built_the_task() -> None:
    from django_redlock.contrib.celery import lock_key

    assert lock_key(celery_tasks.bound_other_name, 7, 1.0) == BOUND_KEY
    with lock(BOUND_KEY, ttl=30):  # in this process too: a duplicate, skipped
        assert skipped(celery_tasks.bound_other_name(7, seconds=1.0))
    # bind=False and a first parameter named `self`: an argument like any other
    assert lock_key(celery_tasks.unbound_self, 1) != lock_key(celery_tasks.unbound_self, 3)
    with lock('tests.support.celery_tasks.unbound_self:{"other":2,"self":1}', ttl=30):
        assert skipped(celery_tasks.unbound_self(1))
        assert celery_tasks.unbound_self(3) == "ran"


class Colour(enum.Enum):
    RED = "red"


def test_default_key_arguments_are_canonical_or_refused() -> None:
    from django_redlock.contrib.celery import lock_key

    keyed = celery_tasks.keyed
    some = uuid.UUID("12345678-1234-5678-1234-567812345678")
    # What a JSON message turns them into gives the same key (the worker may see either).
    assert lock_key(keyed, some) == lock_key(keyed, str(some))
    assert lock_key(keyed, decimal.Decimal("1.50")) == lock_key(keyed, "1.50")
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    assert lock_key(keyed, moment) == lock_key(keyed, moment.isoformat())
    assert lock_key(keyed, datetime.date(2026, 1, 2)) == lock_key(keyed, "2026-01-02")
    assert lock_key(keyed, Colour.RED) == lock_key(keyed, "red")
    assert lock_key(keyed, (1, [2])) == lock_key(keyed, [1, [2]])
    assert lock_key(keyed, {"b": 1, "a": None}) == lock_key(keyed, {"a": None, "b": 1})
    # Anything else would put a repr (often with an address) in the key: refused, named.
    with pytest.raises(TypeError, match=r"argument 'a' .*object.*key="):
        celery_tasks.keyed(object())
    with pytest.raises(TypeError, match=r"argument b\[1\]\['x'\] .*set"):
        lock_key(keyed, 1, b=[0, {"x": {1}}])
    with pytest.raises(TypeError, match=r"argument 'a' .*dict key 1"):
        lock_key(keyed, {1: "x"})
    assert not locks["default"].is_locked("tests.support.celery_tasks.keyed:*")


# -- dedupe_queued on every backend, in this process: apply_async() publishes to a queue that no
# worker reads; the run is apply() in a thread, with the queued call's task id.

NOBODY = "nobody-reads-this"
# A connection to a broker nobody listens on fails at once: kombu would try it 3 times over
# 6 s first (what a failed publish leaves behind is the same either way).
NO_RETRY = {"max_retries": 0}
RUNNING = threading.Event()
FINISH = threading.Event()


def _dedupe_task(alias: str, mode: Any) -> Any:
    @shared_task(
        bind=True, base=SingleInstanceTask, name=f"tests.celery.test_celery.dedupe_{alias}_{mode}"
    )
    @single_instance(key="dedupe:{name}", ttl=5, using=alias, dedupe_queued=mode)
    def dedupe(self: Any, name: str) -> str:
        RUNNING.set()
        assert FINISH.wait(30)
        return str(self.request.id)

    return dedupe


DEDUPE_ALIASES = ("redis", "sentinel", "cluster", "quorum", "local")
DEDUPE = {(a, m): _dedupe_task(a, m) for a in DEDUPE_ALIASES for m in (True, "raise")}


@pytest.fixture
def broker(redis_server: RedisServer) -> Iterator[None]:
    celery_app.configure(redis_server.url)
    yield
    # AsyncResults live in reference cycles; collected later, they would unsubscribe from a
    # result store that has stopped.
    gc.collect()


@pytest.fixture(params=DEDUPE_ALIASES)
def dedupe_alias(
    request: pytest.FixtureRequest, redis_factory: Callable[..., RedisServer]
) -> Iterator[str]:
    if request.param == "quorum":
        nodes = [redis_factory() for _ in range(5)]
        with quorum_alias("quorum", nodes):
            yield "quorum"
        return
    if request.param in ("cluster", "sentinel"):
        request.getfixturevalue(f"_{request.param}_alias")
    yield request.param


@pytest.mark.parametrize("mode", [True, "raise"])
def test_dedupe_queued_on_every_backend(dedupe_alias: str, mode: Any, broker: None) -> None:
    task = DEDUPE[(dedupe_alias, mode)]
    name = f"{dedupe_alias}-{mode}"

    def again() -> str:
        if mode == "raise":
            with pytest.raises(AlreadyQueued) as caught:
                task.apply_async((name,), queue=NOBODY)
            assert f"dedupe:{name}" in str(caught.value)
            return caught.value.task_id
        return str(task.apply_async((name,), queue=NOBODY).id)

    first = task.apply_async((name,), queue=NOBODY, countdown=60)
    assert again() == first.id  # queued: not enqueued again
    RUNNING.clear()
    FINISH.clear()
    runner = threading.Thread(target=task.apply, args=((name,),), kwargs={"task_id": first.id})
    runner.start()
    try:
        assert RUNNING.wait(30)
        assert locks[dedupe_alias].is_locked(f"dedupe:{name}")
        assert again() == first.id  # running: not enqueued either
    finally:
        FINISH.set()
        runner.join(30)
    fourth = task.apply_async((name,), queue=NOBODY)  # done: enqueued anew
    assert fourth.id != first.id
    assert again() == fourth.id


def test_dedupe_queued_needs_single_instance_task(broker: None) -> None:
    with pytest.raises(ValueError, match="dedupe_queued"):
        single_instance(dedupe_queued="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dedupe_ttl"):
        single_instance(dedupe_queued=True, dedupe_ttl=1e30)

    @shared_task(bind=True)
    @single_instance(dedupe_queued=True)
    def no_base(self: Any, a: int) -> int:
        return a

    with pytest.raises(TypeError, match="base=SingleInstanceTask"):
        no_base(1)


def test_retry_of_a_deduplicated_task_is_enqueued(
    prefork: Worker, redis_server: RedisServer
) -> None:
    result = prefork.send(celery_tasks.deduped_retry, "r")
    assert result.get(timeout=30) == "ran"
    assert redis(redis_server).lrange("dedupe-retry:r", 0, -1) == ["0", "1"]


def test_queue_marker_ops(alias: str) -> None:
    backend = locks[alias]
    mark, clear = backend.op_mark_queued, backend.op_clear_queued
    assert backend.execute(mark("m", "t1", 300)) is None  # noted
    assert backend.execute(mark("m", "t2", 300)) == "t1"  # t1 is queued already
    assert backend.execute(clear("m", "t2")) is False  # not t2's to clear
    assert backend.execute(clear("m", "t1")) is True
    assert backend.execute(mark("m", "t2", 300)) is None
    time.sleep(0.4)  # expired: the next call is noted
    assert backend.execute(mark("m", "t3", 300)) is None
    assert backend.execute(mark("m", "t4", 300)) == "t3"


def test_limit_two_runs_at_most_two_at_once(prefork: Worker, redis_server: RedisServer) -> None:
    results = settle([prefork.send(celery_tasks.limited, str(i)) for i in range(6)])
    r = redis(redis_server)
    assert results == ["ran"] * 6  # the others retried until a permit was free
    assert int(r.get("limited:peak")) == 2  # two at once, never three
    assert sorted(r.lrange("limited:ran", 0, -1)) == [str(i) for i in range(6)]
    assert locks["default"].inspect("limited") is None


def test_limit_is_checked_at_decoration() -> None:
    from django_redlock import single_instance

    with pytest.raises(TypeError, match="limit"):
        single_instance(limit=True)
    with pytest.raises(ValueError, match="limit"):
        single_instance(limit=0)
    with pytest.raises(ValueError, match="dedupe_queued"):
        single_instance(limit=2, dedupe_queued=True)


# -- retries, redelivery, helpers, chains, eager mode -----------------------------------------


def wait_for(check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return value


def test_hold_tokens_name_the_task_and_its_attempt() -> None:
    assert hold_of("abc.0.Xy_z-12f") == ("abc", 0)
    assert hold_of("abc.1.3.Xy12") == ("abc.1", 3)  # task ids may contain dots
    for token in (None, "", "abc", "abc.Xy12", ".0.Xy12", "abc.x.Xy12"):
        assert hold_of(token) is None


def test_a_fast_retry_waits_for_its_own_earlier_attempt(
    worker: Worker, redis_server: RedisServer
) -> None:
    # The retry (same task id, retries=1) arrives while attempt 0 still holds the lock: it is
    # no duplicate of anything, so it waits for attempt 0's release and runs.
    result = worker.send(celery_tasks.retry_fast, "r")
    r = redis(redis_server)
    wait_for(lambda: r.lrange("retry-fast:r", 0, -1) == ["0", "1"])
    wait_for(lambda: not locks["default"].is_locked("retry-fast:r"))
    assert result.get(timeout=30) == "ran"


def test_a_redelivered_message_does_not_run_twice(
    worker: Worker, redis_server: RedisServer
) -> None:
    # The same message (same task id) delivered again while its task runs, as acks_late does
    # past the broker's visibility timeout: skipped, and the result stays the first run's.
    task_id = str(uuid.uuid4())
    first = worker.send(celery_tasks.redelivered, "m", 2.0, task_id=task_id)
    r = redis(redis_server)
    wait_for(lambda: r.lrange("redeliver:m:ran", 0, -1))
    again = worker.send(celery_tasks.redelivered, "m", 2.0, task_id=task_id)
    assert again.id == first.id
    assert first.get(timeout=30) == "ran"  # not a skip's sentinel, stored by the copy
    time.sleep(0.5)
    assert r.lrange("redeliver:m:ran", 0, -1) == [task_id]  # the body ran once
    assert f"skipped a redelivered message: task {task_id} " in worker.log.read_text()
    # Another task id for the same key is a duplicate as before, not a redelivery.
    assert worker.send(celery_tasks.redelivered, "m", 0.1).get(timeout=30) == "ran"


def redelivered_skips(worker: Worker, task_id: str) -> int:
    return worker.log.read_text().count(f"skipped a redelivered message: task {task_id} ")


def test_a_redelivered_message_does_not_run_twice_under_a_limit(
    worker: Worker, redis_server: RedisServer
) -> None:
    # limit=2: the copy of a running task's message finds a permit free, or (a second task
    # holding the other) none. Either way it is the same task: skipped, never a second run.
    task_id = str(uuid.uuid4())
    task = celery_tasks.redelivered_limited
    first = worker.send(task, "n", 3.0, task_id=task_id)
    r = redis(redis_server)
    wait_for(lambda: r.lrange("redeliver:n:ran", 0, -1))
    worker.send(task, "n", 3.0, task_id=task_id)  # a permit is free for it
    wait_for(lambda: redelivered_skips(worker, task_id) == 1)
    other = worker.send(task, "n", 2.0)  # another task id: the second permit, at once
    wait_for(lambda: len(r.lrange("redeliver:n:ran", 0, -1)) == 2)
    worker.send(task, "n", 3.0, task_id=task_id)  # no permit free
    wait_for(lambda: redelivered_skips(worker, task_id) == 2)
    assert first.get(timeout=30) == "ran"  # not a skip's sentinel, stored by a copy
    assert other.get(timeout=30) == "ran"
    time.sleep(0.5)
    assert r.lrange("redeliver:n:ran", 0, -1) == [task_id, other.id]  # each body ran once
    assert int(r.get("redeliver:n:peak")) == 2
    assert locks["default"].inspect("redeliver-limited:n") is None


def test_copies_of_one_task_taking_permits_at_once_keep_one(redis_alias: str) -> None:
    # Two copies of one message that both got a permit before either looked: each sees the
    # other; the first (lower fence) keeps its permit, the second gives its back.
    from django_redlock import Semaphore
    from django_redlock.contrib.single import _alone

    first, second = (
        Semaphore("copies", 3, ttl=30, using=redis_alias, token_prefix="t-1.0.") for _ in "ab"
    )
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    assert (second.fence or 0) > (first.fence or 0)
    kept, info = _alone(second, "t-1", 0)
    assert not kept and info is not None and second.token is None  # released
    assert _alone(first, "t-1", 0) == (True, None)
    # A later attempt holding a permit: an older attempt's copy gives its permit back too.
    stale = Semaphore("copies", 3, ttl=30, using=redis_alias, token_prefix="t-1.0.")
    newer = Semaphore("copies", 3, ttl=30, using=redis_alias, token_prefix="t-2.1.")
    first.release()
    assert newer.acquire(blocking=False) and stale.acquire(blocking=False)
    older = Semaphore("copies", 3, ttl=30, using=redis_alias, token_prefix="t-2.0.")
    assert older.acquire(blocking=False)
    assert _alone(older, "t-2", 0)[0] is False and older.token is None
    assert _alone(stale, "t-1", 0) == (True, None)  # another task id is no copy
    newer.release()
    stale.release()


def test_a_fast_retry_under_a_limit_waits_for_its_own_earlier_attempt(
    worker: Worker, redis_server: RedisServer
) -> None:
    # The retry finds a permit free while attempt 0 still runs: it waits for attempt 0 (one
    # task id never runs twice at once), then runs, as with a plain lock.
    result = worker.send(celery_tasks.retry_fast_limited, "r")
    r = redis(redis_server)
    assert result.get(timeout=30) == "ran"
    wait_for(lambda: r.lrange("retry-fast-limited:r", 0, -1) == ["0", "1"])
    assert int(r.get("retry-fast-limited:r:peak")) == 1
    wait_for(lambda: locks["default"].inspect("retry-fast-limited:r") is None)


@pytest.fixture(scope="module")
def _threads(plain_workers: Callable[[str], Worker]) -> Worker:
    return plain_workers("threads")  # a threads worker (its concurrency does not matter here)


@pytest.mark.parametrize("task_name", ["key_of", "key_of_plain"])
def test_lock_key_is_the_same_in_every_process(
    task_name: str, _threads: Worker, _prefork: list[Worker]
) -> None:
    # On a task built on SingleInstanceTask and on one built on Celery's own Task alike.
    task = getattr(celery_tasks, task_name)
    customer = {"id": uuid.UUID(int=7), "tags": ("a", "b"), "limit": decimal.Decimal("1.5")}
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    here = task.lock_key(customer, when, 0.2)
    assert here.startswith(f"tests.support.celery_tasks.{task_name}:")
    for each in (_prefork[0], _threads):
        key, held = each.send(task, customer, when, 0.2).get(timeout=30)
        assert (key, held) == (here, True)  # and it is the key the run holds


class OwnBase(Task):
    """A project's own task base, neither Celery's default nor SingleInstanceTask."""


def test_every_decorated_task_has_lock_key_and_release_lock(broker: None) -> None:
    from celery import Celery

    from django_redlock.contrib.celery import lock_key

    app = Celery("helpers", set_as_current=False)

    @app.task(bind=True, base=OwnBase, name="helpers.own_base")
    @single_instance(key="own:{a}", ttl=5)
    def own_base(self: Any, a: int) -> None: ...

    @app.task(name="helpers.unbound")
    @single_instance(ttl=5)
    def unbound(a: int, b: int = 2) -> None: ...

    @app.task(name="helpers.plain")
    def plain(a: int) -> None: ...

    assert own_base.lock_key(3) == lock_key(own_base, 3) == "own:3"
    assert unbound.lock_key(1) == unbound.lock_key(a=1, b=2) == lock_key(unbound, 1)
    assert celery_tasks.keyed.lock_key(1) == lock_key(celery_tasks.keyed, 1)  # a shared_task
    assert celery_tasks.overlap_skip.lock_key("t") == "overlap:skip"
    with pytest.raises(TypeError, match="not a task decorated"):
        plain.lock_key(1)
    # release_lock likewise, on a task without SingleInstanceTask.
    assert not own_base.release_lock(4)
    held = lock("own:4", ttl=30, token_prefix="dead-task.0.", auto_renew=False)
    assert held.acquire(blocking=False)
    assert own_base.release_lock(4)
    assert not locks["default"].is_locked("own:4")


def test_release_lock_forces_the_key_free(caplog: pytest.LogCaptureFixture) -> None:
    task = celery_tasks.deduped
    key = task.lock_key("stuck")
    with pytest.raises(TypeError, match="not a task decorated"):
        release_lock(celery_tasks.chain_tail, "x", "y")
    assert not task.release_lock("stuck")  # nothing held
    held = lock(key, ttl=30, token_prefix="dead-task.0.", auto_renew=False)
    assert held.acquire(blocking=False)
    with caplog.at_level("WARNING", logger="django_redlock"):
        assert task.release_lock("stuck")
    assert not locks["default"].is_locked(key)
    assert "force-released 'dedupe:stuck'" in caplog.text
    assert "tests.support.celery_tasks.deduped.release_lock()" in caplog.text


@pytest.fixture(scope="module")
def solo(start_worker: Callable[..., Worker]) -> Worker:
    return start_worker(pool="solo", concurrency=1)


def test_a_skipped_duplicate_in_a_chain(solo: Worker, redis_server: RedisServer) -> None:
    r = redis(redis_server)
    q = {"queue": solo.queue}
    with lock("chain:skip", ttl=30):  # held elsewhere: the chain's head is a duplicate
        # "skip": the chain goes on; the next task gets the sentinel as the head's result.
        result = (
            celery_tasks.chain_head.s("skip").set(**q) | celery_tasks.chain_tail.s("skip").set(**q)
        ).apply_async()
        assert result.get(timeout=30) == "tail"
        (previous,) = r.lrange("chain:skip", 0, -1)
        assert skipped(json.loads(previous))["key"] == "chain:skip"
    with lock("chain:raise", ttl=30):
        # "raise": the head fails with LockNotAcquired; Celery marks the rest of the chain
        # failed with it (visible, not lost), and never runs it.
        result = (
            celery_tasks.chain_head_raise.s("raise").set(**q)
            | celery_tasks.chain_tail.s("raise").set(**q)
        ).apply_async()
        with pytest.raises(LockNotAcquired):
            result.get(timeout=30)  # the head's error (get follows the parents)
        wait_for(lambda: result.parent.state == "FAILURE")  # Celery stores the two in turn
        wait_for(lambda: result.state == "FAILURE")
        time.sleep(0.5)
        assert r.lrange("chain:raise", 0, -1) == []


@shared_task(bind=True, base=SingleInstanceTask, name="tests.celery.test_celery.eager_local")
@single_instance(key="eager:{name}", ttl=5, using="local", dedupe_queued=True)
def eager_local(self: Any, name: str) -> str:
    return f"ran {self.request.id}"


def test_task_always_eager_with_locmem(broker: None) -> None:
    app = celery_app.app
    app.conf.task_always_eager = True
    try:
        first = eager_local.delay("e")
        assert first.get() == f"ran {first.id}"
        assert eager_local.delay("e").get().startswith("ran ")  # done: runs again
        with lock("eager:e", ttl=5, using="local"):
            value = eager_local.delay("e").get()
        assert skipped(value)["key"] == "eager:e"
        assert not locks["local"].is_locked("eager:e")
    finally:
        app.conf.task_always_eager = False


def test_the_celery_extra_runs_a_worker_on_redis() -> None:
    # Celery's Redis transport needs kombu[redis] (redis-py and `packaging`): without
    # celery[redis] a worker on a Redis broker dies with ModuleNotFoundError at start.
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    for extra in ("celery", "beat", "test"):
        assert "celery[redis]>=" in extras[extra], extra
    assert "django-celery-beat>=" in extras["beat"]
    # Not in "test": it requires Django < 6.1, and tox's 6.1 environments install "test".
    assert "django-celery-beat" not in extras["test"]


@pytest.fixture(scope="module")
def redelivering(start_worker: Callable[..., Worker]) -> Iterator[Worker]:
    # acks_late, a 2 s visibility timeout, two children: shared by both limits below.
    worker = start_worker(pool="prefork", concurrency=2, REDLOCK_TEST_REDELIVER="1")
    yield worker
    worker.stop()


@pytest.mark.parametrize("limit", [None, 2])
def test_acks_late_past_the_visibility_timeout_runs_the_body_once(
    limit: int | None, redelivering: Worker, redis_server: RedisServer
) -> None:
    # The real thing: acks_late, a 2 s visibility timeout and a task running until the broker
    # delivered the message again (and the copy was skipped). The copies are skipped, the
    # body runs once (with limit=2 too, where a copy finds a permit free).
    late = redelivering
    task = celery_tasks.redelivered if limit is None else celery_tasks.redelivered_limited
    name = f"late-{limit}-{uuid.uuid4().hex[:6]}"
    result = late.send(task, name, 30.0)
    skip = f"skipped a redelivered message: task {result.id} "
    try:
        wait_for(lambda: skip in late.log.read_text(), timeout=30)
    finally:
        redis(redis_server).set(f"redeliver:{name}:release", 1, ex=60)
    assert result.get(timeout=60) == "ran"
    assert "skipped a redelivered message" in late.log.read_text()
    assert redis(redis_server).lrange(f"redeliver:{name}:ran", 0, -1) == [result.id]


def test_acks_late_copy_taken_after_the_run_ended_does_not_run_again(
    start_worker: Callable[..., Worker], redis_server: RedisServer
) -> None:
    # One child: the copy the broker puts back while the run goes on is taken only once
    # that run acknowledged and released the key. The hold is gone then: the copy must still
    # be known as the same message (same task id and attempt), never a second run. The run
    # ends once its copy is back in the queue.
    late = start_worker(pool="prefork", concurrency=1, REDLOCK_TEST_REDELIVER="1")
    name = f"late-one-{uuid.uuid4().hex[:6]}"
    r = redis(redis_server)
    result = late.send(celery_tasks.redelivered, name, 30.0)
    try:
        wait_for(lambda: redis_server.client(db=1).llen(late.queue), timeout=30)
    finally:
        r.set(f"redeliver:{name}:release", 1, ex=60)
    assert result.get(timeout=60) == "ran"
    runs = f"redeliver:{name}:ran"
    wait_for(lambda: "ran already" in late.log.read_text() or r.llen(runs) > 1, timeout=20)
    time.sleep(1)
    assert r.lrange(runs, 0, -1) == [result.id]
    assert result.get(timeout=5) == "ran"  # the copy stored nothing over it
    late.stop()


def deliver(task: Any, task_id: str, *args: Any) -> Any:
    """Run ``task``'s body as a worker runs a delivery of its message ``task_id`` (attempt
    0, not eager: ``acks_late`` applies); a copy of it is the same call again."""
    task.push_request(id=task_id, retries=0, is_eager=False, headers={}, args=list(args),
                      kwargs={}, delivery_info={"routing_key": "celery"})  # fmt: skip
    try:
        return task.run(*args)
    finally:
        task.pop_request()


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True,
             name="tests.celery.test_celery.late_fenced_sale")  # fmt: skip
@single_instance(key="late-fenced-sale:{buyer}", ttl=10, atomic="default")
def late_fenced_sale(self: Any, buyer: str) -> bool:
    from ..support.fenced_child import sell_one

    return sell_one("default", 1, buyer)


@pytest.mark.django_db(transaction=True)
def test_acks_late_fenced_run_stopped_at_its_commit_runs_again(
    broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process stops as Django sends the COMMIT (SIGKILL, OOM, a hard time limit: here
    # SystemExit, which Celery records nothing for either). Nothing committed, and its
    # message comes back (reject_on_worker_lost): the copy must run. The run had noted
    # itself "done" inside its transaction, before the COMMIT: the copy was skipped, the
    # sale lost.
    from celery.exceptions import Ignore
    from django.db.backends.base.base import BaseDatabaseWrapper

    from ..support.fenced_child import open_shop, sales

    open_shop("default", 1, 5)
    buyer = uuid.uuid4().hex[:8]
    task_id = f"sale-{buyer}"
    noted = f"late-fenced-sale:{buyer}:done:{task_id}.0"
    at_commit: list[bool] = []

    def stopped(self: Any) -> None:
        at_commit.append(locks["default"].client.exists(f"redlock:{{{noted}}}:queued") > 0)
        self.connection.rollback()  # as the server does for a process that died
        raise SystemExit(1)

    monkeypatch.setattr(BaseDatabaseWrapper, "commit", stopped)
    with pytest.raises(SystemExit):
        deliver(late_fenced_sale, task_id, buyer)
    monkeypatch.undo()
    assert at_commit == [False] and sales("default") == []
    assert deliver(late_fenced_sale, task_id, buyer) is True  # the message came back: it runs
    assert sales("default") == [(buyer, 5)]
    with pytest.raises(Ignore):  # committed and noted: a later copy is skipped
        deliver(late_fenced_sale, task_id, buyer)
    assert sales("default") == [(buyer, 5)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("outcome", ["committed", "unknown"])
def test_acks_late_fenced_run_whose_commit_reply_was_lost_is_not_run_again(
    broker: None, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    # The COMMIT went through and its reply was lost. The row proves it committed (the block
    # returns; its on_commit callbacks, the note's among them, did not run), or cannot tell
    # (CommitOutcomeUnknown: the task fails, for someone to check). Either way a copy of the
    # message must not sell again: unknown is not "nothing committed".
    from celery.exceptions import Ignore
    from django.db import OperationalError
    from django.db.backends.base.base import BaseDatabaseWrapper

    from django_redlock import CommitOutcomeUnknown, fencing

    from ..support.fenced_child import open_shop, sales

    open_shop("default", 1, 5)
    buyer = uuid.uuid4().hex[:8]
    task_id = f"sale-{buyer}"
    real = BaseDatabaseWrapper.commit

    def reply_lost(self: Any) -> None:
        real(self)
        raise OperationalError("the COMMIT's reply was lost")

    monkeypatch.setattr(BaseDatabaseWrapper, "commit", reply_lost)
    if outcome == "unknown":
        monkeypatch.setattr(fencing, "commit_outcome", lambda *args, **kwargs: None)
        with pytest.raises(CommitOutcomeUnknown):
            deliver(late_fenced_sale, task_id, buyer)
    else:
        assert deliver(late_fenced_sale, task_id, buyer) is True
    monkeypatch.undo()
    assert sales("default") == [(buyer, 5)]
    with pytest.raises(Ignore):  # the message's copy
        deliver(late_fenced_sale, task_id, buyer)
    assert sales("default") == [(buyer, 5)]


@pytest.mark.django_db(transaction=True)
def test_acks_late_fenced_run_whose_commit_reply_was_lost_is_noted_before_its_release(
    broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The COMMIT's reply lost, the row proves it committed: the run was noted done only after
    # run_held released the key. A copy of the message (another worker) taking the key in
    # between found it free and no note: it sold again.
    from django.db import OperationalError
    from django.db.backends.base.base import BaseDatabaseWrapper

    from django_redlock.locking import Lock

    from ..support.fenced_child import open_shop, sales

    open_shop("default", 1, 5)
    buyer = uuid.uuid4().hex[:8]
    task_id = f"sale-{buyer}"
    real_commit, real_release = BaseDatabaseWrapper.commit, Lock.release
    copy: list[str] = []

    def reply_lost(self: Any) -> None:
        real_commit(self)
        raise OperationalError("the COMMIT's reply was lost")

    def copy_taken_at_release(self: Any) -> None:
        real_release(self)
        if copy or not self.name.startswith("late-fenced-sale:"):
            return
        copy.append("taken")  # once (the copy releases too)
        monkeypatch.setattr(BaseDatabaseWrapper, "commit", real_commit)
        try:  # here, as another worker would: the key is free, the block over
            copy.append(repr(deliver(late_fenced_sale, task_id, buyer)))
        except Exception as exc:
            copy.append(type(exc).__name__)

    monkeypatch.setattr(BaseDatabaseWrapper, "commit", reply_lost)
    monkeypatch.setattr(Lock, "release", copy_taken_at_release)
    assert deliver(late_fenced_sale, task_id, buyer) is True
    monkeypatch.undo()
    assert copy == ["taken", "Ignore"] and sales("default") == [(buyer, 5)]


STOPS: list[type[BaseException]] = []


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True,
             name="tests.celery.test_celery.late_stopped")  # fmt: skip
@single_instance(key="late-stopped:{name}", ttl=10)
def late_stopped(self: Any, name: str) -> str:
    if STOPS:
        raise STOPS.pop()("stopped mid-body")
    return name


@pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt])
def test_acks_late_run_stopped_mid_body_runs_again(broker: None, stop: type[BaseException]) -> None:
    # sys.exit() in a signal handler, or KeyboardInterrupt, mid-body: Celery records nothing,
    # the child exits and its message comes back. The run noted itself "done" on its way
    # out: the copy was skipped, and the body never completed.
    from celery.exceptions import Ignore

    name = uuid.uuid4().hex[:8]
    STOPS[:] = [stop]
    with pytest.raises(stop):
        deliver(late_stopped, f"stopped-{name}", name)
    assert deliver(late_stopped, f"stopped-{name}", name) == name  # the copy runs
    with pytest.raises(Ignore):  # and, once it ran, a later copy does not
        deliver(late_stopped, f"stopped-{name}", name)


# -- an exception at any line once the lock is taken ------------------------------------------


@pytest.mark.parametrize("where", ["marker", "run"])
def test_a_soft_time_limit_right_after_the_acquire_releases(
    prefork: Worker, redis_server: RedisServer, where: str
) -> None:
    # SoftTimeLimitExceeded raised once the lock is taken and before the run's body (while
    # the queue marker is cleared, or as the run starts): the hold must go, not stay renewed
    # by the watchdog for the child's life (every later call would find it held).
    from celery.exceptions import SoftTimeLimitExceeded

    r = redis(redis_server)
    name = f"{where}-{uuid.uuid4().hex[:6]}"
    r.set(f"soft-gap:{name}:interrupt-at-{where}", 1)
    failed = prefork.send(celery_tasks.soft_gap, name)
    with pytest.raises(SoftTimeLimitExceeded):
        failed.get(timeout=30)
    ended = time.monotonic()
    while locks["default"].is_locked(f"soft-gap:{name}"):
        assert time.monotonic() - ended < 5, "still held (its TTL is 30 s, renewed)"
        time.sleep(0.05)
    assert r.lrange(f"soft-gap:{name}:ran", 0, -1) == []
    again = prefork.send(celery_tasks.soft_gap, name)
    assert again.get(timeout=30) == "ran"
    assert r.lrange(f"soft-gap:{name}:ran", 0, -1) == [again.id]


# -- the task-id rule: any task id Celery accepts ---------------------------------------------

ODD_TASK_IDS = ["customer|42", "x" * 300, "a\x1fb", "#not-a-hash", "b64:YQ==", "tâche.1.2", "t\n1"]


@pytest.mark.parametrize("task_id", ODD_TASK_IDS, ids=range(len(ODD_TASK_IDS)))
def test_any_task_id_celery_accepts_runs_and_is_named(
    prefork: Worker, redis_server: RedisServer, task_id: str
) -> None:
    # A caller's own task id ("|", over 200 chars, the holder's field separator...) runs its
    # body, and a delay() while it runs is deduplicated to that very id.
    name = uuid.uuid4().hex[:8]
    task_id = f"{task_id}-{name}"
    first = prefork.send(celery_tasks.deduped, name, 1.5, task_id=task_id)
    wait_for(lambda: locks["default"].is_locked(f"dedupe:{name}"))
    second = prefork.send(celery_tasks.deduped, name, 0.1)
    assert second.id == task_id
    assert first.get(timeout=30) == "ran"
    assert redis(redis_server).lrange(f"dedupe:{name}:ran", 0, -1) == [task_id]


def test_hold_tokens_carry_odd_task_ids() -> None:
    from django_redlock.contrib.single import (
        _prefix,
        holder_id,
        holds_task,
        task_id_of,
        token_id,
    )
    from django_redlock.locking.base import check_token_prefix

    for task_id in [*ODD_TASK_IDS, "abc", "abc.1", "#" + "0" * 40, "\ud800", "a\udfffb"]:
        prefix = _prefix(task_id, 3)
        assert check_token_prefix(prefix) == prefix  # a valid token prefix, whatever the id
        assert holds_task(f"{prefix}Xy12", task_id) == 3
        assert holds_task(f"{prefix}Xy12", task_id + "z") is None
        assert "\x1f" not in holder_id(task_id)
        holder_id(task_id).encode("utf-8")  # what Redis takes
        assert task_id_of({"k": holder_id(task_id)}) == task_id
    assert token_id("abc") == "abc"
    assert token_id("#" + "0" * 40) != "#" + "0" * 40  # a raw id never looks like a hash


# -- a run stopped from the worker's main process: released only once its process is gone ---


def test_a_revoke_by_sigusr1_keeps_the_lock_while_the_body_cleans_up(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # SIGUSR1 raises SoftTimeLimitExceeded in the body, which may catch it and go on: the
    # worker's main process must not release the hold meanwhile (a second run would start).
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    key = f"stop-cleans:{name}"
    first = prefork.send(celery_tasks.cleans_up_when_stopped, name)
    wait_for(lambda: r.lrange(f"{key}:ran", 0, -1))
    first.revoke(terminate=True, signal="SIGUSR1")
    wait_for(lambda: r.lrange(f"{key}:soft", 0, -1), timeout=10)
    time.sleep(0.5)
    assert r.get(f"{key}:inside") == "1"
    assert locks["default"].is_locked(key), "released while the body still runs"
    second = prefork.send(celery_tasks.cleans_up_when_stopped, name, 0.1)
    assert skipped(second.get(timeout=30))
    wait_for(lambda: not locks["default"].is_locked(key), timeout=10)
    assert r.get(f"{key}:peak") == "1"


def test_a_hard_time_limit_releases_only_once_the_child_is_gone(
    prefork: Worker, redis_server: RedisServer
) -> None:
    # Celery fails the task (task_failure) before billiard kills the child: a release then
    # lets another holder in while the body still writes. Whoever takes the key next must
    # see no write of it after the acquire.
    r = redis(redis_server)
    for _ in range(4):
        name = uuid.uuid4().hex[:8]
        key = f"hard-limit:{name}"
        result = prefork.send(celery_tasks.hard_limited, name)
        wait_for(lambda: r.lrange(f"{key}:pids", 0, -1))  # noqa: B023
        held = lock(key, ttl=10)
        assert held.acquire(timeout=20)
        taken = time.time()
        time.sleep(0.2)
        assert float(r.get(f"{key}:last")) < taken, "the killed body wrote after the acquire"
        held.release()
        result.get(timeout=10, propagate=False)


def _hold_in_a_child(
    redis_server: RedisServer, name: str, prefix: str, host: str | None = None
) -> subprocess.Popen[str]:
    """A process (named ``host``, if given) holding ``name`` until it is killed."""
    code = (
        "import socket, sys, django\n"
        f"if {host!r}: socket.gethostname = lambda: {host!r}\n"
        "django.setup()\n"
        "from django_redlock import lock\n"
        f"held = lock({name!r}, ttl=30, token_prefix={prefix!r}, auto_renew=False)\n"
        "assert held.acquire(blocking=False)\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    env = {
        **os.environ, "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "tests.support.worker_settings",
        "REDLOCK_TEST_REDIS": redis_server.url,
    }  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def test_release_task_hold_leaves_a_live_process_and_another_hosts_hold(
    redis_server: RedisServer,
) -> None:
    # A copy of a running task's message, killed on another worker, fails there with
    # WorkerLostError for the same task id: its main process must not release the live run's
    # hold (on another host, or a process of this host that still runs). A hold of this
    # host's process that is gone is released.
    from django_redlock.contrib.celery import release_task_hold

    task = celery_tasks.outcome._get_current_object()
    for where, host in (("live", None), ("elsewhere", "another-host")):
        child = _hold_in_a_child(redis_server, f"outcome:{where}", "t1.0.", host)
        try:
            assert not release_task_hold(task, "t1", [where], {})
            assert locks["default"].is_locked(f"outcome:{where}")
        finally:
            child.kill()
            child.wait()
    assert release_task_hold(task, "t1", ["live"], {})  # its process is gone: released
    assert not locks["default"].is_locked("outcome:live")
    assert not release_task_hold(task, "t1", ["elsewhere"], {})  # only its TTL tells there
    assert locks["default"].is_locked("outcome:elsewhere")
    release_lock(task, "elsewhere")
