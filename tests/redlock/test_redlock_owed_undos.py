"""An acquire's undo owed to a node (redlock_io.Debts) never deletes the grant of a later try
with the same token (a Lock whose try got no answer tries again with its token), on either
driver; and the asyncio driver pays a node's debts before its own request to it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from django_redlock import LockError, QuorumNotReached, lock
from django_redlock.backends import redlock_io
from django_redlock.backends.base import Kind
from django_redlock.backends.redlock import RedlockBackend
from django_redlock.backends.redlock_io import OWED_POLL
from django_redlock.testing import RedisServer

from .test_redlock import quorum_alias, running_long_since
from .test_redlock_io import backend_of


@pytest.fixture
def three(redis_factory: Callable[..., RedisServer]) -> list[RedisServer]:
    return [redis_factory() for _ in range(3)]


def _tokens(servers: list[RedisServer], backend: RedlockBackend, name: str) -> list[bytes]:
    key = backend.nodes[0].key(name)
    return [(s.client().get(key) or b"-").split(b"|")[0] for s in servers]


def _other_lock(name: str, alias: str) -> None:
    other = lock(name, using=alias, ttl=5, auto_renew=False)
    assert other.acquire(blocking=False)
    other.release()


def _assert_held(tokens: list[bytes], token: bytes) -> None:
    """The retry's hold is on a majority (a node it did not ask, an undo being under way
    there, may have lost the earlier try's grant to that undo: not counted)."""
    assert sum(t == token for t in tokens) >= 2, f"an owed undo deleted the retry's: {tokens}"
    assert set(tokens) <= {token, b"-"}, tokens


def _try(name: str, alias: str) -> None:
    with contextlib.suppress(LockError):
        lock(name, using=alias, ttl=30, auto_renew=False).acquire(blocking=False)


def _until_paid(backend: RedlockBackend, name: str, alias: str) -> None:
    """Sync requests (which carry what is owed) until nothing is owed (paid, or void)."""
    until = time.monotonic() + 3
    while backend.io.debts.any and time.monotonic() < until:
        _other_lock(name, alias)
        time.sleep(0.05)
    _other_lock(name, alias)


def _fail_beside_two_paused(servers: list[RedisServer], tries: Callable[[], object]) -> None:
    """Nodes 1 and 2 stopped: the try gets QuorumNotReached, its undo is owed to both."""
    servers[1].pause()
    servers[2].pause()
    try:
        with pytest.raises(LockError):
            tries()
        time.sleep(0.7)  # the undo's requests to nodes 1 and 2 time out: owed
    finally:
        servers[1].resume()
        servers[2].resume()
    time.sleep(0.05)


def test_an_async_retry_s_grant_is_not_deleted_by_the_undo_its_failed_try_owed(
    three: list[RedisServer], name: str
) -> None:
    """The retry reused the token, asyncio requests sent nothing owed first, so the retry was
    granted on every node with the undo of that very token still owed; the next sync request
    paid it (the hold deleted on two nodes) and another client took the lock beside it."""
    with quorum_alias("adebt", three, socket_timeout=0.5):
        backend = backend_of("adebt")
        mine = lock(name, using="adebt", ttl=30, auto_renew=False)

        async def run() -> bool:
            assert not await lock(f"{name}:warm", using="adebt").alocked()
            three[1].pause()
            three[2].pause()
            try:
                with pytest.raises(LockError):
                    await mine.aacquire(blocking=False)
                await asyncio.sleep(0.7)  # the undo's requests to nodes 1 and 2 time out: owed
            finally:
                three[1].resume()
                three[2].resume()
            await asyncio.sleep(0.05)
            return await mine.aacquire(blocking=False)  # the same token: the same Lock

        assert asyncio.run(run())
        token = mine.token.encode()
        _until_paid(backend, f"{name}:sync", "adebt")  # sync requests carry what is owed
        _assert_held(_tokens(three, backend, name), token)
        other = lock(name, using="adebt", ttl=30, auto_renew=False)
        assert not other.acquire(blocking=False), "two holders at once"
        mine.release()


def test_a_sync_retry_s_grant_is_not_deleted_by_the_undo_its_failed_try_owed(
    three: list[RedisServer], name: str
) -> None:
    """Sync: the undo owed to nodes still down is held back for them; the retry (which
    needs their votes) was granted there first, and a later request paid the undo."""
    with quorum_alias("sdebt", three, socket_timeout=0.5):
        backend = backend_of("sdebt")
        mine = lock(name, using="sdebt", ttl=30, auto_renew=False)
        assert not lock(f"{name}:warm", using="sdebt").locked()
        _fail_beside_two_paused(three, lambda: mine.acquire(blocking=False))
        assert mine.acquire(blocking=False)  # the same token
        token = mine.token.encode()
        _until_paid(backend, f"{name}:sync", "sdebt")
        _assert_held(_tokens(three, backend, name), token)
        other = lock(name, using="sdebt", ttl=30, auto_renew=False)
        assert not other.acquire(blocking=False), "two holders at once"
        mine.release()


def test_an_undo_owed_to_a_node_that_answers_is_paid_by_the_next_async_request(
    three: list[RedisServer], name: str
) -> None:
    """In a process that only uses asyncio, an undo owed to a node counted up was never sent
    (the collector sends releases only; only a sync request carried it)."""
    with quorum_alias("apay", three, socket_timeout=0.5):
        backend = backend_of("apay")
        node = backend.nodes[0]
        three[0].client().set(node.key(name), "tok|1|0|", px=30_000)
        backend.io.debts.owe(0, backend._node_undo(node, name, "tok", quiet=True), "undo")

        async def other() -> None:
            assert not await lock(f"{name}:other", using="apay").alocked()
            await asyncio.sleep(0.3)  # a node not waited for still answers within the loop

        asyncio.run(other())
        assert three[0].client().get(node.key(name)) is None, "the undo owed was not sent"


def test_a_try_is_not_sent_to_a_node_where_an_undo_of_its_token_is_under_way(
    three: list[RedisServer], name: str
) -> None:
    """Node 2 down, node 1 paused: another thread's request carried the undo owed to node 1,
    written on its connection and not answered. A try with the same token, which needs node
    1's vote, was written there on another connection: had the node resumed then, either
    could run first, and the undo would delete the try's grant. Node 1 is not asked."""
    with quorum_alias("busy", three, socket_timeout=0.5):
        backend = backend_of("busy")
        node = backend.nodes[1]
        _other_lock(f"{name}:warm", "busy")
        three[2].pause()
        try:
            until = time.monotonic() + 5
            while not backend.io.health.is_down(2) and time.monotonic() < until:
                with contextlib.suppress(LockError):
                    lock(f"{name}:tick", using="busy").locked()
            three[1].client().set(node.key(name), "tok|1|0|", px=30_000)  # a lost grant
            backend.io.debts.owe(1, backend._node_undo(node, name, "tok", quiet=True), "undo")
            three[1].pause()
            try:
                carrier = threading.Thread(target=_try, args=(f"{name}:other", "busy"))
                carrier.start()  # its request to node 1 carries the undo first
                time.sleep(0.05)
                with pytest.raises(LockError) as raised:
                    backend.execute(backend.op_acquire(name, "tok", 30_000, "", Kind()))
                carrier.join()
            finally:
                three[1].resume()
        finally:
            three[2].resume()
        assert f"node {node.alias!r} was not asked" in str(raised.value)


def test_an_undo_another_thread_took_to_send_is_seen_by_a_retry_of_its_token(
    three: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's request took the undos owed to nodes 1 and 2 off the books and was
    descheduled before marking them under way: the retry (same token) found them neither
    owed nor under way, was granted on every node, and the undos written after it deleted
    its grant on nodes 1 and 2: a second client took the lock beside it."""
    with quorum_alias("race", three, socket_timeout=0.5):
        backend = backend_of("race")
        mine = lock(name, using="race", ttl=30, auto_renew=False)
        for n in range(3):
            _other_lock(f"{name}:warm{n}", "race")
        three[1].pause()
        three[2].pause()
        try:
            with pytest.raises(LockError):
                mine.acquire(blocking=False)
        finally:
            three[1].resume()
            three[2].resume()
        until = time.monotonic() + 5
        while (backend.io.health.down() or not all(backend.io.debts._owed[1:])) and (
            time.monotonic() < until
        ):
            time.sleep(0.05)
        assert all(backend.io.debts._owed[1:]), "the undo is owed to nodes 1 and 2"
        taken = threading.Semaphore(0)
        note = redlock_io.Flight.note

        def slow_note(flight: redlock_io.Flight, at: int, count: int, op: Any, kind: str) -> None:
            if (
                threading.current_thread().name.startswith("bystander")
                and isinstance(op, redlock_io.Undo)
                and op.name == name
            ):
                taken.release()
                time.sleep(1.0)  # descheduled right after taking the undo off the books
            note(flight, at, count, op, kind)

        monkeypatch.setattr(redlock_io.Flight, "note", slow_note)
        bystanders = [
            threading.Thread(
                target=_other_lock, args=(f"{name}:by{n}", "race"), name=f"bystander{n}"
            )
            for n in range(2)
        ]
        for thread in bystanders:
            thread.start()
        for _ in range(2):
            assert taken.acquire(timeout=5), "the bystanders took both undos"
        try:  # the same token; refused by the nodes where an undo of it is under way
            got = mine.acquire(blocking=False)
        except LockError:
            got = False
        for thread in bystanders:
            thread.join()
        time.sleep(0.2)
        other = lock(name, using="race", ttl=30, auto_renew=False)
        assert not (got and other.acquire(blocking=False)), "two holders at once"
        if got:
            mine.release()


def test_a_dead_reference_an_interrupt_left_in_the_undo_books_changes_nothing(
    three: list[RedisServer], name: str
) -> None:
    """A KeyboardInterrupt landing in a WeakSet's removal callback (a signal storm) is
    swallowed by Python ("Exception ignored in ... WeakSet._remove") and may leave the dead
    reference in ``Debts``' sets of undos under way. A dead reference equals only itself and
    iteration skips it: an acquire of the same key and token still asks every node (none
    kept as "an undo under way"), one script call each, and nothing owed is sent."""
    running_long_since(three)
    with quorum_alias("dead", three):
        backend = backend_of("dead")
        node = backend.nodes[0]
        _other_lock(f"{name}:warm", "dead")
        debts = backend.io.debts
        for i in range(3):
            undo = backend._node_undo(node, name, "tok", quiet=True)
            # As if its callback never ran: a reference without one, its undo then gone.
            debts._sending[i].data.add(weakref.ref(undo))
            debts._undos.data.add(weakref.ref(undo))
            del undo
        assert all(debts._sending) and not list(debts._sending[0])  # dead, and still there
        before = three[0].settled_script_calls(*three[1:])
        got = backend.execute(backend.op_acquire(name, "tok", 30_000, "", Kind()))
        after = three[0].settled_script_calls(*three[1:])
        assert got.acquired
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
        assert _tokens(three, backend, name) == [b"tok"] * 3


def test_an_async_undo_cancelled_by_asyncio_run_s_shutdown_is_sent_by_the_collector(
    three: list[RedisServer], name: str
) -> None:
    """Nodes 1 and 2 stopped: the acquire gets QuorumNotReached, its undo is not waited for.
    Node 0, which granted, holds the undo back (CLIENT PAUSE) from the moment the undo's
    fan-out starts until after asyncio.run returned: its shutdown cancels the undo's task,
    whose connection is closed (the paused node drops what it read). Owed as an undo, it
    waited for this process's next request to node 0: none came, and the hold stayed there
    to its TTL (30 s). The acquire had run there (node 0 answered it): owed as a release,
    the collector sends it."""
    timeout, held_back_ms = 0.5, 300
    with quorum_alias("aundo", three, socket_timeout=timeout):
        key = backend_of("aundo").nodes[0].key(name)
        paused: list[float] = []

        def hold_back_the_undo(frame: Any, event: str, arg: Any) -> None:
            undo = getattr(frame.f_locals.get("fan"), "owed", "") == "undo"
            if event == "call" and frame.f_code.co_name == "_aask" and undo and not paused:
                three[0].client().execute_command("CLIENT", "PAUSE", held_back_ms, "ALL")
                paused.append(time.monotonic())

        async def main() -> None:
            assert not await lock(f"{name}:warm", using="aundo").alocked()
            three[1].pause()
            three[2].pause()
            mine = lock(name, using="aundo", ttl=30, auto_renew=False)
            sys.settrace(hold_back_the_undo)
            try:
                with pytest.raises(QuorumNotReached):
                    await mine.aacquire(blocking=False)
            finally:
                sys.settrace(None)
            # Returns with the undo's task still waiting for node 0: asyncio.run cancels it.

        try:
            asyncio.run(main())
        finally:
            three[1].resume()
            three[2].resume()
        assert paused, "the undo's fan-out never started"
        unpaused = paused[0] + held_back_ms / 1000
        # From node 0's unpause: the collector sends it within its poll (0.1 s), answered
        # within a node timeout. Waited for up to 5 s (the hold's TTL is 30 s).
        deadline = time.monotonic() + 5
        while three[0].client().exists(key):
            assert time.monotonic() < deadline, "the undo never reached node 0"
            time.sleep(0.005)
        landed = time.monotonic() - unpaused
        assert landed < OWED_POLL + timeout, landed


def test_a_release_owed_under_a_kept_token_never_deletes_the_retry_s_grant(
    three: list[RedisServer], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt after the grant, before it was recorded: the hand-back's release got no
    quorum (nodes 1 and 2 stopped), was owed to them, and the Lock kept its token for the
    next try. The probes finding the nodes back took the release off the books, and were
    descheduled before sending it (held here until the retry returned): the retry, with that
    token, was granted on every node, and the release then deleted its grant on nodes 1 and
    2: a second Lock took the same name. Owed, a release was made void once a try of its
    token is sent, as an undo is; but this one was written to the stopped nodes and never
    answered, so it may still run there late (redlock_io ``Debts.burn``): the retry takes a
    new token instead, and the owed release is paid."""
    with quorum_alias("handback", three, socket_timeout=0.5):
        backend = backend_of("handback")
        for n in range(3):
            _other_lock(f"{name}:warm{n}", "handback")
        mine = lock(name, using="handback", ttl=30, auto_renew=False)
        record = type(mine)._record

        granted: list[str] = []

        def interrupted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self is mine:
                granted.append(args[2])  # (owner, actor, token, ...)
                three[1].pause()
                three[2].pause()
                raise RuntimeError("soft time limit")  # the grant is not recorded
            return record(self, *args, **kwargs)

        monkeypatch.setattr(type(mine), "_record", interrupted)
        try:
            with pytest.raises(RuntimeError):
                mine.acquire(blocking=False)
            monkeypatch.setattr(type(mine), "_record", record)
            (token,) = granted
            time.sleep(0.7)  # the hand-back's requests to nodes 1 and 2 time out: owed
            assert all(backend.io.debts._owed[1:]), "the release is owed to nodes 1 and 2"
        finally:
            three[1].resume()
            three[2].resume()
        taken = threading.Semaphore(0)
        retried = threading.Event()
        paid = threading.Semaphore(0)
        pay = redlock_io.Debts._pay

        def slow_pay(debts: redlock_io.Debts, i: int, ops: list[Any], undo: bool) -> None:
            ours = any(op.name == name for op in ops)
            if ours:  # descheduled right after taking the release off the books
                taken.release()
                retried.wait(5)
            try:
                pay(debts, i, ops, undo)
            finally:
                if ours:
                    paid.release()

        monkeypatch.setattr(redlock_io.Debts, "_pay", slow_pay)
        for _ in range(2):
            assert taken.acquire(timeout=5), "the probes took the release owed to nodes 1, 2"
        try:
            got = mine.acquire(blocking=False)
        finally:
            retried.set()
        for _ in range(2):
            assert paid.acquire(timeout=5)
        # The release was written to the stopped nodes and never answered: it may still
        # run there late, so the retry took a new token (not void, the owed one was paid).
        assert mine._unsure_token is None
        assert token.encode() not in _tokens(three, backend, name), "the release was paid"
        other = lock(name, using="handback", ttl=30, auto_renew=False)
        if got:
            assert mine.token != token
            assert not other.acquire(blocking=False), "two holders at once"
            mine.release()
        else:  # refused by the old hold, since released
            assert other.acquire(blocking=False)
            other.release()


def test_the_collector_stops_while_only_an_undo_to_a_node_that_answers_is_owed(
    three: list[RedisServer], name: str
) -> None:
    """The collector sends releases only (an undo could overtake the acquire it undoes), yet
    it ran while anything was owed: an undo owed to a node that answers kept it polling
    every 0.1 s for ever (review rr, 4). It now stops (or never starts); the undo is paid by
    the next request to the node, and by the probe once that node is down."""
    with quorum_alias("undoonly", three, socket_timeout=0.5):
        backend = backend_of("undoonly")
        io, debts = backend.io, backend.io.debts
        _other_lock(f"{name}:warm", "undoonly")
        deadline = time.monotonic() + 3
        while debts._collector is not None:  # the warm-up's, if any
            assert time.monotonic() < deadline
            time.sleep(0.02)
        key = backend.nodes[0].key(name)
        three[0].client().set(key, "tok|1|0|{}", px=30000)
        debts.owe(0, backend._node_undo(backend.nodes[0], name, "tok", False), "undo")
        time.sleep(3 * OWED_POLL)
        assert debts._collector is None, "the collector polls for an undo it never sends"
        assert [len(owed) for owed in debts._owed] == [1, 0, 0]
        assert three[0].client().exists(key), "not sent by the collector"
        _other_lock(f"{name}:next", "undoonly")  # the next request to node 0 pays it first
        assert not three[0].client().exists(key)
        assert not debts.any
        # Owed to a node down, it is the probe's to pay: the collector runs for it.
        three[0].client().set(key, "tok|1|0|{}", px=30000)
        debts.owe(0, backend._node_undo(backend.nodes[0], name, "tok", False), "undo")
        io.health.failed(0)
        debts.collect()
        deadline = time.monotonic() + 5
        while three[0].client().exists(key) or debts._collector is not None:
            assert time.monotonic() < deadline, (
                "the probe never paid the undo, or the collector ran on"
            )
            time.sleep(0.02)


def test_debts_an_async_request_took_to_pay_are_owed_again_when_its_loop_is_closed_plainly(
    three: list[RedisServer], name: str
) -> None:
    """A release owed to node 0 (up), taken off the books by an async request that pays it
    first; node 0 stopped meanwhile, the request's other nodes decide, and the caller closes
    its loop plainly (``run_until_complete(); close()``): the coroutine never resumes. The
    debt was held by it alone: lost, the released hold stayed on node 0 to its TTL (review
    rr, 3). It is noted in ``_open`` before it leaves the books: the collector owes it
    again, and pays it once node 0 answers."""
    with quorum_alias("apaylost", three, socket_timeout=0.5):
        backend = backend_of("apaylost")
        debts = backend.io.debts
        _other_lock(f"{name}:warm", "apaylost")
        key = backend.nodes[0].key(name)
        three[0].client().set(key, "tok|1|0|{}", px=30000)
        debts._collector, debts._beat = object(), time.monotonic() + 60  # none: held off
        release = backend.nodes[0].op_release(name, "tok", Kind())
        debts.owe(0, release, "release")
        three[0].pause()
        try:

            async def other() -> None:
                # A fresh loop: a connection of its own, whose set-up node 0 never answers.
                with contextlib.suppress(LockError):
                    await lock(f"{name}:other", using="apaylost").alocked()

            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(other())
                assert not debts.any, "the async request took the debt to pay it first"
            finally:
                loop.close()
        finally:
            three[0].resume()
        debts._collector = None
        debts.watch()
        deadline = time.monotonic() + 3
        while three[0].client().exists(key):
            assert time.monotonic() < deadline, "the debt the closed loop held was lost"
            time.sleep(0.02)
