"""``@single_instance``: a task that never runs twice at once for the same key, on Celery and
on Django's Tasks framework alike.

The core both integrations share: the decorator and its settings, the keys (the function's
path plus its canonical bound arguments, or ``key=``), taking the lock (naming the task run in
the holder), what a duplicate does, and running the body under the lock, released on every
outcome. Celery's glue is in :mod:`.celery`, Django Tasks' in :mod:`.tasks`: they import this
module, never each other, and this module imports neither. Which framework runs a call is
asked of the adapters in :data:`ADAPTERS`, which the package (``contrib/__init__.py``) fills
(see :class:`Adapter`); a call no adapter claims is a direct call, run under the lock with no
task id.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import decimal
import enum
import functools
import hashlib
import inspect
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, cast

from ..backends import markers
from ..backends.base import Kind, LockInfo
from ..exceptions import LockError, LockNotAcquired
from ..fencing import (
    database_of,
    drop_abandoned,
    fenced_transaction,
    refuse_manual_commit,
    release_after_commit,
)
from ..handler import DEFAULT_LOCK_ALIAS, locks
from ..identity import HOST
from ..identity import current_task as holder_task
from ..locking import BaseLock, Lock, Semaphore, name_template
from ..locking.templates import callable_name, is_async_callable, refuse_generator
from ..signals import duplicate_not_queued, duplicate_skipped  # re-exported: their old path
from ..validation import (
    MAX_TTL,
    check_limit,
    check_name,
    check_optional_seconds,
    check_seconds,
)

logger = logging.getLogger("django_redlock")
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

ON_DUPLICATE = ("skip", "raise", "retry", "coalesce")
#: Keys longer than this are hashed (and say so): Redis keys stay short, names stay readable.
MAX_KEY = 200


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
    ``countdown`` seconds, honouring the task's ``max_retries``) or ``"coalesce"`` (Celery: the
    duplicate returns at once, and exactly one more run follows the current one, with the
    arguments of the last duplicate noted, however many came). The default key takes
    arguments that have one canonical form (see :func:`_canonical`); for others pass ``key=``.
    A ``bind=True`` task's first parameter (whatever its name) is the task, not part of the
    key.

    ``dedupe_queued`` (the task needs ``base=SingleInstanceTask``): ``True`` makes a ``delay()``
    of a key that is queued or running return that task's ``AsyncResult`` instead of enqueuing
    again; ``"raise"`` raises :class:`AlreadyQueued` instead. ``dedupe_ttl``: how long a queue
    marker lasts past the call's countdown/ETA if the task never starts (and a coalesced
    call's note past its last renewal: see the Celery integration).

    ``limit=N``: at most N runs of a key at once (a semaphore of N permits instead of a
    lock); ``on_duplicate`` applies when all N are taken.

    ``atomic=True`` (or a ``DATABASES`` alias): the body runs in the lock's fenced transaction
    (see ``lock(..., atomic=)``), committed before the lock is released; a stale hold raises
    ``StaleFence`` before the body runs, and a hold lost once the body committed is logged,
    not raised (a retry would run the body twice), as is an ``on_commit`` callback's error.

    Under Django's ``@task`` (or the ``django-tasks`` backport's) the same rules apply to each
    task run, keyed by the function's import path, with the holder naming the task result id;
    ``"retry"`` has no equivalent there (the run fails with TypeError), and ``dedupe_queued``
    needs the backend wrapped by :class:`django_redlock.contrib.tasks.DedupeQueuedBackend`.
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
    if on_duplicate == "coalesce" and limit is not None:
        raise ValueError('on_duplicate="coalesce" does not combine with limit: N runs would end')
    database = database_of(atomic)
    if database is not None and limit is not None:
        raise ValueError("atomic= does not combine with limit: N runs of a key would hold at once")

    def decorate(func: F) -> F:
        check_decorated(func)
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


def _take(held: BaseLock, task_id: str | None, attempt: int) -> tuple[bool, LockInfo | None]:
    """Take the task's lock or permit; if not, who holds the key.

    An earlier attempt of this very task holds it only while its ``self.retry()`` propagates:
    Celery publishes the retry (same task id, one more ``retries``) before the lock is
    released on the way out. That attempt is about to release: wait for it, however long its
    clean-up on the way out takes (a retry is a new attempt, never a copy of that one: given
    up, it would be lost), until it is released or its run died (then freed at once). The
    same attempt holding it is a message delivered again while its task runs: a duplicate,
    never a second run.
    """
    backend = held.backend
    for _ in range(3):  # again if it was freed between the try and the look, or died
        if held.acquire(blocking=False):
            return _alone(held, task_id, attempt)
        info = backend.inspect(held.name)
        if info is None:
            continue
        own = attempts_holding(info, task_id)
        if own and max(own) < attempt:
            return _after_earlier(held, task_id, attempt)
        if own and _free_dead_runs(held, info, task_id):
            continue  # the copy of a run that died: it runs now
        return False, info
    return False, None


def _after_earlier(
    held: BaseLock, task_id: str | None, attempt: int
) -> tuple[bool, LockInfo | None]:
    """Wait for an earlier attempt of ``task_id`` to release the key, then take it: in slices
    of the lock's TTL, for as long as that attempt's run lives (its watchdog renews its hold
    while its clean-up runs). Not taken: the key is held by others (a duplicate's answer)."""
    backend = held.backend
    while True:
        if held.acquire(timeout=held.lock_ttl):
            return _alone(held, task_id, attempt)
        info = backend.inspect(held.name)
        if info is None:
            continue
        own = attempts_holding(info, task_id)
        if not own or max(own) >= attempt:
            return False, info
        if _free_dead_runs(held, info, task_id):
            continue
        logger.info(
            "redlock: the retry (attempt %s) of task %s still waits for its earlier attempt to"
            " release %r", attempt, task_id, held.name,
        )  # fmt: skip


def _free_dead_runs(held: BaseLock, info: LockInfo, task_id: str | None) -> bool:
    """Release the holds of ``task_id`` whose run died (see :func:`run_died`); whether any
    went. The message of a run killed mid-body (a prefork child SIGKILLed, with
    ``acks_late`` and ``reject_on_worker_lost``) comes back with the same id and attempt:
    that copy must run, where a copy beside a live run must not."""
    freed = False
    backend = held.backend
    for hold in info.holders or [info]:
        if hold.token is None or holds_task(hold.token, task_id) is None:
            continue
        if not run_died(backend, held.name, hold):
            continue
        if info.holders:
            gone = backend.execute(backend.op_lease_release(held.name, hold.token)) >= 0
        else:
            gone = backend.execute(backend.op_release(held.name, hold.token, Kind())) >= 0
        if gone:
            logger.warning(
                "redlock: released %r, held by task %s whose run died (pid %s on %s): its"
                " message came back and runs now",
                held.name, task_id, hold.holder.get("p"), hold.holder.get("h"),
            )  # fmt: skip
        freed = True  # released now, or by someone else meanwhile: try again
    return freed


def run_died(backend: Any, name: str, hold: LockInfo) -> bool:
    """Whether the run holding ``hold`` died (its process is gone), rather than still running.

    The holder names its host and pid. On this host the pid answers at once (a host name is
    taken to mean one pid namespace). Elsewhere a live run's watchdog renews its hold before
    it expires, and a dead one's only runs out: watch it (at most its TTL). A hold released
    early was a live run that finished: not dead (its copy must not run again).
    """
    who = hold.holder
    pid = str(who.get("p", ""))
    if who.get("h") == HOST and pid.isdigit():
        if int(pid) == os.getpid():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process: alive
            return False
        return False
    if hold.ttl is None:
        return False
    start = time.monotonic()
    expires = start + hold.ttl
    last = hold.ttl
    while True:
        time.sleep(min(0.1, max(hold.ttl / 20, 0.01)))
        info = backend.inspect(name)
        now = time.monotonic()
        mine = [h for h in (info.holders or [info]) if h.token == hold.token] if info else []
        if not mine:
            return now >= expires - 0.05  # gone at its expiry: it ran out, nobody renewed it
        ttl = mine[0].ttl
        if ttl is None or ttl > last + 0.01:
            return False  # renewed: a live run
        last = ttl


def _alone(held: BaseLock, task_id: str | None, attempt: int) -> tuple[bool, LockInfo | None]:
    """Keep a permit only if no other hold of this task id runs. A lock has one holder:
    taking it told already. A semaphore has free permits for a copy of a running task's
    message (or for its retry) too: look at the other permits once this one is taken."""
    if not task_id or not isinstance(held, Semaphore):
        return True, None
    mine = held.fence or 0
    renew_at = time.monotonic() + held.lock_ttl / 3
    try:
        while True:
            info = held.backend.inspect(held.name)
            earlier = False
            for lease in info.holders if info is not None else []:
                other = holds_task(lease.token, task_id)
                if lease.token == held.token or other is None:
                    continue
                if other == attempt and run_died(held.backend, held.name, lease):
                    assert lease.token is not None  # holds_task() found the task in it
                    held.backend.execute(held.backend.op_lease_release(held.name, lease.token))
                    logger.warning(
                        "redlock: released a permit of %r, held by task %s whose run died",
                        held.name, task_id,
                    )  # fmt: skip
                    continue
                # The same attempt that took its permit first runs (of copies taking permits
                # at once, each sees the other and one, by fence order, stays); a later
                # attempt runs rather than an older one; an earlier one is on its way out.
                if other > attempt or (other == attempt and (lease.fence or 0) < mine):
                    held.release()
                    return False, info
                earlier = True
            if not earlier:
                return True, None
            if time.monotonic() >= renew_at:
                # An earlier attempt on its way out for long (a slow clean-up): waited for
                # while its run lives, as a lock's retry waits (see _take). This permit is
                # kept meanwhile (no watchdog renews it yet); a dead run's permit is freed.
                held.extend()
                _free_dead_earlier(held, info, task_id, attempt)
                held.extend()
                renew_at = time.monotonic() + held.lock_ttl / 3
            time.sleep(0.05)  # an earlier attempt releases in a moment (see _take)
    except BaseException:
        with contextlib.suppress(LockError):
            held.release()
        raise


def _free_dead_earlier(held: BaseLock, info: LockInfo | None, task_id: str, attempt: int) -> None:
    """Release the permits of ``task_id``'s attempts before ``attempt`` whose run died."""
    for lease in info.holders if info is not None else []:
        other = holds_task(lease.token, task_id)
        if other is None or other >= attempt or not run_died(held.backend, held.name, lease):
            continue
        assert lease.token is not None
        held.backend.execute(held.backend.op_lease_release(held.name, lease.token))
        logger.warning(
            "redlock: released a permit of %r, held by task %s (attempt %s) whose run died",
            held.name, task_id, other,
        )  # fmt: skip


def attempts_holding(info: LockInfo | None, task_id: str | None) -> list[int]:
    """The attempts of ``task_id`` holding the key (a lock's one hold, a semaphore's
    permits), from its hold tokens."""
    if info is None or not task_id:
        return []
    holds = info.holders or [info]
    found = [holds_task(hold.token, task_id) for hold in holds]
    return [attempt for attempt in found if attempt is not None]


# -- the task-id rule ------------------------------------------------------------------------
#
# Any text Celery accepts as a task id works (callers choose them: ``apply_async(task_id=)``,
# canvas ids). Two places carry it, each with its own limits:
#
# * the hold token, ``<token id>.<attempt>.<random>``: a token holds no "|" and is at most 200
#   chars, so an id that is long (> 150), holds "|" or a control char, or starts with "#" is
#   carried as "#" + its SHA-256 (:func:`token_id`); comparisons go through it, never the raw
#   id (:func:`holds_task`).
# * the holder's task field "k": fields are split on "\x1f", so an id holding one (or starting
#   with "b64:") is carried as "b64:" + its urlsafe base64 (:func:`holder_id`), read back by
#   :func:`task_id_of` (the admin and ``redlock list`` show that form for such ids).

HASHED = "#"
ENCODED = "b64:"
MAX_TOKEN_ID = 150


def token_id(task_id: str) -> str:
    """The form of ``task_id`` in a hold token (see the task-id rule above)."""
    plain = (
        len(task_id) <= MAX_TOKEN_ID
        and not task_id.startswith(HASHED)
        and task_id.isprintable()
        and "|" not in task_id
    )
    if plain:
        return task_id
    return HASHED + hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def holds_task(token: str | None, task_id: str | None) -> int | None:
    """The attempt of ``task_id`` that the hold ``token`` is, or None (not that task's)."""
    found = hold_of(token)
    if found is None or not task_id or found[0] != token_id(task_id):
        return None
    return found[1]


def holder_id(task_id: str) -> str:
    """The form of ``task_id`` in the holder's "k" field (see the task-id rule above)."""
    if "\x1f" in task_id or task_id.startswith(ENCODED) or not _utf8(task_id):
        raw = task_id.encode("utf-8", "surrogatepass")
        return ENCODED + base64.urlsafe_b64encode(raw).decode("ascii")
    return task_id


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate does not: Redis cannot take it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def task_id_of(holder: dict[str, str]) -> str | None:
    """The task id a holder names (its "k" field, decoded), or None."""
    found = holder.get("k")
    if not found:
        return None
    if found.startswith(ENCODED):
        with contextlib.suppress(ValueError):
            return base64.urlsafe_b64decode(found[len(ENCODED) :]).decode("utf-8", "surrogatepass")
    return found


def _prefix(task_id: str | None, attempt: int = 0) -> str | None:
    # "<token id>.<attempt>." then the random part, which never contains a ".".
    return f"{token_id(task_id)}.{attempt}." if task_id else None


def hold_of(token: str | None) -> tuple[str, int] | None:
    """The task id (in its token form, :func:`token_id`) and attempt (``request.retries``) a
    task's hold token names: ``<token id>.<attempt>.<random>`` (task ids may contain dots;
    the other parts do not)."""
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


def describe_holder(info: LockInfo | None) -> str:
    """Who holds a key, for a message: the task(s) holding it, or a plain ``lock()``'s
    process (it names no task)."""
    holds = (info.holders or [info]) if info is not None else []
    if not holds:
        return "nobody (freed meanwhile)"
    named = []
    for hold in holds:
        who = hold.holder
        if who.get("k"):
            named.append(f"task {task_id_of(who)}")
        else:
            named.append(
                f"a lock() outside any task (pid {who.get('p', '?')} on {who.get('h', '?')},"
                f" thread {who.get('t', '?')})"
            )
    return ", ".join(named)


def duplicate(
    config: SingleInstance, task: Any, key: str, task_id: str | None, info: LockInfo | None
) -> Any:
    """What a call that found ``key`` held (by ``info``) does, as ``config.on_duplicate``
    says: raise ``LockNotAcquired``, ``task.retry()``, or skip (the sentinel returned)."""
    holds = (info.holders or [info]) if info is not None else []
    holder = ", ".join(str(task_id_of(h.holder)) for h in holds if h.holder.get("k")) or None
    message = f"task {task_id} not run: {key!r} is held by {describe_holder(info)}"
    if config.on_duplicate == "raise":
        raise LockNotAcquired(f"{message} (backend {config.using!r})")
    if config.on_duplicate == "retry" and task is not None:
        raise task.retry(countdown=config.countdown, exc=LockNotAcquired(message))
    logger.info("redlock: skipped duplicate: %s", message)
    return skip_result(config, task, key, task_id, holder)


def skip_result(
    config: SingleInstance, task: Any, key: str, task_id: str | None, holder: str | None
) -> dict[str, Any]:
    """A skipped duplicate's outcome: ``duplicate_skipped`` sent, the sentinel returned."""
    duplicate_skipped.send_robust(
        sender=task, key=key, task_id=task_id, holder_task_id=holder, using=config.using,
        redelivered=False,
    )  # fmt: skip
    return {"redlock": SKIPPED, "key": key, "task_id": task_id, "holder_task_id": holder}


class AlreadyQueued(LockError):
    """``dedupe_queued="raise"``: a call of a key that is queued or running already, as the
    task ``task_id``."""

    def __init__(self, message: str, task_id: str = "") -> None:
        # args are the constructor's: Celery's JSON result backend stores an exception's
        # args and rebuilds it as cls(*args) (a task may raise it; pickle does the same).
        super().__init__(message, task_id)
        self.task_id = task_id

    def __str__(self) -> str:
        return str(self.args[0])


def clear_queued_marker(config: SingleInstance, key: str, task_id: str) -> None:
    backend = locks[config.using]
    try:
        markers.clear(backend, key, task_id)
    except LockError as exc:  # the marker then expires at its TTL; the run goes on
        logger.warning("redlock: could not clear the queue marker of %r: %s", key, exc)


# -- one run: take the lock, run the body, release (the same for Celery and Django Tasks) ---


def new_hold(config: SingleInstance, key: str, task_id: str | None, attempt: int = 0) -> BaseLock:
    """The lock (or semaphore) object of one run of ``key``, not taken yet (no I/O)."""
    if config.limit is None:
        return Lock(key, ttl=config.ttl, using=config.using,
                    token_prefix=_prefix(task_id, attempt), atomic=config.atomic)  # fmt: skip
    return Semaphore(key, config.limit, ttl=config.ttl, using=config.using,
                     token_prefix=_prefix(task_id, attempt))  # fmt: skip


#: How many exceptions a signal handler raises (a burst of soft time limits, a user's
#: ``SIGALRM`` timeout on top) the way out of a run outlasts, each costing one try of the
#: release; past them the hold runs out at its TTL, no longer renewed once a try began.
LET_GO_TRIES = 64


def let_go(
    held: BaseLock, tries: int = LET_GO_TRIES, interrupted: BaseException | None = None
) -> BaseException | None:
    """Release ``held`` if it holds (on the way out of a run). Never raises: a ``LockError``
    (lost, no answer) leaves the hold to its TTL, no longer renewed; an exception a signal
    handler raises meanwhile, a burst of them too, is returned (the first) and the release
    tried again, as the fenced exit's release is (:func:`guarded` calls it again should one
    land at its entry, before its first try)."""
    # CPython runs a signal's handler only at a function's entry, a call's return or a
    # loop's back-edge. So each call here is in a try on one line (it holds from the line's
    # first instruction), the handlers call nothing but the last, and the next try is reached
    # by falling through: a loop's back-edge is where a signal pending since the last
    # exception's unwinding would run, outside any try (the campaign's bursts landed at the
    # first such place, every time). Each exception costs a try; a deeper call tries again.
    try: return _release_held(held, interrupted)  # noqa: E701  # fmt: skip
    except BaseException as error: interrupted = interrupted or error  # noqa: E701  # fmt: skip
    if tries <= 0:
        return interrupted
    try: return let_go(held, tries - 1, interrupted)  # noqa: E701  # fmt: skip
    except BaseException as error: interrupted = interrupted or error  # noqa: E701  # fmt: skip
    try: return let_go(held, tries - 1, interrupted)  # noqa: E701  # fmt: skip
    except BaseException as error: return let_go(held, tries - 1, interrupted or error)  # noqa: E701  # fmt: skip


def _release_held(held: BaseLock, interrupted: BaseException | None) -> BaseException | None:
    if held.token is not None:
        with contextlib.suppress(LockError):  # lost, or no answer: left to its TTL
            held.release()  # stops the renewal before anything is sent
    return interrupted


def guarded(held: BaseLock, run: Callable[[], T]) -> T:
    """``run()`` (which takes ``held`` and runs the body), ``held`` released on every way
    out: an exception at any line once it is taken (a soft time limit), and a burst of them
    during the clean-up, leave no hold renewed after the run (:func:`let_go`). Raises what
    the run raised; an interrupt (a ``BaseException`` that is no ``Exception``) that came
    during the clean-up rather than a time limit before it."""
    try: return run()  # noqa: E701  # fmt: skip
    except BaseException as first:  # (entered without a call: no signal runs on the way in)
        # A signal pending since the unwinding runs at the first call, let_go's own entry,
        # before its try: so again, each try on one line reached by falling through (a
        # loop's back-edge would be such a place too), once per exception landing there.
        interrupted: BaseException | None = None
        try: interrupted = let_go(held)  # noqa: E701  # fmt: skip
        except BaseException as error: interrupted = error  # noqa: E701  # fmt: skip
        try: interrupted = let_go(held) or interrupted  # noqa: E701  # fmt: skip
        except BaseException as error: interrupted = interrupted or error  # noqa: E701  # fmt: skip
        try: interrupted = let_go(held) or interrupted  # noqa: E701  # fmt: skip
        except BaseException as error: interrupted = interrupted or error  # noqa: E701  # fmt: skip
        try: interrupted = let_go(held) or interrupted  # noqa: E701  # fmt: skip
        except BaseException as error: interrupted = interrupted or error  # noqa: E701  # fmt: skip
        try: interrupted = let_go(held) or interrupted  # noqa: E701  # fmt: skip
        except BaseException as error: interrupted = interrupted or error  # noqa: E701  # fmt: skip
        try: interrupted = let_go(held) or interrupted  # noqa: E701  # fmt: skip
        except BaseException as error: interrupted = interrupted or error  # noqa: E701  # fmt: skip
        if interrupted is not None and not isinstance(interrupted, Exception):
            raise interrupted from first  # an interrupt says more than a time limit before it
        raise


def take(
    config: SingleInstance, key: str, task_id: str | None, task_name: str, attempt: int = 0,
    held: BaseLock | None = None,
) -> tuple[BaseLock, bool, LockInfo | None]:  # fmt: skip
    """Take ``key``'s lock for one run (its holder names the run: ``task_id``, ``task_name``)
    and clear the run's queue marker; return the lock, whether it is held, and if not, who
    holds it. ``held``: the object to take (:func:`new_hold`), made by a caller that guards
    the whole run with :func:`guarded` (an exception such as a soft time limit may come at any
    line once the lock is taken: nothing between the acquire and that guard may leave it held
    and renewed)."""
    if config.atomic is not None:  # autocommit off: refused before the lock is taken
        drop_abandoned(config.atomic)  # (not a block's leftover transaction)
        refuse_manual_commit(config.atomic, f"@single_instance lock {key!r}")
    if held is None:
        held = new_hold(config, key, task_id, attempt)
    named = holder_task.get()
    try:
        try:
            holder_task.set((holder_id(task_id), task_name) if task_id else None)
            acquired, info = _take(held, task_id, attempt)
        finally:
            # By value, not by the set()'s token: an interrupt as set() returned leaves no
            # token, and every later hold in this context would name this run's task.
            holder_task.set(named)
        if config.dedupe_queued and task_id:
            # Not queued any more. Cleared once the lock is taken, so a delay() meanwhile
            # finds the marker or the hold. (One that looked for the hold before it was taken
            # and marks after this still enqueues a duplicate: the lock then excludes it.)
            clear_queued_marker(config, key, task_id)
    except BaseException:
        let_go(held)
        raise
    return held, acquired, info


def run_held(
    held: BaseLock, func: Callable[..., Any], args: tuple, kwargs: dict, atomic: str | None = None
) -> Any:
    """Run the body under ``held`` and release it on every outcome; with ``atomic`` (a
    database alias) in the hold's fenced transaction, which ends before the release. Celery's
    and Django Tasks' runs both come through here."""
    block = None if atomic is None else fenced_transaction(held, atomic)  # held.atomic()
    result: Any = None
    try:
        if block is None:
            result = func(*args, **kwargs)
        else:
            with block:  # committed (or rolled back) before the release
                result = func(*args, **kwargs)
            release_after_commit(held)  # committed: a lost hold is logged, never raised
            return result
    except BaseException as exc:  # Retry, Ignore, Reject, SoftTimeLimitExceeded, errors
        if block is not None and block.committed.done and isinstance(exc, Exception):
            # A soft time limit on a line after the COMMIT: raising would make the run look
            # failed, and autoretry_for would apply the committed work again.
            logger.warning("redlock: %s: its fenced transaction committed; then %s: %s"
                           " (logged, not raised)", held.describe(), type(exc).__name__,
                           exc)  # fmt: skip
            if held.token is not None:  # not released yet
                release_after_commit(held)
            return result
        with contextlib.suppress(LockError):  # the body's exception says more: all release
            held.release()
        raise
    held.release()  # LockLost if the hold was lost meanwhile: the task fails visibly
    return result


# -- which framework runs a call ------------------------------------------------------------


class Adapter(Protocol):
    """A task framework's glue, as the core asks it (the adapters import the core; the core
    imports none of them, it asks those in :data:`ADAPTERS`, in order)."""

    def check_decorated(self, func: Any) -> None:
        """Raise TypeError if ``func`` is this framework's task object (the decorator belongs
        under the task decorator, on the function); else nothing."""

    def runner(self, config: SingleInstance, args: tuple) -> Callable[[tuple, dict], Any] | None:
        """How to run this call of ``config``'s function (``args`` as the function got them)
        if it is this framework's to run (a run of its task, or any call it claims); else
        None, and the next adapter is asked."""


#: The adapters, asked in order (Django Tasks' before Celery's, whose runner claims direct
#: calls too). Filled once, by ``contrib/__init__.py``, which every import of this module runs
#: first.
ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter) -> None:
    """Ask ``adapter`` after those registered before it (once, however often it comes)."""
    if adapter not in ADAPTERS:
        ADAPTERS.append(adapter)


def check_decorated(func: Any) -> None:
    """Refuse what this decorator cannot protect: a task object (it belongs under the task
    decorator, on the function) or a coroutine function."""
    for adapter in ADAPTERS:  # first: a Django Task is not callable, which Celery's refuses
        adapter.check_decorated(func)
    if not callable(func):
        raise TypeError(f"@single_instance decorates a function, not {type(func).__name__}")
    refuse_generator(func, "@single_instance(...)")
    if is_async_callable(func):  # the rule: locking/templates.py, "async callables"
        raise TypeError(
            f"@single_instance decorates a plain function, not the async callable"
            f" {callable_name(func)!r}: its lock would be released before the coroutine runs"
        )


def _run(config: SingleInstance, args: tuple, kwargs: dict) -> Any:
    """One call of a ``@single_instance`` function: as the run of the framework that claims
    it, else as a direct call (under the lock, without a task id)."""
    for adapter in ADAPTERS:
        runner = adapter.runner(config, args)
        if runner is not None:
            return runner(args, kwargs)
    return run_direct(config, args, kwargs)


def run_direct(config: SingleInstance, args: tuple, kwargs: dict) -> Any:
    """A call no framework runs: under the key's lock (whose holder names no task), released
    on every outcome; a duplicate does what ``on_duplicate`` says (no retry without a task)."""
    func = config.func
    task_name = f"{func.__module__}.{func.__qualname__}"
    key = config.key_for(task_name, args, kwargs, bound=False)
    held = new_hold(config, key, None)

    def run() -> Any:
        _, acquired, info = take(config, key, None, task_name, held=held)
        if not acquired:
            return duplicate(config, None, key, None, info)
        return run_held(held, func, args, kwargs, config.atomic)

    return guarded(held, run)


__all__ = [
    "ADAPTERS",
    "Adapter",
    "AlreadyQueued",
    "SingleInstance",
    "duplicate_not_queued",
    "duplicate_skipped",
    "hold_of",
    "holder_id",
    "holds_task",
    "new_hold",
    "register_adapter",
    "run_held",
    "single_instance",
    "skipped",
    "take",
    "task_id_of",
    "token_id",
]
