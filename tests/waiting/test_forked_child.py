"""A forked child and its parent's pub/sub subscriptions (single Redis and Cluster)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import lock
from django_redlock.testing import RedisServer

from ..conftest import ROOT

PARENT = """
import os, sys, threading, time
import django
from django.conf import settings
settings.configure(INSTALLED_APPS=["django_redlock"], DJANGO_REDLOCK={config!r})
django.setup()
from django_redlock import lock
threading.Thread(target=lambda: lock({name!r}, using="x").acquire(timeout=30), daemon=True).start()
time.sleep(0.5)  # waiting: its hub subscribed
pid = os.fork()
if pid == 0:  # a worker child that does other work
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
time.sleep(30)
"""


def _subscribers(nodes: list[RedisServer]) -> int:
    return sum(
        len(node.client().execute_command("CLIENT", "LIST", "TYPE", "pubsub").splitlines())
        for node in nodes
    )


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_forked_child_keeps_no_subscription_of_its_parent_s(
    kind: str, name: str, request: pytest.FixtureRequest
) -> None:
    """A child forked by a process that waited kept its copy of the parent's pub/sub
    socket: once the parent died the server still counted its subscription (a release's
    PUBLISH or SPUBLISH counted the dead waiter as listening, and the next waiter slept until
    the TTL). The child closes its copy (the descriptor only) right after the fork."""
    nodes: list[RedisServer]
    if kind == "redis":
        factory: Callable[..., RedisServer] = request.getfixturevalue("redis_factory")
        nodes = [factory()]
        backend = "django_redlock.backends.redis.RedisBackend"
    else:
        nodes = request.getfixturevalue("cluster_nodes")
        backend = "django_redlock.backends.cluster.RedisClusterBackend"
    config: dict[str, Any] = {"x": {"BACKEND": backend, "LOCATION": nodes[0].url}}
    before = _subscribers(nodes)
    code = textwrap.dedent(PARENT.format(config=config, name=name))
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, **config}):
        holder = lock(name, using="x", ttl=30)
        assert holder.acquire(blocking=False)
        parent = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        child = 0
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            deadline = time.monotonic() + 5
            while _subscribers(nodes) == before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _subscribers(nodes) == before + 1  # the parent's waiter's
            parent.kill()  # the parent dies; its forked child lives on
            parent.wait()
            deadline = time.monotonic() + 3
            while _subscribers(nodes) > before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _subscribers(nodes) == before, "the child kept the parent's subscription"
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait()
            if child:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
        holder.release()
