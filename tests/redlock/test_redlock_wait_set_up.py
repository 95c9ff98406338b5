"""A Redlock wait whose nodes stop answering during its set-up (the subscriptions, after the
first try's refusal) answers within one socket timeout: its set-up and its try share it, and
a paused minority costs the wait nothing.

The set-up subscribed on each node in turn, in the caller's thread: a node paused since its
last answer held it for the connect's handshake (the process's first wait), or for the
confirmation that never came, and the try then waited for the same nodes again."""

from __future__ import annotations

import asyncio
import ctypes
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import lock, locks
from django_redlock.exceptions import BackendUnavailable, QuorumNotReached
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias

SOCKET_TIMEOUT = 1.0
SLACK = 0.6  # a loaded machine's scheduling (1.42 s seen); a second timeout would be 1 s more


@pytest.fixture
def three(redis_factory: Callable[..., RedisServer]) -> Iterator[list[RedisServer]]:
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("setup", servers, socket_timeout=SOCKET_TIMEOUT):
        yield servers


def _warm(name: str) -> None:
    """This process waited before: the nodes' pub/sub connections are open."""
    other = lock(f"{name}:warm", using="setup", ttl=5)
    assert other.acquire(blocking=False)
    assert not lock(f"{name}:warm", using="setup").acquire(timeout=0.1)
    other.release()


def _wait(
    servers: list[RedisServer], paused: list[int], name: str, timeout: float, use_async: bool
) -> tuple[Any, float, float]:
    """A wait on ``name`` (held) whose nodes ``paused`` stop once its first try was refused,
    just before it subscribes. Its outcome (the exception raised, or what it returned), how
    long it took, and how long since the nodes stopped."""
    hub = locks["setup"].hub
    join = hub.join
    paused_at: list[float] = []

    def pausing_join(*args: Any, **kwargs: Any) -> Any:
        paused_at.append(time.monotonic())
        for i in paused:
            servers[i].pause()
        return join(*args, **kwargs)

    hub.join = pausing_join  # type: ignore[method-assign]
    waiter = lock(name, using="setup", ttl=10)
    started = time.monotonic()
    try:
        if use_async:
            outcome: Any = asyncio.run(waiter.aacquire(timeout=timeout))
        else:
            outcome = waiter.acquire(timeout=timeout)
    except Exception as exc:
        outcome = exc
    finally:
        ended = time.monotonic()
        del hub.join
        for server in servers:
            server.resume()
    return outcome, ended - started, ended - paused_at[0]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("warm", [False, True], ids=["first-wait", "warm"])
def test_a_majority_paused_during_the_set_up_fails_the_wait_within_one_timeout(
    three: list[RedisServer], name: str, warm: bool, use_async: bool
) -> None:
    """2.0 s (warm: the confirmations waited for, then the try) and 3.0 s (the first wait:
    two handshakes in turn, then the try) for a 1 s socket timeout.

    Timed from the moment the nodes stopped answering (the promise): the first try, before
    that, was answered, and an asyncio wait's (a fresh loop's connects to every node first)
    is as slow as the machine (the whole wait took 1.79 s on a loaded CI)."""
    holder = lock(name, using="setup", ttl=60, auto_renew=False)
    assert holder.acquire(blocking=False)
    if warm:
        _warm(name)
    outcome, _, silent = _wait(three, [0, 1], name, 10, use_async)
    assert isinstance(outcome, (BackendUnavailable, QuorumNotReached)), outcome
    assert silent < SOCKET_TIMEOUT + SLACK, f"{silent:.2f} s"


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("warm", [False, True], ids=["first-wait", "warm"])
def test_a_node_paused_during_the_set_up_costs_the_wait_nothing(
    three: list[RedisServer], name: str, warm: bool, use_async: bool
) -> None:
    """One node of three paused: the other two hear the release. A wait of 0.3 s took the
    whole socket timeout (1.0 s) in its set-up."""
    holder = lock(name, using="setup", ttl=60, auto_renew=False)
    assert holder.acquire(blocking=False)
    if warm:
        _warm(name)
    outcome, elapsed, _ = _wait(three, [0], name, 0.3, use_async)
    assert outcome is False, outcome
    assert elapsed < 0.3 + 0.4, f"{elapsed:.2f} s"  # well under the 1 s a wait for it costs


def test_a_waiter_joining_while_nodes_are_not_warm_still_hears_a_majority(
    three: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's request, interrupted while nodes 1 and 2 were paused, dropped its
    connections to them (not warm, not down). A waiter joining then subscribed on node 0
    alone, its set-up counted as confirmed with one node, and it never joined the others
    when they answered again: the holder's hold (on nodes 1 and 2, node 0 restarted empty)
    was released on them only, and the waiter slept until the hold's TTL."""
    backend = locks["setup"]
    for n in range(3):
        _warm(f"{name}:{n}")
    holder = lock(name, using="setup", ttl=8, auto_renew=False)
    assert holder.acquire(blocking=False)
    three[0].client().delete(backend.nodes[0].key(name))  # node 0 restarted empty
    gate, at_join = threading.Event(), threading.Event()
    join = backend.hub.join

    def gated_join(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "waiter" and not gate.is_set():
            at_join.set()  # descheduled between its first try and its set-up
            gate.wait(5)
        return join(*args, **kwargs)

    monkeypatch.setattr(backend.hub, "join", gated_join)
    got: list[float] = []

    def waiter() -> None:
        other = lock(name, using="setup", ttl=8, auto_renew=False)
        if other.acquire(timeout=10):
            got.append(time.monotonic())
            other.release()

    thread = threading.Thread(target=waiter, name="waiter")
    thread.start()
    assert at_join.wait(5)

    class Interrupt(Exception):
        pass

    def interrupt(*_: Any) -> None:
        raise Interrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for server in three[1:]:
            server.client().execute_command("CLIENT", "PAUSE", 300, "ALL")
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Interrupt):
            lock(f"{name}:other", using="setup").locked()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    gate.set()
    time.sleep(1.0)
    released = time.monotonic()
    holder.release()
    thread.join(12)
    assert got, "the waiter did not get the free lock"
    assert got[0] - released < 2.0, "the waiter was not woken by the release"


def _hold_the_gil(seconds: float) -> None:
    """A pause of this whole process (a full garbage collection, CPU starvation): no other
    thread of it runs meanwhile (a PyDLL call keeps the GIL)."""
    ctypes.PyDLL(None).usleep(int(seconds * 1_000_000))


def test_a_pause_of_the_waiting_process_is_not_the_nodes_silence(
    redis_factory: Callable[..., RedisServer],
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Healthy nodes confirm the wait's subscriptions within a millisecond, but this process
    stalls 0.3 s (past the 0.1 s set-up deadline) right after subscribing: the confirmations
    sat in the sockets, the hub's readers could not run, and nothing read them once the
    deadline had passed: BackendUnavailable ("too few nodes confirmed") on healthy nodes.
    What has come is read before a node counts as silent."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("stall", servers, socket_timeout=0.1):
        backend = locks["stall"]
        holder = lock(name, using="stall", ttl=10, auto_renew=False)
        assert holder.acquire(blocking=False)
        warm = lock(name, using="stall", ttl=10)
        assert not warm.acquire(timeout=0.2)  # the pub/sub connections are open
        join = backend.hub.join

        def stalling_join(*args: Any, **kwargs: Any) -> Any:
            out = join(*args, **kwargs)
            _hold_the_gil(0.3)  # the SUBSCRIBEs are written; their replies come meanwhile
            return out

        monkeypatch.setattr(backend.hub, "join", stalling_join)
        threading.Timer(0.5, holder.release).start()
        waiter = lock(name, using="stall", ttl=10, auto_renew=False)
        assert waiter.acquire(timeout=3)
        monkeypatch.undo()
        waiter.release()


def test_confirmations_come_and_unread_by_starved_readers_are_waited_for(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The hubs' readers starve (a fresh process's 150 threads on two cores: 13 of them got
    BackendUnavailable on five healthy nodes) while the waiting thread runs on time: the
    confirmations had come and sat unread in the sockets at the set-up's deadline. Replies
    come and unread give the readers one more timeout before a node counts as silent."""
    servers = [redis_factory() for _ in range(3)]
    with quorum_alias("starved", servers, socket_timeout=0.5):
        backend = locks["starved"]
        holder = lock(name, using="starved", ttl=10, auto_renew=False)
        assert holder.acquire(blocking=False)
        assert not lock(name, using="starved").acquire(timeout=0.1)  # the readers run
        entered = [threading.Event() for _ in servers]
        release_at: list[float] = []
        originals = []
        for i, hub in enumerate(backend.hub.hubs):
            pubsub = hub._pubsub
            get_message = pubsub.get_message
            originals.append((pubsub, get_message))

            def starved(*args: Any, _i: int = i, _get: Any = get_message, **kwargs: Any) -> Any:
                entered[_i].set()  # not reading until told
                while not release_at or time.monotonic() < release_at[0]:
                    time.sleep(0.005)
                return _get(*args, **kwargs)

            pubsub.get_message = starved
        try:
            for event in entered:
                assert event.wait(5)  # every reader is past its last read
            release_at.append(time.monotonic() + 0.75)  # past the set-up's 0.5 s
            threading.Timer(1.0, holder.release).start()
            waiter = lock(name, using="starved", ttl=10, auto_renew=False)
            assert waiter.acquire(timeout=3)
            waiter.release()
        finally:
            release_at.append(0.0)
            for pubsub, get_message in originals:
                pubsub.get_message = get_message
