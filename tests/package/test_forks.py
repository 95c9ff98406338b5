"""The package's one fork hook (django_redlock.forks): what a forked child forgets runs in
the child, each registered hook once, in order, even when one of them raises."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

from django_redlock import forks
from django_redlock.identity import owner_id
from django_redlock.locking import holds

SEEN: list[str] = []


@pytest.fixture
def registered() -> Iterator[list[Callable[[], None]]]:
    """Hooks a test registers, taken out again afterwards."""
    added: list[Callable[[], None]] = []
    SEEN.clear()
    yield added
    for hook in added:
        forks._hooks.remove(hook)


def in_child(look: Callable[[], str]) -> str:
    """Fork; the child sends back ``look()`` and exits at once (no pytest machinery)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, look().encode())
        finally:
            sys.stderr.flush()  # what the at-fork hooks reported
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return text


def test_hooks_run_in_the_child_in_order_and_one_raising_stops_none(
    registered: list[Callable[[], None]],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python's own report of an at-fork callback's error (pytest's hook would keep it).
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)

    def first() -> None:
        SEEN.append("first")

    def broken() -> None:
        SEEN.append("broken")
        raise RuntimeError("a hook failed")

    def last() -> None:
        SEEN.append("last")

    for hook in (first, broken, last):
        assert forks.after_fork_in_child(hook) is hook
        registered.append(hook)
    forks.after_fork_in_child(first)  # registered already: it runs once
    assert in_child(lambda: ",".join(SEEN)) == "first,broken,last"
    assert SEEN == []  # the parent ran none of them
    assert "a hook failed" in capfd.readouterr().err  # reported as an at-fork error is


def test_a_child_is_another_owner_and_a_process_of_its_own() -> None:
    parent = (owner_id(), holds.process)
    owner, process = in_child(lambda: f"{owner_id()} {holds.process}").split()
    assert owner != parent[0]
    assert int(process) == parent[1] + 1
    assert (owner_id(), holds.process) == parent


def test_the_fast_paths_thread_connections_know_the_child_is_another_process() -> None:
    # fast_path.py's connections of the parent's pid are closed in a child, never used there.
    from django_redlock import fast_path

    assert fast_path._new_process in forks._hooks  # through the one hook, in order
    child = in_child(lambda: f"{fast_path._PID} {os.getpid()}").split()
    assert child[0] == child[1] != str(os.getpid())
    assert os.getpid() == fast_path._PID


def test_a_child_forked_while_a_thread_made_the_client_makes_its_own(name: str) -> None:
    """A backend's ``_setup`` lock is held while its client is made (a cluster's reads the
    slots over the network, a socket timeout when a node is paused): a child forked then
    inherited it held by a thread it does not have, and its first operation waited forever."""
    import threading

    from django.conf import settings
    from django.test import override_settings

    from django_redlock import lock, locks

    config = {**settings.DJANGO_REDLOCK["redis"]}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "fresh": config}):
        backend = locks["fresh"]
        assert backend._client is None, "made already"
        making, forked = threading.Event(), threading.Event()

        def making_the_client() -> None:
            with backend._setup:  # as make_client() does, over the network
                making.set()
                forked.wait(10)

        thread = threading.Thread(target=making_the_client)
        thread.start()
        assert making.wait(10)

        def take() -> str:  # in the child's one thread (a new thread may reuse the ident
            # of the parent's holder, which the lock then takes for its owner)
            if not backend._setup.acquire(timeout=2):  # what the take would wait for
                return "waiting"
            backend._setup.release()
            held = lock(name, using="fresh")
            took = str(held.acquire(blocking=False))
            held.release()
            return took

        try:
            assert in_child(take) == "True"
        finally:
            forked.set()
            thread.join()
        backend.close()
