"""Who holds a lock: hold tokens, reentrant owner ids, and the metadata shown to operators."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import os
import secrets
import socket
import threading
import weakref
from contextvars import Context, ContextVar
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


def write_seq() -> int:
    """The next number of a reentrant owner's write (an acquire, a release, a settle): larger
    than every one this process drew before, so each owner's writes, which it sends one after
    another, are numbered in the order it sent them. The server keeps the newest it applied
    and refuses an older one (lua/_hold.lua's ``order_stale``): a request that ran late (its
    reply timed out, the owner moved on) changes nothing. An owner lives in one process."""
    return next(_writes)


# -- reentrant owners --------------------------------------------------------------------------
# An owner is one asyncio task, or one thread's run of sync code, of one process, on any host.
#
# The rule under asgiref (SPEC: a lock taken inside sync_to_async / async_to_sync code never
# changes which task or thread owns the caller's holds): asgiref copies every ContextVar a call
# changed back into its caller, and from there into every task the caller creates later. So:
# - a task's id is kept by the task itself (a weak map), never read from a ContextVar: nothing
#   a thread sets can make it someone else;
# - sync code's id is that of the Context it runs in, on this thread: kept in a weak map of
#   the thread's own, keyed by the Context object itself (found through a ContextVar token,
#   which holds it), never in a ContextVar (asgiref would copy it back into the caller).
#   Each ``sync_to_async`` or ``asyncio.to_thread`` call runs in a fresh copy: it is an
#   owner of its own (two tasks' sync halves, even in asgiref's one shared thread, never
#   share one). A thread's own code runs in the thread's Context for the thread's life, so
#   it keeps its id through any number of calls nested in it (async_to_sync, then
#   sync_to_async back onto the thread); a call's id goes with its Context.

_process = {"id": secrets.token_urlsafe(12)}
_serial = itertools.count(1)
_tokens = itertools.count(1)
_writes = itertools.count(1)
_task_ids: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()


#: Per thread: the owner id of each Context sync code asked for one in.
_contexts = threading.local()
_here: ContextVar[None] = ContextVar("redlock_owner_context", default=None)


def _current_context() -> Context:
    """The running Context object itself (``copy_context`` would copy it): a token holds the
    Context it was made in."""
    token = _here.set(None)
    try:
        for ref in gc.get_referents(token):  # a loop, not next(genexpr): every acquire asks
            if type(ref) is Context:
                return ref
        raise RuntimeError("a ContextVar token without its Context")  # pragma: no cover
    finally:
        _here.reset(token)


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
    # id(Context) -> (a weak reference to it, its owner id, the process id it was made in)
    ids: dict[int, tuple[weakref.ref[Context], str, str]] | None = getattr(_contexts, "ids", None)
    if ids is None:
        ids = _contexts.ids = {}
    context = _current_context()
    key = id(context)
    entry = ids.get(key)
    process = _process["id"]
    if entry is None or entry[0]() is not context or entry[2] is not process:
        # New (or before a fork). By id: a Context is unhashable; the entry goes with it.
        found = f"{process}:{next(_serial)}"
        ids[key] = (weakref.ref(context, functools.partial(_forget, ids, key)), found, process)
        return found
    return entry[1]


def _forget(ids: dict[int, Any], key: int, ref: weakref.ref[Context]) -> None:
    if key in ids and ids[key][0] is ref:  # not a newer Context at the same address
        del ids[key]


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


def _actor_name() -> str:
    loop = asyncio._get_running_loop()  # None outside a loop, without raising
    task = asyncio.current_task(loop) if loop is not None else None
    if task is not None:
        return f"{threading.current_thread().name}/{task.get_name()}"
    return str(threading.current_thread().name)
