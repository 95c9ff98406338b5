"""Lock incidents: recorded from signals, written by a background thread (never inside an
acquire or release), kept as ``DJANGO_REDLOCK_INCIDENTS`` says.

    DJANGO_REDLOCK_INCIDENTS = {
        "KINDS": ["force_release", "lost", "duplicate_skipped", "acquire_timeout",
                  "quorum_failure"],       # which kinds to keep (default: all)
        "KEEP_DAYS": 30,                   # `redlock prune-incidents` deletes older ones
        "MAX_ROWS": 100_000,               # ... and the oldest beyond this many
    }
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import close_old_connections

from .forks import after_fork_in_child

logger = logging.getLogger("django_redlock")

ALL_KINDS = ("force_release", "lost", "duplicate_skipped", "acquire_timeout", "quorum_failure")
DEFAULTS: dict[str, Any] = {"KINDS": ALL_KINDS, "KEEP_DAYS": 30, "MAX_ROWS": 100_000}


def config() -> dict[str, Any]:
    return {**DEFAULTS, **getattr(settings, "DJANGO_REDLOCK_INCIDENTS", {})}


class Recorder:
    """A queue and one daemon thread that writes what is queued to the database.

    The queue is bounded: when the database is slow or down, and a loop of timed-out waits
    records faster than it writes, incidents beyond ``limit`` are dropped (and counted in a
    warning), never held in memory without end, and ``record`` never blocks a lock's caller.
    """

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self.dropped = 0
        self._forget()

    def _forget(self) -> None:
        """Fresh state: at start, and in a forked child, where the parent's writer thread is
        gone and the queue's internal lock may have been held at the fork."""
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(self.limit)
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    def record(
        self, kind: str, name: str, backend: str, detail: str = "", user: Any = None
    ) -> None:
        if kind not in config()["KINDS"]:
            return
        incident = {"kind": kind, "name": name[:1024], "backend": backend[:100],
                    "detail": detail, "user": user}  # fmt: skip
        try:
            self._queue.put_nowait(incident)
        except queue.Full:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                logger.warning("redlock: %d lock incidents dropped (the writer is behind): "
                               "the latest %s of %r", self.dropped, kind, name)  # fmt: skip
            return
        with self._mutex:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._write_forever, name="redlock-incidents", daemon=True
                )
                self._thread.start()

    def _write_forever(self) -> None:
        while True:  # nothing may end this thread: flush() waits for it
            batch = [self._queue.get()]
            while not self._queue.empty() and len(batch) < 500:
                batch.append(self._queue.get_nowait())
            try:
                self._write(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        try:
            from .models import LockIncident

            LockIncident.objects.bulk_create([LockIncident(**fields) for fields in batch])
        except Exception as exc:  # no database here, or it is down: the log keeps it
            logger.warning("redlock: could not record %d lock incidents: %s", len(batch), exc)
        try:
            close_old_connections()
        except Exception as exc:
            logger.debug("redlock: closing the incident writer's connection: %s", exc)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout`` s) until everything recorded so far is written."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._queue.all_tasks_done.wait(remaining)


recorder = Recorder()
after_fork_in_child(recorder._forget)  # the child's incidents are its own


def prune() -> int:
    """Delete incidents older than KEEP_DAYS, and the oldest beyond MAX_ROWS."""
    from django.utils import timezone

    from .models import LockIncident

    options = config()
    cutoff = timezone.now() - timedelta(days=float(options["KEEP_DAYS"]))
    deleted, _ = LockIncident.objects.filter(created_at__lt=cutoff).delete()
    keep = int(options["MAX_ROWS"])
    # By age, as the newest are listed: ids follow insertion, not created_at (hosts whose
    # clocks differ write rows out of time order), so the rows beyond the newest MAX_ROWS
    # are picked by the same ordering, never by an id cut-off.
    newest = LockIncident.objects.order_by("-created_at", "-id").values_list("id", flat=True)
    while True:
        beyond = list(newest[keep : keep + 500])
        if not beyond:
            return deleted
        extra, _ = LockIncident.objects.filter(id__in=beyond).delete()
        deleted += extra


# -- signal receivers ----------------------------------------------------------------------


def _on_lost(sender: Any, lock: Any, reason: str = "", **_: Any) -> None:
    recorder.record("lost", lock.name, lock.using, reason)


def _on_timeout(sender: Any, lock: Any, timeout: float = 0, **_: Any) -> None:
    recorder.record("acquire_timeout", lock.name, lock.using, f"gave up after {timeout:g} s")


def _on_quorum(sender: Any, backend: str, name: str, error: Any = None, **_: Any) -> None:
    recorder.record("quorum_failure", name, backend, str(error))


def on_duplicate(sender: Any, key: str, task_id: Any = None, holder_task_id: Any = None,
                 using: str = "", **_: Any) -> None:  # fmt: skip
    """The receiver of ``contrib.single.duplicate_skipped`` (Celery's and Django Tasks'
    duplicates): connected by the app's ``ready()``, which sits above ``contrib``."""
    task = getattr(sender, "name", "")
    recorder.record("duplicate_skipped", key, using,
                    f"task {task} {task_id} skipped; held by task {holder_task_id}")  # fmt: skip


def connect() -> None:
    """Called when the app is ready: the lock's own signals (see :func:`on_duplicate`)."""
    from .signals import acquire_timed_out, lock_lost, quorum_not_reached

    lock_lost.connect(_on_lost, dispatch_uid="redlock-incidents-lost")
    acquire_timed_out.connect(_on_timeout, dispatch_uid="redlock-incidents-timeout")
    quorum_not_reached.connect(_on_quorum, dispatch_uid="redlock-incidents-quorum")
