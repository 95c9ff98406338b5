"""Tasks the worker runs; they note what happened in Redis for the tests to read."""

from __future__ import annotations

import json
import time
from typing import Any

from celery import shared_task
from celery.exceptions import Ignore, Reject
from celery.signals import before_task_publish, task_prerun

from django_redlock import locks, single_instance
from django_redlock.contrib.celery import SingleInstanceTask

# Count bodies running at once, and the peak, atomically.
ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def redis() -> Any:
    return locks["default"].client  # type: ignore[attr-defined]


def body(group: str, tag: str, seconds: float, release: str | None = None) -> str:
    redis().eval(ENTER, 2, f"{group}:inside", f"{group}:peak")
    try:
        redis().rpush(f"{group}:ran", tag)
        wait_released(release, seconds)
    finally:
        redis().decr(f"{group}:inside")
    return "ran"


def wait_released(release: str | None, seconds: float) -> None:
    """Sleep ``seconds``, or less once a test sets the key ``release``: a run the test needs
    alive until an event (a kill) ends as soon as it is not needed any more."""
    if release is None:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while not redis().exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)


@shared_task(acks_late=False)  # on an acks_late worker too: no copy of it runs again later
def occupy(name: str, seconds: float) -> str:
    """Keeps one of the worker's slots busy (no lock): ``seconds``, or until the test sets
    ``occupy:<name>:release``."""
    redis().rpush(f"occupy:{name}:started", 1)
    wait_released(f"occupy:{name}:release", seconds)
    redis().rpush(f"occupy:{name}:ended", 1)
    return "ran"


@shared_task(bind=True)
@single_instance(key="overlap:skip", ttl=5, on_duplicate="skip")
def overlap_skip(self: Any, tag: str, seconds: float = 0.5) -> str:
    return body("skip", tag, seconds)


@shared_task
@single_instance(key="overlap:raise", ttl=5, on_duplicate="raise")
def overlap_raise(tag: str, seconds: float = 0.5) -> str:
    return body("raise", tag, seconds)


@shared_task(bind=True, max_retries=None)
@single_instance(key="overlap:retry", ttl=5, on_duplicate="retry", countdown=0.1)
def overlap_retry(self: Any, tag: str, seconds: float = 0.2) -> str:
    return body("retry", tag, seconds)


@shared_task
@single_instance(ttl=5)
def keyed(a: int, b: int = 2, seconds: float = 0.5) -> str:
    return body("keyed", f"{a}-{b}", seconds)


@shared_task(bind=True)
@single_instance(key="long:{name}", ttl=1)
def long_task(self: Any, name: str, seconds: float) -> str:
    return body(f"long:{name}", self.request.id, seconds)


@shared_task(bind=True, max_retries=1)
@single_instance(key="outcome:{mode}", ttl=30)
def outcome(self: Any, mode: str) -> str:
    redis().rpush("outcome", f"{mode}:{self.request.retries}")
    if mode == "fail":
        raise ValueError("the task failed")
    if mode == "retry" and self.request.retries == 0:
        raise self.retry(countdown=0.1)
    if mode == "ignore":
        raise Ignore()
    if mode == "reject":
        raise Reject("rejected", requeue=False)
    if mode in ("soft", "revoke", "hard"):
        time.sleep(30)
    return "ok"


@shared_task(bind=True, max_retries=None)
@single_instance(key="crash:{name}", ttl=2, on_duplicate="retry", countdown=0.1)
def crash(self: Any, name: str, seconds: float) -> str:
    redis().rpush(f"crash:{name}", self.request.id)
    time.sleep(seconds)
    return "ran"


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(key="dedupe:{name}", ttl=5, dedupe_queued=True)
def deduped(self: Any, name: str, seconds: float = 1.0) -> str:
    return body(f"dedupe:{name}", self.request.id, seconds)


@shared_task(bind=True)
@single_instance(ttl=5)
def bound_other_name(task: Any, customer_id: int, seconds: float = 0.5) -> str:
    # bind=True with the task parameter not named `self`: Celery passes the task all the same
    return body("bound", task.request.id, seconds)


@shared_task
@single_instance(ttl=5)
def unbound_self(self: int, other: int = 2) -> str:
    # bind=False: `self` is an ordinary argument here, and part of the key
    return "ran"


@shared_task(bind=True, base=SingleInstanceTask, max_retries=1)
@single_instance(key="dedupe-retry:{name}", ttl=5, dedupe_queued=True)
def deduped_retry(self: Any, name: str) -> str:
    redis().rpush(f"dedupe-retry:{name}", self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)  # its own id again: must be enqueued, not deduplicated
    return "ran"


@shared_task(bind=True, max_retries=1)
@single_instance(key="retry-fast:{name}", ttl=30)
def retry_fast(self: Any, name: str) -> str:
    redis().rpush(f"retry-fast:{name}", self.request.retries)
    if self.request.retries == 0:
        # The retry (same task id) is queued while this attempt still holds the lock, as with
        # any self.retry(): here for a whole second.
        self.retry(countdown=0, throw=False)
        time.sleep(1.0)
    return "ran"


@shared_task(bind=True)
@single_instance(key="redeliver:{name}", ttl=30)
def redelivered(self: Any, name: str, seconds: float = 2.0) -> str:
    return body(f"redeliver:{name}", self.request.id, seconds, release=f"redeliver:{name}:release")


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(ttl=5)
def key_of(self: Any, customer: dict, when: str, seconds: float = 0.2) -> list[Any]:
    key = self.lock_key(customer, when, seconds)
    return [key, locks["default"].is_locked(key)]


@shared_task(bind=True)
@single_instance(ttl=5)
def key_of_plain(self: Any, customer: dict, when: str, seconds: float = 0.2) -> list[Any]:
    # Celery's own Task as the base: task.lock_key() all the same
    key = self.lock_key(customer, when, seconds)
    return [key, locks["default"].is_locked(key)]


@shared_task(bind=True)
@single_instance(key="chain:{name}", ttl=30)
def chain_head(self: Any, name: str) -> str:
    return f"head:{name}"


@shared_task(bind=True)
@single_instance(key="chain:{name}", ttl=30, on_duplicate="raise")
def chain_head_raise(self: Any, name: str) -> str:
    return f"head:{name}"


@shared_task
def chain_tail(previous: Any, name: str) -> str:
    redis().rpush(f"chain:{name}", json.dumps(previous))
    return "tail"


@shared_task(bind=True, max_retries=None)
@single_instance(key="limited", ttl=5, on_duplicate="retry", countdown=0.05, limit=2)
def limited(self: Any, tag: str, seconds: float = 0.4) -> str:
    return body("limited", tag, seconds)


@shared_task(bind=True)
@single_instance(key="redeliver-limited:{name}", ttl=30, limit=2)
def redelivered_limited(self: Any, name: str, seconds: float = 2.0) -> str:
    return body(f"redeliver:{name}", self.request.id, seconds, release=f"redeliver:{name}:release")


@shared_task(bind=True, max_retries=1)
@single_instance(key="retry-fast-limited:{name}", ttl=30, limit=2)
def retry_fast_limited(self: Any, name: str) -> str:
    group = f"retry-fast-limited:{name}"
    redis().eval(ENTER, 2, f"{group}:inside", f"{group}:peak")
    try:
        redis().rpush(group, self.request.retries)
        if self.request.retries == 0:
            # The retry is queued while this attempt still runs (a permit is free for it).
            self.retry(countdown=0, throw=False)
            time.sleep(1.0)
    finally:
        redis().decr(f"{group}:inside")
    return "ran"


# -- a prefork child SIGKILLed mid-run, its message requeued (acks_late, reject_on_worker_lost)


def lost_body(self: Any, name: str) -> str:
    import os

    entries = redis().rpush(f"lost:{name}", f"{self.request.id}:{os.getpid()}")
    if entries == 1:  # the first run: waits to be killed
        time.sleep(60)
    return "ran"


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
@single_instance(key="lost:{name}", ttl=60)
def lost_child(self: Any, name: str) -> str:
    return lost_body(self, name)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
@single_instance(key="lost-limited:{name}", ttl=60, limit=2)
def lost_child_limited(self: Any, name: str) -> str:
    return lost_body(self, name)


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(key="member:{name}", ttl=30, dedupe_queued=True)
def member(self: Any, name: str, seconds: float = 1.0) -> str:
    return body(f"member:{name}", self.request.id, seconds)


@shared_task
def collect(results: list[Any]) -> list[Any]:
    return results


@shared_task(bind=True)
@single_instance(key="coalesce:{name}", ttl=10, on_duplicate="coalesce")
def coalesced(self: Any, name: str, tag: str, seconds: float = 0.5) -> str:
    return body(f"coalesce:{name}", tag, seconds, release=f"coalesce:{name}:{tag}:release")


@shared_task(bind=True, expires=1.0)  # a follow-up held for a longer countdown expires
@single_instance(key="coalesce-exp:{name}", ttl=10, on_duplicate="coalesce")
def coalesced_expiring(self: Any, name: str, tag: str, seconds: float = 0.5) -> str:
    return body(f"coalesce-exp:{name}", tag, seconds)


@shared_task(bind=True)
@single_instance(key="coalesce-killed:{name}", ttl=30, on_duplicate="coalesce")
def coalesced_killed(self: Any, name: str, tag: str, seconds: float = 0.1) -> str:
    import os

    redis().rpush(f"coalesce-killed:{name}:pids", os.getpid())
    return body(f"coalesce-killed:{name}", tag, seconds)


def _waiting_body(group: str, name: str, tag: str, seconds: float) -> str:
    import os

    redis().rpush(f"{group}:{name}:pids", os.getpid())
    # Each run of a call ends early once the test sets "<group>:<name>:<tag>:release".
    body(f"{group}:{name}", tag, seconds, release=f"{group}:{name}:{tag}:release")
    redis().rpush(f"{group}:{name}:done", tag)
    return "ran"


# dedupe_ttl 1 s: their follow-ups wait in a busy queue longer than that.
@shared_task(bind=True)
@single_instance(key="coalesce-wait:{name}", ttl=10, on_duplicate="coalesce", dedupe_ttl=1.0)
def coalesced_waiting(self: Any, name: str, tag: str, seconds: float = 0.1) -> str:
    return _waiting_body("coalesce-wait", name, tag, seconds)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
@single_instance(key="coalesce-wait-late:{name}", ttl=10, on_duplicate="coalesce", dedupe_ttl=1.0)
def coalesced_waiting_late(self: Any, name: str, tag: str, seconds: float = 0.1) -> str:
    return _waiting_body("coalesce-wait-late", name, tag, seconds)


# TTL 3 s: a run whose whole worker was killed leaves a hold that a poll outwaits soon.
@shared_task(bind=True)
@single_instance(key="coalesce-short:{name}", ttl=3, on_duplicate="coalesce")
def coalesced_short_ttl(self: Any, name: str, tag: str, seconds: float = 0.5) -> str:
    return body(f"coalesce-short:{name}", tag, seconds)


@shared_task(bind=True, time_limit=4)
@single_instance(key="coalesce-pub:{name}", ttl=30, on_duplicate="coalesce")
def coalesced_slow_publish(self: Any, name: str, tag: str, seconds: float = 0.1) -> str:
    # Its follow-up's publish takes 5 s (below): a run's end is stopped there (its hard
    # time limit, 4 s, or a SIGKILL), between the follow-up mark and the message.
    import os

    redis().rpush(f"coalesce-pub:{name}:pids", os.getpid())
    return body(f"coalesce-pub:{name}", tag, seconds, release=f"coalesce-pub:{name}:release")


@before_task_publish.connect(weak=False)
def _slow_follow_up_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
    """A slow broker for ``coalesced_slow_publish``'s first follow-up."""
    headers = headers or {}
    if sender == coalesced_slow_publish.name and headers.get("redlock_follow_up"):
        name = str(headers.get("argsrepr", "")).split("'")[1]
        if redis().rpush(f"coalesce-pub:{name}:publishing", headers.get("id", "")) == 1:
            time.sleep(5.0)


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(key="coalesce-dd:{name}", ttl=10, on_duplicate="coalesce", dedupe_queued=True)
def coalesced_deduped(self: Any, name: str, tag: str, seconds: float = 0.5) -> str:
    return body(f"coalesce-dd:{name}", tag, seconds)


class FlakyPublish(SingleInstanceTask):
    """A base whose publish from inside a run fails once when the test sets a flag (the
    broker refusing the coalesced follow-up): what a run does then."""

    abstract = True

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        from kombu.exceptions import OperationalError

        if self.request.id and redis().delete("flaky-publish"):
            raise OperationalError("the broker refused the publish (test)")
        return super().apply_async(args, kwargs, **options)


@shared_task(bind=True, base=FlakyPublish)
@single_instance(key="coalesce-flaky:{name}", ttl=10, on_duplicate="coalesce")
def coalesced_flaky(self: Any, name: str, tag: str, seconds: float = 0.5) -> str:
    return body(f"coalesce-flaky:{name}", tag, seconds)


def lock_errors() -> dict[str, Exception]:
    """One of each of the app's exceptions with fields of their own, as a task may raise it."""
    from django_redlock.exceptions import BackendUnavailable, MissingPermission, StaleFence

    return {
        "stale": StaleFence("lock 'x' is stale: fence 7 is below 9", 7, 9),
        "unavailable": BackendUnavailable("backend 'default' timed out", timed_out=True),
        "refused": MissingPermission("user 'u' may not run TIME", "+time", "+time ~redlock:*"),
    }


@shared_task
def raise_lock_error(kind: str) -> None:
    """Raise it out of a task: the caller's ``.get()`` rebuilds it from the result backend
    (Celery's JSON serializer keeps an exception's type, module and ``args`` alone)."""
    raise lock_errors()[kind]


# -- an exception (a soft time limit's) right after the lock is taken, before the body's guard


def _interrupt_once(flag: str) -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    if redis().delete(flag):
        raise SoftTimeLimitExceeded("injected between the acquire and the run (test)")


def _inject_interrupts() -> None:
    """Wrap two calls made once the lock is taken and before the body runs (the queue
    marker's clear, the run's start) so that a test's flag makes them raise, as a soft time
    limit firing on that line would."""
    from django_redlock.contrib import celery as contrib_celery
    from django_redlock.contrib import single as contrib_single

    clear, run_held = contrib_single.clear_queued_marker, contrib_celery.run_held

    def clear_then(config: Any, key: str, task_id: str) -> None:
        if key.startswith("soft-gap:"):
            _interrupt_once(f"{key}:interrupt-at-marker")
        clear(config, key, task_id)

    def run_then(held: Any, *args: Any, **kwargs: Any) -> Any:
        if held.name.startswith("soft-gap:"):
            _interrupt_once(f"{held.name}:interrupt-at-run")
        return run_held(held, *args, **kwargs)

    contrib_single.clear_queued_marker = clear_then  # type: ignore[assignment]
    contrib_celery.run_held = run_then  # type: ignore[assignment]


_inject_interrupts()


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(key="soft-gap:{name}", ttl=30, dedupe_queued=True)
def soft_gap(self: Any, name: str) -> str:
    redis().rpush(f"soft-gap:{name}:ran", self.request.id)
    return "ran"


# -- coalesce: duplicates whose notes land after the run ended ---------------------------------


def _pause_late_notes() -> None:
    """Hold a duplicate's note of a ``coalesce-late:`` key until the moment a test set (so
    the run ends first, and the duplicates note at once), and list the notes in the order
    written."""
    from django_redlock.backends import markers

    mark = markers.mark

    def paused(backend: Any, name: str, task_id: str, ttl_ms: int) -> str | None:
        if not (name.startswith("coalesce-late:") and name.endswith(":coalesce")):
            return mark(backend, name, task_id, ttl_ms)
        tag = json.loads(task_id)["args"][1] if task_id.startswith("{") else None
        until = redis().get(f"coalesce-late-pause-until:{tag}") if tag else None
        if until:  # a note (not another marker's value) the test holds back
            time.sleep(max(0.0, float(until) - time.time()))
        found = mark(backend, name, task_id, ttl_ms)
        if found is None and task_id.startswith("{"):
            redis().rpush(f"{name}:noted", json.loads(task_id)["args"][1])
        return found

    swap = markers.swap

    def noting(backend: Any, name: str, expected: str, value: str, ttl_ms: int) -> bool:
        swapped = swap(backend, name, expected, value, ttl_ms)
        # A note replacing another (not a follow-up claiming one: that one is "taken").
        if swapped and name.startswith("coalesce-late:") and value.startswith("{"):
            note = json.loads(value)
            if "taken" not in note:
                redis().rpush(f"{name}:noted", note["args"][1])
        return swapped

    markers.mark = paused
    markers.swap = noting


_pause_late_notes()


@task_prerun.connect
def _start_late(sender: Any = None, **_: Any) -> None:
    """Hold back the start of a ``coalesced_late`` run until the moment a test set."""
    if getattr(sender, "name", "").endswith(".coalesced_late"):
        until = redis().get("coalesce-late-start-after")
        if until:
            time.sleep(max(0.0, float(until) - time.time()))


@shared_task(bind=True)
@single_instance(key="coalesce-late:{name}", ttl=10, on_duplicate="coalesce", countdown=0.5)
def coalesced_late(self: Any, name: str, tag: str, seconds: float = 0.5) -> str:
    return body(f"coalesce-late:{name}", tag, seconds)


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(key="dedupe-slow:{name}", ttl=10, dedupe_queued=True)
def deduped_slow_start(self: Any, name: str) -> str:
    return body(f"dedupe-slow:{name}", self.request.id, 0.1)


@task_prerun.connect
def _start_slowly(sender: Any = None, task_id: str = "", **_: Any) -> None:
    """A run that starts 2.5 s after its worker took (and acknowledged) its message."""
    if getattr(sender, "name", "").endswith(".deduped_slow_start"):
        redis().set(f"dedupe-slow-started:{task_id}", 1)
        time.sleep(2.5)


# -- a run stopped from the worker's main process while its body may still run ---------------


@shared_task(bind=True)
@single_instance(key="stop-cleans:{name}", ttl=5)
def cleans_up_when_stopped(self: Any, name: str, cleanup: float = 3.0) -> str:
    # revoke(terminate=True, signal="SIGUSR1") raises SoftTimeLimitExceeded here: the body
    # cleans up (still writing) before it ends.
    from celery.exceptions import SoftTimeLimitExceeded

    redis().eval(ENTER, 2, f"stop-cleans:{name}:inside", f"stop-cleans:{name}:peak")
    try:
        redis().rpush(f"stop-cleans:{name}:ran", self.request.id)
        try:
            time.sleep(30)
        except SoftTimeLimitExceeded:
            redis().rpush(f"stop-cleans:{name}:soft", self.request.id)
            time.sleep(cleanup)
        return "ran"
    finally:
        redis().decr(f"stop-cleans:{name}:inside")


@shared_task(bind=True, time_limit=1.5)
@single_instance(key="hard-limit:{name}", ttl=10)
def hard_limited(self: Any, name: str) -> None:
    # Writes until the hard time limit kills it.
    import os

    redis().rpush(f"hard-limit:{name}:pids", os.getpid())
    while True:
        redis().set(f"hard-limit:{name}:last", repr(time.time()))
        time.sleep(0.001)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
@single_instance(key="coalesce-lost:{name}", ttl=30, on_duplicate="coalesce")
def coalesced_lost(self: Any, name: str, tag: str, seconds: float = 0.1) -> str:
    # A call tagged "slow..." waits to be killed the first time it runs.
    import os

    redis().rpush(f"coalesce-lost:{name}:pids", f"{tag}:{os.getpid()}")
    if tag.startswith("slow") and redis().incr(f"coalesce-lost:{name}:{tag}") == 1:
        seconds = 60.0
    return body(f"coalesce-lost:{name}", tag, seconds)


# acks_late (the worker's REDLOCK_TEST_REDELIVER): a copy of a finished run's message meets
# the key held by someone else.


@shared_task(bind=True)
@single_instance(key="late-copy-coalesce:{name}", ttl=10, on_duplicate="coalesce", countdown=0.5)
def late_copy_coalesce(self: Any, name: str, seconds: float = 4.0) -> str:
    return body(f"late-copy-coalesce:{name}", self.request.id, seconds)


# -- coalesce: arguments in Celery's JSON (datetime, UUID, Decimal...) -------------------------


def typed_body(group: str, value: Any, seconds: float) -> str:
    # repr: what the run was given, types included (a datetime, not its ISO string).
    return body(group, repr(value), seconds, release=f"{group}:release")


@shared_task(bind=True)
@single_instance(key="coalesce-typed:{name}", ttl=10, on_duplicate="coalesce")
def coalesced_typed(self: Any, name: str, value: Any, seconds: float = 0.1) -> str:
    return typed_body(f"coalesce-typed:{name}", value, seconds)


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(
    key="coalesce-typed-dd:{name}", ttl=10, on_duplicate="coalesce", dedupe_queued=True
)
def coalesced_typed_deduped(self: Any, name: str, value: Any, seconds: float = 0.1) -> str:
    return typed_body(f"coalesce-typed-dd:{name}", value, seconds)


# -- self.retry() whose earlier attempt releases later than the lock's TTL ---------------------


def _retry_slowly(task: Any, group: str, cleanup: float) -> str:
    redis().rpush(f"{group}:ran", task.request.retries)
    if task.request.retries == 0:
        try:
            raise task.retry(countdown=0)  # published here, then it propagates
        finally:
            time.sleep(cleanup)  # a slow clean-up on the way out, longer than the TTL
    return "done"


@shared_task(bind=True, max_retries=2)
@single_instance(key="retry-slow:{name}", ttl=1, on_duplicate="skip")
def retry_slow_release(self: Any, name: str, cleanup: float = 2.5) -> str:
    return _retry_slowly(self, f"retry-slow:{name}", cleanup)


@shared_task(bind=True, max_retries=2)
@single_instance(key="retry-slow-limited:{name}", ttl=1, on_duplicate="skip", limit=2)
def retry_slow_release_limited(self: Any, name: str, cleanup: float = 2.5) -> str:
    return _retry_slowly(self, f"retry-slow-limited:{name}", cleanup)


# -- coalesce: a revoked follow-up stopped by its hard time limit ------------------------------


@shared_task(bind=True, time_limit=3)
@single_instance(key="coalesce-hard:{name}", ttl=10, on_duplicate="coalesce", dedupe_ttl=1.0)
def coalesced_hard_limited(self: Any, name: str, tag: str, seconds: float = 0.5) -> str:
    group = f"coalesce-hard:{name}"
    return body(group, tag, seconds, release=f"{group}:release")
