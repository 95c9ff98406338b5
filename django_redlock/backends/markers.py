"""Queue markers: the note, beside a lock, that a task for its name is queued, so a second
``delay()`` (or ``enqueue()``) is not enqueued. ``@single_instance``'s dedupe (Celery and
Django Tasks) and the celery-once and celery-singleton drop-ins keep them; no lock operation
reads them. They are here, not in the backend contract (``base``), and their callers reach
them through the functions below, never through a backend's methods directly.

A backend keeps markers by having the five operations of :class:`QueueMarkers` (the Redis
backends with ``lua/mark_queued.lua``, ``clear_marker.lua``, ``swap_marker.lua`` and
``read_marker.lua`` on :func:`queued_key`; Redlock by majority over its nodes'; LocMem in
its process). One that
has not refuses with NotImplementedError, before any I/O. The rules every one follows:

* :func:`mark`: note ``task_id`` for ``ttl_ms`` unless a task is noted already; the id
  noted already, or None when ``task_id`` is noted now.
* :func:`clear`: remove the marker only while it still names ``task_id`` (a newer one stays);
  whether it did.
* :func:`swap`: replace the marker by another value only while it holds the expected one,
  in one step; whether it did.
* :func:`read`: the task id noted and the milliseconds it has left (None: no marker); a read
  only, so clearing whoever it names is :func:`read` then :func:`clear` with that id.
* :func:`names`: the lock names (a glob) that have a marker, by ``SCAN`` (never ``KEYS``).

Each is one operation, run as the backend runs every other (``execute``): a backend that
cannot answer raises as it does for a lock (BackendUnavailable, QuorumNotReached).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, cast

from .base import Op

T = TypeVar("T")


class QueueMarkers(Protocol):
    """What a backend that keeps queue markers has (see the rules above)."""

    def op_mark_queued(self, name: str, task_id: str, ttl_ms: int) -> Op[str | None]: ...

    def op_clear_queued(self, name: str, task_id: str) -> Op[bool]: ...

    def op_swap_queued(self, name: str, expected: str, value: str, ttl_ms: int) -> Op[bool]: ...

    def op_read_queued(self, name: str) -> Op[tuple[str, int] | None]: ...

    def queued_names(self, match: str = "*") -> list[str]: ...

    def execute(self, op: Op[T]) -> T: ...


_NEEDED = (
    "op_mark_queued",
    "op_clear_queued",
    "op_swap_queued",
    "op_read_queued",
    "queued_names",
)


def of(backend: Any) -> QueueMarkers:
    """``backend`` as a keeper of queue markers; NotImplementedError (before any I/O) when it
    keeps none."""
    missing = [name for name in _NEEDED if not hasattr(backend, name)]
    if missing:
        describe = getattr(backend, "describe", lambda: repr(backend))
        raise NotImplementedError(f"{describe()} keeps no queue markers (no {missing[0]})")
    return cast(QueueMarkers, backend)


def queued_key(backend: Any, name: str) -> str:
    """The Redis key of ``name``'s marker: beside the lock, in its hash slot."""
    return f"{backend.key(name)}:queued"


def mark(backend: Any, name: str, task_id: str, ttl_ms: int) -> str | None:
    """Note ``task_id`` as ``name``'s queued task for ``ttl_ms``, unless a task is noted
    already: then that task's id (None: ``task_id`` is noted now)."""
    markers = of(backend)
    return markers.execute(markers.op_mark_queued(name, task_id, ttl_ms))


def clear(backend: Any, name: str, task_id: str) -> bool:
    """Remove ``name``'s marker if it still names ``task_id``; whether it did."""
    markers = of(backend)
    return markers.execute(markers.op_clear_queued(name, task_id))


def swap(backend: Any, name: str, expected: str, value: str, ttl_ms: int) -> bool:
    """Replace ``name``'s marker by ``value`` (for ``ttl_ms``) only while it holds
    ``expected``, in one step (never absent in between); whether it did."""
    markers = of(backend)
    return markers.execute(markers.op_swap_queued(name, expected, value, ttl_ms))


def read(backend: Any, name: str) -> tuple[str, int] | None:
    """The task id ``name``'s marker names and the milliseconds it has left (None: none)."""
    markers = of(backend)
    return markers.execute(markers.op_read_queued(name))


def names(backend: Any, match: str = "*") -> list[str]:
    """The lock names matching the glob ``match`` that have a marker."""
    return of(backend).queued_names(match)
