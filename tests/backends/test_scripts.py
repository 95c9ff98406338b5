"""The script layer's direct path: a plain client's lock commands skip redis-py's command
wrapper, but wherever that wrapper does something (a tracer's or subclass's execute_command,
on the class or the instance, configured retries, a reply redis-py parses) it is used."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import override_settings
from redis.backoff import NoBackoff
from redis.retry import Retry

from django_redlock import fast_path, lock, locks, scripts, wire
from django_redlock.testing import RedisServer


def _commands_seen_by(wrap: Callable[[Callable[..., Any]], None], name: str) -> list[str]:
    """The commands a lock's acquire, look and release send through ``execute_command``
    after ``wrap`` has wrapped it (given the wrapper to install)."""
    seen: list[str] = []
    original = redis.Redis.execute_command
    held = lock(name, using="redis", auto_renew=False)
    held.acquire()  # the server learns the scripts (else a NOSCRIPT and SCRIPT LOAD show too)
    held.release()

    def traced(self: Any, *args: Any, **options: Any) -> Any:  # as APM tracers patch redis-py
        seen.append(str(args[0]))
        return original(self, *args, **options)

    wrap(traced)
    held.acquire()
    assert held.locked()
    held.release()
    return seen


def test_a_tracer_on_the_class_sees_every_lock_command(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    original = redis.Redis.execute_command

    def install(traced: Callable[..., Any]) -> None:
        traced.__wrapped__ = original  # type: ignore[attr-defined]
        monkeypatch.setattr(redis.Redis, "execute_command", traced)

    seen = _commands_seen_by(install, name)
    # The acquire's script, the look (a command or a script), the release's script.
    assert len(seen) == 3 and seen[0] == seen[2] == "EVALSHA", seen


def test_a_tracer_on_the_client_sees_every_lock_command(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    client = locks["redis"].client  # type: ignore[attr-defined]

    def install(traced: Callable[..., Any]) -> None:
        def bound(*args: Any, **options: Any) -> Any:
            return traced(client, *args, **options)

        bound.__wrapped__ = redis.Redis.execute_command  # type: ignore[attr-defined]
        monkeypatch.setattr(client, "execute_command", bound, raising=False)

    seen = _commands_seen_by(install, name)
    assert len(seen) == 3 and seen[0] == seen[2] == "EVALSHA", seen


class _WraptLikeProxy:
    """What wrapt's FunctionWrapper (OpenTelemetry's, ddtrace's, Elastic's and New Relic's redis
    instrumentation) puts on the class: a proxy that passes itself off as the function it
    wraps (its ``__class__``, ``__code__``, ``==``), and binds like a method."""

    def __init__(self, wrapped: Any, wrapper: Callable[..., Any]) -> None:
        object.__setattr__(self, "__wrapped__", wrapped)
        object.__setattr__(self, "_wrapper", wrapper)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return self.__wrapped__.__class__  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __eq__(self, other: object) -> bool:
        return bool(self.__wrapped__ == other)

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __get__(self, instance: Any, owner: Any) -> Any:
        if instance is None:
            return self
        return functools.partial(self._wrapper, self.__wrapped__, instance)


def test_a_wrapt_style_tracer_on_the_class_sees_every_lock_command(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    def install(traced: Callable[..., Any]) -> None:
        def wrapper(wrapped: Any, instance: Any, *args: Any, **options: Any) -> Any:
            return traced(instance, *args, **options)

        proxy = _WraptLikeProxy(redis.Redis.execute_command, wrapper)
        monkeypatch.setattr(redis.Redis, "execute_command", proxy)

    seen = _commands_seen_by(install, name)
    assert len(seen) == 3 and seen[0] == seen[2] == "EVALSHA", seen


@pytest.mark.parametrize("alias", ["redis", "sentinel"])
def test_the_backends_own_clients_take_the_direct_path(alias: str, request: Any) -> None:
    if alias == "sentinel":
        request.getfixturevalue("_sentinel_alias")
    client = locks[alias].client  # type: ignore[attr-defined]
    assert wire.bare_execute(client, "EVALSHA")
    # A command whose reply redis-py parses keeps its parsed reply (PING's is True).
    assert not wire.bare_execute(client, "PING")
    assert fast_path.command(client, "PING") is True


def test_a_client_that_retries_goes_through_redis_py(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"retry": Retry(NoBackoff(), 2)},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "retrying": config}):
        client = locks["retrying"].client  # type: ignore[attr-defined]
        assert not wire.bare_execute(client, "EVALSHA")
        held = lock(name, using="retrying", auto_renew=False)
        assert held.acquire(blocking=False)
        held.release()


def test_a_cluster_client_goes_through_redis_py(_cluster_alias: None, name: str) -> None:
    client = locks["cluster"].client  # type: ignore[attr-defined]
    assert not wire.bare_execute(client, "EVALSHA")  # RedisCluster routes by key itself
    held = lock(name, using="cluster", auto_renew=False)
    assert held.acquire(blocking=False)
    assert held.locked()
    held.release()


# -- the Lua: one restart guard for both acquires ------------------------------------------

GUARDED = {
    # script: (keys, args), the node marker last among the keys and the guard last (ms)
    "acquire": (["rg:{l}", "rg:{l}:f", "rg:{l}:q", "rg:{l}:d", "rg:{l}:w", "rg:{l}:b:tok",
                 "rg:node"],
                ["tok", 30000, "{}", "0", "0", 1000]),
    "redlock_acquire": (["rg:{l}", "rg:{l}:f", "rg:node"], ["tok", 30000, "{}", 0, 1000]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_the_restart_guard_votes_no_until_it_has_passed(
    redis_server: RedisServer, name: str
) -> None:
    client = redis_server.client()
    keys, args = GUARDED[name]
    source = scripts.script(name).source
    # No marker: the node lost its data. Marked now, and no vote for the guard's 1000 ms.
    reply = client.eval(source, len(keys), *keys, *args)
    assert reply[0] == 0 and 0 < reply[1] <= 1000, reply
    assert client.pttl("rg:{l}") == -2 and client.get("rg:node") is not None
    # Marked long ago: the guard is over, and the lock is granted.
    client.set("rg:node", "0")
    reply = client.eval(source, len(keys), *keys, *args)
    assert reply[0] == 1 and reply[2] == 1, reply
    # No guard (0 ms): the marker is not even read.
    client.delete("rg:{l}", "rg:node")
    reply = client.eval(source, len(keys), *keys, *args[:-1], 0)
    assert reply[0] == 1 and client.get("rg:node") is None, reply
    client.delete("rg:{l}", "rg:{l}:f")


def test_the_restart_guard_is_written_once_and_spliced_into_both_acquires() -> None:
    lua = Path(scripts.__file__).with_name("lua")
    sets_marker = "redis.call('SET', marker"
    writing = sorted(p.name for p in lua.glob("*.lua") if sets_marker in p.read_text())
    assert writing == ["_restart_guard.lua"]
    for name in GUARDED:
        assert scripts.script(name).source.count(sets_marker) == 1
