"""``@single_instance``: a Celery task that never runs twice at once for the same key.

Placed directly under ``@shared_task`` / ``@app.task`` (above them it raises TypeError: Celery
would run the undecorated function). The lock is taken before the body runs, renewed by the
watchdog while it runs, and released on every outcome: success, exception, ``self.retry()``
(before the retry is scheduled), ``Ignore``, ``Reject``, soft time limit. A revoke with
``terminate=True`` or a hard time limit kills the body mid-run; the worker's main process then
releases the hold whose token carries that task's id. A worker killed outright leaves a lock
that frees itself after its TTL: seconds, not hours.

A hold's token is ``<task id>.<attempt>.<random>`` (the attempt is ``request.retries``). So a
run that finds its own task id holding the key can tell a retry that arrived before the
earlier attempt released (it waits for it) from its own message delivered again while it runs
(a duplicate: skipped, never a second run).
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import enum
import functools
import hashlib
import inspect
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from celery import Task, current_task
from celery.exceptions import Ignore, TimeLimitExceeded, WorkerLostError
from celery.local import Proxy
from celery.signals import task_failure, task_revoked
from celery.utils import uuid as uuid_text
from celery.utils.time import maybe_make_aware
from django.dispatch import Signal

from ..backends.base import Kind, LockInfo, Released
from ..exceptions import LockError, LockNotAcquired
from ..fencing import database_of, release_after_commit
from ..handler import DEFAULT_LOCK_ALIAS, locks
from ..identity import current_task as holder_task
from ..locking import BaseLock, Lock, Semaphore, name_template
from ..validation import (
    MAX_TTL,
    check_limit,
    check_name,
    check_optional_seconds,
    check_seconds,
    to_ms,
)

logger = logging.getLogger("django_redlock")
F = TypeVar("F", bound=Callable[..., Any])

ON_DUPLICATE = ("skip", "raise", "retry")
#: Keys longer than this are hashed (and say so): Redis keys stay short, names stay readable.
MAX_KEY = 200

#: Sent (sender = the task) when a duplicate was skipped: key, task_id, holder_task_id, using,
#: redelivered (True: the task's own message delivered again while it runs).
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
    dedupe_queued: bool | str  # False, True or "raise"
    dedupe_ttl: float
    limit: int | None = None  # at most this many runs of a key at once (a semaphore)
    atomic: str | None = None  # the database of the body's fenced transaction, if any
    #: Every parameter: the arguments of a task Celery built with bind=False.
    signature: inspect.Signature = field(init=False)
    #: Without the first parameter, where a bind=True task gets the task itself (whatever the
    #: parameter's name). Which one applies is known only once Celery built the task.
    bound_signature: inspect.Signature = field(init=False)
    _templates: dict[bool, Callable[[tuple, dict], str]] = field(
        init=False, default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        signature = inspect.signature(self.func)
        object.__setattr__(self, "signature", signature)
        params = list(signature.parameters.values())
        if params and params[0].kind in (
            params[0].POSITIONAL_ONLY,
            params[0].POSITIONAL_OR_KEYWORD,
        ):
            params = params[1:]  # else (*args): the task is args[0], and no named argument
        object.__setattr__(self, "bound_signature", signature.replace(parameters=params))
        if isinstance(self.key, str):
            # Checked now over every parameter; over a bound task's own at its first call.
            name_template(self.key, signature, self.func.__qualname__)

    def key_for(self, task_name: str, args: tuple, kwargs: dict, *, bound: bool) -> str:
        """The lock name for one call; ``args`` exclude the task a ``bind=True`` task gets."""
        if callable(self.key):
            return check_name(self.key(*args, **kwargs))
        if isinstance(self.key, str):
            build = self._templates.get(bound)
            if build is None:
                signature = self.bound_signature if bound else self.signature
                build = self._templates[bound] = name_template(self.key, signature, task_name)
            return build(args, kwargs)
        call = (self.bound_signature if bound else self.signature).bind(*args, **kwargs)
        call.apply_defaults()  # f(1), f(a=1) and f() with a=1 are one key
        values = {
            name: _canonical(value, name, task_name) for name, value in call.arguments.items()
        }
        canonical = json.dumps(values, sort_keys=True, separators=(",", ":"))
        key = f"{task_name}:{canonical}"
        if len(key) > MAX_KEY:
            key = f"{task_name}:sha256:{hashlib.sha256(canonical.encode()).hexdigest()}"
        return key


#: What a default key accepts, besides str, int, float, bool, None, lists, tuples and dicts
#: with str keys: types with one obvious text, the one a JSON message gives the worker.
CANONICAL_TEXT = (uuid.UUID, decimal.Decimal, datetime.date)  # datetime is a date


def _canonical(value: Any, where: str, task_name: str) -> Any:
    """``value`` as JSON that every process computes alike, or TypeError: a repr would put an
    address (different in every process) or unstable text into the key."""
    if isinstance(value, enum.Enum):
        return _canonical(value.value, where, task_name)
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, (list, tuple)):  # a JSON message makes a tuple a list
        return [_canonical(v, f"{where}[{i}]", task_name) for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise _not_canonical(task_name, where, f"has dict key {k!r}, not a str")
        return {k: _canonical(v, f"{where}[{k!r}]", task_name) for k, v in value.items()}
    if isinstance(value, CANONICAL_TEXT):
        return value.isoformat() if isinstance(value, datetime.date) else str(value)
    raise _not_canonical(task_name, where, f"is a {type(value).__qualname__}")


def _not_canonical(task_name: str, where: str, what: str) -> TypeError:
    shown = repr(where) if where.isidentifier() else where
    return TypeError(
        f"{task_name}: argument {shown} {what}, which has no canonical form for the default lock"
        " key (str, int, float, bool, None, list, tuple, dict with str keys, UUID, Decimal,"
        " date, datetime, Enum); pass key= to @single_instance (a template or a callable over"
        " the arguments) to name the lock"
    )


def single_instance(
    key: str | Callable[..., str] | None = None,
    *,
    ttl: float | None = None,
    on_duplicate: str = "skip",
    using: str = DEFAULT_LOCK_ALIAS,
    countdown: float = 10.0,
    dedupe_queued: bool | Literal["raise"] = False,
    dedupe_ttl: float = 3600.0,
    limit: int | None = None,
    atomic: bool | str | None = None,
) -> Callable[[F], F]:
    """Run the task body under a lock named by ``key`` (default: task name + arguments).

    ``key``: a ``str.format`` template over the task's arguments, or a callable taking them.
    ``on_duplicate``: ``"skip"`` (log, send ``duplicate_skipped``, return the :func:`skipped`
    sentinel naming the holder: SUCCESS, so ``.get()`` returns at once), ``"raise"``
    (``LockNotAcquired``: the task fails visibly) or ``"retry"`` (``self.retry`` after
    ``countdown`` seconds, honouring the task's ``max_retries``). The default key takes
    arguments that have one canonical form (see :func:`_canonical`); for others pass ``key=``.
    A ``bind=True`` task's first parameter (whatever its name) is the task, not part of the
    key.

    ``dedupe_queued`` (the task needs ``base=SingleInstanceTask``): ``True`` makes a ``delay()``
    of a key that is queued or running return that task's ``AsyncResult`` instead of enqueuing
    again; ``"raise"`` raises :class:`AlreadyQueued` instead. ``dedupe_ttl``: how long a queue
    marker lasts past the call's countdown/ETA if the task never starts.

    ``limit=N``: at most N runs of a key at once (a semaphore of N permits instead of a
    lock); ``on_duplicate`` applies when all N are taken.

    ``atomic=True`` (or a ``DATABASES`` alias): the body runs in the lock's fenced transaction
    (see ``lock(..., atomic=)``), committed before the lock is released; a stale hold raises
    ``StaleFence`` before the body runs, and a hold lost once the body committed is logged,
    not raised (a retry would run the body twice).
    """
    if on_duplicate not in ON_DUPLICATE:
        raise ValueError(f"on_duplicate must be one of {ON_DUPLICATE}, not {on_duplicate!r}")
    if key is not None and not callable(key):
        check_name(key)
    ttl = check_optional_seconds(ttl, "ttl")
    countdown = check_seconds(countdown, "countdown", allow_zero=True)
    dedupe_ttl = check_seconds(dedupe_ttl, "dedupe_ttl", most=MAX_TTL)  # Redis' PX bound
    if dedupe_queued is not True and dedupe_queued is not False and dedupe_queued != "raise":
        raise ValueError(f'dedupe_queued must be True, False or "raise", not {dedupe_queued!r}')
    if not isinstance(using, str):
        raise TypeError(f"using must be a backend alias (str), not {using!r}")
    if limit is not None:
        limit = check_limit(limit)
        if dedupe_queued:
            # One queue marker per key, while N may run: "already queued" would refuse the
            # 2nd of N runs the limit allows.
            raise ValueError("dedupe_queued does not combine with limit: a key may run N times")
    database = database_of(atomic)
    if database is not None and limit is not None:
        raise ValueError("atomic= does not combine with limit: N runs of a key would hold at once")

    def decorate(func: F) -> F:
        _check_decorated(func)
        config = SingleInstance(
            func, key, ttl, on_duplicate, using, countdown, dedupe_queued, dedupe_ttl, limit,
            database,
        )  # fmt: skip

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


def _is_bound(task: Any) -> bool:
    """Whether Celery built ``task`` with ``bind=True``: then ``run`` is a plain function that
    Python binds to the task (a method); with ``bind=False`` it is a staticmethod."""
    return inspect.ismethod(getattr(task, "run", None))


def _task_of(config: SingleInstance, args: tuple) -> tuple[Any, bool]:
    """The task running ``config``'s function, if any, and whether it is bound (then it is
    ``args[0]``)."""
    first = args[0] if args else None
    if isinstance(first, Task) and _is_bound(first) and _config_of(first) is config:
        return first, True
    task = current_task._get_current_object() if current_task else None
    # Another task's body calling this function directly is no run of this task.
    return (task if task is not None and _config_of(task) is config else None), False


def _run(config: SingleInstance, args: tuple, kwargs: dict) -> Any:
    task, bound = _task_of(config, args)
    call_args = args[1:] if bound else args
    func = config.func
    task_name = task.name if task is not None else f"{func.__module__}.{func.__qualname__}"
    task_id = task.request.id if task is not None else None
    if config.dedupe_queued and task is not None and not isinstance(task, SingleInstanceTask):
        raise TypeError(
            f"{task_name}: dedupe_queued needs the task built on SingleInstanceTask, whose"
            " apply_async() does the deduplication: @shared_task(bind=True,"
            " base=SingleInstanceTask) (without it every delay() is enqueued)"
        )
    key = config.key_for(task_name, call_args, kwargs, bound=bound)
    attempt = int(getattr(task.request, "retries", 0) or 0) if task_id else 0
    held: BaseLock
    if config.limit is None:
        held = Lock(key, ttl=config.ttl, using=config.using, token_prefix=_prefix(task_id, attempt),
                    atomic=config.atomic)  # fmt: skip
    else:
        held = Semaphore(key, config.limit, ttl=config.ttl, using=config.using,
                         token_prefix=_prefix(task_id, attempt))  # fmt: skip
    marker = holder_task.set((task_id, task_name) if task_id else None)
    try:
        acquired, info = _take(held, task_id, attempt)
    finally:
        holder_task.reset(marker)
    if config.dedupe_queued and task_id:
        # Not queued any more. Cleared once the lock is taken, so a delay() meanwhile finds
        # the marker or the hold. (One that looked for the hold before it was taken and marks
        # after this still enqueues a duplicate: the lock then excludes it, nothing is lost.)
        _clear_queued_marker(config, key, task_id)
    if not acquired:
        holder = hold_of(info.token if info is not None else None)
        if task_id and holder is not None and holder[0] == task_id:
            return _redelivered(config, task, key, task_id, holder[1])
        return _duplicate(config, task, key, task_id, info)
    try:
        with contextlib.ExitStack() as fenced:
            if config.atomic is not None:  # committed (or rolled back) before the release
                fenced.enter_context(held.atomic())
            result = func(*args, **kwargs)
    except BaseException:  # Retry, Ignore, Reject, SoftTimeLimitExceeded, errors: all release
        with contextlib.suppress(LockError):  # the body's exception says more
            held.release()
        raise
    if config.atomic is not None:
        release_after_commit(held)  # committed: a lost hold is logged, never raised
        return result
    held.release()  # LockLost if the hold was lost meanwhile: the task fails visibly
    return result


def _take(held: BaseLock, task_id: str | None, attempt: int) -> tuple[bool, LockInfo | None]:
    """Take the task's lock; if not, who holds it.

    An earlier attempt of this very task holds it only while its ``self.retry()`` propagates:
    Celery publishes the retry (same task id, one more ``retries``) before the lock is
    released on the way out. That attempt is about to release: wait for it (at most the
    lock's TTL, should it have died right there). The same attempt holding it is a message
    delivered again while its task runs: a duplicate, never a second run.
    """
    backend = held.backend
    for _ in range(2):  # a second try if it was freed between the try and the look
        if held.acquire(blocking=False):
            return True, None
        info = backend.inspect(held.name)
        if info is None:
            continue
        holder = hold_of(info.token)
        if task_id and holder is not None and holder[0] == task_id and holder[1] < attempt:
            if held.acquire(timeout=held.lock_ttl):
                return True, None
            return False, backend.inspect(held.name)
        return False, info
    return False, None


def _prefix(task_id: str | None, attempt: int = 0) -> str | None:
    # "<task id>.<attempt>." then the random part, which never contains a ".".
    return f"{task_id}.{attempt}." if task_id else None


def hold_of(token: str | None) -> tuple[str, int] | None:
    """The task id and attempt (``request.retries``) a task's hold token names:
    ``<task id>.<attempt>.<random>`` (task ids may contain dots; the other parts do not)."""
    if not token:
        return None
    head, dot, _ = token.rpartition(".")
    task_id, dot2, attempt = head.rpartition(".")
    if not dot or not dot2 or not task_id or not attempt.isdigit():
        return None
    return task_id, int(attempt)


#: What a skipped duplicate returns (``on_duplicate="skip"``): a plain dict, so any result
#: serializer keeps it, and ``.get()`` returns it at once. Tell it apart with :func:`skipped`.
SKIPPED = "duplicate_skipped"


def skipped(value: Any) -> dict[str, Any] | None:
    """The details (``key``, ``task_id``, ``holder_task_id``) if ``value``, a task's result,
    is a skipped duplicate's; else None."""
    if isinstance(value, dict) and value.get("redlock") == SKIPPED:
        return value
    return None


def _duplicate(
    config: SingleInstance, task: Any, key: str, task_id: str | None, info: LockInfo | None
) -> Any:
    holder = info.holder.get("k") if info is not None else None
    if info is not None and info.holders:  # a semaphore's: every holding task
        holder = ", ".join(str(h.holder.get("k")) for h in info.holders)
    message = f"task {task_id} not run: {key!r} is held by task {holder}"
    if config.on_duplicate == "raise":
        raise LockNotAcquired(f"{message} (backend {config.using!r})")
    if config.on_duplicate == "retry" and task is not None:
        raise task.retry(countdown=config.countdown, exc=LockNotAcquired(message))
    logger.info("redlock: skipped duplicate: %s", message)
    duplicate_skipped.send_robust(
        sender=task, key=key, task_id=task_id, holder_task_id=holder, using=config.using,
        redelivered=False,
    )  # fmt: skip
    return {"redlock": SKIPPED, "key": key, "task_id": task_id, "holder_task_id": holder}


def _redelivered(config: SingleInstance, task: Any, key: str, task_id: str, attempt: int) -> Any:
    """The message of a running task, delivered again (``acks_late`` past the broker's
    visibility timeout): never run twice. ``Ignore`` stores nothing, so the task's result
    stays the running attempt's."""
    logger.warning(
        "redlock: skipped a redelivered message: task %s runs already (attempt %s holds %r)",
        task_id, attempt, key,
    )  # fmt: skip
    duplicate_skipped.send_robust(
        sender=task, key=key, task_id=task_id, holder_task_id=task_id, using=config.using,
        redelivered=True,
    )  # fmt: skip
    raise Ignore()


# -- the worker's main process: release what a killed child held ----------------------------


def _config_of(task: Any) -> SingleInstance | None:
    return getattr(getattr(task, "run", None), "__redlock__", None)


def release_task_hold(task: Any, task_id: str, args: Any, kwargs: Any) -> bool:
    """Release ``task_id``'s hold on its key, if it still has it (compare-and-delete)."""
    config = _config_of(task)
    if config is None or not task_id:
        return False
    key = config.key_for(task.name, tuple(args or ()), dict(kwargs or {}), bound=_is_bound(task))
    backend = locks[config.using]
    info = backend.inspect(key)
    # A hold's token is "<task id>.<attempt>.<random>": compare the whole id, or stopping
    # task "abc" would release task "abc.1"'s hold.
    if info is not None and info.holders:  # limit=N: the task's own permit
        mine = [h.token for h in info.holders if (hold_of(h.token) or ("",))[0] == task_id]
        if not mine or mine[0] is None:
            return False
        released = backend.execute(backend.op_lease_release(key, mine[0])) >= 0
        logger.info("redlock: released a permit of %r, held by stopped task %s", key, task_id)
        return released
    holder = hold_of(info.token if info is not None else None)
    if info is None or info.token is None or holder is None or holder[0] != task_id:
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


class AlreadyQueued(LockError):
    """``dedupe_queued="raise"``: a call of a key that is queued or running already, as the
    task ``task_id``."""

    def __init__(self, message: str, task_id: str = "") -> None:
        super().__init__(message)
        self.task_id = task_id

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its task id (a task may raise it)
        return (type(self), (str(self), self.task_id))


class SingleInstanceTask(Task):
    """A task base that does not enqueue a call whose key is queued or running already.

    Needed for ``dedupe_queued``: ``@shared_task(bind=True, base=SingleInstanceTask)``. The
    second ``.delay()`` returns the ``AsyncResult`` of the queued or running task (or raises
    :class:`AlreadyQueued` with ``dedupe_queued="raise"``). Works on every backend.
    """

    abstract = True

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        config = _config_of(self)
        if config is None or not config.dedupe_queued:
            return super().apply_async(args, kwargs, **options)
        key = lock_key(self, *(args or ()), **(kwargs or {}))
        backend = locks[config.using]
        task_id = options.pop("task_id", None)
        # self.retry() sends the running task's own id again: that call was accepted already,
        # so it is never deduplicated (to itself, or to the holder it waits for).
        retrying = task_id is not None and task_id == self.request.id
        if not retrying:
            running = backend.inspect(key)
            holder = running.holder.get("k") if running is not None else None
            if holder:
                return self._deduplicated(config, key, str(holder))
        task_id = task_id or uuid_text()
        # The marker outlives the wait in the queue (countdown/ETA included), then expires.
        wait = self._queue_wait(options) + config.dedupe_ttl
        queued = backend.execute(backend.op_mark_queued(key, task_id, to_ms(wait)))
        if queued is not None and queued != task_id and not retrying:
            return self._deduplicated(config, key, queued)
        return super().apply_async(args, kwargs, task_id=task_id, **options)

    def _queue_wait(self, options: dict[str, Any]) -> float:
        """Seconds the call waits in the queue by its countdown or ETA."""
        wait = float(options.get("countdown") or 0)
        eta = options.get("eta")
        if isinstance(eta, datetime.datetime):
            eta = maybe_make_aware(eta, self.app.timezone)  # Celery's reading of a naive ETA
            wait = max(wait, (eta - self.app.now()).total_seconds())
        return max(0.0, wait)

    def _deduplicated(self, config: SingleInstance, key: str, task_id: str) -> Any:
        if config.dedupe_queued == "raise":
            raise AlreadyQueued(
                f"{self.name} not queued: {key!r} is queued or running already as task"
                f" {task_id} (backend {config.using!r})",
                task_id,
            )
        return self.AsyncResult(task_id)

    def lock_key(self, *args: Any, **kwargs: Any) -> str:
        """The lock name a call with these arguments uses (see :func:`lock_key`)."""
        return lock_key(self, *args, **kwargs)

    def release_lock(self, *args: Any, **kwargs: Any) -> Released:
        """Force-release the lock of a call with these arguments (see :func:`release_lock`)."""
        return release_lock(self, *args, **kwargs)


def lock_key(task: Any, *args: Any, **kwargs: Any) -> str:
    """The lock name that ``task.delay(*args, **kwargs)`` runs under (any task decorated with
    ``@single_instance``; ``args`` as given to ``delay``, without a bound task's ``self``)."""
    config = _config_of(task)
    if config is None:
        raise TypeError(f"{task!r} is not a task decorated with @single_instance")
    return config.key_for(task.name, args, kwargs, bound=_is_bound(task))


def release_lock(task: Any, *args: Any, **kwargs: Any) -> Released:
    """Force-release the lock that ``task.delay(*args, **kwargs)`` runs under, whoever holds
    it: an operator's action, as the admin's force-release (logged at WARNING and recorded as
    a ``force_release`` lock incident). Only the hold found is released (a hold taken since is
    left alone). Truthy only when it released one: ``Released.RELEASED``, else ``NOT_HELD``
    or ``CHANGED``. The task still running keeps running: it only no longer excludes others.
    """
    from ..incidents import recorder

    key = lock_key(task, *args, **kwargs)  # TypeError for a task without @single_instance
    config = _config_of(task)
    assert config is not None
    backend = locks[config.using]
    info = backend.inspect(key)
    if info is None:
        return Released.NOT_HELD
    outcome = backend.force_release(key, info.token, None if info.token else info.fence)
    if outcome:
        holder = info.holder.get("k")
        detail = f"by {task.name}.release_lock(); held by task {holder}"
        logger.warning("redlock: force-released %r on %r %s", key, config.using, detail)
        recorder.record("force_release", key, config.using, detail)
    return outcome


def _clear_queued_marker(config: SingleInstance, key: str, task_id: str) -> None:
    backend = locks[config.using]
    try:
        backend.execute(backend.op_clear_queued(key, task_id))
    except LockError as exc:  # the marker then expires at its TTL; the run goes on
        logger.warning("redlock: could not clear the queue marker of %r: %s", key, exc)


__all__ = [
    "AlreadyQueued",
    "SingleInstanceTask",
    "duplicate_skipped",
    "hold_of",
    "lock_key",
    "release_lock",
    "release_task_hold",
    "single_instance",
    "skipped",
]
