"""What the Celery migration shims do to a key as a whole: who has it (a queued task's marker
or a running task's hold), and freeing it whoever has it (the originals' ``unlock`` /
``clear_lock`` / ``clear_locks``: an operator's action, logged and recorded as a
``force_release`` incident when a running task's hold goes)."""

from __future__ import annotations

import contextlib
import logging

from ..backends import markers
from ..backends.base import glob_escape
from ..contrib.celery import sent_name
from ..contrib.single import task_id_of
from ..exceptions import LockError
from ..handler import locks

logger = logging.getLogger("django_redlock")


def marker(using: str, key: str) -> tuple[str, float] | None:
    """The task id ``key``'s queue marker names and the seconds it has left, if any."""
    backend = locks[using]
    found = markers.read(backend, key)
    return None if found is None else (found[0], found[1] / 1000)


def existing_task_id(using: str, key: str) -> str | None:
    """The task queued (its marker) or running (its hold) under ``key``, if any."""
    noted = marker(using, key)
    if noted is not None:
        return noted[0]
    info = locks[using].inspect(key)
    holder = task_id_of(info.holder) if info is not None else None
    return str(holder) if holder else None


def seconds_left(using: str, key: str) -> float:
    """How long ``key`` stays taken at most: its marker's TTL, else its hold's (0: free)."""
    noted = marker(using, key)
    if noted is not None:
        return noted[1]
    info = locks[using].inspect(key)
    return float(info.ttl or 0.0) if info is not None else 0.0


def take(using: str, key: str, task_id: str, ttl_ms: int) -> str | None:
    """Take ``key`` for ``ttl_ms`` by hand (the originals' ``raise_or_lock`` / ``aquire_lock``)
    unless a task is noted there: its id (None: taken now), as :func:`markers.mark`.

    The marker is noted as sent, to no queue by name: a ``delay()`` meeting a marker with no
    such note takes it for a publish whose producer died, and queues anew after
    ``publish_wait``; with it, the key is obeyed until its TTL (no queue: its message is never
    looked for in the broker, there is none)."""
    backend = locks[using]
    found = markers.mark(backend, key, task_id, ttl_ms)
    if found is not None and found != task_id:
        return found
    try:
        markers.mark(backend, sent_name(key, task_id), "", ttl_ms)
    except BaseException:
        # Unnoted, the key would not hold: not taken at all, rather (the caller is told).
        with contextlib.suppress(LockError):
            markers.clear(backend, key, task_id)
        raise
    return found


def clear_key(using: str, key: str, by: str) -> bool:
    """Free ``key`` whoever has it: its marker (compare-and-delete with the id read) and a
    running task's hold (force-release of the hold found). Whether anything went."""
    from ..incidents import recorder

    backend = locks[using]
    cleared = False
    noted = marker(using, key)
    if noted is not None:
        cleared = bool(markers.clear(backend, key, noted[0]))
    info = backend.inspect(key)
    if info is not None and backend.force_release(
        key, info.token, None if info.token else info.fence
    ):
        detail = f"by {by}; held by task {info.holder.get('k')}"
        logger.warning("redlock: force-released %r on %r %s", key, using, detail)
        recorder.record("force_release", key, using, detail)
        cleared = True
    return cleared


def clear_prefix(using: str, prefix: str) -> int:
    """Free every key starting with ``prefix`` (markers and holds); how many went."""
    backend = locks[using]
    match = glob_escape(prefix) + "*"
    names = set(markers.names(backend, match))
    names.update(info.name for info in backend.iter_locks(match))
    # A backend that cannot answer raises (BackendUnavailable): nothing is reported cleared
    # that was not.
    return sum(clear_key(using, name, "clear_locks()") for name in sorted(names))
