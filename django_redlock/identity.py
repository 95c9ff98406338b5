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
# An owner is one asyncio task, or one thread's run of sync code, of one process, on any host.
#
# The rule under asgiref (SPEC: a lock taken inside sync_to_async / async_to_sync code never
# changes which task or thread owns the caller's holds): asgiref copies every ContextVar a call
# changed back into its caller, and from there into every task the caller creates later. So:
# - a task's id is kept by the task itself (a weak map), never read from a ContextVar: nothing
#   a thread sets can make it someone else;
# - sync code's id is a ContextVar slot that counts only in the Context that made it (checked
#   with a ContextVar token, which knows its Context). Each ``sync_to_async`` or
#   ``asyncio.to_thread`` call runs in a fresh copy: it is an owner of its own (two tasks'
#   sync halves, even in asgiref's one shared thread, never share one), and a slot it copies
#   back is ignored by everyone else. A thread's own code keeps its id through those copies;
#   a call nested back onto it (async_to_sync, then sync_to_async) is a call of its own. (A
#   copied slot cannot tell the task it reached from that task's children: sharing it would
#   let two tasks' sync halves hold one reentrant lock; a new owner per call never does.)

_process = {"id": secrets.token_urlsafe(12)}
_serial = itertools.count(1)
_tokens = itertools.count(1)
_task_ids: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()


class _Slot:
    """One sync owner: its id, its thread, and the token of the Context it counts in (renewed
    at each check: a token resets once). ``before``: the slot this one replaced there."""

    __slots__ = ("before", "id", "thread", "token")

    def __init__(self, id: str, thread: threading.Thread, before: _Slot | None) -> None:
        self.id, self.thread, self.before = id, weakref.ref(thread), before
        self.token = _here.set(None)

    def counts_here(self, thread: threading.Thread) -> bool:
        if self.thread() is not thread or not self.id.startswith(f"{_process['id']}:"):
            return False
        try:
            _here.reset(self.token)  # ValueError: made in another Context (a copy)
        except (ValueError, RuntimeError):
            return False
        self.token = _here.set(None)
        return True


#: How many slots copied back over one another a thread looks through for its own, newest
#: first, besides the oldest (a thread's own code, under the calls nested in it): each
#: sync_to_async call's first owner_id tries this many before it makes its own.
_DEPTH = 8
_owner: ContextVar[_Slot | None] = ContextVar("redlock_owner", default=None)
_here: ContextVar[None] = ContextVar("redlock_owner_context", default=None)


def owner_id() -> str:
    """The reentrant owner id of the current asyncio task, or of the current thread's sync
    code (see the rule above)."""
    loop = asyncio._get_running_loop()  # None outside a loop, without raising
    task = asyncio.current_task(loop) if loop is not None else None
    if task is not None:
        found = _task_ids.get(task)
        if found is None:
            found = _task_ids[task] = f"{_process['id']}:{next(_serial)}"
        return found
    thread = threading.current_thread()
    slot = first = _owner.get()
    last = None
    for _ in range(_DEPTH):  # the slots copied back over this Context's own one, newest first
        if slot is None:
            break
        if slot.counts_here(thread):
            if slot is not first:
                _owner.set(slot)
            return slot.id
        last, slot = slot, slot.before
    if slot is not None and last is not None:
        # Longer than _DEPTH: keep the oldest (a thread's own code, under the calls nested
        # in it) and drop the middle, so that a chain stays at most _DEPTH + 1 long.
        oldest = slot
        while oldest.before is not None:
            oldest = oldest.before
        if oldest.counts_here(thread):
            _owner.set(oldest)
            return oldest.id
        last.before = oldest
    made = _Slot(f"{_process['id']}:{next(_serial)}", thread, first)
    _owner.set(made)
    return made.id


def lend_owner(task: asyncio.Task[Any]) -> None:
    """Make ``task`` (just created, not started) the current owner: a helper task that
    finishes this owner's release after a cancellation."""
    _task_ids[task] = owner_id()


_PID = [str(os.getpid())]


def _new_process_id() -> None:
    _process["id"] = secrets.token_urlsafe(12)
    _PID[0] = str(os.getpid())
    _metas.clear()
    _task_ids.clear()


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


def _current_actor() -> Any:
    loop = asyncio._get_running_loop()  # None outside a loop, without raising
    task = asyncio.current_task(loop) if loop is not None else None
    return task if task is not None else threading.current_thread()


def _actor_name() -> str:
    actor = _current_actor()
    if isinstance(actor, asyncio.Task):
        return f"{threading.current_thread().name}/{actor.get_name()}"
    return str(actor.name)
