"""The one script layer every Redis backend shares, sync and asyncio.

The Lua lives in ``lua/<operation>.lua``; helpers shared by several scripts live in
``lua/_<helper>.lua`` and are spliced in where a script says ``--! include _<helper>``.
Scripts run by ``EVALSHA``; a server that answers ``NOSCRIPT`` (after ``SCRIPT FLUSH``, a
restart or a failover) gets the script loaded and the call repeated, so callers never see it.

Commands go out through the fast path (:mod:`django_redlock.fast_path`): on the calling
thread's own connection where redis-py's wrapper would do nothing, else through redis-py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from .fast_path import command, commands
from .wire import bare_execute, cluster_node_of, texts

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


@dataclass(eq=False, slots=True)  # not frozen: every lock operation makes one or more
class Call:
    """One script invocation: what a pipeline batches. Never changed once made."""

    script: Script
    keys: Sequence[str]
    args: Sequence[Any]

    def evalsha(self, client: Any, by: float | None = None) -> Any:
        # Not client.evalsha(): that one checks for deprecated arguments on every call.
        keys = self.keys  # the count as text: the packer then converts nothing (wire.texts)
        sha = self.script.sha
        return command(client, "EVALSHA", sha, str(len(keys)), *keys, *self.args, by=by)


def _is_noscript(result: object) -> bool:
    return isinstance(result, NoScriptError) or (
        isinstance(result, ResponseError) and str(result).startswith("NOSCRIPT")
    )


def run(client: Any, call: Call, by: float | None = None) -> Any:
    """Run one script: one round trip, two when the server has to be taught it first.
    ``by``: answered by then at the latest (see :func:`.fast_path.command`)."""
    for tries in range(LOADS):
        try:
            return call.evalsha(client, by)
        except NoScriptError:
            if tries == LOADS - 1:
                raise
            _load(client, call.script, () if tries else call.keys, by)
    raise AssertionError("unreachable")


# A cluster's script is loaded first on the node its key's slot cache names; if NOSCRIPT
# comes again (an ASK or MOVED followed to a node that lacks it), on every primary.
LOADS = 3


def _load(client: Any, needed: Script, keys: Sequence[str] = (), by: float | None = None) -> None:
    # A cluster: only on the key's node (client.script_load() asks every primary, and a
    # paused one then failed a call on a healthy master).
    node = cluster_node_of(client, keys[0]) if keys else None
    if node is not None:
        client.execute_command("SCRIPT LOAD", needed.source, target_nodes=node)
        return
    # As its own command (not client.script_load(), whose reply redis-py converts): on the
    # thread's connection, not one checked out of the pool.
    if bare_execute(client, "SCRIPT"):
        command(client, "SCRIPT", "LOAD", needed.source, by=by)
    else:
        client.script_load(needed.source)


async def arun(client: Any, call: Call) -> Any:
    """:func:`run` on a ``redis.asyncio`` client."""
    for tries in range(LOADS):
        try:
            return await call.evalsha(client)
        except NoScriptError:
            if tries == LOADS - 1:
                raise
            await _aload(client, call.script, () if tries else call.keys)
    raise AssertionError("unreachable")


async def _aload(client: Any, needed: Script, keys: Sequence[str] = ()) -> None:
    node = cluster_node_of(client, keys[0]) if keys else None  # as _load
    if node is not None:
        await client.execute_command("SCRIPT LOAD", needed.source, target_nodes=node)
    else:
        await client.script_load(needed.source)


def _pipeline(client: Any, calls: Sequence[Call | tuple[Any, ...]]) -> Any:
    """Script calls and plain commands (``("WAIT", 1, 100)``), on one connection."""
    pipe = client.pipeline(transaction=False)
    for call in calls:
        if isinstance(call, Call):
            # Not pipe.evalsha(): a cluster pipeline refuses that method, yet routes this
            # command by its keys like any other.
            pipe.execute_command(
                *texts(("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args))
            )
        else:
            pipe.execute_command(*texts(call))
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


def run_many(
    client: Any, calls: Sequence[Call | tuple[Any, ...]], by: float | None = None
) -> list[Any]:
    """Run many scripts in one pipelined round trip; errors come back as values. ``by``: as
    :func:`run`."""
    results = commands(client, [_request(call) for call in calls], by)
    for tries in range(LOADS - 1):  # as run(): the keys' nodes, then every primary
        missing = _again(calls, results)
        if not missing:
            break
        for needed, keys in _needed(client, calls, missing, everywhere=tries > 0):
            _load(client, needed, keys, by)
        retried = commands(client, [_request(calls[i]) for i in missing], by)
        for i, result in zip(missing, retried, strict=True):
            results[i] = result
    return results


def _needed(
    client: Any,
    calls: Sequence[Call | tuple[Any, ...]],
    missing: Sequence[int],
    everywhere: bool = False,
) -> list[tuple[Script, tuple[str, ...]]]:
    """Each script to load once per node (a cluster's: the node of a key of its calls that
    answered NOSCRIPT; any other client's: its one server), with that key; ``everywhere``:
    once, with no key (a cluster: every primary)."""
    needed: dict[tuple[Script, Any], tuple[str, ...]] = {}
    for i in missing:
        call = calls[i]
        if isinstance(call, Call):
            keys = () if everywhere else tuple(call.keys[:1])
            node = cluster_node_of(client, keys[0]) if keys else None
            needed.setdefault((call.script, None if node is None else node.name), keys)
    return [(script, keys) for (script, _), keys in needed.items()]


def _request(call: Call | tuple[Any, ...]) -> tuple[Any, ...]:
    if isinstance(call, Call):
        return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    return call


async def arun_many(client: Any, calls: Sequence[Call | tuple[Any, ...]]) -> list[Any]:
    """:func:`run_many` on a ``redis.asyncio`` client."""
    results = list(await _pipeline(client, calls).execute(raise_on_error=False))
    for tries in range(LOADS - 1):
        missing = _again(calls, results)
        if not missing:
            break
        for needed, keys in _needed(client, calls, missing, everywhere=tries > 0):
            await _aload(client, needed, keys)
        pipe = _pipeline(client, [calls[i] for i in missing])
        retried = await pipe.execute(raise_on_error=False)
        for i, result in zip(missing, retried, strict=True):
            results[i] = result
    return results


def teach(client: Any, requests: Sequence[Any]) -> None:
    """Load the scripts of ``requests`` (their ``Call`` ones) into ``client``'s server: one
    that answered NOSCRIPT elsewhere (a Redlock fan-out's connection), so the op sent again
    runs at once instead of answering NOSCRIPT a second time. Used by ``redlock_io``."""
    for needed in {call.script for call in requests if isinstance(call, Call)}:
        _load(client, needed)


def register(client: Any) -> None:
    """Teach a server (a cluster: every primary) every script, when the app is ready."""
    for each in all_scripts():
        client.script_load(each.source)
