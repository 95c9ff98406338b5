"""An ``aacquire()`` coroutine closed while it waits (GeneratorExit: what the collector or a
torn-down event loop does to a pending task) cleans up without awaiting: it leaves the fair
queue and stops watching, and closing it raises nothing. The close only hands the clean-up
to the finisher thread (no I/O, no thread start where a finalizer runs), which runs it soon
after.

(A coroutine closed in the middle of redis-py's own read is redis-py's to clean up: its
async connection needs a running loop to disconnect.)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from django_redlock import lock
from django_redlock.locking import finisher
from django_redlock.testing import RedisServer

from ..conftest import ROOT


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
    # Its clean-up runs on the finisher thread, not in close(): waited for, bounded.
    assert finisher.wait_finished(5)


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


# The collector closes a pending task's coroutine at whatever allocation triggered it, in any
# thread: here one inside Thread.start() (it holds threading's ``_active_limbo_lock``, which
# every other thread's start and every new thread's bootstrap wait for), within a waiter's try
# (a call deadline stands), while the server holds replies back (CLIENT PAUSE). A clean-up
# run there waits for the server, and every thread start in the process waits with it.
CLOSED_BY_THE_COLLECTOR = """
import asyncio, os, threading, time
import django
from django.conf import settings
settings.configure(INSTALLED_APPS=["django_redlock"], DJANGO_REDLOCK={config!r})
django.setup()
from django_redlock import fast_path, lock

holder = lock({name!r}, using="x", ttl=10, fair=True)
assert holder.acquire()
coro = lock({name!r}, using="x", ttl=10, fair=True).aacquire(timeout=5)
loop = asyncio.new_event_loop()
task = loop.create_task(coro)
loop.run_until_complete(asyncio.sleep(0.3))  # registered in the fair queue, asleep
assert not task.done()
task._log_destroy_pending = False
loop.close()
import redis
redis.Redis.from_url({url!r}).execute_command("CLIENT", "PAUSE", 1500, "ALL")
took, started = [], []
from django_redlock.locking import finisher
ran_by = finisher._finisher[0].thread  # started by the aacquire, before any close
assert ran_by is not None and ran_by.is_alive()

def finalizer() -> None:  # a thread of its own: no connection yet, so the leave connects
    with fast_path.answered_by(time.monotonic() + 10), threading._active_limbo_lock:
        before = set(threading.enumerate())
        began = time.monotonic()
        coro.close()
        took.append(time.monotonic() - began)
        started.extend(t.name for t in set(threading.enumerate()) - before)

closer = threading.Thread(target=finalizer, daemon=True)
closer.start()
closer.join(5)
if closer.is_alive():
    print("stalled", flush=True)
    os._exit(3)
holder.release()
newcomer = lock({name!r}, using="x", ttl=10, fair=True)
deadline = time.monotonic() + 5  # the queue left once the server answers, by the finisher
while not newcomer.acquire(blocking=False):
    assert time.monotonic() < deadline, "the closed waiter kept its place in the queue"
    time.sleep(0.02)
newcomer.release()
assert not started, started  # no thread started by the close
assert finisher._finisher[0].thread is ran_by  # the clean-up's thread existed before
print(round(took[0], 3), flush=True)
"""


def test_a_waiter_closed_by_the_collector_under_a_thread_start_s_lock_returns_at_once(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The collector closing a waiting ``aacquire()`` does no I/O and starts no thread there:
    the close returns at once; its queue entry is left shortly after (the finisher thread).
    Before: the clean-up's leave waited for the paused server there (1.5 s; a socket
    timeout, with the server gone), the thread start's lock held meanwhile (the stall the
    fault campaign caught: an acquire blocked 5 s)."""
    server = redis_factory()
    config = {
        "x": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    }
    code = textwrap.dedent(CLOSED_BY_THE_COLLECTOR.format(config=config, name=name, url=server.url))
    try:
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the subprocess hung")
    assert run.returncode == 0, (run.stdout, run.stderr[-3000:])
    assert float(run.stdout.split()[-1]) < 0.5  # the close itself: no round trip


FORKED = """
import asyncio, os, time
import django
from django.conf import settings
settings.configure(INSTALLED_APPS=["django_redlock"], DJANGO_REDLOCK={config!r})
django.setup()
from django_redlock import lock
from django_redlock.locking import finisher

async def probe() -> None:
    await lock({name!r} + ":probe", using="x").alocked()

asyncio.run(probe())  # the parent's finisher runs
assert finisher._finisher[0].running
pid = os.fork()
if pid == 0:
    code = 1
    try:
        assert not finisher._finisher[0].running  # the parent's thread is not the child's
        holder = lock({name!r}, using="x", ttl=10, fair=True)
        assert holder.acquire()
        coro = lock({name!r}, using="x", ttl=10, fair=True).aacquire(timeout=5)
        loop = asyncio.new_event_loop()
        task = loop.create_task(coro)
        loop.run_until_complete(asyncio.sleep(0.3))
        task._log_destroy_pending = False
        loop.close()
        coro.close()
        assert finisher.wait_finished(5)  # the child's own finisher left the queue
        holder.release()
        newcomer = lock({name!r}, using="x", ttl=10, fair=True)
        assert newcomer.acquire(blocking=False)
        newcomer.release()
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok", flush=True)
"""


def test_a_forked_child_runs_a_finisher_of_its_own(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    config = {
        "x": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    }
    code = textwrap.dedent(FORKED.format(config=config, name=name))
    try:
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the subprocess hung")
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.stdout, run.stderr[-3000:])
