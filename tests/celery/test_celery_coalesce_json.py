"""``on_duplicate="coalesce"`` with arguments Celery's JSON serializer carries (datetime,
UUID, Decimal...): noted as such and given to the follow-up as Celery gives them to a run;
arguments nothing can note are refused at ``.delay()``. Real workers and a real Redis broker."""

from __future__ import annotations

import datetime
import decimal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import shared_task

from django_redlock import locks, single_instance
from django_redlock.backends import markers
from django_redlock.contrib.celery import SingleInstanceTask, UnnotableArguments
from django_redlock.testing import RedisServer
from tests.support import celery_compat_tasks, celery_tasks

from .test_celery import NOBODY, Worker, broker, redis, start_worker, wait_for

__all__ = ["broker", "start_worker"]  # fixtures, imported to be used here

# Each a type Celery's JSON serializer (kombu's) carries and gives the worker back as is.
VALUES = [
    datetime.datetime(2026, 1, 1, 12, 30, tzinfo=datetime.timezone.utc),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    decimal.Decimal("1.50"),
    datetime.date(2026, 1, 2),
    b"raw",
]


@pytest.fixture(scope="module")
def prefork(start_worker: Callable[..., Worker]) -> Worker:
    return start_worker(pool="prefork", concurrency=2)  # a run and its duplicate


@pytest.mark.parametrize(
    ("task", "group"),
    [(celery_tasks.coalesced_typed, "coalesce-typed"),
     (celery_tasks.coalesced_typed_deduped, "coalesce-typed-dd")],
    ids=["coalesce", "coalesce-dedupe_queued"],
)  # fmt: skip
def test_coalesce_runs_a_call_with_celery_json_arguments_as_celery_gives_them(
    prefork: Worker, redis_server: RedisServer, task: Any, group: str
) -> None:
    # The note was plain JSON: with dedupe_queued .delay() raised TypeError (on an idle key
    # too); without, a duplicate failed on the worker and its call never ran.
    r = redis(redis_server)
    name = uuid.uuid4().hex[:8]
    # What Celery's JSON message gives a run that is no duplicate: the reference.
    assert prefork.send(task, f"{name}-idle", VALUES, 0.0).get(timeout=30) == "ran"
    given = r.lrange(f"{group}:{name}-idle:ran", 0, -1)
    assert given == [repr(VALUES)]
    first = prefork.send(task, name, "t0", 30.0)  # runs until its duplicate was settled
    wait_for(lambda: r.lrange(f"{group}:{name}:ran", 0, -1))
    duplicate = prefork.send(task, name, VALUES, 0.0)
    try:
        assert duplicate.get(timeout=30, propagate=False) is not None
    finally:
        r.set(f"{group}:{name}:release", 1, ex=60)
    assert first.get(timeout=30) == "ran"
    assert duplicate.state == "SUCCESS", duplicate.result
    wait_for(lambda: len(r.lrange(f"{group}:{name}:ran", 0, -1)) == 2, timeout=15)
    wait_for(lambda: not locks["default"].is_locked(f"{group}:{name}"))
    time.sleep(0.5)  # nothing more follows
    assert r.lrange(f"{group}:{name}:ran", 0, -1) == [repr("t0"), given[0]]


@shared_task(bind=True, base=SingleInstanceTask, name="tests.celery.coalesce_json.coalesce_only")
@single_instance(key="coalesce-only:{name}", ttl=5, on_duplicate="coalesce")
def coalesce_only(self: Any, name: str, value: Any) -> str:
    return name


class Opaque:
    """Nothing serializes it as JSON (pickle would)."""


@pytest.mark.parametrize(
    ("task", "group"),
    [(celery_tasks.coalesced_typed_deduped, "coalesce-typed-dd"), (coalesce_only, "coalesce-only")],
    ids=["dedupe_queued", "plain"],
)  # fmt: skip
def test_a_coalesced_call_nothing_can_note_is_refused_at_delay(
    broker: None, task: Any, group: str
) -> None:
    # Refused before any Redis call (no marker, no note), with a clear error; with pickle
    # too, which would carry it: the note could not.
    name = uuid.uuid4().hex[:8]
    key = f"{group}:{name}"
    for serializer in ("json", "pickle"):
        with pytest.raises(UnnotableArguments, match="Celery's JSON"):
            task.apply_async((name, Opaque()), queue=NOBODY, serializer=serializer)
    backend = locks["default"]
    assert markers.read(backend, key) is None
    assert markers.read(backend, f"{key}:coalesce") is None
    assert isinstance(UnnotableArguments("x"), TypeError)  # (what it raised before)


def test_celery_once_unlock_before_run_takes_celery_json_arguments(broker: None) -> None:
    # The shim's unlock_before_run is coalesce + dedupe_queued: .delay() raised TypeError.
    task = celery_compat_tasks.once_unlock_before_run
    for value in VALUES:
        name = uuid.uuid4().hex[:8]
        assert task.apply_async((name, value), queue=NOBODY).id
