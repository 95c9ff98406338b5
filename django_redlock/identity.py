"""Who holds a lock: hold tokens, reentrant owner ids, and the metadata shown to operators."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import socket
import threading
import weakref
from contextvars import ContextVar
from typing import Any

HOST = socket.gethostname()

# Set by the Celery integration while a task body runs, so holders name their task.
current_task: ContextVar[tuple[str, str] | None] = ContextVar("redlock_task", default=None)


def new_token() -> str:
    """128 random bits, URL-safe, never containing the ``|`` the lock value uses."""
    return secrets.token_urlsafe(16)


# -- reentrant owners --------------------------------------------------------------------------
# An owner is one thread or one asyncio task of one process, on any host. The id lives in a
# ContextVar, not a threading.local, so two tasks on one loop are two owners. A ContextVar is
# copied into child tasks (and into threads started by asgiref's sync_to_async), so each id
# remembers which task or thread it was made for; anyone else gets an id of its own.

_process = {"id": secrets.token_urlsafe(12)}
_serial = itertools.count(1)
_owner: ContextVar[tuple[str, weakref.ref[Any]] | None] = ContextVar("redlock_owner", default=None)


def _current_actor() -> Any:
    loop = asyncio._get_running_loop()  # None outside a loop, without raising
    task = asyncio.current_task(loop) if loop is not None else None
    return task if task is not None else threading.current_thread()


def owner_id() -> str:
    """The reentrant owner id of the current thread or asyncio task."""
    actor = _current_actor()
    slot = _owner.get()
    prefix = f"{_process['id']}:"
    if slot is None or slot[1]() is not actor or not slot[0].startswith(prefix):
        slot = (f"{prefix}{next(_serial)}", weakref.ref(actor))
        _owner.set(slot)
    return slot[0]


_PID = [str(os.getpid())]


def _new_process_id() -> None:
    _process["id"] = secrets.token_urlsafe(12)
    _PID[0] = str(os.getpid())


if hasattr(os, "register_at_fork"):
    # A forked child is another owner, even for the thread that forked it.
    os.register_at_fork(after_in_child=_new_process_id)


#: Separates the holder's fields: compact (a held plain lock stays near 200 bytes in Redis)
#: and never part of a host, thread or task name.
FIELD = "\x1f"
HOLDER_FIELDS = ("h", "p", "t", "k", "n", "q")  # host, pid, thread, task id, task name, fair


def holder_meta(*, fair: bool = False) -> str:
    task = current_task.get() or ("", "")
    fields = [HOST, _PID[0], _actor_name(), *task, "1" if fair else ""]
    return FIELD.join(fields).rstrip(FIELD)


def parse_holder(meta: str) -> dict[str, str]:
    """The fields :func:`holder_meta` wrote, by their one-letter names; empty ones left out."""
    return {k: v for k, v in zip(HOLDER_FIELDS, meta.split(FIELD), strict=False) if v}


def _actor_name() -> str:
    actor = _current_actor()
    if isinstance(actor, asyncio.Task):
        return f"{threading.current_thread().name}/{actor.get_name()}"
    return str(actor.name)
