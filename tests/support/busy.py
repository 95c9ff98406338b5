"""A server busy running a script (BUSY for every other client), and CONFIG set for a while."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis


@contextlib.contextmanager
def configured(server: redis.Redis, **values: Any) -> Iterator[None]:
    old = {key: server.config_get(key)[key] for key in values}
    for key, value in values.items():
        server.config_set(key, value)
    try:
        yield
    finally:
        for key, value in old.items():
            server.config_set(key, value)


@contextlib.contextmanager
def busy(server: redis.Redis) -> Iterator[None]:
    """The server runs a script that never ends (BUSY for everyone else) until SCRIPT KILL."""
    with configured(server, **{"lua-time-limit": 10}):
        kwargs = server.connection_pool.connection_kwargs
        runner = redis.Redis(host=kwargs["host"], port=kwargs["port"], socket_timeout=30)
        thread = threading.Thread(target=_run_forever, args=(runner,))
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while True:  # BUSY comes once the script ran past lua-time-limit
                try:
                    server.ping()
                except redis.exceptions.ResponseError as exc:
                    if str(exc).startswith("BUSY"):
                        break
                assert time.monotonic() < deadline, "the script never made the server busy"
                time.sleep(0.01)
            yield
        finally:
            while True:
                try:
                    server.script_kill()
                    break
                except redis.exceptions.ResponseError as exc:
                    if "NOTBUSY" in str(exc):
                        break
                    time.sleep(0.01)
            thread.join(10)
            runner.close()


def _run_forever(client: redis.Redis) -> None:
    with contextlib.suppress(redis.RedisError):
        client.eval("while true do end", 0)
