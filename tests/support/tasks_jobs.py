"""Django Tasks the db_worker processes run (and a few the ImmediateBackend runs in the test
process); they note what happened in Redis for the tests to read."""

from __future__ import annotations

import json
import time
from typing import Any

try:
    from django.tasks import task  # Django 6.0+
except ImportError:
    from django_tasks import task  # the backport, on 4.2-5.2

try:
    from django.tasks.signals import task_started
except ImportError:
    from django_tasks.signals import task_started

from django_redlock import locks, single_instance
from django_redlock.contrib.tasks import lock_key

# Count bodies running at once, and the peak, atomically.
ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def redis() -> Any:
    return locks["default"].client  # type: ignore[attr-defined]


def body(group: str, tag: str) -> str:
    """Note the run, then wait until the test opens the group's gate."""
    redis().eval(ENTER, 2, f"{group}:inside", f"{group}:peak")
    try:
        redis().rpush(f"{group}:ran", tag)
        deadline = time.monotonic() + 60
        while not redis().exists(f"{group}:open") and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        redis().decr(f"{group}:inside")
    return "ran"


@task()
@single_instance(key="tasks:overlap:skip", ttl=10, on_duplicate="skip")
def overlap_skip(tag: str) -> str:
    return body("skip", tag)


@task()
@single_instance(key="tasks:overlap:raise", ttl=10, on_duplicate="raise")
def overlap_raise(tag: str) -> str:
    return body("raise", tag)


@task()
@single_instance(key="tasks:limited", ttl=10, limit=2)
def limited(tag: str) -> str:
    return body("limited", tag)


@task()
@single_instance(ttl=10)  # the default key: this function's path and its arguments
def blocker(tag: str) -> str:
    return body("block", tag)


@task()
@single_instance(key="tasks:dedupe:{n}", ttl=10, dedupe_queued=True)
def deduped(n: int, fail: bool = False) -> str:
    body("dedupe", str(n))
    if fail:
        raise RuntimeError("the run failed")
    return "ran"


@task()
@single_instance(key="tasks:killed:{n}", ttl=2, dedupe_queued=True)
def killed(n: int) -> str:
    return body("killed", str(n))  # its gate stays shut: the worker is killed meanwhile


@task()
@single_instance(key="tasks:killed-early:{n}", ttl=2, dedupe_queued=True)
def killed_early(n: int) -> str:
    return "ran"


def _claimed(sender: Any = None, task_result: Any = None, **_: Any) -> None:
    """A run of killed_early, claimed (its row RUNNING): held here, before the run takes its
    key, while the test's "killed-early:hold" is set (a slow receiver, a paused Redis)."""
    if getattr(getattr(task_result, "task", None), "func", None) is not killed_early.func:
        return
    redis().rpush("killed-early:claimed", str(task_result.id))
    deadline = time.monotonic() + 60
    while redis().exists("killed-early:hold") and time.monotonic() < deadline:
        time.sleep(0.02)


task_started.connect(_claimed, dispatch_uid="tests-killed-early")


# -- run by the ImmediateBackend, in the test process ---------------------------------------


def seen(key: str) -> dict[str, Any]:
    info = locks["default"].inspect(key)
    return {"key": key, "holder": info.holder if info is not None else None}


@task(backend="immediate", takes_context=True)
@single_instance(ttl=5)
def with_context(context: Any, a: int, b: int = 2) -> dict[str, Any]:
    return {**seen(lock_key(with_context, a, b=b)), "id": str(context.task_result.id)}


@task(backend="immediate")
@single_instance(ttl=5)
def without_context(a: int) -> dict[str, Any]:
    return seen(lock_key(without_context, a))


@task(backend="immediate")
@single_instance(ttl=5, on_duplicate="retry")
def retrying() -> None:
    raise AssertionError("never runs: Django's Tasks have no retry")


@task(backend="immediate")
@single_instance(ttl=5, dedupe_queued=True)
def dedupe_unwrapped() -> None:
    raise AssertionError("never runs: its backend does not dedupe")


@task(backend="immediate")
@single_instance(key="tasks:nested", ttl=5, on_duplicate="raise")
def nested(inner: bool) -> str:
    if not inner:  # the inner run finds the key held by this one
        return json.dumps(_outcome(lambda: nested.enqueue(True)))
    return "inner ran"


def _outcome(call: Any) -> Any:
    result = call()
    return [result.status, [e.exception_class_path for e in result.errors]]


@task(backend="immediate")
@single_instance(key="tasks:next-page", ttl=5, dedupe_queued=True)
def next_page(page: int) -> list[Any]:
    """A continuation: page 1 enqueues page 2 under its own key, on the backend it runs on
    (a dedupe-wrapped ImmediateBackend runs it inside the outer enqueue())."""
    if page > 1:
        return ["ran", page]
    from django_redlock.contrib.single import AlreadyQueued

    try:
        next_page.using(backend="dedupe_immediate").enqueue(page + 1)
    except AlreadyQueued as exc:
        return ["AlreadyQueued", exc.task_id]
    return ["enqueued"]


@task(backend="immediate")
@single_instance(key="tasks:slow-immediate", ttl=5, dedupe_queued=True)
def slow_immediate(seconds: float) -> str:
    """Runs ``seconds`` (a dedupe-wrapped ImmediateBackend: inside its enqueue())."""
    time.sleep(seconds)
    return "ran"


@task(backend="immediate")
@single_instance(key="tasks:interrupted", ttl=5)
def holder_seen(interrupt: bool) -> dict[str, Any]:
    """The holder of its key as its body sees it; ``interrupt``: Ctrl-C in the body."""
    info = locks["default"].inspect("tasks:interrupted")
    if interrupt:
        raise KeyboardInterrupt("Ctrl-C in the body")
    return dict(info.holder) if info is not None else {}
