"""``@single_instance``: a Celery task that never runs twice at once for the same key.

Placed directly under ``@shared_task`` / ``@app.task`` (above them it raises TypeError: Celery
would run the undecorated function). The lock is taken before the body runs, renewed by the
watchdog while it runs, and released on every outcome: success, exception, ``self.retry()``
(before the retry is scheduled), ``Ignore``, ``Reject``, soft time limit. A revoke with
``terminate=True`` or a hard time limit kills the body mid-run; the worker's main process then
releases the hold whose token carries that task's id. A worker killed outright leaves a lock
that frees itself after its TTL: seconds, not hours.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar, cast

from celery import Task, current_task
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.local import Proxy
from celery.signals import task_failure, task_revoked
from django.dispatch import Signal

from ..backends.base import BaseLockBackend, Kind, Op
from ..exceptions import LockError, LockNotAcquired
from ..handler import DEFAULT_LOCK_ALIAS, locks
from ..identity import current_task as holder_task
from ..identity import new_token
from ..locking import Lock, name_template
from ..scripts import Call, script
from ..validation import check_name, check_optional_seconds, check_seconds

logger = logging.getLogger("django_redlock")
F = TypeVar("F", bound=Callable[..., Any])

ON_DUPLICATE = ("skip", "raise", "retry")
#: Keys longer than this are hashed (and say so): Redis keys stay short, names stay readable.
MAX_KEY = 200

#: Sent (sender = the task) when a duplicate was skipped: key, task_id, holder_task_id, using.
duplicate_skipped = Signal()


@dataclass(frozen=True)
class SingleInstance:
    """The settings of one ``@single_instance`` task."""

    func: Callable[..., Any]
    key: str | Callable[..., str] | None
    ttl: float | None
    on_duplicate: str
    using: str
    countdown: float
    dedupe_queued: bool
    dedupe_ttl: float
    signature: inspect.Signature = field(init=False)

    def __post_init__(self) -> None:
        params = list(inspect.signature(self.func).parameters.values())
        if self.bound:  # Celery passes the task itself as `self`; it is no part of the key
            params = params[1:]
        signature = inspect.Signature(params)
        object.__setattr__(self, "signature", signature)
        if isinstance(self.key, str):
            name_template(self.key, signature, self.func.__qualname__)  # checked now

    @property
    def bound(self) -> bool:
        params = list(inspect.signature(self.func).parameters)
        return bool(params) and params[0] == "self"

    def key_for(self, task_name: str, args: tuple, kwargs: dict) -> str:
        """The lock name for one call; ``args`` exclude a bound task's ``self``."""
        if callable(self.key):
            return check_name(self.key(*args, **kwargs))
        if isinstance(self.key, str):
            return name_template(self.key, self.signature, task_name)(args, kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()  # f(1), f(a=1) and f() with a=1 are one key
        canonical = json.dumps(bound.arguments, sort_keys=True, separators=(",", ":"), default=repr)
        key = f"{task_name}:{canonical}"
        if len(key) > MAX_KEY:
            key = f"{task_name}:sha256:{hashlib.sha256(canonical.encode()).hexdigest()}"
        return key


def single_instance(
    key: str | Callable[..., str] | None = None,
    *,
    ttl: float | None = None,
    on_duplicate: str = "skip",
    using: str = DEFAULT_LOCK_ALIAS,
    countdown: float = 10.0,
    dedupe_queued: bool = False,
    dedupe_ttl: float = 3600.0,
) -> Callable[[F], F]:
    """Run the task body under a lock named by ``key`` (default: task name + arguments).

    ``key``: a ``str.format`` template over the task's arguments, or a callable taking them.
    ``on_duplicate``: ``"skip"`` (log, send ``duplicate_skipped``, return None), ``"raise"``
    (``LockNotAcquired``: the task fails visibly) or ``"retry"`` (``self.retry`` after
    ``countdown`` seconds, honouring the task's ``max_retries``). A bound task's first
    parameter must be named ``self``. ``dedupe_queued`` needs ``base=SingleInstanceTask``.
    """
    if on_duplicate not in ON_DUPLICATE:
        raise ValueError(f"on_duplicate must be one of {ON_DUPLICATE}, not {on_duplicate!r}")
    if key is not None and not callable(key):
        check_name(key)
    ttl = check_optional_seconds(ttl, "ttl")
    countdown = check_seconds(countdown, "countdown", allow_zero=True)
    dedupe_ttl = check_seconds(dedupe_ttl, "dedupe_ttl")
    if not isinstance(using, str):
        raise TypeError(f"using must be a backend alias (str), not {using!r}")

    def decorate(func: F) -> F:
        _check_decorated(func)
        config = SingleInstance(
            func, key, ttl, on_duplicate, using, countdown, dedupe_queued, dedupe_ttl
        )

        @functools.wraps(func)
        def run_once(*args: Any, **kwargs: Any) -> Any:
            return _run(config, args, kwargs)

        run_once.__redlock__ = config  # type: ignore[attr-defined]
        return cast(F, run_once)

    return decorate


def _check_decorated(func: Any) -> None:
    """Refuse a Celery task: above ``@shared_task`` this decorator would wrap the task object,
    while Celery runs the function it was built from, unprotected."""
    # Proxy first (the tuple is tried in order): isinstance(proxy, Task) would evaluate a
    # lazy task at import time.
    if isinstance(func, (Proxy, Task)) or (inspect.isclass(func) and issubclass(func, Task)):
        raise TypeError(
            "@single_instance must be placed directly under @shared_task / @app.task (it"
            " decorates the task's function): above them it would wrap the task object, which"
            " Celery never calls, and the task would run unprotected. Write:\n"
            "    @shared_task(bind=True)\n    @single_instance(...)\n    def my_task(self, ...):"
        )
    if not callable(func):
        raise TypeError(f"@single_instance decorates a function, not {type(func).__name__}")


def _run(config: SingleInstance, args: tuple, kwargs: dict) -> Any:
    task = current_task._get_current_object() if current_task else None
    call_args = args[1:] if config.bound else args
    func = config.func
    task_name = task.name if task is not None else f"{func.__module__}.{func.__qualname__}"
    task_id = task.request.id if task is not None else None
    key = config.key_for(task_name, call_args, kwargs)
    if config.dedupe_queued and task_id:
        _clear_queued_marker(config, key, task_id)
    held = Lock(key, ttl=config.ttl, using=config.using, token_prefix=_prefix(task_id))
    marker = holder_task.set((task_id, task_name) if task_id else None)
    try:
        acquired = held.acquire(blocking=False)
    finally:
        holder_task.reset(marker)
    if not acquired:
        return _duplicate(config, task, key, task_id)
    try:
        result = func(*args, **kwargs)
    except BaseException:  # Retry, Ignore, Reject, SoftTimeLimitExceeded, errors: all release
        with contextlib.suppress(LockError):  # the body's exception says more
            held.release()
        raise
    held.release()  # LockLost if the hold was lost meanwhile: the task fails visibly
    return result


def _prefix(task_id: str | None) -> str | None:
    return f"{task_id}." if task_id else None


def _duplicate(config: SingleInstance, task: Any, key: str, task_id: str | None) -> Any:
    info = locks[config.using].inspect(key)
    holder = info.holder.get("k") if info is not None else None
    message = f"task {task_id} not run: {key!r} is held by task {holder}"
    if config.on_duplicate == "raise":
        raise LockNotAcquired(f"{message} (backend {config.using!r})")
    if config.on_duplicate == "retry" and task is not None:
        raise task.retry(countdown=config.countdown, exc=LockNotAcquired(message))
    logger.info("redlock: skipped duplicate: %s", message)
    duplicate_skipped.send_robust(
        sender=task, key=key, task_id=task_id, holder_task_id=holder, using=config.using
    )
    return None


# -- the worker's main process: release what a killed child held ----------------------------


def _config_of(task: Any) -> SingleInstance | None:
    return getattr(getattr(task, "run", None), "__redlock__", None)


def release_task_hold(task: Any, task_id: str, args: Any, kwargs: Any) -> bool:
    """Release ``task_id``'s hold on its key, if it still has it (compare-and-delete)."""
    config = _config_of(task)
    if config is None or not task_id:
        return False
    key = config.key_for(task.name, tuple(args or ()), dict(kwargs or {}))
    backend = locks[config.using]
    info = backend.inspect(key)
    # A hold's token is "<task id>.<random>" and the random part has no ".": compare the
    # whole id, or stopping task "abc" would release task "abc.1"'s hold.
    if info is None or info.token is None or info.token.rpartition(".")[0] != task_id:
        return False
    released = backend.execute(backend.op_release(key, info.token, Kind())) >= 0
    logger.info("redlock: released %r, held by stopped task %s", key, task_id)
    return released


@task_revoked.connect
def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if terminated and request is not None:
        _quietly(sender, request.id, request.args, request.kwargs)


@task_failure.connect
def _on_failure(
    sender: Any = None, task_id: str = "", exception: Any = None, args: Any = None,
    kwargs: Any = None, **_: Any,
) -> None:  # fmt: skip
    if isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        _quietly(sender, task_id, args, kwargs)


def _quietly(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    try:
        release_task_hold(task, task_id, args, kwargs)
    except LockError as exc:  # the hold then frees itself at its TTL
        logger.warning("redlock: could not release stopped task %s's lock: %s", task_id, exc)


# -- queue-time deduplication ---------------------------------------------------------------


class SingleInstanceTask(Task):
    """A task base that does not enqueue a call whose key is queued or running already.

    Needed only for ``dedupe_queued=True``: ``@shared_task(bind=True, base=SingleInstanceTask)``.
    The second ``.delay()`` returns the ``AsyncResult`` of the queued or running task.
    """

    abstract = True

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        config = _config_of(self)
        if config is None or not config.dedupe_queued:
            return super().apply_async(args, kwargs, **options)
        key = config.key_for(self.name, tuple(args or ()), dict(kwargs or {}))
        backend = locks[config.using]
        running = backend.inspect(key)
        if running is not None and running.holder.get("k"):
            return self.AsyncResult(running.holder["k"])
        task_id = options.pop("task_id", None) or new_token()
        delay = float(options.get("countdown") or 0)
        eta = options.get("eta")
        if isinstance(eta, datetime):
            delay = max(delay, (eta - datetime.now(timezone.utc)).total_seconds())
        # The marker outlives the wait in the queue (countdown/ETA included), then expires.
        marker = _marker(backend, key)
        client = backend.client  # type: ignore[attr-defined]
        if not client.set(marker, task_id, nx=True, ex=max(1, round(delay + config.dedupe_ttl))):
            queued = client.get(marker)
            if queued is not None:
                return self.AsyncResult(queued.decode() if isinstance(queued, bytes) else queued)
        return super().apply_async(args, kwargs, task_id=task_id, **options)


def _marker(backend: BaseLockBackend, key: str) -> str:
    """Where a queued call of ``key`` is noted (beside the lock, in its hash slot)."""
    return f"{backend.key(key)}:queued"


def _clear_queued_marker(config: SingleInstance, key: str, task_id: str) -> None:
    backend = locks[config.using]
    backend.execute(Op(key, Call(script("clear_marker"), [_marker(backend, key)], [task_id])))


__all__ = ["SingleInstanceTask", "duplicate_skipped", "release_task_hold", "single_instance"]
