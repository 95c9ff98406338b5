"""The in-process wake-up hub: one waiter per release, and no release ever lost."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from django_redlock.waiters import CompositeHub
from django_redlock.waiting import ReleaseHub


def test_a_release_wakes_one_waiter_the_longest_waiting() -> None:
    hub = ReleaseHub()
    with hub.watch("c") as first, hub.watch("c") as second:
        hub.notify("c")
        assert first.wait(0) is True
        assert second.wait(0) is False  # only one can win: only one is woken


def test_a_release_during_a_retry_is_not_lost() -> None:
    hub = ReleaseHub()
    with hub.watch("c") as waiter:
        hub.notify("c")  # a release: the waiter wakes and goes to try again
        assert waiter.wait(0) is True
        hub.notify("c")  # another release, while that try is on its way
        waiter.baton = False  # the try is done: it failed (someone took the lock meanwhile)
        assert waiter.wait(0) is True  # the second release is still there: it tries again


def test_a_woken_waiter_that_leaves_passes_the_wake_on() -> None:
    hub = ReleaseHub()
    with hub.watch("c") as second:
        with hub.watch("c"):
            hub.notify("c")  # wakes the first one, which then times out without trying
        assert second.wait(0) is True  # so the release reaches the second one


def test_a_wake_up_for_an_abandoned_waiter_runs_its_leave_once() -> None:
    # The server still has the id first in line: its wake-up is the cue to leave for it.
    plain = ReleaseHub()
    nodes = [ReleaseHub(), ReleaseHub()]  # a Redlock's: each node's hub hears the wake-up
    for hub, hearing in ((plain, [plain]), (CompositeHub(nodes, 0), nodes)):
        ran: list[str] = []
        done = threading.Event()
        for each in hearing:
            each.notify("p.2")  # never abandoned: nothing to do
        with hub.watch("p.1", by_id=True) as waiter:
            hub.abandon("p.1", lambda ran=ran, done=done: (ran.append("p.1"), done.set()))
            hearing[0].notify("p.1")  # still watched: woken, no leave yet
            assert waiter.wait(0) is True
            assert not done.wait(0.1) and ran == []
        # Gone without trying: the wake-up it held is passed on, to the leave.
        assert done.wait(5)
        for each in hearing:
            each.notify("p.1")
        time.sleep(0.1)
        assert ran == ["p.1"]


def test_abandoned_waiters_over_the_bound_are_left_at_once() -> None:
    """The registry is bounded; the oldest entry over the bound was forgotten, so a wake-up
    for it was heard by nobody and the lock's next waiter slept until the hold's expiry:
    it is left at once instead (its leave runs), and never twice."""
    hub = ReleaseHub()
    hub.SETTING_UP = 0.0  # abandoned long ago: none still setting up
    ran: list[int] = []
    for i in range(hub.ABANDONED_MAX + 1):
        hub.abandon(f"p.{i}", lambda i=i: ran.append(i))
    time.sleep(0.2)
    assert ran == [0]  # the oldest, left now
    hub.notify("p.0")
    hub.notify(f"p.{hub.ABANDONED_MAX}")
    time.sleep(0.2)
    assert ran == [0, hub.ABANDONED_MAX]


def test_an_abandoned_waiter_left_for_the_bound_whose_leave_fails_is_kept() -> None:
    """Its leave sent at once failed (the server away): it was dropped, "its entry lapses on
    the server", but a plain lock's waiters set lapses only when nobody waits: the next
    release woke the dead id, nobody here ran its leave, the next waiter slept to the TTL.
    Kept (over the bound), the wake-up for it runs the leave again."""
    hub = ReleaseHub()
    hub.SETTING_UP = 0.0
    tries: list[int] = []

    def leave() -> None:
        tries.append(0)
        if len(tries) == 1:
            raise ConnectionError("the server is away")

    hub.abandon("p.old", leave)
    for i in range(hub.ABANDONED_MAX):
        hub.abandon(f"p.{i}", lambda: None)
    time.sleep(0.2)
    assert tries == [0]  # left at once, and failed
    hub.notify("p.old")
    time.sleep(0.2)
    assert tries == [0, 0]


def test_a_waiter_still_watching_is_never_left_for_the_bound() -> None:
    hub = ReleaseHub()
    hub.SETTING_UP = 0.0
    ran: list[int] = []
    with hub.watch("p.live", by_id=True):
        hub.abandon("p.live", lambda: ran.append(-1))  # a waiter's leave, held from its start
        for i in range(hub.ABANDONED_MAX):
            hub.abandon(f"p.{i}", lambda i=i: ran.append(i))
        time.sleep(0.2)
        assert ran == [0]  # not the live one, though older


def test_a_waiter_still_setting_up_is_never_left_for_the_bound() -> None:
    """Past ABANDONED_MAX waiters watching in one process, the newest one's leave (held from
    before its first try, abandoned just before it starts watching) was the one left at
    once, not being watched yet: a fair waiter lost its queue place as it joined."""
    hub = ReleaseHub()
    ran: list[str] = []
    with contextlib.ExitStack() as watching:
        for i in range(hub.ABANDONED_MAX):
            hub.abandon(f"p.{i}", lambda i=i: ran.append(str(i)))
            watching.enter_context(hub.watch(f"p.{i}", by_id=True))
        hub.abandon("p.new", lambda: ran.append("new"))
        with hub.watch("p.new", by_id=True):
            time.sleep(0.2)
            assert ran == []
    assert len(hub._abandoned) == hub.ABANDONED_MAX + 1  # all kept: each may be woken


def test_a_leave_for_an_abandoned_waiter_that_fails_is_tried_at_the_next_wake_up() -> None:
    nodes = [ReleaseHub(), ReleaseHub()]
    for hub, hearing in ((ReleaseHub(), None), (CompositeHub(nodes, 0), nodes)):
        tries: list[int] = []
        done = threading.Event()

        def leave(tries: list[int] = tries, done: threading.Event = done) -> None:
            tries.append(1)
            if len(tries) == 1:
                raise ConnectionError("cut")
            done.set()

        hub.abandon("p.1", leave)
        for each in hearing or [hub]:
            each.notify("p.1")
            time.sleep(0.1)  # the first (failing) leave is done before the next wake-up
        if hearing is None:
            hub.notify("p.1")
        assert done.wait(5)
        assert len(tries) == 2


def test_a_wake_up_for_an_abandoned_waiter_when_no_thread_can_start_keeps_the_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """notify() runs on the pub/sub reader's thread: a thread that cannot start (a pids
    limit) must not end that reader; the leave is kept for the next wake-up."""
    hub = ReleaseHub()
    done = threading.Event()
    hub.abandon("p.1", done.set)

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", refused)
        hub.notify("p.1")  # raised out of the reader before
    assert not done.is_set()
    hub.notify("p.1")
    assert done.wait(5)


def test_a_closed_hub_hands_over_the_leaves_of_waiters_gone_not_of_those_watching() -> None:
    """A watching waiter moves to the next hub with its own leave; handed over too, a
    wake-up reaching the next hub before the waiter would run it and drop a live waiter."""
    hub, heir = ReleaseHub(), ReleaseHub()
    hub.abandon("p.gone", lambda: None)
    with hub.watch("p.live", by_id=True):
        hub.abandon("p.live", lambda: None)
        hub.close()
        hub.hand_over(heir.take_over)
        assert set(heir._abandoned) == {"p.gone"}
        hub.abandon("p.late", lambda: None)  # abandoned after the close: to the heir
    assert set(heir._abandoned) == {"p.gone", "p.late"}
