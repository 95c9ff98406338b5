"""The one script layer every Redis backend shares.

The Lua lives in ``lua/<operation>.lua``. Scripts run by ``EVALSHA``; a server that answers
``NOSCRIPT`` (after ``SCRIPT FLUSH``, a restart or a failover) gets the script loaded and the
call repeated, so callers never see it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, ResponseError


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str


@cache
def script(name: str) -> Script:
    source = (
        resources.files("django_redlock").joinpath("lua").joinpath(f"{name}.lua").read_text("utf-8")
    )
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


def all_scripts() -> list[Script]:
    names = sorted(
        entry.name[: -len(".lua")]
        for entry in resources.files("django_redlock").joinpath("lua").iterdir()
        if entry.name.endswith(".lua")
    )
    return [script(name) for name in names]


@dataclass(frozen=True)
class Call:
    """One script invocation: what a pipeline batches."""

    script: Script
    keys: Sequence[str]
    args: Sequence[Any]


def _is_noscript(result: object) -> bool:
    return isinstance(result, NoScriptError) or (
        isinstance(result, ResponseError) and str(result).startswith("NOSCRIPT")
    )


def run(client: Any, call: Call) -> Any:
    """Run one script: one round trip, two when the server has to be taught it first."""
    try:
        return client.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
    except NoScriptError:
        client.script_load(call.script.source)
        return client.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)


def run_many(client: Any, calls: Sequence[Call]) -> list[Any]:
    """Run many scripts in one pipelined round trip; errors come back as values."""
    results = _pipelined(client, calls)
    missing = [i for i, result in enumerate(results) if _is_noscript(result)]
    if missing:
        for needed in {calls[i].script for i in missing}:
            client.script_load(needed.source)
        for i, result in zip(missing, _pipelined(client, [calls[i] for i in missing]), strict=True):
            results[i] = result
    return results


def _pipelined(client: Any, calls: Sequence[Call]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for call in calls:
        pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
    return list(pipe.execute(raise_on_error=False))


def register(client: Any) -> None:
    """Teach a server every script up front (when the app is ready)."""
    pipe = client.pipeline(transaction=False)
    for each in all_scripts():
        pipe.script_load(each.source)
    pipe.execute()
