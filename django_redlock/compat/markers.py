"""What the Celery migration shims do to a key as a whole: who has it (a queued task's marker
or a running task's hold), and freeing it whoever has it (the originals' ``unlock`` /
``clear_lock`` / ``clear_locks``: an operator's action, logged and recorded as a
``force_release`` incident when a running task's hold goes)."""

from __future__ import annotations

import logging

from ..backends import markers
from ..backends.base import glob_escape
from ..contrib.single import task_id_of
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
