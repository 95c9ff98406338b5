"""The one script layer every Redis backend shares, sync and asyncio.

The Lua lives in ``lua/<operation>.lua``; helpers shared by several scripts live in
``lua/_<helper>.lua`` and are spliced in where a script says ``--! include _<helper>``.
Scripts run by ``EVALSHA``; a server that answers ``NOSCRIPT`` (after ``SCRIPT FLUSH``, a
restart or a failover) gets the script loaded and the call repeated, so callers never see it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import socket
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from types import FunctionType
from typing import Any

import redis.client
import redis.connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    import hiredis

_HiredisPacker = getattr(redis.connection, "HiredisRespSerializer", None)
_HIREDIS_PACKS = HIREDIS_AVAILABLE and _HiredisPacker is not None

INCLUDE = "--! include "


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str


def _read(name: str) -> str:
    return resources.files("django_redlock").joinpath("lua").joinpath(f"{name}.lua").read_text()


@cache
def script(name: str) -> Script:
    lines = [
        _read(line[len(INCLUDE) :].strip()) if line.startswith(INCLUDE) else line
        for line in _read(name).splitlines()
    ]
    source = "\n".join(lines)
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


def all_scripts() -> list[Script]:
    names = sorted(
        entry.name[: -len(".lua")]
        for entry in resources.files("django_redlock").joinpath("lua").iterdir()
        if entry.name.endswith(".lua") and not entry.name.startswith("_")
    )
    return [script(name) for name in names]


@dataclass(frozen=True)
class Call:
    """One script invocation: what a pipeline batches."""

    script: Script
    keys: Sequence[str]
    args: Sequence[Any]

    def evalsha(self, client: Any) -> Any:
        # Not client.evalsha(): that one checks for deprecated arguments on every call.
        return command(client, "EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)


def command(client: Any, *args: Any) -> Any:
    """``client.execute_command(*args)``; on a plain ``redis.Redis``, straight on the calling
    thread's own connection of its pool (see :func:`_bound`), skipping redis-py's per-command
    wrapper (a retry loop, which ours are configured not to use, and redis-py 8's operation
    metrics) and the pool's checkout and return on every command. Where that wrapper does
    anything for the client, it is used as before (see :func:`_direct`)."""
    if not _direct(client, args[0]):
        return client.execute_command(*args)
    pool = client.connection_pool
    bound = _bound(pool)
    if bound is None:  # this thread's connection is mid-command (a finalizer, a signal handler)
        return _checked_out(pool, args)
    conn = bound.connection
    bound.busy = True
    try:
        conn.send_packed_command(_pack(conn, args))
        return conn.read_response()
    except ResponseError:
        raise  # an answer: the connection is in step
    except BaseException:
        # No answer, or part of one (a time-out, a reset, an interrupt): a reply may still be
        # on its way, so the socket is never read again; the next command connects afresh.
        conn.disconnect()
        raise
    finally:
        bound.busy = False


def _checked_out(pool: Any, args: tuple[Any, ...]) -> Any:
    conn = pool.get_connection()
    try:
        conn.send_packed_command(_pack(conn, args))
        return conn.read_response()
    except ResponseError:
        raise
    except BaseException:
        conn.disconnect()  # as in command(): a Sentinel connection does not do it itself
        raise
    finally:
        pool.release(conn)  # which drops it too if the server announced maintenance


def _pack(conn: Any, args: tuple[Any, ...]) -> Any:
    """The command in RESP: by hiredis straight away when the connection packs with it (our
    arguments are str, bytes and int: nothing for redis-py's serializer to convert)."""
    if _HIREDIS_PACKS and type(conn._command_packer) is _HiredisPacker and " " not in args[0]:
        return [hiredis.pack_command(args)]
    return conn._command_packer.pack(*args)


_PID = os.getpid()


def _new_process() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_new_process)


def pack_many(conn: Any, commands: Sequence[tuple[Any, ...]]) -> Any:
    """Several commands in RESP, to send at once (a pipeline's packing, without its
    per-argument serializer when hiredis packs)."""
    if (
        _HIREDIS_PACKS
        and type(conn._command_packer) is _HiredisPacker
        and not any(" " in command[0] for command in commands)  # "SCRIPT LOAD": redis-py's
    ):
        return [b"".join([hiredis.pack_command(command) for command in commands])]
    return conn.pack_commands(commands)


#: Connections of ended threads kept for new threads, per pool: a server that starts a
#: thread per request (runserver, gevent's greenlets) would otherwise connect per request.
SPARES = 16


class _Bound:
    """A connection one thread runs its lock commands on, made like the pool's own but kept
    outside it: one per thread however small the pool, and never waiting for a free one.
    When its thread ends (its ``threading.local`` goes, and this with it), the connection is
    kept for the next new thread, or closed when enough are kept."""

    __slots__ = ("__weakref__", "busy", "connection", "pid", "poller", "socket", "spares")

    def __init__(self, pool: Any, spares: deque[tuple[int, Any]]) -> None:
        self.spares = spares
        self.connection: Any = _spare(spares) or pool.connection_class(**pool.connection_kwargs)
        self.pid, self.busy = _PID, False
        self.socket: Any = None  # the socket the poller watches
        self.poller: Any = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self.pid == _PID and not self.busy and len(self.spares) < SPARES:
                self.spares.append((self.pid, self.connection))
            else:
                # Now, not when the garbage collector gets to it (a connection is in a
                # cycle). A forked child's copy: closes the child's, the parent's lives on.
                self.connection.disconnect()


def _spare(spares: deque[tuple[int, Any]]) -> Any:
    """A connection an ended thread of this process left, if any."""
    while spares:
        try:
            pid, connection = spares.pop()
        except IndexError:  # another thread took the last one
            return None
        if pid == _PID:
            return connection
        connection.disconnect()  # the parent's, copied by a fork: closes this copy only
    return None


def _bound(pool: Any) -> _Bound | None:
    """The calling thread's connection to ``pool``'s server (None while it is mid-command):
    made once per thread, not checked out of the pool and back on every command. A forked
    child makes its own (closing the parent's copy leaves the parent's socket alone)."""
    try:
        threads, spares, everyone = pool._django_redlock_threads
    except AttributeError:
        threads, spares, everyone = pool.__dict__.setdefault(
            "_django_redlock_threads", (threading.local(), deque(), weakref.WeakSet())
        )
    bound: _Bound | None = getattr(threads, "bound", None)
    if bound is None or bound.pid != _PID:
        bound = threads.bound = _Bound(pool, spares)
        everyone.add(bound)
    elif bound.busy:
        return None
    _recheck(bound)
    return bound


def disconnect_threads(pool: Any) -> None:
    """Close every thread's lock connection to ``pool``'s server, and those kept (the
    backend is closed): a thread that sends again connects again."""
    threads = pool.__dict__.get("_django_redlock_threads")
    if threads is None:
        return
    _, spares, everyone = threads
    for bound in list(everyone):
        if bound.pid == _PID:
            bound.connection.disconnect()
    while spares:
        with contextlib.suppress(IndexError):
            spares.pop()[1].disconnect()


def _recheck(bound: _Bound) -> None:
    """What the pool does at each checkout: a connection with something to read while no
    reply is due (the server closed it: a restart, CLIENT KILL, an idle time-out) is replaced
    before a command is sent on it, which would fail where a new connection would not. One
    poll(0) on a poller kept per socket: a third of what redis-py's ``can_read()`` costs."""
    conn = bound.connection
    sock = conn._sock
    if sock is None:
        # Not send_command's own connecting: that skips a Sentinel connection's connect(),
        # which asks the sentinels where the master is.
        conn.connect()
        return
    if sock is not bound.socket:
        bound.socket, bound.poller = sock, None
        if _POLL and type(sock) is socket.socket:  # not TLS: it may have bytes buffered above
            bound.poller = select.poll()
            bound.poller.register(sock, select.POLLIN)
    try:
        stale = bool(bound.poller.poll(0)) if bound.poller is not None else conn.can_read()
    except (RedisConnectionError, OSError):
        stale = True
    if stale:
        conn.disconnect()


_POLL = hasattr(select, "poll")


_OWN: list[Any] = []  # redis-py's own Redis.execute_command, once seen


def _direct(client: Any, name: str) -> bool:
    """Whether redis-py's wrapper would do nothing but run the command: a plain ``redis.Redis``
    (not a cluster, nor a single-connection client) whose ``execute_command`` is redis-py's own
    (not replaced on the class or the instance by a tracer or a subclass, before or after this
    module was imported), whose connections retry nothing, for a command whose reply redis-py
    does not parse (no response callback). Only ``execute_command`` is looked at: a subclass
    that changes redis-py's inner methods instead is not noticed."""
    execute = type(client).execute_command
    if not (_OWN and execute is _OWN[0]) and not _seen_as_own(execute):
        return False
    retry = client.connection_pool.connection_kwargs.get("retry")
    return (
        client.connection is None
        and "execute_command" not in client.__dict__
        and getattr(retry, "_retries", 1) == 0  # none given: redis-py's default retries
        and name not in client.response_callbacks
    )


def _seen_as_own(execute: Any) -> bool:
    if any(execute is own for own in _OWN):  # not ==: a wrapt proxy equals what it wraps
        return True
    if not _is_redis_pys(execute):
        return False
    _OWN.append(execute)
    return True


def _is_redis_pys(function: Any) -> bool:
    # type(), not isinstance(): a tracer's wrapt proxy claims the class (and the __code__) of
    # the function it wraps.
    code = getattr(function, "__code__", None)
    return (
        type(function) is FunctionType
        and code is not None
        and code.co_name == "execute_command"
        and code.co_filename == redis.client.__file__
    )


def _is_noscript(result: object) -> bool:
    return isinstance(result, NoScriptError) or (
        isinstance(result, ResponseError) and str(result).startswith("NOSCRIPT")
    )


def _script_of(call: Call | tuple[Any, ...]) -> Script:
    assert isinstance(call, Call)  # only script calls answer NOSCRIPT
    return call.script


def run(client: Any, call: Call) -> Any:
    """Run one script: one round trip, two when the server has to be taught it first."""
    try:
        return call.evalsha(client)
    except NoScriptError:
        client.script_load(call.script.source)
        return call.evalsha(client)


async def arun(client: Any, call: Call) -> Any:
    """:func:`run` on a ``redis.asyncio`` client."""
    try:
        return await call.evalsha(client)
    except NoScriptError:
        await client.script_load(call.script.source)
        return await call.evalsha(client)


def _pipeline(client: Any, calls: Sequence[Call | tuple[Any, ...]]) -> Any:
    """Script calls and plain commands (``("WAIT", 1, 100)``), on one connection."""
    pipe = client.pipeline(transaction=False)
    for call in calls:
        if isinstance(call, Call):
            # Not pipe.evalsha(): a cluster pipeline refuses that method, yet routes this
            # command by its keys like any other.
            pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
        else:
            pipe.execute_command(*call)
    return pipe


def _again(calls: Sequence[Call | tuple[Any, ...]], results: Sequence[Any]) -> list[int]:
    """What to send again once the scripts are loaded: the calls answered NOSCRIPT, and the
    plain commands after the first of them. Those were there to see the scripts' effect
    (``WAIT``: the replicas that have this connection's writes so far), which they did not."""
    missing = [i for i, result in enumerate(results) if _is_noscript(result)]
    if not missing:
        return missing
    return [i for i in range(missing[0], len(calls))
            if i in missing or not isinstance(calls[i], Call)]  # fmt: skip


def run_many(client: Any, calls: Sequence[Call | tuple[Any, ...]]) -> list[Any]:
    """Run many scripts in one pipelined round trip; errors come back as values."""
    results = list(_pipeline(client, calls).execute(raise_on_error=False))
    missing = _again(calls, results)
    if missing:
        for needed in {_script_of(calls[i]) for i in missing if isinstance(calls[i], Call)}:
            client.script_load(needed.source)
        retried = _pipeline(client, [calls[i] for i in missing]).execute(raise_on_error=False)
        for i, result in zip(missing, retried, strict=True):
            results[i] = result
    return results


async def arun_many(client: Any, calls: Sequence[Call | tuple[Any, ...]]) -> list[Any]:
    """:func:`run_many` on a ``redis.asyncio`` client."""
    results = list(await _pipeline(client, calls).execute(raise_on_error=False))
    missing = _again(calls, results)
    if missing:
        for needed in {_script_of(calls[i]) for i in missing if isinstance(calls[i], Call)}:
            await client.script_load(needed.source)
        pipe = _pipeline(client, [calls[i] for i in missing])
        retried = await pipe.execute(raise_on_error=False)
        for i, result in zip(missing, retried, strict=True):
            results[i] = result
    return results


def register(client: Any) -> None:
    """Teach a server (a cluster: every primary) every script, when the app is ready."""
    for each in all_scripts():
        client.script_load(each.source)
