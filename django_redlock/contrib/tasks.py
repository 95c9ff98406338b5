"""``@single_instance`` under Django's Tasks framework (``django.tasks``, Django 6.0+, or the
``django-tasks`` backport on 4.2-5.2), and queue-time dedupe for its backends.

The rules are Celery's (:mod:`.single` holds the shared core); what differs is how a run is
known. A worker sends ``task_started`` with the run's ``TaskResult`` just before it calls the
function, in the thread that calls it (Django's ``ImmediateBackend``, django-tasks-db's
``db_worker``), and ``task_finished`` after; a ``takes_context=True`` task also gets it as
``context.task_result``. The holder of the lock then names the task result id.

Queue-time dedupe needs a hook before a run is queued. The framework has one:
``BaseTaskBackend.enqueue``, so :class:`DedupeQueuedBackend` wraps the configured backend (a
subclass of it, so ``db_worker`` and ``isinstance`` checks still accept it). A ``Task``
subclass would not do: ``@task`` builds the backend's ``task_class``, itself a backend choice.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import inspect
import json
import logging
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from types import FrameType, TracebackType
from typing import Any, NamedTuple

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from ..backends import markers
from ..exceptions import LockError, LockNotAcquired
from ..handler import locks
from ..identity import current_task as holder_task
from ..locking import Lock, finisher
from ..validation import to_ms
from .single import (
    AlreadyQueued,
    SingleInstance,
    clear_queued_marker,
    duplicate,
    guarded,
    holder_id,
    new_hold,
    run_held,
    take,
    task_id_of,
)

logger = logging.getLogger("django_redlock")

#: Django's own (6.0+) and the backport: either may run a task, and both may be installed.
FRAMEWORKS = ("django.tasks", "django_tasks")


class _Run(NamedTuple):
    result: Any  # the TaskResult
    frame: FrameType | None  # the frame that sent task_started (the worker's, running it)
    thread: int


#: The runs this thread is in, innermost last, each from ``task_started`` to ``task_finished``
#: (the ImmediateBackend runs a task enqueued by a running one inside it). A run whose sender's
#: frame has returned without ``task_finished`` (a KeyboardInterrupt, which the ImmediateBackend
#: passes on unreported; an interrupt at any line between the two signals) is over: dropped
#: at the next look, never taken for the run a later call is in.
_current: ContextVar[tuple[_Run, ...]] = ContextVar("redlock_task_runs", default=())
_connected: set[str] = set()


def _sender_frame() -> FrameType | None:
    """The frame that sent the signal being received (past the dispatcher's own frames)."""
    here = inspect.currentframe()
    frame = here.f_back.f_back if here is not None and here.f_back is not None else None
    while frame is not None and frame.f_globals.get("__name__", "").startswith("django.dispatch"):
        frame = frame.f_back
    return frame


def _live(run: _Run) -> bool:
    """Whether ``run``'s sender is still running (its frame is one this call is inside). From
    another thread nothing can be told: live."""
    if run.frame is None or run.thread != threading.get_ident():
        return True
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None
    while frame is not None:
        if frame is run.frame:
            return True
        frame = frame.f_back
    return False


def _runs() -> tuple[_Run, ...]:
    """The runs this call is in (the ended ones dropped)."""
    runs = _current.get()
    live = tuple(run for run in runs if _live(run))
    if len(live) != len(runs):
        _current.set(live)
    return live


def _loaded(module: str) -> list[Any]:
    """``module`` (e.g. ``"base"``) of each Tasks framework imported so far."""
    return [
        sys.modules[f"{name}.{module}"] for name in FRAMEWORKS if f"{name}.{module}" in sys.modules
    ]


def connect() -> None:
    """Follow the runs of every Tasks framework imported so far (idempotent). Called when a
    function is decorated (its module imported ``task`` already) and by the dedupe backend."""
    for name in FRAMEWORKS:
        if name in sys.modules and name not in _connected:
            signals = importlib.import_module(f"{name}.signals")
            signals.task_started.connect(_started, weak=False, dispatch_uid=f"redlock:{name}")
            signals.task_finished.connect(_finished, weak=False, dispatch_uid=f"redlock:{name}")
            signals.task_enqueued.connect(_enqueued, weak=False, dispatch_uid=f"redlock:{name}")
            _connected.add(name)


def _started(sender: Any = None, task_result: Any = None, **_: Any) -> None:
    if task_result is not None:
        run = _Run(task_result, _sender_frame(), threading.get_ident())
        _current.set((*_runs(), run))


def _finished(sender: Any = None, task_result: Any = None, **_: Any) -> None:
    if task_result is None:
        return
    runs = _runs()
    if runs and runs[-1].result.id == task_result.id:
        _current.set(runs[:-1])
    _forget_queued(task_result)


#: While this context's dedupe enqueue() of a task calls the backend's: the task's function
#: and the run the backend reported queued (``task_enqueued``), if it did.
_watching: ContextVar[tuple[Any, list[Any]] | None] = ContextVar("redlock_enqueued", default=None)


def _enqueued(sender: Any = None, task_result: Any = None, **_: Any) -> None:
    watching = _watching.get()
    if watching is None or task_result is None or watching[1]:
        return  # the first only: a run the backend makes inside enqueue() sends its own
    if getattr(getattr(task_result, "task", None), "func", None) is watching[0]:
        watching[1].append(task_result)


def _queued_by(backend: Any, func: Any, seen: list[Any], exc: BaseException) -> Any:
    """The run an enqueue() that raised ``exc`` may have queued (None: known not to): the
    one ``task_enqueued`` reported, or one the raising frames held (a receiver before ours
    raised, an interrupt in the signal's send), then asked for by id where the backend can
    answer: gone is "not queued"; an answer we cannot have is "queued" (never lost)."""
    found = seen[0] if seen else _result_in(exc.__traceback__, func)
    if found is None or not getattr(backend, "supports_get_result", False):
        return found
    try:
        backend.get_result(found.id)
    except tuple(errors.TaskResultDoesNotExist for errors in _loaded("exceptions")):
        return None  # saved in a transaction that rolled back: nothing queued
    except Exception:  # unknown: taken as queued
        return found
    return found


def _result_in(tb: TracebackType | None, func: Any) -> Any:
    """A task result of ``func`` in the locals of the traceback's frames (or one level into a
    dict of them: a signal's keyword arguments), outermost first; or a stored row's
    (``task_result`` of django-tasks-db's model, raised in its save or ``post_save``)."""
    classes = tuple(base.TaskResult for base in _loaded("base") if hasattr(base, "TaskResult"))
    while tb is not None and classes:
        for value in list(tb.tb_frame.f_locals.values()):
            for item in (value, *(value.values() if isinstance(value, dict) else ())):
                if not isinstance(item, classes) and hasattr(type(item), "task_result"):
                    try:
                        item = item.task_result
                    except Exception:  # a row not complete yet: not this
                        continue
                if isinstance(item, classes) and getattr(item.task, "func", None) is func:
                    return item
        tb = tb.tb_next
    return None


def config_of(func: Any) -> SingleInstance | None:
    return getattr(func, "__redlock__", None)


def check_decorated(func: Any) -> None:
    """Refuse a Django ``Task``: above ``@task`` this decorator would wrap the Task object,
    while the worker calls the function it was built from, unprotected."""
    if any(isinstance(func, base.Task) for base in _loaded("base")):
        raise TypeError(
            "@single_instance must be placed directly under Django's @task (it decorates the"
            " task's function): above it, it would wrap the Task object, which the worker never"
            " calls, and the task would run unprotected. Write:\n"
            "    @task()\n    @single_instance(...)\n    def my_task(...):"
        )
    connect()


def current_run(config: SingleInstance, args: tuple) -> tuple[Any, bool] | None:
    """The ``TaskResult`` of the Django task run calling ``config``'s function, if any, and
    whether the function got the run's context as its first argument."""
    first = args[0] if args else None
    if first is not None and any(isinstance(first, base.TaskContext) for base in _loaded("base")):
        result = first.task_result
        return (result, True) if config_of(result.task.func) is config else None
    runs = _runs()
    # Another task's body calling this function directly is no run of this task.
    if runs and config_of(runs[-1].result.task.func) is config:
        return runs[-1].result, False
    return None


def run(config: SingleInstance, current: tuple[Any, bool] | None, args: tuple, kwargs: dict) -> Any:
    """One run (``current`` from :func:`current_run`), or a direct call (None): the body runs
    under the key's lock, which names the task result id, and is released on every outcome."""
    func = config.func
    task_name = f"{func.__module__}.{func.__qualname__}"
    result, with_context = current if current is not None else (None, False)
    task_id = str(result.id) if result is not None else None
    if result is not None:
        _check_run(config, result.task)
    key = config.key_for(task_name, args[1:] if with_context else args, kwargs, bound=with_context)
    held = new_hold(config, key, task_id)
    # One guard from before the acquire to the run (as Celery's path): an exception at any
    # line once the lock is taken (an async exception, a signal handler's, a burst of them)
    # releases it.

    def run() -> Any:
        _, acquired, info = take(config, key, task_id, task_name, 0, held)
        if not acquired:
            task = result.task if result is not None else None
            return duplicate(config, task, key, task_id, info)
        return run_held(held, func, args, kwargs, config.atomic)

    return guarded(held, run)


class TasksAdapter:
    """Django Tasks' answers to the core (see :class:`.single.Adapter`): a ``Task`` object is
    refused under the decorator; a call is this framework's only inside one of its runs."""

    def check_decorated(self, func: Any) -> None:
        check_decorated(func)

    def runner(self, config: SingleInstance, args: tuple) -> Callable[[tuple, dict], Any] | None:
        found = current_run(config, args)
        if found is None:
            return None
        return lambda args, kwargs: run(config, found, args, kwargs)


def lock_key(task: Any, *args: Any, **kwargs: Any) -> str:
    """The lock name that ``task.enqueue(*args, **kwargs)`` runs under (a Django ``Task`` whose
    function is decorated with ``@single_instance``; ``args`` without the context)."""
    config = config_of(getattr(task, "func", None))
    if config is None:
        raise TypeError(f"{task!r} is not a Django task decorated with @single_instance")
    return config.key_for(task.module_path, args, kwargs, bound=task.takes_context)


def _check_run(config: SingleInstance, task: Any) -> None:
    if config.on_duplicate in ("retry", "coalesce"):
        raise TypeError(
            f"{task.module_path}: on_duplicate={config.on_duplicate!r} needs Celery's task"
            ' retries and routing; Django\'s Tasks framework has none: use on_duplicate="skip"'
            ' or "raise"'
        )
    if config.dedupe_queued and not getattr(task.get_backend(), "redlock_dedupe_queued", False):
        raise TypeError(
            f"{task.module_path}: dedupe_queued needs its backend ({task.backend!r}) wrapped"
            ' for it: TASKS = {"...": {"BACKEND": "django_redlock.contrib.tasks.'
            'DedupeQueuedBackend", "WRAPS": "<the backend>", ...}} (without it every enqueue()'
            " is queued)"
        )


# -- queue-time deduplication ---------------------------------------------------------------

#: The enqueues of one key take turns under this lock (briefly: while one enqueues).
ENQUEUE_TTL = 30.0
#: A queue marker noted before the task result id is known (the backend makes the id).
RESERVED = "redlock-enqueuing:"


#: The keys whose enqueue turn this context holds: an ``ImmediateBackend`` runs the task inside
#: ``enqueue()``, and a run enqueuing its own key must not wait for the turn it is inside.
#: Each entry names its turn: one whose turn was let go is stale (an interrupt as the entry was
#: taken out left it), so it never refuses a later enqueue.
_enqueuing: ContextVar[tuple[tuple[str, Lock], ...]] = ContextVar("redlock_enqueuing", default=())


def _in_turn(key: str) -> bool:
    return any(k == key and turn.token is not None for k, turn in _enqueuing.get())


class DedupeQueuedMixin:
    """Mixed into a Tasks backend class: an ``enqueue()`` of a ``dedupe_queued`` task whose
    key is queued or running returns that run's ``TaskResult`` (or raises
    :class:`AlreadyQueued`) instead of queueing another. Other tasks are enqueued as the
    backend does. :class:`DedupeQueuedBackend` does the same without a subclass."""

    redlock_dedupe_queued = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)  # type: ignore[call-arg]
        connect()

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)  # type: ignore[misc]
        _validate(task)

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        return dedupe_enqueue(self, super().enqueue, task, args, kwargs)  # type: ignore[misc]

    async def aenqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        config = config_of(task.func)
        if config is None or not config.dedupe_queued:
            return await super().aenqueue(task, args, kwargs)  # type: ignore[misc]
        return await sync_to_async(self.enqueue, thread_sensitive=True)(task, args, kwargs)


def _validate(task: Any) -> None:
    config = config_of(task.func)
    if config is not None:
        _check_run(config, task)  # at import: @task() builds the Task


def dedupe_enqueue(backend: Any, enqueue: Any, task: Any, args: Any, kwargs: Any) -> Any:
    """``enqueue(task, args, kwargs)`` (the backend's own) unless ``task`` dedupes queued
    runs and its key is queued or running: then that run's result, or AlreadyQueued."""
    config = config_of(task.func)
    if config is None or not config.dedupe_queued:
        return enqueue(task, args, kwargs)
    return _enqueue_once(backend, enqueue, config, task, tuple(args), dict(kwargs))


def _enqueue_once(
    backend: Any, enqueue: Any, config: SingleInstance, task: Any, args: tuple, kwargs: dict
) -> Any:
    # The key the run will compute, from the arguments as the run gets them (JSON).
    key = config.key_for(task.module_path, *_as_stored(args, kwargs), bound=task.takes_context)
    store = locks[config.using]
    if _in_turn(key):
        # Inside this key's own enqueue (an ImmediateBackend running the task): the outer
        # call is queueing or running it right now. Waiting for its turn would wait for
        # ourselves.
        running = store.inspect(key)
        holder = task_id_of(running.holder) if running is not None else None
        existing = _existing(backend, config, task, key, holder) if holder else None
        if existing is not None:
            return existing
        raise AlreadyQueued(
            f"{task.module_path} not enqueued: {key!r} is being enqueued or run by this very"
            f" call (backend {config.using!r})",
            str(holder or ""),
        )
    if _own_uncommitted(config, key):
        # This thread queued the key's run in a transaction still open (its connection sees
        # the row): that run, without a turn another enqueue may hold, waiting for our COMMIT.
        existing = _queued_or_running(backend, config, task, key, store)
        if existing is not None:
            return existing
    # Enqueues of a key take turns, so the marker can name the task result id, which the
    # backend makes only while it queues the run (an atomic note would need the id first).
    deadline = time.monotonic() + ENQUEUE_TTL
    look = TURN_LOOK
    while True:
        wait = min(look, max(deadline - time.monotonic(), 0.0))
        look *= 2  # each wait that runs out is a timeout (metrics, incidents): a few at most
        turn = Lock(f"{key}:enqueue", ttl=ENQUEUE_TTL, timeout=wait, using=config.using)
        entered = False
        # A ``with``: an interrupt at any line (as the turn is taken, as the call returns)
        # lets it go, never leaving every enqueue of the key waiting behind it.
        try:
            with turn:
                entered = True
                return _enqueue_in_turn(
                    backend, enqueue, config, task, args, kwargs, key, store, turn, deadline
                )
        except LockNotAcquired:
            if entered:
                raise
        # Another enqueue() of the key has the turn. An ImmediateBackend runs the task inside
        # it, for as long as the run lasts: that run is the existing one (looked at between
        # waits, rather than waiting for the turn behind it).
        existing = _queued_or_running(backend, config, task, key, store)
        if existing is not None:
            return existing
        if time.monotonic() >= deadline:
            raise LockNotAcquired(f"{task.module_path}: {key!r} is being enqueued elsewhere")


#: Seconds before the first look at the key while another enqueue() of it has the turn
#: (doubled after each look).
TURN_LOOK = 0.5


def _queued_or_running(
    backend: Any, config: SingleInstance, task: Any, key: str, store: Any
) -> Any:
    """The run that holds ``key``, or the one its marker names (queued), if any."""
    running = store.inspect(key)
    holder = task_id_of(running.holder) if running is not None else None
    if holder:
        existing = _existing(backend, config, task, key, holder)
        if existing is not None:
            return existing
    found = markers.read(store, key)
    return _existing(backend, config, task, key, found[0]) if found is not None else None


def _enqueue_in_turn(
    backend: Any, enqueue: Any, config: SingleInstance, task: Any, args: tuple, kwargs: dict,
    key: str, store: Any, turn: Lock, deadline: float,
) -> Any:  # fmt: skip
    try:
        _enqueuing.set((*_enqueuing.get(), (key, turn)))
        _await_commit(backend, config, task, key, store, deadline)
        running = store.inspect(key)
        holder = task_id_of(running.holder) if running is not None else None
        existing = _existing(backend, config, task, key, holder) if holder else None
        if existing is not None:
            return existing
        reservation = f"{RESERVED}{secrets.token_urlsafe(9)}"
        for _ in range(2):  # once more after clearing a stale marker
            found = markers.mark(store, key, reservation, to_ms(ENQUEUE_TTL))
            if found is None:
                break  # noted: ours to enqueue
            existing = _existing(backend, config, task, key, found)
            if existing is not None:
                return existing
            clear_queued_marker(config, key, found)  # gone, finished or abandoned
        else:
            raise LockError(f"{task.module_path}: could not note {key!r} as queued")
        result = None
        seen: list[Any] = []
        try:
            watching = _watching.set((task.func, seen))
            try:
                result = enqueue(task, args, kwargs)
            finally:
                _watching.reset(watching)
            _name_run(config, store, task, key, reservation, result)
            if _already_finished(backend, result):  # it ran before its id was noted
                clear_queued_marker(config, key, str(result.id))
            else:
                _hold_until_commit(config, key, result)
        except BaseException as exc:
            # Raised out of enqueue(): UNKNOWN, not "nothing queued" (a backend saves the run,
            # then sends task_enqueued, whose receivers' errors pass on): the run it reported
            # or held, asked for by id (see _queued_by); none: nothing was queued. Queued
            # (or once it returned: an interrupt at any later line), the marker must name
            # the run, never stay a reservation (taken for abandoned: the next enqueue()
            # would queue a second run); and a run over already (an ImmediateBackend's) is
            # queued no more: a marker naming it (which that backend cannot look up) would
            # refuse the key for dedupe_ttl.
            if result is None:
                result = _queued_by(backend, task.func, seen, exc)
            if result is None:
                clear_queued_marker(config, key, reservation)
            else:
                _name_run(config, store, task, key, reservation, result)
                if _already_finished(backend, result):
                    clear_queued_marker(config, key, str(result.id))
                else:
                    _hold_until_commit(config, key, result)
            raise
        return result
    finally:
        # By value, not by the set()'s token: an interrupt as set() returned leaves no token,
        # and the key must not stay noted (this context's later enqueues of it were refused).
        _enqueuing.set(tuple(e for e in _enqueuing.get() if e[1] is not turn and e[1].token))


# -- a run queued in an open transaction ------------------------------------------------------
# A database backend (django-tasks-db) saves the run's row on the caller's connection: inside
# an atomic() block no other connection sees it before the COMMIT, and an enqueue() of the
# key there would take the marker's run for gone and queue a second one. So the key stays
# taken, by a lock of its own (``<key>:enqueue:commit``, renewed), until that transaction
# ends: the COMMIT's on_commit callback releases it (the marker names a run all can see);
# a rollback (Django has no hook for it) drops the callback unrun, and its finalizer
# releases the lock. The marker stays: "dropped unrun" is no proof of a rollback (Django
# drops the callbacks after a plain one that raised; a fenced block proves a COMMIT whose
# reply was lost and runs only its on_commit_or_proved callbacks), and the next enqueue()
# of the key looks its run up by id (gone, rolled back: the key is free; see _existing).

#: The suffix of the lock a run queued in an open transaction holds until it ends.
COMMIT_SUFFIX = ":enqueue:commit"


class _Uncommitted:
    """The ``on_commit`` callback of a run queued in an open transaction (see above)."""

    def __init__(self, config: SingleInstance, key: str, held: Lock) -> None:
        self.using, self.key, self.held = config.using, key, held
        # Django logs a robust callback's error with its ``__qualname__``: without one (an
        # instance has none), that log raised AttributeError out of a plain atomic()'s exit
        # (the block committed) and every later callback of the transaction was dropped.
        self.__qualname__ = "django_redlock.contrib.tasks._Uncommitted"
        # Run once it is dropped unrun (a rollback: the transaction's, or the savepoint's the
        # enqueue was made in; a closed connection's; a COMMIT whose callbacks Django dropped),
        # and nothing else refers to it. Not kept by the callback: ``held`` only.
        finisher.ensure_started()  # here: the finalizer may hand the release to it
        self._dropped = weakref.finalize(self, _let_go_dropped, held)

    def __call__(self) -> None:  # committed: the run is visible, its marker stays
        # The release first, and once more should it be cut short (a signal handler's
        # exception, which Django's ``try:`` for a robust callback logs and goes on): the
        # finalizer goes only once it is done, never leaving the lock to its TTL.
        try: _let_go(self.held)  # noqa: E701  # fmt: skip
        except BaseException: self._dropped(); raise  # noqa: E701, E702  # fmt: skip
        self._dropped.detach()


def _let_go(held: Lock) -> None:
    try:
        held.release()
    except LockError as exc:  # never taken (an interrupt), or expired: it frees at its TTL
        logger.debug("redlock: %s: %s", held.describe(), exc)
    # (Not another Exception: a signal handler's, before the release, goes to the caller,
    # which asks once more; swallowed here, the lock stayed taken to its TTL.)


def _let_go_dropped(held: Lock) -> None:
    """The finalizer's: once more should it be cut short; nothing to raise to. Run by the
    garbage collector (any thread, any lock held: no I/O there), the release is handed to
    the finisher thread; dropped by the rollback itself, it runs here, as the transaction
    ends."""
    if finisher.in_collection():
        finisher.hand(functools.partial(_let_go_twice, held))
        return
    _let_go_twice(held)


def _let_go_twice(held: Lock) -> None:
    for _ in range(2):
        try:
            return _let_go(held)
        except Exception:  # (the lock then frees at its TTL)
            logger.debug("redlock: %s: the release was cut short", held.describe(), exc_info=True)


def _uncommitted_on(result: Any) -> str | None:
    """The database alias whose open transaction holds ``result``'s row, if any (a
    django-tasks-db run: its ``db_result``, saved on that alias)."""
    alias = getattr(getattr(getattr(result, "db_result", None), "_state", None), "db", None)
    if not isinstance(alias, str) or alias not in connections:
        return None
    return alias if connections[alias].in_atomic_block else None


def _own_uncommitted(config: SingleInstance, key: str) -> bool:
    """Whether this thread queued a run of ``key`` in a transaction still open."""
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            for entry in connection.run_on_commit:
                hook = entry[1]
                if isinstance(hook, _Uncommitted) and (hook.using, hook.key) == (
                    config.using, key
                ):  # fmt: skip
                    return True
    return False


def _hold_until_commit(config: SingleInstance, key: str, result: Any) -> None:
    """Keep ``key`` taken until the transaction holding ``result``'s row ends, if one does."""
    alias = _uncommitted_on(result)
    if alias is None:
        return
    held = Lock(f"{key}{COMMIT_SUFFIX}", ttl=ENQUEUE_TTL, using=config.using)
    # The callback first: an interrupt after the take still has it released at the end.
    transaction.on_commit(_Uncommitted(config, key, held), using=alias, robust=True)
    # Free (we have the turn, and a waiting enqueue waits before its own), unless this
    # thread's transaction holds it already for an earlier run of the key. Its holder names
    # the run: the proof of the COMMIT a waiting enqueue() looks for (see _committed).
    named = holder_task.get()
    try:
        holder_task.set(
            (holder_id(str(result.id)), f"{config.func.__module__}.{config.func.__qualname__}")
        )
        held.acquire(blocking=False)
    finally:
        holder_task.set(named)  # by value (see single.take)


def _await_commit(
    backend: Any, config: SingleInstance, task: Any, key: str, store: Any, deadline: float
) -> None:
    """Wait (up to ``deadline``) for the transaction of another connection that queued a run
    of ``key`` to end: then its run is visible (committed), or gone (rolled back). The lock
    goes only once Django reached the library's ``on_commit`` callback, after every one
    registered before it (a slow mail, an HTTP call): so between waits, the row of the run
    the lock's holder names, visible to this connection, says the COMMIT happened (the
    caller then finds the run, queued or running, or queues one if it ended)."""
    if _own_uncommitted(config, key) or not store.is_locked(f"{key}{COMMIT_SUFFIX}"):
        return
    look = COMMIT_LOOK
    while True:
        wait = min(look, max(deadline - time.monotonic(), 0.0))
        look *= 2  # each wait that runs out is a timeout (metrics, incidents): a few at most
        try:
            with Lock(f"{key}{COMMIT_SUFFIX}", ttl=ENQUEUE_TTL, timeout=wait, using=config.using):
                return
        except LockNotAcquired:
            pass
        run = _committed(backend, key, store)
        # Committed, and still queued or running: the caller returns it. Over: the caller
        # queues a new run, which, in a transaction of this thread, needs the commit lock
        # for itself (a third enqueue() would take its invisible row for rolled back): then
        # it waits for the lock still.
        if run is not None and not (run.is_finished and _in_transaction()):
            return
        if time.monotonic() >= deadline:
            if run is not None:
                raise LockNotAcquired(
                    f"{task.module_path}: {key!r}: its run committed and ended, but its"
                    f" transaction's on_commit callbacks still ran after {ENQUEUE_TTL:g} s"
                    " (this enqueue(), inside a transaction, waits for them)"
                )
            raise LockNotAcquired(
                f"{task.module_path}: {key!r} was queued in a transaction still open after"
                f" {ENQUEUE_TTL:g} s"
            )


#: Seconds before the first look for a committed run while another connection's transaction
#: holds the key (doubled after each look).
COMMIT_LOOK = 0.5


def _committed(backend: Any, key: str, store: Any) -> Any:
    """The run whose transaction holds ``key``'s commit lock, if visible to this connection:
    then that transaction committed (the run queued, running or finished); else None. The
    lock's holder names the run: the marker does only while the run is queued (the run
    clears it as it takes the key; it may expire in a long transaction), so it is looked at
    only for a lock whose holder names none (taken by an earlier release). A row this
    connection cannot see (still open, or rolled back), a reservation or a backend that
    keeps no results prove nothing: the lock is waited for."""
    info = store.inspect(f"{key}{COMMIT_SUFFIX}")
    run_id = task_id_of(info.holder) if info is not None else None
    if run_id is None and info is not None:
        found = markers.read(store, key)
        run_id = found[0] if found is not None and not found[0].startswith(RESERVED) else None
    if run_id is None:  # (no lock any more: the next wait takes it at once)
        return None
    try:
        return backend.get_result(run_id)
    except NotImplementedError:
        return None
    except tuple(errors.TaskResultDoesNotExist for errors in _loaded("exceptions")):
        return None


def _in_transaction() -> bool:
    """Whether this thread is inside an ``atomic()`` block on any database."""
    return any(c.in_atomic_block for c in connections.all(initialized_only=True))


def _name_run(
    config: SingleInstance, store: Any, task: Any, key: str, reservation: str, result: Any
) -> None:
    """The reservation replaced by the queued run's id, in one step (compare-and-set), or
    the id noted where the reservation expired (an enqueue() longer than its TTL: a run
    inside it); a marker already naming it stays."""
    ttl_ms = to_ms(_queue_wait(task) + config.dedupe_ttl)
    if not markers.swap(store, key, reservation, str(result.id), ttl_ms):
        markers.mark(store, key, str(result.id), ttl_ms)


def _existing(backend: Any, config: SingleInstance, task: Any, key: str, found: str) -> Any:
    """The queued or running run ``found`` names, or None if there is none (any more)."""
    if found.startswith(RESERVED):
        return None  # left by an enqueue that died in its turn
    message = (
        f"{task.module_path} not enqueued: {key!r} is queued or running already as task"
        f" result {found} (backend {config.using!r})"
    )
    try:
        result = backend.get_result(found)
    except NotImplementedError:  # a backend that keeps no results: say which run it is
        raise AlreadyQueued(f"{message}; this backend cannot return it", found) from None
    except tuple(errors.TaskResultDoesNotExist for errors in _loaded("exceptions")):
        return None
    if result.is_finished or _died_before_take(config, key, found, result):
        return None
    if config.dedupe_queued == "raise":
        raise AlreadyQueued(message, found)
    return result


def _died_before_take(config: SingleInstance, key: str, found: str, result: Any) -> bool:
    """Whether the run ``found`` died between its worker's claim (its row RUNNING, for good:
    nothing reaps it) and its take, which clears the marker: RUNNING for longer than the
    lock's TTL, and not holding the key. Obeyed, its marker refused the key for
    ``dedupe_ttl``; a dead run's key frees at its lock's TTL. (A take slower than that only
    lets a second run be queued: the lock keeps them apart.)"""
    if str(getattr(result, "status", "")) != "RUNNING":
        return False
    started = getattr(result, "last_attempted_at", None) or getattr(result, "started_at", None)
    if started is None:
        return False
    store = locks[config.using]
    ttl = config.ttl if config.ttl is not None else store.default_ttl
    if (timezone.now() - started).total_seconds() < ttl:
        return False
    running = store.inspect(key)
    return running is None or task_id_of(running.holder) != found


def _already_finished(backend: Any, result: Any) -> bool:
    if result.is_finished:
        return True
    if not getattr(backend, "supports_get_result", False):
        return False
    try:
        return bool(backend.get_result(result.id).is_finished)
    except Exception:  # unknown: the marker stays (the run clears it when it ends)
        return False


class DedupeQueuedBackend:
    """The ``BACKEND`` of a ``TASKS`` entry that dedupes queued runs; ``"WRAPS"`` names the
    backend that does the work (its ``OPTIONS``, ``QUEUES`` apply as usual)::

        TASKS = {"default": {
            "BACKEND": "django_redlock.contrib.tasks.DedupeQueuedBackend",
            "WRAPS": "django_tasks_db.DatabaseBackend",
        }}

    Transparent: the backend made is an instance of the wrapped class itself, with its
    ``enqueue``, ``aenqueue`` and ``validate_task`` wrapped on the instance. So its worker
    (``db_worker --backend default``), ``isinstance`` checks and signal receivers connected
    with ``sender=<the wrapped class>`` (``task_enqueued``, ``task_started``...) see the
    backend they expect.
    """

    def __new__(cls, alias: str, params: dict[str, Any]) -> Any:
        wrapped = params.get("WRAPS")
        if not isinstance(wrapped, str) or not wrapped:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]: DedupeQueuedBackend needs WRAPS, the dotted path of the"
                f" backend it wraps (e.g. 'django_tasks_db.DatabaseBackend'), not {wrapped!r}"
            )
        try:
            base = import_string(wrapped)
        except ImportError as exc:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]: WRAPS {wrapped!r}: {exc}") from exc
        return wrap(base(alias, params))


def wrap(backend: Any) -> Any:
    """Make ``backend`` (a Tasks backend instance) dedupe queued runs, in place; returned."""
    connect()
    enqueue, aenqueue, validate = backend.enqueue, backend.aenqueue, backend.validate_task

    def dedupe(task: Any, args: Any, kwargs: Any) -> Any:
        return dedupe_enqueue(backend, enqueue, task, args, kwargs)

    async def adedupe(task: Any, args: Any, kwargs: Any) -> Any:
        config = config_of(task.func)
        if config is None or not config.dedupe_queued:
            return await aenqueue(task, args, kwargs)
        return await sync_to_async(dedupe, thread_sensitive=True)(task, args, kwargs)

    def validate_task(task: Any) -> None:
        validate(task)
        _validate(task)

    backend.enqueue, backend.aenqueue, backend.validate_task = dedupe, adedupe, validate_task
    backend.redlock_dedupe_queued = True
    return backend


def _as_stored(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments as a run gets them back: through JSON (a tuple comes back a list)."""
    try:
        stored = json.loads(json.dumps([list(args), kwargs]))
    except (TypeError, ValueError):  # the backend refuses them, with its own message
        return args, kwargs
    return tuple(stored[0]), stored[1]


def _queue_wait(task: Any) -> float:
    """Seconds the run waits in the queue by its ``run_after``."""
    run_after = getattr(task, "run_after", None)
    if not isinstance(run_after, datetime.datetime):
        return 0.0
    now = timezone.now() if timezone.is_aware(run_after) else datetime.datetime.now()
    return max(0.0, (run_after - now).total_seconds())


def _forget_queued(task_result: Any) -> None:
    """A run ended (whatever its outcome): its queue marker, if still there, goes."""
    try:
        config = config_of(task_result.task.func)
        if config is None or not config.dedupe_queued:
            return
        task = task_result.task
        args, kwargs = tuple(task_result.args), dict(task_result.kwargs)
        key = config.key_for(task.module_path, args, kwargs, bound=task.takes_context)
    except (ImportError, AttributeError, TypeError, ValueError):
        return  # not a task of ours any more, or arguments no key fits: nothing was noted
    clear_queued_marker(config, key, str(task_result.id))  # logs a failure: it expires


__all__ = [
    "DedupeQueuedBackend",
    "DedupeQueuedMixin",
    "connect",
    "dedupe_enqueue",
    "lock_key",
    "wrap",
]
