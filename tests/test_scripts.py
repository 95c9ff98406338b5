"""The script layer's direct path: plain clients skip redis-py's command wrapper, but a
tracer's wrapper (or a subclass's execute_command) still sees every lock command."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from django_redlock import lock, locks, scripts


def test_a_wrapped_execute_command_sees_every_lock_command(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    seen: list[str] = []
    original = redis.Redis.execute_command

    def traced(self: Any, *args: Any, **options: Any) -> Any:  # as APM tracers patch redis-py
        seen.append(str(args[0]))
        return original(self, *args, **options)

    held = lock(name, using="redis", auto_renew=False)
    held.acquire()  # the server learns the scripts (else a NOSCRIPT and SCRIPT LOAD show too)
    held.release()
    monkeypatch.setattr(redis.Redis, "execute_command", traced)
    held.acquire()
    assert held.locked()
    held.release()
    # The acquire's script, the look (a command or a script), the release's script.
    assert len(seen) == 3 and seen[0] == seen[2] == "EVALSHA", seen


@pytest.mark.parametrize("alias", ["redis", "cache", "sentinel"])
def test_the_backends_clients_take_the_direct_path(alias: str, request: Any) -> None:
    if alias == "sentinel":
        request.getfixturevalue("_sentinel_alias")
    # redis-py's own execute_command, not a subclass's: our commands skip its wrapper.
    client = locks[alias].client  # type: ignore[attr-defined]
    assert type(client).execute_command is scripts._PLAIN_EXECUTE
    assert scripts.command(client, "PING") in (True, b"PONG", "PONG")
