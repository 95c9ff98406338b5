"""``@single_instance``: a Celery task that never runs twice at once for the same key.

Placed directly under ``@shared_task`` / ``@app.task`` (above them it raises TypeError: Celery
would run the undecorated function). The lock is taken before the body runs, renewed by the
watchdog while it runs, and released on every outcome: success, exception, ``self.retry()``
(before the retry is scheduled), ``Ignore``, ``Reject``, soft time limit. A revoke with
``terminate=True`` or a hard time limit stops the body mid-run; the worker's main process then
releases the hold whose token carries that task's id, once the process that took it is gone
(never while a body may still run; a hold another host took is left to its TTL). A worker
killed outright leaves a lock that frees itself after its TTL: seconds, not hours.

A hold's token is ``<task id>.<attempt>.<random>`` (the attempt is ``request.retries``). So a
run that finds its own task id holding the key can tell a retry that arrived before the
earlier attempt released (it waits for it) from its own message delivered again while it runs
(a duplicate: skipped, never a second run). With ``limit=N`` such a copy may find a permit
free and take it: it then looks at the other permits, and gives its own back. A copy taken
only after its run ended (``acks_late``) finds that run's "done" note: skipped as well.
"""

from __future__ import annotations

import contextlib
import datetime
import dis
import functools
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from celery import Task, current_task
from celery.exceptions import (
    Ignore,
    Reject,
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery.local import Proxy
from celery.signals import task_failure, task_postrun, task_received, task_revoked, worker_ready
from celery.states import READY_STATES
from celery.utils import uuid as uuid_text
from celery.utils.time import maybe_iso8601, maybe_make_aware
from django.db import connections
from kombu.utils import json as kombu_json

from ..backends import markers
from ..backends.base import Kind, Released
from ..exceptions import LockError
from ..fencing import drop_all_abandoned, on_commit_or_proved
from ..handler import locks
from ..identity import HOST
from ..signals import duplicate_not_queued, duplicate_skipped  # re-exported here
from ..validation import MAX_TTL, to_ms
from ..waiters import start_thread
from .broker import watched_publish
from .single import (  # the core shared with Django's Tasks framework (re-exported here)
    AlreadyQueued,
    SingleInstance,
    attempts_holding,
    clear_queued_marker,
    describe_holder,
    duplicate,
    guarded,
    hold_of,
    holds_task,
    let_go,
    new_hold,
    run_held,
    single_instance,
    skip_result,
    skipped,
    take,
    task_id_of,
    token_id,
)

logger = logging.getLogger("django_redlock")

#: The message header of a deduplicated call published only so that its promised task id
#: resolves (a canvas member): it names the task that runs the key; the worker runs nothing.
DUPLICATE_OF = "redlock_duplicate_of"


def check_decorated(func: Any) -> None:
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


class CeleryAdapter:
    """Celery's answers to the core (see :class:`.single.Adapter`): a Celery task object is
    refused under the decorator, and every call is Celery's to run (a direct call too, as a
    run without a task)."""

    def check_decorated(self, func: Any) -> None:
        check_decorated(func)

    def runner(self, config: SingleInstance, args: tuple) -> Callable[[tuple, dict], Any]:
        return lambda args, kwargs: _run(config, args, kwargs)


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
    if config.dedupe_queued and task is not None and not isinstance(task, SingleInstanceTask):
        raise TypeError(
            f"{task_name}: dedupe_queued needs the task built on SingleInstanceTask, whose"
            " apply_async() does the deduplication: @shared_task(bind=True,"
            " base=SingleInstanceTask) (without it every delay() is enqueued)"
        )
    key = config.key_for(task_name, call_args, kwargs, bound=bound)

    def body_for(noted: tuple, noted_kwargs: dict) -> Any:  # a follow-up's noted call
        return func(*((args[0], *noted) if bound else noted), **noted_kwargs)

    return run_task(config, task, task_name, key, call_args, kwargs,
                    lambda: func(*args, **kwargs), body_for)  # fmt: skip


def run_task(
    config: SingleInstance, task: Any, task_name: str, key: str, call_args: tuple,
    kwargs: dict, body: Callable[[], Any],
    body_for: Callable[[tuple, dict], Any] | None = None,
) -> Any:  # fmt: skip
    """One run of ``task`` (None: a direct call) under ``key``'s lock: ``body()`` runs only
    with the key held, and the hold goes on every outcome. A duplicate does what
    ``config.on_duplicate`` says; a copy of a live run's message is skipped (a dead run's
    copy runs). ``call_args``/``kwargs``: the call as queued (for ``coalesce``);
    ``body_for(args, kwargs)``: the body over other arguments (a coalesced follow-up runs
    the call noted last). The ``@single_instance`` decorator and the migration shims'
    ``__call__`` both come here."""
    task_id = task.request.id if task is not None else None
    duplicate_of = _duplicate_of(task)
    if duplicate_of:  # published only so the promised id resolves: report, run nothing
        logger.info(
            "redlock: task %s not run: %r is queued or running as task %s",
            task_id, key, duplicate_of,
        )  # fmt: skip
        return skip_result(config, task, key, task_id, duplicate_of)
    attempt = int(getattr(task.request, "retries", 0) or 0) if task_id else 0
    coalesce = config.on_duplicate == "coalesce" and task is not None
    # A follow-up's retry runs its own message's call (as any retry does).
    follow_up = coalesce and attempt == 0 and _is_follow_up(task)
    if follow_up and _is_poll(task):  # its mark goes first: a look from now on polls again
        _clear_mark(config, _poll_name(key), task_id)
    elif follow_up:
        _clear_next(config, key, task_id)  # before the take: see the rules above _coalesce
    held = new_hold(config, key, task_id, attempt)
    acquired = False
    ending = _Ending()  # the follow-up's note dropped, the run noted done: once it settled
    kept: object | None = None  # this run keeps the key's note (see _keep_note)
    # acks_late: a copy of this very message put back while its run went on, taken after that
    # run ended (see _ran_already), is looked for before anything else it would do.
    late = bool(task_id) and _acks_late(task)
    # One guard from before the acquire to the end of the run: a soft time limit (or any
    # exception, a burst of them too) at any line once the lock is taken releases it, and
    # the watchdog renews nothing after the run (run_held's own guard starts only inside it).

    def run() -> Any:
        nonlocal acquired, body, kept
        _, acquired, info = take(config, key, task_id, task_name, attempt, held)
        if acquired and coalesce:
            kept = _keep_note(config, key, running=True)
        if not acquired:
            # Only this attempt or a later one: an earlier one holding it is this retry's
            # past, never a copy of this message (see _take).
            own = [a for a in attempts_holding(info, task_id) if a >= attempt]
            if task_id and own:
                return _redelivered(config, task, key, task_id, own[0])
            if late and _ran_already(config, key, cast(str, task_id), attempt):
                # Not noted, retried nor skipped over its run's stored result: it ran.
                return _redelivered(config, task, key, cast(str, task_id), attempt, ended=True)
            if follow_up:  # the note stays: the holder's end (or a later look) queues it
                return _follow_up_waits(config, task, key, task_id, info)
            if coalesce:
                return _coalesce(config, task, key, task_id, info, call_args, kwargs)
            return duplicate(config, task, key, task_id, info)
        if late and _ran_already(config, key, cast(str, task_id), attempt):
            # Before a follow-up claims the note: a later duplicate's call is not its own.
            _released_or_raise(held)
            return _redelivered(config, task, key, cast(str, task_id), attempt, ended=True)
        if follow_up and task_id and was_revoked(config.using, task_id):
            # Revoked, and run all the same: the worker never learnt of it (one restarted
            # while holding it for its countdown lost Celery's in-memory revoke).
            _drop_cancelled_call(config, key, task_id, _header(task.request, FOLLOW_UP_CALL))
            _released_or_raise(held)  # (the finally below queues a follow-up for a call left)
            return {**skip_result(config, task, key, task_id, None), "coalesced": True}
        if follow_up:
            claimed = _claim_note(config, key, cast(str, task_id), task_name)
            if claimed is None or isinstance(claimed, str):
                # None: another follow-up ran it, nothing left to run. A name: another task's
                # call (a key two tasks share), never run by this task's function: the
                # finally below queues that task's follow-up.
                if claimed is not None:
                    logger.info("redlock: the coalesced call of %r is task %s's: not run by"
                                " %s", key, claimed, task_name)  # fmt: skip
                _released_or_raise(held)
                result = skip_result(config, task, key, task_id, None)
                return {**result, "coalesced": True}
            call, text = claimed
            args, kw = tuple(call["args"]), dict(call["kwargs"])
            # self.retry() sends the request's arguments: the call it runs, not its message's.
            task.request.args, task.request.kwargs = list(args), dict(kw)
            if body_for is not None:
                body = functools.partial(body_for, args, kw)
            ending.steps.append(_dropping_note(config, key, text, ending))
        if late:
            ending.steps.append(_noting_done(config, task, key, cast(str, task_id), attempt))
        if not ending.steps:
            return run_held(held, body, (), {}, config.atomic)
        # Inside an outer transaction the block's callbacks run at the outer COMMIT.
        outer = config.atomic is not None and connections[config.atomic].in_atomic_block
        try:
            result = run_held(held, _settling(config, body, ending), (), {}, config.atomic)
        except Exception as exc:
            if ending.returned:  # fenced: the COMMIT failed, or its outcome is unknown
                ending(exc)
            raise
        if ending.returned and not outer:  # committed, its note cut short (a lost reply's
            ending()  # proof runs it before the release: on_commit_or_proved): noted now
        return result

    try:
        return guarded(held, run)
    finally:
        _kept_notes.pop(kept, None)
        if coalesce and acquired:  # taken, then interrupted: it ends too
            _queue_follow_up(config, task, key)


# -- on_duplicate="coalesce": one more run after the current one, with the last arguments ----
#
# A duplicate notes its call (arguments and queue) under "<key>:coalesce", replacing any
# earlier note in one step. A follow-up is a message (header FOLLOW_UP) that, once it holds the
# key, claims the note (compare-and-set: marked taken by its task id) and runs that call; the
# note goes once its run settled (see _Ending: with atomic=, after its COMMIT; compare-
# and-delete: a note written meanwhile stays), so a follow-up killed, stopped or interrupted
# before that leaves it to its message's copy (same task id) or to the next follow-up (a
# later note keeps it inside until then: see note_call). So every note written before it
# starts, the last one's arguments, makes one run. A note is its task's: a follow-up of
# another task with the same key runs none (see _claim_note, _publish_as). At most one
# follow-up is queued at a time:
# "<key>:coalesce:next" names it from its publish until it starts, when it clears that name
# before it takes the key. It is queued (unless one is) whenever a note may be left behind:
# by a run of the key, after its release; by a duplicate, after its note, if the key is free
# then (the run ended before the note) or held by something that queues nothing (a plain
# lock(), another task: then after ``countdown``, and it looks again); by the worker's main
# process for a run it stopped. The orders (note, then look; release, then queue; clear the
# name, then take) leave no note without a follow-up to come, but for a publish that failed
# or an interrupt between the note and the look: for those, each worker's main process
# queues the follow-up of a note none is coming for (see _keep_left_notes). The note and
# the name are kept with the queue-marker operations, so it works on every backend.

#: The header of a coalesced follow-up's message: it runs the call noted last for its key.
FOLLOW_UP = "redlock_follow_up"
#: A follow-up's header naming the note ("call") it was queued for: the call its revoke
#: cancels, should the worker discard it before it runs (a later call's note stays).
FOLLOW_UP_CALL = "redlock_follow_up_call"


def _released_or_raise(held: Any) -> None:
    """Release ``held`` now (a run that ends without its body); an interrupt meanwhile goes
    on once it is released."""
    interrupted = let_go(held)
    if interrupted is not None:
        raise interrupted


def _pending_name(key: str) -> str:
    return f"{key}:coalesce"


def _next_name(config: SingleInstance, key: str) -> str:
    # With dedupe_queued, the queue marker: the follow-up is the key's queued call.
    return key if config.dedupe_queued else f"{key}:coalesce:next"


def _follow_up_kind(task: Any) -> Any:
    return _header(task.request, FOLLOW_UP)


def _is_follow_up(task: Any) -> bool:
    return bool(_follow_up_kind(task))


def _header(request: Any, name: str) -> Any:
    return getattr(request, name, None) or (getattr(request, "headers", None) or {}).get(name)


def _is_poll(task: Any) -> bool:
    return bool(_follow_up_kind(task) == POLL)


class UnnotableArguments(TypeError):
    """A coalescing task's call whose arguments Celery's JSON cannot carry: its note (the
    follow-up runs the call noted last) could not be written, so the call is refused."""


def note_text(call: dict[str, Any]) -> str:
    """A note's text, in Celery's JSON (kombu's): datetime, date, time, UUID, Decimal and
    bytes are noted as a JSON message carries them, and :func:`read_note` gives them back as
    the worker gets them from such a message. Raises :class:`UnnotableArguments`."""
    try:
        return cast(str, kombu_json.dumps(call))
    except (TypeError, ValueError, OverflowError) as exc:  # ValueError: a circular reference
        raise UnnotableArguments(
            f"on_duplicate='coalesce' notes a call's arguments in Celery's JSON (kombu's:"
            f" JSON plus datetime, date, time, UUID, Decimal, bytes), which cannot carry"
            f" these: {exc}"
        ) from exc


def read_note(text: str | bytes) -> dict[str, Any]:
    """A note's call, its arguments decoded as Celery's JSON serializer decodes them."""
    return cast(dict[str, Any], kombu_json.loads(text))


def check_notable(args: Any, kwargs: Any) -> None:
    """Refuse a call :func:`note_call` could not note, before anything is written or sent."""
    note_text({"args": list(args or ()), "kwargs": dict(kwargs or {})})


def note_call(
    config: SingleInstance, key: str, args: Any, kwargs: Any, queue: Any,
    task_id: str | None, task_name: str | None = None, route: dict[str, Any] | None = None,
) -> tuple[str, str | None]:  # fmt: skip
    """Note a call under ``key`` for the next follow-up, replacing any note (the last call's
    arguments win). ``task_name``: lets a starting worker find the task of a note left.
    ``route``: the call's exchange and routing key, when it came by them rather than by a
    queue's name (its follow-up goes the same way). Returns the note written and the one it
    replaced (for :func:`unnote_call`)."""
    backend = locks[config.using]
    call = {"args": list(args or ()), "kwargs": dict(kwargs or {}), "queue": queue,
            "id": task_id, "task": task_name, "call": uuid_text()}  # fmt: skip
    if route:
        call["route"] = route
    # "call": unique per note, so taking one back (unnote_call) never takes a later call's
    # note with the same arguments.
    note = note_text(call)
    ttl_ms = to_ms(config.dedupe_ttl)
    for _ in range(10):
        found = markers.mark(backend, _pending_name(key), note, ttl_ms)
        if found is None:
            return note, None
        # A call a follow-up claimed is not replaced: it stays inside the note ("before")
        # until that run settles, so a follow-up stopped first leaves it to run (then this).
        before = _claimed_in(found)
        note = note_text({**call, "before": before}) if before else note_text(call)
        # In one step (compare-and-set): the earlier note is never gone before this one is
        # written (a soft time limit between a delete and a write lost both calls).
        if markers.swap(backend, _pending_name(key), found, note, ttl_ms):
            return note, found
    raise LockError(f"could not note the coalesced call of {key!r}: notes kept changing")


def _claimed_in(text: str) -> str | None:
    """The claimed call a note holds (the note itself if claimed, else its "before")."""
    try:
        found = json.loads(text)
    except ValueError:
        return None
    if not isinstance(found, dict):
        return None
    return text if found.get("taken") else found.get("before")


def _next_call(text: str) -> dict[str, Any]:
    """The call a note's next follow-up runs: a claimed call kept inside it first."""
    call = read_note(text)
    return read_note(call["before"]) if call.get("before") else call


def _without_before(call: dict[str, Any]) -> str:
    return note_text({k: v for k, v in call.items() if k != "before"})


def unnote_call(config: SingleInstance, key: str, note: str, previous: str | None) -> None:
    """Take back a call's note (its publish failed: the caller is told, and calls again):
    the note it replaced put back, only while the note is still this call's (compare-and-set:
    a later call's note, or a follow-up's claim, stays). A replaced note a follow-up claimed
    goes again if that follow-up's run ended meanwhile (its drop found this call's note: see
    :func:`_ran_mark_name`); a follow-up still running drops it itself, one stopped leaves it
    to run. A failure is logged: the note then runs once (at least once)."""
    backend, name = locks[config.using], _pending_name(key)
    try:
        if previous is None:
            _take_back(backend, name, note, None, to_ms(config.dedupe_ttl))
            return
        try:
            restored = _take_back(backend, name, note, previous, to_ms(config.dedupe_ttl))
            if restored is not None:
                _drop_ended_claim(config, key, restored)
        except BaseException:
            # An interrupt at any line since the swap (done or not): an ended follow-up's
            # claim put back is looked for still (compare-and-delete: else nothing happens).
            with contextlib.suppress(LockError):
                _drop_ended_claim(config, key, previous)
            raise
    except LockError as exc:
        logger.warning("redlock: could not take back the coalesced call of %r: %s", key, exc)


def _take_back(backend: Any, name: str, note: str, previous: str | None, ttl_ms: int) -> str | None:
    """Put ``previous`` back (None: clear) while the note is still ``note``'s call, with the
    claimed call it kept ("before") as it stands now: gone if it settled meanwhile (its
    follow-up took it out), claimed again if another follow-up did. Returns what it put back."""
    mine = json.loads(note).get("call")
    for _ in range(10):
        found = markers.read(backend, name)
        current = json.loads(found[0]) if found is not None else {}
        if found is None or current.get("call") != mine:
            return None  # a later call's note stays
        restore, kept = previous, current.get("before")
        if previous is not None:
            earlier = read_note(previous)
            if earlier.get("taken"):
                restore = kept  # the claimed call it replaced (None: it ran)
            elif earlier.get("before"):
                restore = note_text({**earlier, "before": kept}) if kept else (
                    _without_before(earlier)
                )  # fmt: skip
        if restore is None:
            if markers.clear(backend, name, found[0]):
                return None
        elif markers.swap(backend, name, found[0], restore, ttl_ms):
            return restore
    return None


def _drop_ended_claim(config: SingleInstance, key: str, previous: str) -> None:
    """Drop the note ``previous`` if it is a follow-up's claim and that follow-up ended."""
    claimer = json.loads(previous).get("taken")
    backend = locks[config.using]
    if claimer and markers.read(backend, _ran_mark_name(key, claimer)) is not None:
        markers.clear(backend, _pending_name(key), previous)


def _ran_mark_name(key: str, task_id: str) -> str:
    """Noted by a follow-up whose run ended while its claimed note was replaced (its drop
    found another note): a failed call taking its note back must not put that one back, or
    the call would run twice. The follow-up notes it, then drops its claim once more; the
    taker puts it back, then looks for the mark: whichever comes last drops it."""
    return f"{key}:coalesce:ran:{task_id}"


def _coalesces(task: Any, info: Any) -> bool:
    """Whether the holder ``info`` is a run of this coalescing task (whose end queues the
    follow-up); not a plain ``lock()`` or another task."""
    holds = (info.holders or [info]) if info is not None else []
    return any(h.holder.get("k") and h.holder.get("n") == task.name for h in holds)


def _coalesce(
    config: SingleInstance, task: Any, key: str, task_id: str | None, info: Any,
    args: tuple, kwargs: dict,
) -> Any:  # fmt: skip
    backend = locks[config.using]
    queue, route = _delivered_by(task)
    note_call(config, key, args, kwargs, queue, task_id, task.name, route)
    logger.info(
        "redlock: coalesced duplicate: task %s not run now: %r is held by %s; one more run"
        " follows", task_id, key, describe_holder(info),
    )  # fmt: skip
    _queue_unless_followed(config, task, key, backend.inspect(key))
    result = skip_result(config, task, key, task_id, task_id_of(info.holder) if info else None)
    return {**result, "coalesced": True}


def _delivered_by(task: Any) -> tuple[str | None, dict[str, Any] | None]:
    """The way the running call's message came, for its follow-up to come the same way: a
    queue's name (Celery sends a call routed by queue to the default exchange, by that
    name), else the exchange and routing key it was published with, as Celery's own retry
    publishes again (that routing key is no queue's name: published as one, it would go to
    a new queue nobody reads)."""
    info = getattr(task.request, "delivery_info", None) or {}
    routing_key, exchange = info.get("routing_key"), info.get("exchange")
    if not routing_key:
        return None, None
    if not exchange:
        return str(routing_key), None
    return None, {"exchange": str(exchange), "routing_key": str(routing_key)}


def _destination(call: dict[str, Any]) -> dict[str, Any]:
    """The publish options sending a follow-up where ``call``'s message went."""
    route = call.get("route")
    if isinstance(route, dict) and route.get("exchange"):
        return {"exchange": route["exchange"], "routing_key": route.get("routing_key")}
    return {"queue": call["queue"]} if call.get("queue") else {}


def _queue_unless_followed(
    config: SingleInstance, task: Any, key: str, holder: Any, poll: bool = False
) -> None:
    """After a note: queue its follow-up unless the key's holder will (a run of this task
    queues it at its end; ``poll``: a follow-up that found it held polls, should that run's
    whole worker have died)."""
    if holder is None:  # the run ended before the note: queue it now
        _queue_follow_up(config, task, key)
    elif not _coalesces(task, holder):  # nobody would: look again after countdown
        _queue_follow_up(config, task, key, countdown=config.countdown)
    elif poll:  # its end will; should its whole worker die first, a poll finds the key free
        _queue_poll(config, task, key)


# A poll (header FOLLOW_UP = POLL) is a follow-up sent ``ttl`` seconds late: a holder whose
# worker died outright (no end, no main process to queue for it) has lost its hold by then.
# It runs the note if the key is free; held by a run again, it polls again. One at a time per
# key ("<key>:coalesce:poll", which expires soon after the poll was due). A poll that meets a
# follow-up runs nothing: the note is taken once.

#: The FOLLOW_UP header's value on a poll.
POLL = "poll"


def _moment(value: Any) -> Any:
    """An ETA or ``expires`` as Celery reads it: an ISO-8601 string (its retries send them
    so, and ``apply_async`` passes one on) is the moment it names."""
    return maybe_iso8601(value) if isinstance(value, str) else value


def _poll_name(key: str) -> str:
    return f"{key}:coalesce:poll"


def _queue_poll(config: SingleInstance, task: Any, key: str) -> None:
    backend = locks[config.using]
    after = float(config.ttl or 60.0) + 1.0  # a dead holder's hold has expired by then
    try:
        noted = markers.read(backend, _pending_name(key))
        if noted is None:
            return
        poll_id = uuid_text()
        ttl_ms = to_ms(after + FOLLOW_UP_PUBLISH_GRACE)
        # The mark in the try: an interrupt (or a lost reply) as it is written clears it.
        try:
            if markers.mark(backend, _poll_name(key), poll_id, ttl_ms) is not None:
                return  # one is coming
            call = _next_call(noted[0])
            options = _destination(call)
            # No expires= (the task's own): a poll is due after the TTL, and one discarded
            # would leave the note with nothing to come should the holder's worker be dead.
            _publish_as(task, call, tuple(call["args"]), call["kwargs"], task_id=poll_id,
                        headers={FOLLOW_UP: POLL}, countdown=after, expires=None,
                        **options)  # fmt: skip
        except BaseException as exc:
            with contextlib.suppress(LockError):
                markers.clear(backend, _poll_name(key), poll_id)
            if not isinstance(exc, Exception) or isinstance(exc, SoftTimeLimitExceeded):
                raise
            logger.warning("redlock: could not queue a poll of %r: %s", key, exc)
    except LockError as exc:  # the holder's end (or the next run) queues it still
        logger.warning("redlock: could not queue a poll of %r: %s", key, exc)


def _clear_mark(config: SingleInstance, name: str, task_id: str | None) -> None:
    if not task_id:
        return
    try:
        markers.clear(locks[config.using], name, task_id)
    except LockError as exc:  # it then expires
        logger.warning("redlock: could not clear the mark %r: %s", name, exc)


def _follow_up_waits(
    config: SingleInstance, task: Any, key: str, task_id: str | None, info: Any
) -> Any:
    """A follow-up that found the key held: the note stays, for the follow-up the holder's
    end queues (or one after ``countdown``, for a holder that queues none)."""
    logger.info(
        "redlock: the coalesced follow-up %s waits: %r is held by %s",
        task_id, key, describe_holder(info),
    )  # fmt: skip
    _queue_unless_followed(config, task, key, info, poll=True)
    result = skip_result(config, task, key, task_id, task_id_of(info.holder) if info else None)
    return {**result, "coalesced": True}


def _clear_next(config: SingleInstance, key: str, task_id: str | None) -> None:
    if not task_id:
        return
    backend, name = locks[config.using], _next_name(config, key)
    try:
        markers.clear(backend, name, task_id)
        # Its sent note vouches only for a mark naming it, which is gone: not kept an hour.
        sent = markers.read(backend, sent_name(name, task_id))
        if sent is not None:
            markers.clear(backend, sent_name(name, task_id), sent[0])
        _clear_writer(backend, name, task_id)
    except LockError as exc:  # it then expires; a stale one is replaced (see below)
        logger.warning("redlock: could not clear the follow-up mark of %r: %s", key, exc)


def _claim_note(
    config: SingleInstance, key: str, task_id: str, task_name: str | None = None
) -> tuple[dict[str, Any], str] | str | None:
    """The call noted last for ``key``, claimed by the follow-up ``task_id`` (compare-and-set:
    the note marked "taken" by it, not deleted, until its body ended: see
    :func:`_running_note`), with the note's claimed text; None if there is none. A note that
    another follow-up claimed is claimed again: this run holds the key, so that one is not
    running it (stopped before its body ended: killed, a soft time limit). A note claimed by
    ``task_id`` itself is its message's copy coming back (``acks_late``, a killed child):
    it runs. A note whose taker was revoked is a cancelled call: dropped, not run (the
    revoke is noted as it reaches a worker, before the revoked run is stopped, whose exit
    queues the follow-up that finds it: see :func:`_noting_revoke`).

    A claimed call a later note replaced is kept inside it ("before": see
    :func:`note_call`) and claimed first: the later call runs in the follow-up after. A call
    another task noted (two tasks whose keys come out the same) is not claimed: that task's
    name is returned (its own follow-up runs it, with its function)."""
    backend = locks[config.using]
    ttl_ms = to_ms(config.dedupe_ttl)
    for _ in range(10):
        found = markers.read(backend, _pending_name(key))
        if found is None:
            return None
        note = read_note(found[0])
        before = note.get("before")
        call = read_note(before) if before else note
        taken = call.get("taken")
        if call.get("task") and task_name and call["task"] != task_name:
            return str(call["task"])
        if taken == task_id:
            return call, before or found[0]
        if taken is not None and was_revoked(config.using, str(taken)):
            # (compare-and-delete: a later call stays; kept inside, it runs now)
            if markers.clear(backend, _pending_name(key), found[0]) if not before else (
                markers.swap(backend, _pending_name(key), found[0], _without_before(note),
                             ttl_ms)
            ):  # fmt: skip
                logger.info("redlock: revoked task %s: its coalesced call of %r dropped",
                            taken, key)  # fmt: skip
                if not before:
                    return None
            continue
        claimed = note_text({**call, "taken": task_id})
        whole = note_text({**note, "before": claimed}) if before else claimed
        if markers.swap(backend, _pending_name(key), found[0], whole, ttl_ms):
            return call, claimed
    return None


def _drop_cancelled_call(config: SingleInstance, key: str, task_id: str, wanted: Any) -> None:
    """The call of a revoked follow-up that runs: the note it claimed, or the one it was
    queued for (``wanted``: its FOLLOW_UP_CALL header), while unclaimed; compare-and-delete,
    so a call noted since stays. A failure leaves it: it runs (at least once)."""
    backend = locks[config.using]
    try:
        found = markers.read(backend, _pending_name(key))
        if found is None:
            return
        note = json.loads(found[0])
        call = json.loads(note["before"]) if note.get("before") else note
        taken = call.get("taken")
        ours = taken == task_id or (taken is None and bool(wanted) and call.get("call") == wanted)
        if ours and _drop_claim(config, key, found[0], note):
            logger.info("redlock: revoked task %s: its coalesced call of %r dropped", task_id, key)
    except (LockError, ValueError) as exc:
        logger.warning("redlock: could not drop revoked task %s's call: %s", task_id, exc)


def _drop_claim(config: SingleInstance, key: str, text: str, note: dict[str, Any]) -> bool:
    """Drop the claimed call of the note ``text`` (``note``, parsed): the note itself, or the
    claimed call kept inside it (a later call's note stays). Compare-and-set."""
    backend, name = locks[config.using], _pending_name(key)
    if not note.get("before"):
        return bool(markers.clear(backend, name, text))
    rest = _without_before(read_note(text))
    return bool(markers.swap(backend, name, text, rest, to_ms(config.dedupe_ttl)))


def _settle_claim(config: SingleInstance, key: str, claimed: str) -> bool:
    """Drop the claimed call ``claimed`` wherever it is (the note, or kept inside a later
    one); whether it did (False: not found)."""
    backend = locks[config.using]
    for _ in range(10):
        found = markers.read(backend, _pending_name(key))
        if found is None:
            return False
        note = json.loads(found[0])
        if found[0] != claimed and note.get("before") != claimed:
            return False
        if _drop_claim(config, key, found[0], note):
            return True
    return False


def _dropping_note(
    config: SingleInstance, key: str, claimed: str, ending: _Ending
) -> Callable[[BaseException | None], None]:
    """A follow-up's step once its run settled (see :class:`_Ending`): the note it claimed
    deleted (before the release: a follow-up taking the key then must not find it). A body
    that never started (a soft time limit on the way to it: neither ``ending.entered``, see
    :func:`_reached_body`, nor ``ending.returned`` set),
    or a ``Reject`` asking to run it again, leaves it claimed: the message's copy, or the
    next follow-up, runs it. (A run stopped, or a fenced one whose COMMIT did not happen,
    never settles: it stays too.)"""

    def drop(exc: BaseException | None) -> None:
        if isinstance(exc, Reject) and exc.requeue:
            return
        # An error on the way to the body (the fenced block's database down...) fails the
        # call visibly, as it did, rather than queueing it again and again.
        if isinstance(exc, SoftTimeLimitExceeded) and not (ending.entered or ending.returned):
            return
        backend = locks[config.using]
        try:
            if _settle_claim(config, key, claimed):
                return
            # Gone: a failed publish that replaced it may take its note back, putting this
            # claim back (see unnote_call): noted as ended first, then dropped again.
            task_id = json.loads(claimed)["taken"]
            ttl_ms = to_ms(config.dedupe_ttl)
            markers.mark(backend, _ran_mark_name(key, task_id), "1", ttl_ms)
            _settle_claim(config, key, claimed)
        except LockError as exc:  # the call may then run once more (at least once)
            logger.warning("redlock: could not clear the coalesced call of %r: %s", key, exc)

    return drop


def _queue_follow_up(
    config: SingleInstance, task: Any, key: str, countdown: float | None = None
) -> None:
    """Queue a follow-up for the call noted under ``key``, if one is noted and no follow-up
    is queued already (a mark naming a task that ended is stale: replaced). Never raises into
    the run that calls it: a publish that fails leaves the note, which the worker's main
    process queues at its next look (see :func:`_keep_left_notes`)."""
    backend = locks[config.using]
    name = _next_name(config, key)
    try:
        noted = markers.read(backend, _pending_name(key))
        if noted is None:
            return
        follow_id = uuid_text()
        ttl_ms = to_ms(config.dedupe_ttl + (countdown or 0.0))
        # From the mark's send to the publish, any line may raise (a soft time limit, a
        # lost reply): our mark, written or not, is cleared below, or remembered as unsent.
        try:
            # Who writes the mark, noted before it: a mark never noted as sent is stale once
            # its writer is gone (see _next_stale), not 30 s later.
            markers.mark(backend, _writer_name(name, follow_id), _writer(), ttl_ms)
            for _ in range(3):
                queued = markers.mark(backend, name, follow_id, ttl_ms)
                if queued is None:
                    break
                if not _next_stale(config, task, key, queued):
                    _clear_writer(backend, name, follow_id)
                    return  # queued and not started: it takes the note when it runs
                markers.clear(backend, name, queued)
                _clear_writer(backend, name, queued)
                _unsent_marks.discard(queued)
            else:
                _clear_writer(backend, name, follow_id)
                return
            call = _next_call(noted[0])
            options = _destination(call)
            if countdown:
                options["countdown"] = countdown
            args, kwargs = tuple(call["args"]), call["kwargs"]
            headers = {FOLLOW_UP: "1", FOLLOW_UP_CALL: call.get("call")}
            # expires=None: the calls noted were accepted (their own messages ran in time);
            # the task's expires= would discard them in a busy queue, with nobody to tell.
            target = _publish_as(
                task,
                call,
                args,
                kwargs,
                task_id=follow_id,
                headers=headers,
                expires=None,
                **options,
            )
        except BaseException as exc:  # refused, or a soft time limit: no mark without a message
            _unsent_marks.add(follow_id)  # first: the clear may fail, or not be reached
            with contextlib.suppress(LockError):
                markers.clear(backend, name, follow_id)
                _unsent_marks.discard(follow_id)
                _clear_writer(backend, name, follow_id)
            if not isinstance(exc, Exception) or isinstance(exc, SoftTimeLimitExceeded):
                raise  # the run fails with it; its failure handler queues the follow-up
            logger.warning(
                "redlock: could not queue the coalesced call of %r (%s): it stays noted, and"
                " the worker's main process queues it", key, exc,
            )  # fmt: skip
            return
        if not (config.dedupe_queued and isinstance(task, SingleInstanceTask)):
            # (With dedupe_queued, apply_async notes it.) Only a mark noted as sent is looked
            # for in the broker; one never noted is stale after FOLLOW_UP_PUBLISH_GRACE.
            queue = routed_queue(target, args, kwargs, options)
            if queue is not None:
                with contextlib.suppress(LockError):
                    markers.mark(backend, sent_name(name, follow_id), queue, ttl_ms)
        logger.info("redlock: queued the coalesced call of %r as task %s", key, follow_id)
        _keep_note(config, key, running=False)
    except LockError as exc:  # the note stays: the main process (or the next run) queues it
        logger.warning("redlock: could not queue the coalesced call of %r: %s", key, exc)


# A note's TTL is dedupe_ttl, renewed (every third of it) by the process that stands for it:
# the run of the key it waits for, as long as that runs (however long: the watchdog renews
# its lock), then the process that queued its follow-up, until a follow-up claims it (its own
# run keeps it then) or it is gone, however long the follow-up waits in a busy queue. Those
# die (a child recycled by --max-tasks-per-child) or stop (a claimed note whose follow-up was
# killed) while a follow-up is still owed: so each worker's main process also renews every
# note left (see _keep_left_notes). Only a note nobody stands for (no worker of its app runs)
# expires, dedupe_ttl after the last renewal.

#: The notes this process keeps: a token -> (settings, key, kept for a run of the key).
_kept_notes: dict[object, tuple[SingleInstance, str, bool]] = {}
_keeper_pid: list[int] = []  # the pid whose keeper thread runs (a forked child starts its own)


def _keep_note(config: SingleInstance, key: str, running: bool) -> object:
    """Keep ``key``'s note (renewing its TTL) from now: ``running``, until the token is
    popped from ``_kept_notes``; else until a follow-up claimed it, or it is gone."""
    token = object()
    if _keeper_pid != [os.getpid()]:
        _kept_notes.clear()  # a forked child's copy of its parent's: the parent keeps them
        _keeper_pid[:] = [os.getpid()]
        _kept_notes[token] = (config, key, running)
        thread = threading.Thread(target=_keep_notes, name="redlock-coalesce-notes", daemon=True)
        start_thread(thread)
    else:
        _kept_notes[token] = (config, key, running)
    return token


def _keep_notes() -> None:
    due: dict[object, float] = {}
    while _keeper_pid == [os.getpid()]:
        now = time.monotonic()
        for token, (config, key, running) in list(_kept_notes.items()):
            every = max(config.dedupe_ttl / 3, 0.05)
            if due.setdefault(token, now + every) > now:
                continue
            due[token] = now + every
            try:
                if not _renew_note(config, key, running):
                    _kept_notes.pop(token, None)
            except Exception as exc:  # LockError, a note not ours: tried again
                logger.warning("redlock: could not renew the coalesced call of %r: %s", key, exc)
        for token in [t for t in due if t not in _kept_notes]:
            del due[token]
        time.sleep(0.05 if _kept_notes else 0.5)  # a note kept from now is due in ttl/3


def _renew_note(config: SingleInstance, key: str, running: bool) -> bool:
    """Renew ``key``'s note (compare-and-set: a note written meanwhile has its full TTL);
    whether to keep it on."""
    backend, name = locks[config.using], _pending_name(key)
    found = markers.read(backend, name)
    if found is None:
        return running
    if not running and json.loads(found[0]).get("taken"):
        return False  # its follow-up runs it, and keeps it
    markers.swap(backend, name, found[0], found[0], to_ms(config.dedupe_ttl))
    return True


def _publish_as(task: Any, call: dict[str, Any], args: tuple, kwargs: Any, **options: Any) -> Any:
    """Publish a follow-up of ``call`` as the task that noted it (two tasks whose keys come
    out the same share the note: each call runs with its own task's function); returns that
    task. An unknown name (not registered here) is sent by name."""
    name = call.get("task")
    if not name or name == task.name:
        task.apply_async(args, kwargs, **options)
        return task
    target = task.app.tasks.get(name)
    if target is None:
        task.app.send_task(name, args, kwargs, **options)
        return task
    target.apply_async(args, kwargs, **options)
    return target


def _writer() -> str:
    """This process, as a follow-up mark's writer (a forked child has its own pid)."""
    return f"{HOST}:{os.getpid()}"


def _writer_name(name: str, task_id: str) -> str:
    return f"{name}:by:{task_id}"


def _clear_writer(backend: Any, name: str, task_id: str) -> None:
    with contextlib.suppress(LockError):  # else it expires with the mark
        found = markers.read(backend, _writer_name(name, task_id))
        if found is not None:
            markers.clear(backend, _writer_name(name, task_id), found[0])


def _writer_pid(backend: Any, name: str, task_id: str) -> int | None:
    """The pid of the process on this host that wrote the follow-up mark ``task_id`` (None:
    unknown, or on another host)."""
    found = markers.read(backend, _writer_name(name, task_id))
    host, _, pid = found[0].rpartition(":") if found is not None else ("", "", "")
    return int(pid) if host == HOST and pid.isdigit() else None


def _follow_up_once_writer_gone(config: SingleInstance, task: Any, key: str) -> None:
    """For the main process, after a stopped run: a follow-up mark not noted as sent whose
    writer (a child of this host) still runs is looked at again once that process is gone.
    A hard time limit fails the task before the child is killed, maybe in its end's publish:
    dead before the message went, its mark is stale then (see :func:`_next_stale`)."""
    backend, name = locks[config.using], _next_name(config, key)
    try:
        mark = markers.read(backend, name)
        if mark is None or markers.read(backend, sent_name(name, mark[0])) is not None:
            return
        pid = _writer_pid(backend, name, mark[0])
    except LockError:
        return
    if pid is None or pid == os.getpid() or not _alive(pid):
        return

    def watch() -> None:
        deadline = time.monotonic() + WATCH_STOPPED_RUN
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            _queue_follow_up(config, task, key)
        except Exception:  # a thread's error would be lost: logged
            logger.exception("redlock: could not queue the coalesced call of %r", key)

    start_thread(threading.Thread(target=watch, name=f"redlock-follow-{pid}", daemon=True))


#: Follow-up marks this process wrote, or may have, whose message was not published and whose
#: clear failed or was cut short (a lost reply): stale at the next look, not after the grace.
_unsent_marks: set[str] = set()

#: Seconds after which a follow-up mark whose message was never noted as sent is stale: its
#: queuer died (or a soft time limit struck) between the mark and the publish.
FOLLOW_UP_PUBLISH_GRACE = 30.0


def _next_stale(config: SingleInstance, task: Any, key: str, queued: str) -> bool:
    """Whether the follow-up mark naming ``queued`` no longer stands for a message to come:
    its task ended, its message is gone from the broker (purged), or it was never sent. A
    wrong "stale" only queues one follow-up more, which finds the note taken and runs
    nothing; a wrong "not stale" would strand the note."""
    if queued in _unsent_marks:
        return True
    backend, name = locks[config.using], _next_name(config, key)
    sent = markers.read(backend, sent_name(name, queued))
    if sent is None:
        # Its writer (a process on this host) died before noting it as sent: never sent.
        pid = _writer_pid(backend, name, queued)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            return True
    if _task_ended(task, queued):
        # A worker stores REVOKED as a revoke reaches it, and discards a message it holds
        # (for its countdown) only later, following up then (see _discarded_follow_up): one
        # queued now would run the cancelled call. Unknown whether it is held: stale.
        revoked = not config.dedupe_queued and was_revoked(config.using, queued)
        return not (revoked and _message_held(config, task, key, queued))
    deduped = config.dedupe_queued and isinstance(task, SingleInstanceTask)
    if deduped and task._stale(key, queued):  # a purged message's marker too
        return True
    if sent is None:
        mark = markers.read(backend, name)
        left = mark[1] if mark is not None and mark[0] == queued else None
        # Its TTL was dedupe_ttl (+ countdown) when marked: this much less, and it is older.
        return left is not None and left < to_ms(config.dedupe_ttl - FOLLOW_UP_PUBLISH_GRACE)
    if not sent[0]:  # published to no queue by name (see SingleInstanceTask._note_sent)
        return False
    from .broker import message_queued

    return message_queued(task.app, sent[0], queued) is False


def _message_held(config: SingleInstance, task: Any, key: str, queued: str) -> bool:
    """Whether the follow-up ``queued``'s message is known to be in its queue or held by a
    worker (only one noted as sent to a queue by name is looked for)."""
    sent = markers.read(locks[config.using], sent_name(_next_name(config, key), queued))
    if sent is None or not sent[0]:
        return False
    from .broker import message_queued

    return message_queued(task.app, sent[0], queued) is True


def _task_ended(task: Any, task_id: str) -> bool:
    """Whether ``task_id`` has a final state (unknown: not ended, its mark expires)."""
    try:
        return task.AsyncResult(task_id).state in READY_STATES
    except Exception:
        return False


def _duplicate_of(task: Any) -> str | None:
    """The task a deduplicated call's message names (see :data:`DUPLICATE_OF`), if any."""
    if task is None:
        return None
    request = task.request
    found = getattr(request, DUPLICATE_OF, None) or (request.headers or {}).get(DUPLICATE_OF)
    return str(found) if found else None


def _redelivered(
    config: SingleInstance, task: Any, key: str, task_id: str, attempt: int, ended: bool = False
) -> Any:
    """The message of a running (``ended``: finished) task, delivered again (``acks_late``
    past the broker's visibility timeout): never run twice. ``Ignore`` stores nothing, so
    the task's result stays the attempt's that ran."""
    if ended:
        logger.warning(
            "redlock: skipped a redelivered message: task %s ran already (attempt %s, %r)",
            task_id, attempt, key,
        )  # fmt: skip
    else:
        logger.warning(
            "redlock: skipped a redelivered message: task %s runs already (attempt %s holds"
            " %r)", task_id, attempt, key,
        )  # fmt: skip
    duplicate_skipped.send_robust(
        sender=task, key=key, task_id=task_id, holder_task_id=task_id, using=config.using,
        redelivered=True,
    )  # fmt: skip
    raise Ignore()


# -- acks_late: a message put back while its run went on, taken after that run ended --------
#
# The broker restores an unacknowledged message after its visibility timeout, while its task
# still runs; a worker may take that copy only once the run released the key (one child, or
# every child busy). The hold is gone then, so the run notes, before it releases, that this
# attempt of its task ran ("<key>:done:<task id>.<attempt>"); a run that takes the key and
# finds that note is such a copy. Noted only once the run settled (see _Ending): a run
# killed or stopped mid-body, or before its fenced COMMIT, has its requeued copy run. Only
# for acks_late tasks (an early-acknowledged message is never put back once a run started),
# and not for Reject (the body asked to run it again).


def _acks_late(task: Any) -> bool:
    # An eager run (apply()) has no message to come back: the same id may run again.
    return bool(getattr(task, "acks_late", False)) and not task.request.is_eager


def _done_name(key: str, task_id: str, attempt: int) -> str:
    return f"{key}:done:{token_id(task_id)}.{attempt}"


def done_ttl(task: Any) -> float:
    """How long (seconds) a finished run's note lasts: twice the broker's visibility timeout
    (a copy put back waits in the queue), at least an hour."""
    options = getattr(task.app.conf, "broker_transport_options", None) or {}
    try:
        visibility = float(options.get("visibility_timeout") or 3600)
    except (TypeError, ValueError):
        visibility = 3600.0
    return min(max(2 * visibility, 3600.0), MAX_TTL)


def _ran_already(config: SingleInstance, key: str, task_id: str, attempt: int) -> bool:
    try:
        return markers.read(locks[config.using], _done_name(key, task_id, attempt)) is not None
    except LockError as exc:  # unknown: it runs (at least once, as without the note)
        logger.warning("redlock: could not look whether task %s ran already: %s", task_id, exc)
        return False


def _noting_done(
    config: SingleInstance, task: Any, key: str, task_id: str, attempt: int
) -> Callable[[BaseException | None], None]:
    """A run's step once it settled (see :class:`_Ending`): noting that this attempt ran.
    Not for ``Reject`` (the body asked to run it again)."""

    def note(exc: BaseException | None) -> None:
        if isinstance(exc, Reject):
            return
        try:
            markers.mark(
                locks[config.using], _done_name(key, task_id, attempt), "1",
                to_ms(done_ttl(task)),
            )  # fmt: skip
        except LockError as exc:  # a copy may then run again (at least once)
            logger.warning("redlock: could not note task %s as done: %s", task_id, exc)

    return note


class _Ending:
    """What a run does once its outcome is settled, before its release where it can: each
    step is given the exception the run raised (None: it returned), and they run once.

    Settled: the body returned (in a fenced transaction: once its COMMIT happened), or the
    run raised an ``Exception``, which Celery records as the task's outcome (a failure, a
    retry). So does a fenced block's COMMIT that failed (a copy beside the retry that
    ``autoretry_for`` queues would do the work twice) or whose outcome is unknown (the task
    fails with ``CommitOutcomeUnknown``; a copy would run the work again blindly). Never
    settled: a run stopped (``SystemExit``, ``KeyboardInterrupt``: Celery records nothing,
    the child exits; a process killed), mid-body or before its COMMIT: its message comes
    back and runs."""

    def __init__(self) -> None:
        self.steps: list[Callable[[BaseException | None], None]] = []
        self.entered = False  # the body's frame was reached (set when it raised)
        self.returned = False  # the body returned (a fenced block's COMMIT comes after)
        self.settled = False

    def __call__(self, exc: BaseException | None = None) -> None:
        if self.settled:
            return
        for step in self.steps:
            step(exc)
        self.settled = True  # last: steps cut short run again after the release


def _settling(
    config: SingleInstance, body: Callable[[], Any], ending: _Ending
) -> Callable[[], Any]:
    """``body``, settling ``ending`` when it raises an ``Exception`` or, once it returned:
    at once, or in a fenced transaction at its COMMIT (an ``on_commit`` callback: Django
    runs it after the COMMIT and before the release; a transaction rolled back, or a
    process killed before its COMMIT, never runs it)."""

    def run() -> Any:
        if config.atomic is not None:
            # Also at a lost COMMIT the row proved committed: before the release, so a
            # copy taking the key then finds the run noted.
            on_commit_or_proved(ending, using=config.atomic)
        try:
            result = body()
            ending.returned = True  # in the try: a time limit on it ends the run settled
        except Exception as exc:
            ending.entered = ending.returned or _reached_body(exc, config.func)
            ending(exc)
            raise
        if config.atomic is None:
            ending()
        return result

    return run


def _reached_body(exc: BaseException, func: Any) -> bool:
    """Whether ``exc``, caught in ``_settling``'s ``run`` (its traceback's first frame), came
    once the body (``func``, the function the call runs) was called: from the call's
    instruction on in ``run`` (a limit as the body returned), or from ``func``'s own frame
    or a frame it called. The frames on the way in (``body_for``, a shim's wrapper, the task
    class's ``__call__``) are not the body: a limit there leaves the call to run (at least
    once). A flag set before the call could not say so: a soft time limit may strike at any
    line on the way in. The innermost frame is not counted: a soft time limit's is its
    signal handler's."""
    tb = exc.__traceback__
    if tb is None:
        return False
    call = _call_offset(tb.tb_frame.f_code)
    if call is None or tb.tb_lasti > call:
        return True  # not found (unknown: as before), or past the call: the body returned
    if tb.tb_lasti < call:
        return False
    frames = []
    deeper = tb.tb_next
    while deeper is not None and deeper.tb_next is not None:
        frames.append(deeper)
        deeper = deeper.tb_next
    if not frames:
        return True  # raised in run at the call's instruction, after the body returned
    body = _code_of(func)
    if body is None:  # not a function: any frame past this module's is the body's (as before)
        return any(f.tb_frame.f_code.co_filename != __file__ for f in frames)
    # Else on the way in; or on the way out of a frame in between once the body returned (a
    # task class's __call__): the call then runs once more (at least once).
    return any(f.tb_frame.f_code is body for f in frames)


def _code_of(func: Any) -> Any:
    """The code of the frame a call of ``func`` opens (a method's function's), if known."""
    return getattr(getattr(func, "__func__", func), "__code__", None)


@functools.cache
def _call_offset(code: Any) -> int | None:
    """The offset of ``_settling``'s ``run``'s call of ``body``."""
    seen = False
    for instruction in dis.get_instructions(code):
        seen = seen or instruction.argval == "body"
        if seen and instruction.opname.startswith("CALL"):
            return instruction.offset
    return None


# -- the worker's main process: release what a killed child held ----------------------------


def _config_of(task: Any) -> SingleInstance | None:
    """The settings a task runs under: a ``SingleInstanceTask``'s hook (the shims build
    theirs), else its function's ``@single_instance``."""
    hook = getattr(task, "single_instance_config", None)
    if hook is not None:
        return hook()
    return _decorated(task)


def _decorated(task: Any) -> SingleInstance | None:
    return getattr(getattr(task, "run", None), "__redlock__", None)


def release_task_hold(task: Any, task_id: str, args: Any, kwargs: Any) -> bool:
    """Release ``task_id``'s hold on its key if the run that took it is over (compare-and-
    delete): its process is this one (a failure handler runs after the body) or, on this host,
    is gone. A hold whose process still runs (a revoke's SIGUSR1 that the body catches, a hard
    time limit announced before the kill) or that another host took (a copy of the message
    killed there, beside the live run) is left: see :func:`_release_when_over`."""
    config = _config_of(task)
    if config is None or not task_id:
        return False
    key = lock_key(task, *(args or ()), **(kwargs or {}))
    backend = locks[config.using]
    released = False
    for hold, permit in _task_holds(backend, key, task_id):
        if _run_state(hold) == "over":
            released = _release_hold(backend, key, hold, permit, task_id) or released
    return released


def _task_holds(backend: Any, key: str, task_id: str) -> list[tuple[Any, bool]]:
    """``task_id``'s holds on ``key`` (a lock's one hold, a semaphore's permits), each with
    whether it is a permit. A hold's token is "<task id>.<attempt>.<random>": the whole id is
    compared, or stopping task "abc" would release task "abc.1"'s hold."""
    info = backend.inspect(key)
    if info is None:
        return []
    if info.holders:
        return [(h, True) for h in info.holders if holds_task(h.token, task_id) is not None]
    return [(info, False)] if holds_task(info.token, task_id) is not None else []


def _release_hold(backend: Any, key: str, hold: Any, permit: bool, task_id: str) -> bool:
    if permit:
        released = backend.execute(backend.op_lease_release(key, hold.token)) >= 0
    else:
        released = backend.execute(backend.op_release(key, hold.token, Kind())) >= 0
    if released:
        logger.info("redlock: released %r, held by stopped task %s", key, task_id)
    return bool(released)


def _run_state(hold: Any) -> str:
    """Whether the process that took ``hold`` is "over" (this very process, whose run ended:
    its failure handler is called after the body; or on this host and gone, a zombie too),
    still "running" (on this host), or "elsewhere" (another host: only its TTL tells)."""
    who = hold.holder
    pid = str(who.get("p", ""))
    if who.get("h") != HOST or not pid.isdigit():
        return "elsewhere"
    if int(pid) == os.getpid():
        return "over"
    return "running" if _alive(int(pid)) else "over"


def _alive(pid: int) -> bool:
    """Whether ``pid`` may still run code: it exists and is no zombie (a killed pool child
    stays one until the pool reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[:1] != [b"Z"]
    except OSError:  # gone meanwhile, or no /proc: the kill() above answered
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


#: How long (seconds) the worker's main process watches a stopped run's process before it
#: leaves its hold to the hold's own end (its run's release, or its TTL once the process died).
WATCH_STOPPED_RUN = 600.0


def _release_when_over(
    task: Any, task_id: str, args: Any, kwargs: Any, then: Callable[[], None] | None = None
) -> None:
    """Release ``task_id``'s holds once the process running each is gone, in a thread of
    the worker's main process (never while a body may run: a revoke's SIGUSR1 raises
    ``SoftTimeLimitExceeded`` in it, which it may catch and go on; a hard time limit fails
    the task before the child is killed). A hold released by its own run, or taken
    elsewhere, is left alone. ``then``: called once nothing is left to watch."""
    config = _config_of(task)
    if config is None or not task_id:
        if then is not None:
            then()
        return
    key = lock_key(task, *(args or ()), **(kwargs or {}))
    backend = locks[config.using]

    def watch() -> None:
        try:
            deadline = time.monotonic() + WATCH_STOPPED_RUN
            while True:
                holds = [(h, p) for h, p in _task_holds(backend, key, task_id)
                         if _run_state(h) != "elsewhere"]  # fmt: skip
                for hold, permit in holds:
                    if _run_state(hold) == "over":
                        _release_hold(backend, key, hold, permit, task_id)
                running = [h for h, _ in holds if _run_state(h) == "running"]
                if not running or time.monotonic() >= deadline:
                    break
                pids = {int(h.holder["p"]) for h in running}
                # The pids are watched here (cheap), Redis once a second (released meanwhile?).
                look = time.monotonic() + 1.0
                while time.monotonic() < look and all(_alive(pid) for pid in pids):
                    time.sleep(0.02)
        except LockError as exc:  # the hold then frees itself at its TTL (its process died)
            logger.warning("redlock: could not release stopped task %s's lock: %s", task_id, exc)
        except Exception:  # a thread's error would be lost: logged
            logger.exception("redlock: releasing stopped task %s's lock failed", task_id)
        if then is not None:
            then()

    if not any(_run_state(h) == "running" for h, _ in _task_holds(backend, key, task_id)):
        watch()  # nothing to wait for: at once, in the handler
        return
    start_thread(threading.Thread(target=watch, name=f"redlock-stopped-{task_id}", daemon=True))


@task_revoked.connect
def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False,
    **_: Any,
) -> None:  # fmt: skip
    """A revoked task: terminated, its hold goes; revoked before it ran or expired (the
    worker discards the message), its queue marker goes, as it will never run."""
    if request is None:
        return
    config = _config_of(sender)
    key = None
    if config is not None and request.id:
        try:
            key = lock_key(sender, *(request.args or ()), **(request.kwargs or {}))
        except (TypeError, ValueError):  # arguments no key fits: nothing was noted
            key = None
    if key is not None and config is not None and config.on_duplicate == "coalesce":
        # An expiry cancels nothing: the note may hold a call that never got the expired
        # message's id (a duplicate coalesced on a worker). Celery counts an expired id as
        # revoked: only our note of a revoke tells (unknown: not cancelled, the call runs).
        cancelled = terminated or not expired or was_revoked(config.using, str(request.id))
        if cancelled:
            # First: the stopped run's end queues a follow-up for any note left.
            _drop_revoked_call(config, key, str(request.id), terminated)
        if not terminated and not (cancelled and config.dedupe_queued):
            _discarded_follow_up(config, sender, key, request, cancelled)
    if terminated:
        _quietly(sender, request.id, request.args, request.kwargs)
    if key is None or config is None or not config.dedupe_queued:
        return
    clear_queued_marker(config, key, str(request.id))  # logs a failure: it expires


def _drop_revoked_call(config: SingleInstance, key: str, task_id: str, terminated: bool) -> None:
    """A revoke is a cancel: the call a revoked follow-up runs (the note it claimed) goes,
    rather than being run again by the next follow-up (compare-and-delete: a call noted since
    stays, and runs). With ``dedupe_queued``, so does the note of a queued follow-up
    revoked before it ran (the calls noted were given its id: they go with it); without,
    see :func:`_discarded_follow_up`. A follow-up merely killed (not revoked) keeps its call
    (at least once)."""
    backend = locks[config.using]
    try:
        found = markers.read(backend, _pending_name(key))
        if found is None:
            return
        note = json.loads(found[0])
        taken = (json.loads(note["before"]) if note.get("before") else note).get("taken")
        if taken != task_id:
            if taken is not None or terminated or not config.dedupe_queued:
                return
            mark = markers.read(backend, _next_name(config, key))
            if mark is None or mark[0] != task_id:
                return
        if _drop_claim(config, key, found[0], note):
            logger.info("redlock: revoked task %s: its coalesced call of %r dropped", task_id, key)
    except (LockError, ValueError) as exc:  # then it runs once more (at least once)
        logger.warning("redlock: could not drop revoked task %s's call: %s", task_id, exc)


def _discarded_follow_up(
    config: SingleInstance, task: Any, key: str, request: Any, cancelled: bool
) -> None:
    """A follow-up the worker discarded before it ran. Revoked (no ``dedupe_queued``: see
    :func:`_drop_revoked_call`): the call it was queued for (its FOLLOW_UP_CALL header) is
    dropped, while unclaimed (compare-and-delete: a later call's note stays). Expired (and
    not revoked), it cancelled nothing, with ``dedupe_queued`` too (the note may hold a call
    coalesced on a worker, never given its id). Either way a note left needs a follow-up:
    the one that ended meanwhile queued none, as the mark still named this one, so the mark
    goes and another is queued."""
    task_id = str(request.id)
    backend = locks[config.using]
    try:
        found = markers.read(backend, _pending_name(key)) if cancelled else None
        if found is not None:
            call = json.loads(found[0])
            wanted = _header(request, FOLLOW_UP_CALL)
            ours = bool(wanted) and call.get("call") == wanted and call.get("taken") is None
            if ours and markers.clear(backend, _pending_name(key), found[0]):
                logger.info("redlock: revoked task %s: its coalesced call of %r dropped",
                            task_id, key)  # fmt: skip
        name = _next_name(config, key)
        # Another follow-up is coming (or this one was none's: a poll), unless, with
        # dedupe_queued, the marker ran out already (its TTL ends with the message's expires=).
        if not markers.clear(backend, name, task_id) and (
            not config.dedupe_queued or markers.read(backend, name) is not None
        ):
            return
        with contextlib.suppress(LockError):
            sent = markers.read(backend, sent_name(name, task_id))
            if sent is not None:
                markers.clear(backend, sent_name(name, task_id), sent[0])
        _queue_unless_followed(config, task, key, backend.inspect(key))
    except (LockError, ValueError) as exc:  # the note stays: the next run's end queues it
        logger.warning("redlock: could not follow up discarded task %s: %s", task_id, exc)


# A fenced block the task's ``with`` abandoned (a soft time limit entering its exit, caught by
# the task) is rolled back and its lock released once the task ended, not at the thread's
# next fenced block.
task_postrun.connect(drop_all_abandoned, weak=False, dispatch_uid="redlock-fenced-abandoned")


@task_failure.connect
def _on_failure(
    sender: Any = None, task_id: str = "", exception: Any = None, args: Any = None,
    kwargs: Any = None, **_: Any,
) -> None:  # fmt: skip
    # A soft time limit too: a run that failed with it holds nothing any more (its run
    # released on the way out; this is the second try, should that release have failed).
    if isinstance(exception, (TimeLimitExceeded, SoftTimeLimitExceeded, WorkerLostError)):
        _quietly(sender, task_id, args, kwargs)


def _quietly(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    """Release a stopped run's hold once its process is gone; with ``coalesce``, then queue
    the call a duplicate noted meanwhile (the killed run never got to its own follow-up)."""
    config = _config_of(task)

    def follow_up() -> None:
        # Whether it released or not (a soft time limit's run let go on its way out, and may
        # have been stopped before it queued): a note left must have a follow-up.
        if config is not None and config.on_duplicate == "coalesce":
            key = lock_key(task, *(args or ()), **(kwargs or {}))
            _queue_follow_up(config, task, key)
            _follow_up_once_writer_gone(config, task, key)

    try:
        _release_when_over(task, task_id, args, kwargs, then=follow_up)
    except LockError as exc:  # the hold then frees itself at its TTL
        logger.warning("redlock: could not release stopped task %s's lock: %s", task_id, exc)


# -- queue-time deduplication ---------------------------------------------------------------


class SingleInstanceTask(Task):
    """A task base that does not enqueue a call whose key is queued or running already.

    Needed for ``dedupe_queued``: ``@shared_task(bind=True, base=SingleInstanceTask)``. The
    second ``.delay()`` returns the ``AsyncResult`` of the queued or running task (or raises
    :class:`AlreadyQueued` with ``dedupe_queued="raise"``). Works on every backend.
    """

    abstract = True

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Queue the call unless its key is queued or running already.

        The queue marker names the queued task id and never outlives its message: it is
        cleared if the publish raises (the error propagates; the next call queues, and so
        does a call that met it while that publish was in progress: see
        :meth:`_published`), its TTL
        ends with the message's ``expires``, a worker discarding the message (revoked or
        expired) clears it, and a marker whose task has a final state (``SUCCESS``,
        ``FAILURE``, ``REVOKED``...) is stale: replaced, not obeyed. A caller that chose the
        task id (a ``group``/``chord`` member, ``task_id=``) was promised that id: a duplicate
        is then published as a message that runs nothing and returns the skipped sentinel, so
        the id resolves and the canvas goes on.
        """
        config = _config_of(self)
        if config is None or not config.dedupe_queued:
            # Refused here, not on the worker that notes it as a duplicate (a retry was accepted).
            if (
                config is not None
                and config.on_duplicate == "coalesce"
                and not options.get("retries")
            ):
                check_notable(args, kwargs)
            return super().apply_async(args, kwargs, **options)
        watch_revokes(self.app)
        key = lock_key(self, *(args or ()), **(kwargs or {}))
        backend = locks[config.using]
        headers = options.get("headers") or {}
        if headers.get(FOLLOW_UP):  # a coalesced follow-up: its queuer marked it already
            follow_up = options.get("task_id")
            if not follow_up or self.app.conf.task_always_eager:
                return super().apply_async(args, kwargs, **options)
            ttl_ms = to_ms(self.queue_marker_ttl(options))
            watch = None
            try:
                with watched_publish(self.app, follow_up, options) as watch:
                    sent = super().apply_async(args, kwargs, **options)
            finally:  # sent, or maybe: noted, whatever line an exception landed on
                if self._maybe_published(watch, key, follow_up, args, kwargs, options):
                    self._note_sent(key, follow_up, args, kwargs, options, ttl_ms)
            return sent
        promised = options.pop("task_id", None)
        # self.retry() sends the running task's own id again: that call was accepted already,
        # so it is never deduplicated (to itself, or to the holder it waits for).
        retrying = (promised is not None and promised == self.request.id) or bool(
            options.get("retries")
        )
        coalesce = config.on_duplicate == "coalesce" and not retrying
        if coalesce:  # refused here, before any Redis call, not when its note is written
            check_notable(args, kwargs)
        queue = options.get("queue")
        exchange = getattr(options.get("exchange"), "name", options.get("exchange"))
        # A call by an exchange (no queue named): its follow-up goes the same way.
        route = (
            {"exchange": str(exchange), "routing_key": options.get("routing_key")}
            if exchange and queue is None
            else None
        )

        def note() -> tuple[str, str | None]:
            # Noted only once the call is accepted: queued (before its publish: its follow-up
            # runs the call noted last), or joined to the queued call. A call turned away
            # never replaces the arguments of one that was accepted.
            return note_call(
                config, key, args, kwargs, getattr(queue, "name", queue), None, self.name, route
            )

        if coalesce:  # queued as a follow-up, which runs the call noted last
            options["headers"] = {**headers, FOLLOW_UP: "1"}
        if not retrying and self.dedupes_running():
            running = backend.inspect(key)
            holder = task_id_of(running.holder) if running is not None else None
            if holder:
                if coalesce and self.joins_queued_call():
                    note()
                return self._not_queued(key, str(holder), args, kwargs, promised, options)
        task_id = promised or uuid_text()
        ttl_ms = to_ms(self.queue_marker_ttl(options))
        queued = None
        try:
            for _ in range(3):  # again after clearing a stale marker
                queued = markers.mark(backend, key, task_id, ttl_ms)
                if queued is None or queued == task_id or retrying:
                    break
                if not self._stale(key, queued) and self._published(key, queued):
                    break
                clear_queued_marker(config, key, queued)
            else:  # stale markers each time: queue it unmarked (never dropped; the lock excludes)
                queued = task_id
        except BaseException:
            # The mark's reply lost (or an interrupt): it may be written, naming a message
            # that is never published, and with no "sent" note it would be obeyed for its
            # TTL. Ours only (compare-and-delete); a failure to clear is logged.
            if not retrying:
                clear_queued_marker(config, key, task_id)
            raise
        if queued is not None and queued != task_id and not retrying:
            # Met only once that call's publish happened (see _published): its note is
            # written, so this one, if it joins, comes after it.
            if coalesce and self.joins_queued_call():
                note()
            return self._not_queued(key, queued, args, kwargs, promised, options)
        noted = sent = watch = None
        eager = self.app.conf.task_always_eager
        noting = queued is None and not eager  # eager: it ran already
        try:
            if coalesce:
                noted = note()
            if eager:
                sent = super().apply_async(args, kwargs, task_id=task_id, **options)
            else:
                with watched_publish(self.app, task_id, options) as watch:
                    sent = super().apply_async(args, kwargs, task_id=task_id, **options)
            if noting:
                self._note_sent(key, task_id, args, kwargs, options, ttl_ms)
        except BaseException:
            if sent is not None or self._maybe_published(
                watch, key, task_id, args, kwargs, options
            ):
                # Published (the broker took it) or maybe (an exception once the producer
                # was entered, and the broker does not say it lacks the message): the marker
                # stays, noted as sent (unnoted, it is taken for a publish that never came:
                # queued anew). Cleared only when it is known nothing was queued.
                if noting:
                    self._note_sent(key, task_id, args, kwargs, options, ttl_ms)
                raise
            if queued is None:  # our marker: the message it names was never queued
                clear_queued_marker(config, key, task_id)
            # The caller is told the call failed (and calls again): its arguments must not
            # run. The note of a failed note() is left (a lost reply: at least once).
            if noted is not None:
                unnote_call(config, key, *noted)
            raise
        return sent

    def _maybe_published(
        self, watch: Any, key: str, task_id: str, args: Any, kwargs: Any,
        options: dict[str, Any],
    ) -> bool:  # fmt: skip
        """Whether a publish that raised may have queued ``task_id``'s message: the broker
        took it, or the producer was entered and the broker, asked by id, does not answer
        "not there" on two looks a pause apart, with no worker noted as taking it and no run
        of it holding the key (unknown is taken as sent: never a call lost, at worst one
        obeyed marker until its TTL)."""
        if watch is None or not watch.entered:
            return False  # the producer was never called: nothing queued
        if watch.published:
            return True
        from .broker import message_queued

        queue = self._queue_of(args, kwargs, options)
        if not queue:
            return True
        config = self.single_instance_config()
        assert config is not None
        for look in range(2):  # an idle worker may have taken it already, not yet noted
            if look:
                time.sleep(self.message_check_pause)
            if message_queued(self.app, queue, task_id) is not False:
                return True
            try:
                if markers.read(locks[config.using], received_name(key, task_id)) is not None:
                    return True  # a worker took it
                running = locks[config.using].inspect(key)
            except LockError:
                return True  # unknown: taken as sent
            if running is not None and task_id_of(running.holder) == task_id:
                return True  # it runs
        return False

    def single_instance_config(self) -> SingleInstance | None:
        """The settings this task runs and queues under (a hook: the shims build theirs);
        by default its function's ``@single_instance``."""
        return _decorated(self)

    def single_instance_key(self, args: tuple, kwargs: dict) -> str:
        """The key of a call (a hook: the shims name theirs); by default the decorator's."""
        config = _decorated(self)
        if config is None:
            raise TypeError(f"{self!r} is not a task decorated with @single_instance")
        return config.key_for(self.name, args, kwargs, bound=_is_bound(self))

    def queue_marker_ttl(self, options: dict[str, Any]) -> float:
        """How long the marker of a call with these options lasts (a hook: a shim's per-call
        timeout): the wait in the queue plus ``dedupe_ttl``, but never past the message's
        ``expires`` (it cannot run after that)."""
        config = self.single_instance_config()
        assert config is not None
        ttl = self._queue_wait(options) + config.dedupe_ttl
        expires = _moment(options.get("expires", self.expires))
        if isinstance(expires, datetime.datetime):
            expires = (
                maybe_make_aware(expires, self.app.timezone) - self.app.now()
            ).total_seconds()
        if isinstance(expires, (int, float)) and not isinstance(expires, bool):
            ttl = min(ttl, max(float(expires), 0.001))
        return ttl

    #: Look for a marked message in the broker at most this often (seconds) per key and
    #: process, once it was found there: a loop of ``delay()`` calls reads the queue once.
    message_check_every = 2.0
    #: The pause between the two looks that find a message gone (see :meth:`message_gone`).
    message_check_pause = 1.0
    #: How long (seconds) a message a worker took counts as on its way to its run, neither
    #: in the broker nor holding the key (acknowledged early, its run not started yet: a
    #: busy child, slow prerun handlers). A worker dying with it is found out after that.
    message_start_grace = 60.0

    def _stale(self, key: str, task_id: str) -> bool:
        """Whether the marker naming ``task_id`` is stale: its task ended, was revoked (by
        this app's ``control.revoke``), or its message can no longer run."""
        config = self.single_instance_config()
        assert config is not None
        return (
            self._ended(task_id)
            or was_revoked(config.using, task_id)
            or self._stamp_revoked(key, task_id)
            or self.message_gone(key, task_id)
        )

    def _stamp_revoked(self, key: str, task_id: str) -> bool:
        """Whether the queued call ``task_id`` carries a stamp a stamped revoke named (see
        :func:`note_revoked_stamps`). Unknown: False (the other checks decide)."""
        config = self.single_instance_config()
        assert config is not None
        backend = locks[config.using]
        try:
            noted = markers.read(backend, stamps_name(key, task_id))
            if noted is None:
                return False
            stamps = json.loads(noted[0])
            return any(
                markers.read(backend, revoked_stamp_name(header, value)) is not None
                for header, values in stamps.items()
                for value in values
            )
        except (LockError, ValueError, TypeError, AttributeError) as exc:
            logger.info("redlock: could not check the stamps of task %s: %s", task_id, exc)
            return False

    #: How long (seconds) a call that meets the marker of a publish in progress (not noted as
    #: sent yet) waits for that publish: see :meth:`_published`.
    publish_wait = 5.0

    def _published(self, key: str, task_id: str) -> bool:
        """Whether the marker naming ``task_id`` stands for a message that was published:
        noted as sent, now or within ``publish_wait`` seconds (its publish in progress), or
        run already (its run took the key). False once the marker went otherwise (that
        publish failed, and its producer cleared it), or still not sent after the wait (its
        producer died between the mark and the publish): the caller queues the call itself,
        and at worst two messages run one after the other (the lock keeps them apart), where
        obeying such a marker lost the call."""
        config = self.single_instance_config()
        assert config is not None
        backend = locks[config.using]
        deadline = time.monotonic() + self.publish_wait
        pause = 0.005
        while True:  # a Redis that cannot answer: its LockError goes to the caller
            if markers.read(backend, sent_name(key, task_id)) is not None:
                return True
            noted = markers.read(backend, key)
            if noted is None or noted[0] != task_id:
                running = backend.inspect(key)
                holder = task_id_of(running.holder) if running is not None else None
                return holder == task_id or self._ended(task_id)
            if time.monotonic() >= deadline:
                logger.warning(
                    "redlock: the queue marker of %r names task %s, not published after %.1f"
                    " s: queued anew", key, task_id, self.publish_wait,
                )  # fmt: skip
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _note_sent(
        self, key: str, task_id: str, args: Any, kwargs: Any, options: dict[str, Any],
        ttl_ms: int,
    ) -> None:  # fmt: skip
        """Note, beside the marker and as long, that ``task_id``'s message was published and
        to which queue: only such a marker is checked against the broker; one routed to no
        queue by name (an exchange or routing key of the call's own) is noted with an empty
        queue (published, never looked for). A marker without the note is a publish in
        progress (see :meth:`_published`)."""
        queue = self._queue_of(args, kwargs, options) or ""
        config = self.single_instance_config()
        assert config is not None
        backend = locks[config.using]
        stamps = {
            str(h): sorted(_stamp_values(options[h]))
            for h in options.get("stamped_headers") or ()
            if options.get(h) is not None
        }
        try:
            if stamps:  # a stamped revoke must find them (see _stamp_revoked)
                markers.mark(backend, stamps_name(key, task_id), json.dumps(stamps), ttl_ms)
            markers.mark(backend, sent_name(key, task_id), queue, ttl_ms)
            if ttl_ms > to_ms(config.dedupe_ttl):
                # A countdown/ETA: its marker outlives a revoke's note of dedupe_ttl, so a
                # revoke must find how long to keep its note (see note_revoked).
                _note_queue_wait(backend, stamps, task_id, ttl_ms)
        except LockError as exc:  # then the marker is obeyed until its TTL
            logger.warning("redlock: could not note task %s as sent: %s", task_id, exc)

    def _queue_of(self, args: Any, kwargs: Any, options: dict[str, Any]) -> str | None:
        return routed_queue(self, args, kwargs, options)

    def message_gone(self, key: str, task_id: str) -> bool:
        """Whether the message of ``task_id``, which ``key``'s marker names, can no longer
        run: noted as published, and neither in its queue nor held by a worker, on two
        looks ``message_check_pause`` apart, with no run of it started in between. Only a
        Redis broker can be asked (see :mod:`django_redlock.contrib.broker`); elsewhere, or
        when anything cannot answer, False: the marker is obeyed until its TTL."""
        from .broker import message_queued

        seen = _found_in_broker.get((key, task_id))
        if seen is not None and time.monotonic() - seen < self.message_check_every:
            return False
        config = self.single_instance_config()
        assert config is not None
        backend = locks[config.using]
        try:
            sent = markers.read(backend, sent_name(key, task_id))
            if sent is None or not sent[0]:  # not (yet) published, or to no queue by name
                return False
            if markers.read(backend, received_name(key, task_id)) is not None:
                return False  # a worker took it lately: its run is on its way
            queue = sent[0]
            if message_queued(self.app, queue, task_id) is not False:
                _remember_found(key, task_id)
                return False
            # A worker may hold it unnoted for a moment (taken from the list and not yet in
            # the unacked hash, or acknowledged early and not yet started): look again.
            time.sleep(self.message_check_pause)
            # The marker, then the hold: a run takes the lock before it clears its marker.
            noted = markers.read(backend, key)
            running = backend.inspect(key)
            if running is not None and task_id_of(running.holder) == task_id:
                return False  # it started: its run holds the key
            if markers.read(backend, received_name(key, task_id)) is not None:
                return False  # a worker took it meanwhile (between the list and the hash)
            if noted is None or noted[0] != task_id:
                # Its marker went meanwhile, and no run of it holds the key: it ran already,
                # or another caller took it for gone. The caller marks again, and obeys
                # whatever marker it finds then.
                return True
            if message_queued(self.app, queue, task_id) is not False:
                _remember_found(key, task_id)
                return False
        except LockError as exc:  # unknown is not gone: obey the marker
            logger.info("redlock: could not check the message of task %s: %s", task_id, exc)
            return False
        logger.warning(
            "redlock: the message of task %s (%r, queue %r) is gone from the broker (purged or"
            " lost): its queue marker no longer counts", task_id, key, queue,
        )  # fmt: skip
        return True

    def _ended(self, task_id: str) -> bool:
        """Whether ``task_id`` has a final state in the result backend (then its marker is
        stale: the worker cleared it, or could not, e.g. revoked before it ran). Unknown
        (no result backend, an error) counts as not ended: the marker expires at its TTL."""
        try:
            return self.AsyncResult(task_id).state in READY_STATES
        except Exception:  # a result backend that cannot answer: obey the marker
            return False

    def _queue_wait(self, options: dict[str, Any]) -> float:
        """Seconds the call waits in the queue by its countdown or ETA."""
        wait = float(options.get("countdown") or 0)
        eta = _moment(options.get("eta"))
        if isinstance(eta, datetime.datetime):
            eta = maybe_make_aware(eta, self.app.timezone)  # Celery's reading of a naive ETA
            wait = max(wait, (eta - self.app.now()).total_seconds())
        return max(0.0, wait)

    def dedupes_running(self) -> bool:
        """Whether a call of a key that runs (not only one queued) is not queued (a hook:
        celery-once's ``unlock_before_run`` queues it). With ``on_duplicate="coalesce"`` it is
        queued: the run it then meets coalesces it into one more run, where deduplicating it
        to the running task would drop its arguments."""
        config = self.single_instance_config()
        return config is None or config.on_duplicate != "coalesce"

    def joins_queued_call(self) -> bool:
        """Whether a ``coalesce`` call that meets a queued (or running) call of its key joins
        it: its arguments noted, to run in that call's place (the last call's arguments win),
        and the caller handed that call's result. Not with ``dedupe_queued="raise"``: the call
        is refused, and its arguments are not noted. A hook: celery-once's shim refuses every
        such call."""
        config = self.single_instance_config()
        return config is not None and config.dedupe_queued != "raise"

    def _not_queued(
        self, key: str, task_id: str, args: Any, kwargs: Any, promised: str | None,
        options: dict[str, Any],
    ) -> Any:  # fmt: skip
        # Never silent, whatever the hook returns: logged and signalled.
        config = _config_of(self)
        assert config is not None
        logger.info(
            "redlock: %s not queued: %r is queued or running as task %s", self.name, key, task_id
        )
        duplicate_not_queued.send_robust(
            sender=self, key=key, task_id=promised, holder_task_id=task_id, using=config.using
        )
        return self.deduplicated(key, task_id, args, kwargs, promised, options)

    def deduplicated(
        self, key: str, task_id: str, args: Any, kwargs: Any, promised: str | None,
        options: dict[str, Any],
    ) -> Any:  # fmt: skip
        """What a call not queued returns: ``key`` is queued or running as ``task_id``
        (``promised``: the id the caller chose, if any; ``options``: the call's). A hook: the
        migration shims override it. Logged and signalled (``duplicate_not_queued``) before
        it is called."""
        config = _config_of(self)
        assert config is not None
        if config.dedupe_queued == "raise":
            raise AlreadyQueued(
                f"{self.name} not queued: {key!r} is queued or running already as task"
                f" {task_id} (backend {config.using!r})",
                task_id,
            )
        if promised is not None and promised != task_id:
            return self.publish_duplicate(task_id, args, kwargs, promised, options)
        return self.AsyncResult(task_id)

    def publish_duplicate(
        self, task_id: str, args: Any, kwargs: Any, promised: str, options: dict[str, Any]
    ) -> Any:
        """Publish a deduplicated call under the id its caller holds (a canvas member), as a
        message that runs nothing and returns the skipped sentinel naming ``task_id``: so
        the id resolves (a ``group`` finishes, a ``chord`` calls back)."""
        headers = {**(options.pop("headers", None) or {}), DUPLICATE_OF: task_id}
        return super().apply_async(args, kwargs, task_id=promised, headers=headers, **options)

    def lock_key(self, *args: Any, **kwargs: Any) -> str:
        """The lock name a call with these arguments uses (see :func:`lock_key`)."""
        return lock_key(self, *args, **kwargs)

    def release_lock(self, *args: Any, **kwargs: Any) -> Released:
        """Force-release the lock of a call with these arguments (see :func:`release_lock`)."""
        return release_lock(self, *args, **kwargs)


def routed_queue(task: Any, args: Any, kwargs: Any, options: dict[str, Any]) -> str | None:
    """The queue Celery routes this call to (as ``send_task`` does), when that names the one
    list the message is in: a queue on a direct exchange, by its own routing key. An exchange
    or routing key of the call's own (a topic exchange...) may send it elsewhere: None
    (nothing is noted, the marker is obeyed)."""
    wanted = dict(options)
    if "queue" not in wanted and getattr(task, "queue", None):
        wanted["queue"] = task.queue
    try:
        routed = task.app.amqp.router.route(wanted, task.name, args, kwargs, task_type=task)
    except Exception:  # a router of the user's that refuses: nothing noted
        return None
    queue = routed.get("queue")
    exchange = getattr(queue, "exchange", None)
    if not getattr(queue, "name", None) or exchange is None or exchange.type != "direct":
        return None
    named = routed.get("exchange", exchange)
    if getattr(named, "name", named) != exchange.name:
        return None
    if routed.get("routing_key", queue.routing_key) != queue.routing_key:
        return None
    return str(queue.name)


# -- a queued call revoked: no longer queued -----------------------------------------------
#
# A revoke is a broadcast to the workers; the one that holds the message discards it only
# when it reaches it (a busy worker: after its run). Meanwhile the queue marker names a call
# that will never run. So the app's ``control.revoke`` (which ``AsyncResult.revoke`` calls
# too) notes each id it revoked, in every backend a dedupe_queued task of the app uses; a
# marker naming a noted id is stale. A revoke from another process (``celery control
# revoke``) is not seen: its marker goes when a worker discards the message.


def revoked_name(task_id: str) -> str:
    return f"redlock-revoked:{token_id(task_id)}"


def was_revoked(using: str, task_id: str) -> bool:
    try:
        return markers.read(locks[using], revoked_name(task_id)) is not None
    except Exception:  # unknown (or an alias not configured here): the other checks decide
        return False


def waiting_name(task_id: str) -> str:
    """The note that ``task_id`` was queued with a countdown/ETA: as long as its marker."""
    return f"redlock-waits:{token_id(task_id)}"


def stamp_waiting_name(header: str, value: str) -> str:
    """The note that a call carrying this stamp waits in a queue: as long as its longest
    marker."""
    return f"redlock-waits-stamp:{token_id(header)}={token_id(value)}"


def _note_queue_wait(
    backend: Any, stamps: dict[str, list[str]], task_id: str, ttl_ms: int
) -> None:  # fmt: skip
    """Note how long the marker of a call queued with a countdown/ETA lasts, by its id and
    by each of its stamps (only ever lengthened): a revoke of it keeps its note that long."""
    markers.mark(backend, waiting_name(task_id), "1", ttl_ms)
    for header, values in stamps.items():
        for value in values:
            name = stamp_waiting_name(header, value)
            found = markers.mark(backend, name, "1", ttl_ms)
            if found is not None:
                left = markers.read(backend, name)
                if left is not None and left[1] < ttl_ms:
                    markers.swap(backend, name, left[0], left[0], ttl_ms)


def _revoke_ttl_ms(backend: Any, seconds: float, waiting: str) -> int:
    """How long a revoke's note lasts: ``dedupe_ttl``, or as long as the marker of a call
    it revoked that waits longer in its queue (a countdown/ETA): a revoke's note that ran
    out first left the marker obeyed, and a later call was folded into the revoked one."""
    ttl_ms = to_ms(seconds)
    found = markers.read(backend, waiting)
    return max(ttl_ms, found[1]) if found is not None else ttl_ms


def note_revoked(app: Any, task_ids: Any) -> None:
    """Note ``task_ids`` (an id or a list) as revoked, for ``app``'s dedupe_queued tasks:
    for ``dedupe_ttl``, or as long as the marker of a call queued with a countdown/ETA."""
    ids = [task_ids] if isinstance(task_ids, str) else list(task_ids or ())
    ttl: dict[str, float] = {}
    for task in list(app.tasks.values()):
        try:
            config = _config_of(task)
        except Exception:  # a hook of the user's that cannot answer: not ours to note
            continue
        if config is not None and (config.dedupe_queued or config.on_duplicate == "coalesce"):
            ttl[config.using] = max(ttl.get(config.using, 0.0), config.dedupe_ttl)
    for using, seconds in ttl.items():
        for task_id in ids:
            try:
                backend = locks[using]
                ttl_ms = _revoke_ttl_ms(backend, seconds, waiting_name(str(task_id)))
                markers.mark(backend, revoked_name(str(task_id)), "1", ttl_ms)
            except Exception as exc:  # unavailable, or an alias not configured here: its
                # marker goes when a worker discards the message; the other aliases are noted
                logger.warning("redlock: could not note task %s as revoked: %s", task_id, exc)


def watch_revokes(app: Any) -> None:
    """Make ``app.control.revoke`` (and ``revoke_by_stamped_headers``: the stamps) note what
    it revokes (once per app)."""
    control = app.control
    if getattr(control, "redlock_notes_revokes", False):
        return
    revoke = control.revoke

    @functools.wraps(revoke)
    def noting(task_id: Any, *args: Any, **kwargs: Any) -> Any:
        result = revoke(task_id, *args, **kwargs)
        try:
            note_revoked(app, task_id)
        except Exception as exc:  # the revoke itself went out: never fail it
            logger.warning("redlock: could not note a revoke: %s", exc)
        return result

    control.revoke = noting
    stamped = getattr(control, "revoke_by_stamped_headers", None)  # Celery 5.3+
    if stamped is not None:

        @functools.wraps(stamped)
        def noting_stamps(headers: Any, *args: Any, **kwargs: Any) -> Any:
            result = stamped(headers, *args, **kwargs)
            try:
                note_revoked_stamps(app, _as_stamps(headers))
            except Exception as exc:  # the revoke itself went out: never fail it
                logger.warning("redlock: could not note a revoke: %s", exc)
            return result

        control.revoke_by_stamped_headers = noting_stamps
    control.redlock_notes_revokes = True


def _noting_revoke(handler: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A worker's ``revoke``/``terminate``/``revoke_by_stamped_headers`` (with terminate:
    the matching runs) control command that notes the revoke first
    (see :func:`note_revoked`), before Celery stops the run: a revoke is a cancel, and the
    stopped run's exit queues a follow-up that must find its call cancelled (Celery stores
    REVOKED and sends ``task_revoked`` only after the kill: a slow result backend left that
    follow-up time to run the call again). A revoke from any process (``celery control``
    too) is seen."""

    @functools.wraps(handler)
    def noting(state: Any, *args: Any, **kwargs: Any) -> Any:
        task_id = kwargs.get("task_id", args[0] if name == "revoke" and args else None)
        if name == "terminate" and task_id is None and len(args) > 1:
            task_id = args[1]
        try:
            if name == "revoke_by_stamped_headers":
                headers = _as_stamps(kwargs.get("headers", args[0] if args else None))
                terminate = kwargs.get("terminate", args[1] if len(args) > 1 else False)
                # The stamps, for a queued message whose marker a .delay() meets (see
                # _stamp_revoked); the ids of the runs it stops, before the kill.
                note_revoked_stamps(state.app, headers)
                task_id = _stamped_runs(headers) if terminate else []
            note_revoked(state.app, task_id)
        except Exception as exc:  # never fail the revoke; _on_revoked drops the call later
            logger.warning("redlock: could not note a revoke: %s", exc)
        return handler(state, *args, **kwargs)

    noting.redlock_notes_revokes = True  # type: ignore[attr-defined]
    return noting


def _as_stamps(headers: Any) -> dict[str, set[str]]:
    """A stamped revoke's headers (a dict of stamp name to value(s), or a list of
    ``"name=value"``), as stamp name -> values."""
    if isinstance(headers, list):
        headers = dict(str(h).split("=", 1) for h in headers if "=" in str(h))
    if not isinstance(headers, dict):
        return {}
    return {str(k): _stamp_values(v) for k, v in headers.items()}


def _stamp_values(value: Any) -> set[str]:
    return {str(x) for x in (value if isinstance(value, (list, tuple, set)) else [value])}


def _stamped_runs(headers: dict[str, set[str]]) -> list[str]:
    """The ids of this worker's active requests whose stamps match ``headers``, as Celery
    matches them."""
    from celery.worker import state as worker_state

    found = []
    for request in list(worker_state.active_requests):
        stamps = getattr(request, "stamps", None) or {}
        for header, wanted in headers.items():
            if stamps.get(header) is not None and _stamp_values(stamps[header]) & wanted:
                found.append(str(request.id))
                break
    return found


def revoked_stamp_name(header: str, value: str) -> str:
    return f"redlock-revoked-stamp:{token_id(header)}={token_id(value)}"


def note_revoked_stamps(app: Any, headers: dict[str, set[str]]) -> None:
    """Note the stamps of a stamped revoke (as long as ``dedupe_ttl``, or as the longest
    marker of a call carrying one that waits for a countdown/ETA), for ``app``'s
    dedupe_queued tasks: a queued message carrying one is discarded when a worker takes it,
    so its marker must not be obeyed meanwhile."""
    names = [
        (revoked_stamp_name(h, v), stamp_waiting_name(h, v))
        for h, values in headers.items()
        for v in values
    ]
    ttl: dict[str, float] = {}
    for task in list(app.tasks.values()):
        try:
            config = _config_of(task)
        except Exception:  # a hook of the user's that cannot answer: not ours to note
            continue
        if config is not None and config.dedupe_queued:
            ttl[config.using] = max(ttl.get(config.using, 0.0), config.dedupe_ttl)
    for using, seconds in ttl.items():
        for name, waiting in names:
            try:
                backend = locks[using]
                markers.mark(backend, name, "1", _revoke_ttl_ms(backend, seconds, waiting))
            except Exception as exc:  # then the marker is obeyed until the discard
                logger.warning("redlock: could not note a revoked stamp: %s", exc)


def _watch_revoke_commands() -> None:
    from celery.worker.control import Panel

    for name in ("revoke", "terminate", "revoke_by_stamped_headers"):
        handler = Panel.data.get(name)
        if handler is not None and not getattr(handler, "redlock_notes_revokes", False):
            Panel.data[name] = _noting_revoke(handler, name)


_watch_revoke_commands()


def received_name(key: str, task_id: str) -> str:
    """The name of the note that a worker took ``task_id``'s message (see
    :data:`SingleInstanceTask.message_start_grace`)."""
    return f"{key}:received:{task_id}"


@task_received.connect
def _on_received(request: Any = None, **_: Any) -> None:
    """A worker took a deduplicated call's message (before it acknowledges it): noted for
    ``message_start_grace``, so that a look for the message between its early acknowledgement
    and its run taking the key does not take it for gone (and queue the call again)."""
    task = getattr(request, "task", None)
    config = _config_of(task) if task is not None else None
    task_id = getattr(request, "id", None)
    if config is None or not config.dedupe_queued or not task_id:
        return
    try:
        key = lock_key(task, *(request.args or ()), **(request.kwargs or {}))
        grace = float(getattr(task, "message_start_grace", 60.0))
        markers.mark(locks[config.using], received_name(key, str(task_id)), "1", to_ms(grace))
    except (TypeError, ValueError, LockError) as exc:  # then the two looks decide, as before
        logger.info("redlock: could not note task %s as taken by a worker: %s", task_id, exc)


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    """A worker starts: queue the follow-up of every coalesced note left behind (its run's
    whole worker died: no end, no main process queued it). A follow-up that finds the key
    held waits as any does."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        tasks = dict(app.tasks)
        aliases = set()
        for task in tasks.values():
            config = _config_of(task)
            if config is not None and config.on_duplicate == "coalesce":
                aliases.add(config.using)
        for alias in sorted(aliases):
            backend = locks[alias]
            for name in markers.names(backend, "*:coalesce"):
                found = markers.read(backend, name)
                try:
                    note = json.loads(found[0]) if found is not None else {}
                    task = tasks.get(note.get("task") or "")
                except (ValueError, AttributeError, TypeError):  # not a note of ours
                    continue
                config = _config_of(task) if task is not None else None
                if config is not None and config.using == alias:
                    _queue_follow_up(config, task, name[: -len(":coalesce")])
    except Exception as exc:  # the next run of each key queues its note still
        logger.warning("redlock: could not look for coalesced calls left behind: %s", exc)
    every = min((c.dedupe_ttl for c in _coalesce_configs(app)), default=None)
    if every is not None:
        keeper = threading.Thread(
            target=_keep_left_notes, args=(app, max(every / 3, 0.05)),
            name="redlock-coalesce-left-notes", daemon=True,
        )  # fmt: skip
        start_thread(keeper)


def _coalesce_configs(app: Any) -> list[SingleInstance]:
    configs = [_config_of(task) for task in list(app.tasks.values())]
    return [c for c in configs if c is not None and c.on_duplicate == "coalesce"]


#: How often (seconds, at most) the worker's main process looks at the coalesced notes left
#: (see :func:`_keep_left_notes`): a note owed a follow-up that none is queued for (its publish
#: failed, or an exception cut its duplicate short right after its note) is queued from there.
LEFT_NOTE_LOOK = 30.0


def _keep_left_notes(app: Any, every: float) -> None:
    """The worker's main process, for as long as it runs: look every ``every`` seconds (the
    shortest ``dedupe_ttl``/3, at most :data:`LEFT_NOTE_LOOK`) at each coalesced note left.

    * Renew it once a third of its TTL is past. A note stands for a follow-up owed until one
      claimed it and settled (it deletes it then): whichever process queued that follow-up
      may be gone (a recycled child) or have stopped (a claimed note), while the follow-up
      waits in a queue, however long.
    * Renew the revoke of the follow-up that claimed it, if revoked: a revoke is a cancel,
      and must last as long as the note it cancels (else a later follow-up runs the call).
      So for a follow-up revoked while queued, with its mark, while its message waits (see
      :func:`_keep_queued_revoke`).
    * Queue its follow-up when none is coming: the key free and no follow-up queued, on two
      looks a moment apart (a follow-up clears its mark just before it takes the key, a run
      releases just before it queues). Its publish failed at the run's end (a broker away),
      or the duplicate that noted it was cut short right after its note: the call is owed a
      run all the same. A publish that fails again is tried at the next look."""
    pace = min(every, LEFT_NOTE_LOOK)
    while True:
        time.sleep(pace)
        try:
            unfollowed = _look_at_left_notes(app)
            if unfollowed:
                time.sleep(min(pace, 1.0))
            for config, task, key, text in unfollowed:
                if _unfollowed(config, key, text):
                    _queue_follow_up(config, task, key)
        except Exception as exc:  # tried again at the next round
            logger.warning("redlock: could not look after the coalesced calls left: %s", exc)


def _look_at_left_notes(app: Any) -> list[tuple[SingleInstance, Any, str, str]]:
    """Renew the notes left (and their takers' revokes); the notes with no follow-up coming
    now, as (settings, task, key, note)."""
    unfollowed = []
    for alias in sorted({c.using for c in _coalesce_configs(app)}):
        backend = locks[alias]
        for name in markers.names(backend, "*:coalesce"):
            found = markers.read(backend, name)  # name: the key's note
            try:
                note = json.loads(found[0]) if found is not None else {}
                task = app.tasks.get(note.get("task") or "")
                before = json.loads(note["before"]) if note.get("before") else {}
            except (ValueError, AttributeError, TypeError):  # not a note of ours
                continue
            config = _config_of(task) if task is not None else None
            if found is None or config is None or config.using != alias:
                continue
            ttl_ms = to_ms(config.dedupe_ttl)
            if found[1] < ttl_ms * 2 // 3:  # due (each dedupe_ttl/3), as a keeper's
                # Compare-and-set: a note written meanwhile has its full TTL.
                markers.swap(backend, name, found[0], found[0], ttl_ms)
            for taken in {note.get("taken"), before.get("taken")} - {None}:
                revoke = markers.read(backend, revoked_name(str(taken)))
                if revoke is not None and revoke[1] < ttl_ms * 2 // 3:
                    markers.swap(backend, revoked_name(str(taken)), revoke[0], revoke[0], ttl_ms)
            key = name[: -len(":coalesce")]
            _keep_queued_revoke(config, task, key, ttl_ms)
            if _unfollowed(config, key, found[0]):
                unfollowed.append((config, task, key, found[0]))
    return unfollowed


def _keep_queued_revoke(config: SingleInstance, task: Any, key: str, ttl_ms: int) -> None:
    """The follow-up queued for ``key``'s note, revoked while it waits in its queue: its
    revoke and the mark naming it renewed while its message is still there. A worker that
    never learnt of the revoke (a fresh one, a restart) and takes it later still finds it,
    and drops the call; no second follow-up is queued meanwhile (it would run the cancelled
    call). A message not found (purged, a broker that cannot be asked) is left to the
    mark's TTL."""
    backend, name = locks[config.using], _next_name(config, key)
    mark = markers.read(backend, name)
    revoke = markers.read(backend, revoked_name(mark[0])) if mark is not None else None
    if mark is None or revoke is None:
        return
    due = ttl_ms * 2 // 3
    if min(mark[1], revoke[1]) >= due or not _message_held(config, task, key, mark[0]):
        return
    if revoke[1] < due:
        markers.swap(backend, revoked_name(mark[0]), revoke[0], revoke[0], ttl_ms)
    if mark[1] < due and markers.swap(backend, name, mark[0], mark[0], ttl_ms):
        sent = markers.read(backend, sent_name(name, mark[0]))
        if sent is not None:
            markers.swap(backend, sent_name(name, mark[0]), sent[0], sent[0], ttl_ms)


def _unfollowed(config: SingleInstance, key: str, text: str) -> bool:
    """Whether ``key``'s note is still ``text`` with no follow-up coming: the key free (a
    run of it queues one at its end; a follow-up that holds it runs it) and none queued."""
    backend = locks[config.using]
    found = markers.read(backend, _pending_name(key))
    if found is None or found[0] != text or backend.inspect(key) is not None:
        return False
    return markers.read(backend, _next_name(config, key)) is None


def sent_name(key: str, task_id: str) -> str:
    """The name of the note that ``task_id``'s message under ``key`` was published (its value:
    the queue), kept beside the queue marker with the same TTL."""
    return f"{key}:sent:{task_id}"


def stamps_name(key: str, task_id: str) -> str:
    """The name of the note of the stamps ``task_id``'s message under ``key`` was published
    with (JSON: stamp name -> values), kept beside the queue marker with the same TTL."""
    return f"{key}:stamps:{task_id}"


#: (key, task id) -> when its message was last found in the broker (monotonic), per process.
_found_in_broker: dict[tuple[str, str], float] = {}


def _remember_found(key: str, task_id: str) -> None:
    if len(_found_in_broker) >= 10_000:
        _found_in_broker.clear()
    _found_in_broker[(key, task_id)] = time.monotonic()


def lock_key(task: Any, *args: Any, **kwargs: Any) -> str:
    """The lock name that ``task.delay(*args, **kwargs)`` runs under (any task decorated with
    ``@single_instance``; ``args`` as given to ``delay``, without a bound task's ``self``)."""
    hook = getattr(task, "single_instance_key", None)
    if hook is not None:
        return hook(args, kwargs)
    config = _decorated(task)
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
        holder = task_id_of(info.holder)
        detail = f"by {task.name}.release_lock(); held by task {holder}"
        logger.warning("redlock: force-released %r on %r %s", key, config.using, detail)
        recorder.record("force_release", key, config.using, detail)
    return outcome


def _task_lock_key(self: Task, *args: Any, **kwargs: Any) -> str:
    """The lock name a call with these arguments uses (see :func:`lock_key`)."""
    return lock_key(self, *args, **kwargs)


def _task_release_lock(self: Task, *args: Any, **kwargs: Any) -> Released:
    """Force-release the lock of a call with these arguments (see :func:`release_lock`)."""
    return release_lock(self, *args, **kwargs)


# task.lock_key() and task.release_lock() on every task @single_instance decorates, whatever
# its base: Celery builds the task's class itself (type(name, (base,), ...), no hook per
# task), and the decorator only sees the function. So they are methods of Celery's Task; on a
# task without @single_instance they raise TypeError saying so. A base's own methods of those
# names come first (and SingleInstanceTask defines them as well).
for _name, _helper in (("lock_key", _task_lock_key), ("release_lock", _task_release_lock)):
    if not hasattr(Task, _name):
        setattr(Task, _name, _helper)


__all__ = [
    "AlreadyQueued",
    "SingleInstanceTask",
    "UnnotableArguments",
    "duplicate_not_queued",
    "duplicate_skipped",
    "hold_of",
    "lock_key",
    "release_lock",
    "release_task_hold",
    "run_task",
    "single_instance",
    "skipped",
]
