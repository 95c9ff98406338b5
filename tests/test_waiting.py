"""The in-process wake-up hub: one waiter per release, and no release ever lost."""

from __future__ import annotations

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
