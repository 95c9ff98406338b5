"""An ``aacquire()`` coroutine closed while it waits (GeneratorExit: what the collector or a
torn-down event loop does to a pending task) cleans up without awaiting: it leaves the fair
queue and stops watching, and closing it raises nothing.

(A coroutine closed in the middle of redis-py's own read is redis-py's to clean up: its
async connection needs a running loop to disconnect.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from django_redlock import lock


def close_while_waiting(coro: Coroutine[Any, Any, Any], seconds: float) -> None:
    """Run ``coro`` as a task for ``seconds``, close its loop with the task pending, then
    close the coroutine itself."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    loop.run_until_complete(asyncio.sleep(seconds))
    assert not task.done()
    task._log_destroy_pending = False  # left pending on purpose
    loop.close()
    coro.close()  # raised "generator ignored GeneratorExit" before


@pytest.mark.parametrize("fair", [False, True])
@pytest.mark.parametrize("alias", ["redis", "local"])
def test_a_waiter_closed_while_waiting_leaves_cleanly(alias: str, name: str, fair: bool) -> None:
    holder = lock(name, using=alias, ttl=10, fair=fair)
    assert holder.acquire()
    close_while_waiting(lock(name, using=alias, ttl=10, fair=fair).aacquire(timeout=5), 0.3)
    holder.release()
    # A fair waiter left in the queue would keep its place (until its lease lapses) and
    # refuse a newcomer's try.
    newcomer = lock(name, using=alias, ttl=10, fair=fair)
    assert newcomer.acquire(blocking=False)
    newcomer.release()
