"""``@single_instance(atomic=...)`` on a real Celery worker, on the tests' PostgreSQL."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from django_redlock.contrib.celery import release_lock
from django_redlock.testing import PostgresServer, RedisServer
from tests.support import celery_app, fenced_tasks

from ..celery.test_celery import Worker
from ..support.fenced_child import open_shop, sales
from ..support.proxy import LossyProxy
from .test_fenced_postgres import PG, eventually, waiting_on_a_row

pytestmark = pytest.mark.django_db(databases=["default", PG], transaction=True)


@pytest.fixture
def worker(
    redis_server: RedisServer, postgres_env: dict[str, str], tmp_path: Path
) -> Iterator[Worker]:
    celery_app.configure(redis_server.url)
    started = Worker(redis_server.url, "prefork", 2, "fenced", tmp_path / "worker.log",
                     postgres_env)  # fmt: skip
    yield started
    started.stop()
    gc.collect()  # AsyncResults in reference cycles: collected while the result store runs


def test_a_task_whose_lock_was_force_released_keeps_its_successor_waiting(
    worker: Worker, redis_server: RedisServer
) -> None:
    """Task A reads the stock; its lock is force-released (as an operator would); task B
    takes it, and its body waits for A's transaction: it reads what A committed. A's release
    then finds its hold gone: logged, and A succeeds (its sale committed; a retry would sell
    twice)."""
    open_shop(PG, 1, 2)
    r = redis_server.client()
    first = worker.send(fenced_tasks.fenced_sale, 1, "a", True)
    eventually(lambda: r.llen("fenced-sale:a:read"), "task A reading the stock", 60)
    assert release_lock(fenced_tasks.fenced_sale, 1, "a", True)
    second = worker.send(fenced_tasks.fenced_sale, 1, "b")
    eventually(lambda: second.ready() or waiting_on_a_row(), "task B waiting for A's row", 60)
    r.rpush("fenced-sale:a:go", 1)
    assert second.get(timeout=60) is True and first.get(timeout=60) is True
    assert sales(PG) == [("a", 2), ("b", 1)]


def test_a_task_that_fails_after_selling_commits_nothing(worker: Worker) -> None:
    open_shop(PG, 1, 5)
    failed = worker.send(fenced_tasks.fenced_sale, 1, "a", kwargs={"fail": True})
    with pytest.raises(RuntimeError, match="after selling: True"):
        failed.get(timeout=60)
    assert sales(PG) == []  # rolled back
    assert worker.send(fenced_tasks.fenced_sale, 1, "b").get(timeout=60) is True
    assert sales(PG) == [("b", 5)]


def test_a_callback_failing_after_the_commit_does_not_make_autoretry_sell_twice(
    worker: Worker,
) -> None:
    """The on_commit callback raises after the COMMIT (ConnectionError, in the task's
    autoretry_for): raised out of the task, Celery retried it and sold again. The block
    committed: the error is logged, the task succeeds once."""
    open_shop(PG, 1, 5)
    assert worker.send(fenced_tasks.fenced_sale_with_mail, 1, "a").get(timeout=60) is True
    assert sales(PG) == [("a", 5)]


def test_a_soft_time_limit_during_a_late_commit_does_not_make_autoretry_sell_twice(
    redis_server: RedisServer, postgres_server: PostgresServer, postgres_env: dict[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    """The worker reaches PostgreSQL through a proxy that holds the COMMIT's reply back; the
    soft time limit fires meanwhile. Django's exit turned it into ProgrammingError, passed on
    as "nothing committed": autoretry_for sold again. The block committed: the task succeeds
    once."""
    proxy = LossyProxy(postgres_server.port)
    celery_app.configure(redis_server.url)
    env = {**postgres_env, "REDLOCK_TEST_PG_PORT": str(proxy.port)}
    started = Worker(redis_server.url, "prefork", 1, "fenced", tmp_path / "worker.log", env)
    try:
        open_shop(PG, 1, 5)
        proxy.fault_commit("late", hold=4.0)
        result = started.send(fenced_tasks.fenced_sale_slow_commit, 1, "a")
        assert result.get(timeout=60) is True
        assert proxy.commits_faulted == 1 and sales(PG) == [("a", 5)]
        log = (tmp_path / "worker.log").read_text()
        assert "Soft time limit (1s) exceeded" in log and "proves that it committed" in log
    finally:
        started.stop()
        proxy.close()
        gc.collect()
