"""The one script layer every Redis backend shares, sync and asyncio.

The Lua lives in ``lua/<operation>.lua``; helpers shared by several scripts live in
``lua/_<helper>.lua`` and are spliced in where a script says ``--! include _<helper>``.
Scripts run by ``EVALSHA``; a server that answers ``NOSCRIPT`` (after ``SCRIPT FLUSH``, a
restart or a failover) gets the script loaded and the call repeated, so callers never see it.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.exceptions import NoScriptError, ResponseError

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


#: redis-py's own ``Redis.execute_command`` (unwrapped, should a tracer have wrapped it first).
_PLAIN_EXECUTE = inspect.unwrap(redis.Redis.execute_command)


def command(client: Any, *args: Any) -> Any:
    """``client.execute_command(*args)``; on a plain ``redis.Redis``, straight on a connection
    of its pool, with the calls redis-py makes there: the connection disconnects itself on a
    socket error or time-out (a reply may be lost, never misread later), and goes back to the
    pool. What is skipped is redis-py's per-command wrapper, its retry loop (our clients retry
    nothing) and, in redis-py 8, operation metrics: about 7 us of client CPU a round trip, on
    every lock operation. A client of another class (a cluster), a single-connection client, or
    an ``execute_command`` that a tracer or a subclass replaced goes through it as before."""
    if type(client).execute_command is not _PLAIN_EXECUTE or client.connection is not None:
        return client.execute_command(*args)
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command(*args)
        return conn.read_response()
    finally:
        if getattr(conn, "should_reconnect", bool)():  # a server's maintenance notice
            conn.disconnect()
        pool.release(conn)


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


def run_many(client: Any, calls: Sequence[Call | tuple[Any, ...]]) -> list[Any]:
    """Run many scripts in one pipelined round trip; errors come back as values."""
    results = list(_pipeline(client, calls).execute(raise_on_error=False))
    missing = [i for i, result in enumerate(results) if _is_noscript(result)]
    if missing:
        for needed in {_script_of(calls[i]) for i in missing}:
            client.script_load(needed.source)
        retried = _pipeline(client, [calls[i] for i in missing]).execute(raise_on_error=False)
        for i, result in zip(missing, retried, strict=True):
            results[i] = result
    return results


async def arun_many(client: Any, calls: Sequence[Call | tuple[Any, ...]]) -> list[Any]:
    """:func:`run_many` on a ``redis.asyncio`` client."""
    results = list(await _pipeline(client, calls).execute(raise_on_error=False))
    missing = [i for i, result in enumerate(results) if _is_noscript(result)]
    if missing:
        for needed in {_script_of(calls[i]) for i in missing}:
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
