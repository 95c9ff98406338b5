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

from .forks import after_fork_in_child

HOST = socket.gethostname()

# Set by the Celery integration while a task body runs, so holders name their task.
current_task: ContextVar[tuple[str, str] | None] = ContextVar("redlock_task", default=None)


def new_token() -> str:
    """A hold's token: unique (the process's 96 random bits and a serial), URL-safe, never
    containing the ``|`` the lock value uses. Cheaper than fresh random bits per hold."""
    return f"{_process['id']}{next(_tokens):x}"


def new_waiter_id() -> str:
    """A waiter's id, '<process id>.<serial>': a release finds the waiter's process inbox
    from it (see lua/_wake.lua). Neither part ever contains a '.'."""
    return f"{_process['id']}.{next(_serial)}"


def process_id() -> str:
    return _process["id"]


# -- reentrant owners --------------------------------------------------------------------------
# An owner is one thread or one asyncio task of one process, on any host. The id lives in a
# ContextVar, not a threading.local, so two tasks on one loop are two owners. A ContextVar is
# copied into child tasks (and into threads started by asgiref's sync_to_async), so each id
# remembers which task or thread it was made for; anyone else gets an id of its own.

_process = {"id": secrets.token_urlsafe(12)}
_serial = itertools.count(1)
_tokens = itertools.count(1)
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
    _metas.clear()


# A forked child is another owner, even for the thread that forked it.
after_fork_in_child(_new_process_id)


#: Separates the holder's fields: compact (a held plain lock stays near 200 bytes in Redis)
#: and never part of a host, thread or task name.
FIELD = "\x1f"
# host, pid, thread, task id, task name, fair, multi-lock ("<names>.<group id>": lock_all)
HOLDER_FIELDS = ("h", "p", "t", "k", "n", "q", "m")


_metas: dict[tuple[str, tuple[str, str] | None, bool], str] = {}


def holder_meta(*, fair: bool = False) -> str:
    task = current_task.get()
    key = (_actor_name(), task, fair)
    meta = _metas.get(key)
    if meta is None:  # built once per thread (or task) name: every acquire asks for it
        if len(_metas) > 10_000:  # one entry per Celery task id: keep it bounded
            _metas.clear()
        fields = [HOST, _PID[0], key[0], *(task or ("", "")), "1" if fair else ""]
        meta = _metas[key] = FIELD.join(fields).rstrip(FIELD)
    return meta


def group_meta(meta: str, group: str, size: int) -> str:
    """``meta`` (:func:`holder_meta`'s) marked as one of the ``size`` holds that ``lock_all``
    took together as multi-lock ``group``: the field "m" is ``"<size>.<group>"``."""
    fields = meta.split(FIELD)
    fields += [""] * (HOLDER_FIELDS.index("m") - len(fields))
    return FIELD.join([*fields, f"{size}.{group}"])


def parse_holder(meta: str) -> dict[str, str]:
    """The fields :func:`holder_meta` wrote, by their one-letter names; empty ones left out."""
    return {k: v for k, v in zip(HOLDER_FIELDS, meta.split(FIELD), strict=False) if v}


def _actor_name() -> str:
    actor = _current_actor()
    if isinstance(actor, asyncio.Task):
        return f"{threading.current_thread().name}/{actor.get_name()}"
    return str(actor.name)
