"""Tasks on the migration shims (celery-once's QueueOnce, celery-singleton's Singleton) that
the tests' Celery worker runs; they note what happened in Redis for the tests to read."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from django_redlock.compat.celery_once import QueueOnce
from django_redlock.compat.celery_singleton import Singleton
from tests.support.celery_tasks import body, redis


class ExpectedTaskFail(Exception):
    pass


@shared_task(base=Singleton)
def singleton_simple(*args: Any) -> list[Any]:
    return list(args)


@shared_task(base=Singleton)
def singleton_fails(*args: Any) -> None:
    raise ExpectedTaskFail()


@shared_task(bind=True, base=Singleton)
def singleton_slow(self: Any, name: str, seconds: float = 1.0) -> str:
    return body(f"singleton:{name}", self.request.id, seconds)


@shared_task(bind=True, base=Singleton, max_retries=1)
def singleton_retry(self: Any, name: str) -> str:
    redis().rpush(f"singleton-retry:{name}", self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return "ran"


@shared_task(base=Singleton, unique_on=["a", "c"])
def unique_on_args(a: int, b: int, c: int, d: int = 4) -> int:
    return a * b * c * d


@shared_task(base=Singleton, unique_on=["b", "d"])
def unique_on_kwargs(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@shared_task(base=Singleton, unique_on=[])
def unique_on_empty(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@shared_task(base=Singleton, unique_on="c")
def unique_on_string(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@shared_task(base=Singleton, unique_on="d")
def unique_on_default(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@shared_task(base=Singleton, lock_expiry=60)
def singleton_expiry(*args: Any) -> list[Any]:
    return list(args)


@shared_task(base=Singleton, raise_on_duplicate=True)
def singleton_raises(*args: Any) -> list[Any]:
    return list(args)


# -- celery-once ------------------------------------------------------------------------------


@shared_task(name="simple_example", base=QueueOnce)
def simple_example() -> str:
    return "simple"


@shared_task(name="bound_task", bind=True, base=QueueOnce)
def bound_task(self: Any, a: int, b: int) -> int:
    return a + b


@shared_task(name="args_example", base=QueueOnce)
def args_example(a: int, b: int) -> int:
    return a + b


@shared_task(name="select_args_example", base=QueueOnce, once={"keys": ["a"]})
def select_args_example(a: int, b: int) -> int:
    return a + b


@shared_task(name="autoretry_for_example", base=QueueOnce, autoretry_for=(Exception,))
def autoretry_for_example(a: int, b: int) -> int:
    return a + b


@shared_task(bind=True, base=QueueOnce)
def once_slow(self: Any, name: str, seconds: float = 1.0) -> str:
    return body(f"once:{name}", self.request.id, seconds)


@shared_task(bind=True, base=QueueOnce, once={"graceful": True})
def once_graceful(self: Any, name: str, seconds: float = 1.0) -> str:
    return body(f"once-graceful:{name}", self.request.id, seconds)


@shared_task(bind=True, base=QueueOnce, once={"keys": []}, max_retries=1)
def once_retry(self: Any, a: int = 0) -> str:
    redis().rpush("once-retry", f"{a}:{self.request.retries}")
    if a != 1:
        raise self.retry(kwargs={"a": 1}, countdown=0.1)
    return "ran"


@shared_task(bind=True, base=QueueOnce, once={"unlock_before_run": True, "keys": ["name"]})
def once_unlock_before_run(self: Any, name: str, tag: str, seconds: float = 1.5) -> str:
    return body(f"once-ubr:{name}", tag, seconds)


@shared_task(bind=True, base=QueueOnce, once={"keys": ["name"]})
def once_fails(self: Any, name: str) -> None:
    time.sleep(0.1)
    raise ExpectedTaskFail()


@shared_task
def raise_duplicate(kind: str) -> None:
    """Raise one of the duplicate errors out of a task, as a body calling a deduplicated
    task's ``delay()`` does: the caller's ``.get()`` rebuilds it from the result backend."""
    from django_redlock.compat.celery_once import AlreadyQueued as OnceAlreadyQueued
    from django_redlock.compat.celery_singleton import DuplicateTaskError
    from django_redlock.contrib.celery import AlreadyQueued

    if kind == "singleton":
        raise DuplicateTaskError("Attempted to queue a duplicate of task ID t-1", task_id="t-1")
    if kind == "once":
        raise OnceAlreadyQueued(12.5, "t-1")
    raise AlreadyQueued("x not queued: 'k' is queued or running already as task t-1", "t-1")
