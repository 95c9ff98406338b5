"""Leader election (``django_redlock.leader``): candidates in real processes
(tests/support/child.py ``lead`` and ``who``), and the
term's loss, resignation and asyncio form here."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import (
    BackendUnavailable,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    Term,
    current_leader,
    leader,
    locks,
    run_as_leader,
)
from django_redlock.leader import Keeper, _resign_all
from django_redlock.testing import RedisServer

from ..conftest import Child


def leading(candidates: list[Child], timeout: float) -> tuple[Child, int]:
    """The one candidate that says LEADING within ``timeout`` s, and its fence."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for each in candidates:
            line = each.poll()
            if line is not None and line.startswith("LEADING"):
                return each, int(line.split()[1])
        time.sleep(0.01)
    raise AssertionError(f"nobody led within {timeout:g} s: {[c.seen for c in candidates]}")


def test_three_candidates_one_leads_and_a_sigkilled_leader_is_followed_within_the_ttl(
    child: Callable[..., Child], name: str
) -> None:
    candidates = [child("lead", "--name", name, "--ttl", "3") for _ in range(3)]
    for each in candidates:
        each.expect("CAMPAIGNING")
    first, fence = leading(candidates, 60)
    time.sleep(0.3)
    assert not any(c.poll() for c in candidates if c is not first)  # nobody else leads
    # A fourth process names the leader.
    assert child("who", "--name", name).expect("LEADER") == f"True {first.process.pid} {fence}"
    first.process.kill()
    killed = time.monotonic()
    rest = [c for c in candidates if c is not first]
    second, fence2 = leading(rest, 10)
    assert time.monotonic() - killed < 3 + 3  # within the TTL (plus a loaded machine's seconds)
    assert fence2 > fence
    assert child("who", "--name", name).expect("LEADER") == f"True {second.process.pid} {fence2}"


def test_a_leader_paused_past_its_lease_sees_term_lost_at_its_first_look_after_waking(
    child: Callable[..., Child], name: str
) -> None:
    """SIGSTOP past the lease: another candidate leads. The woken leader's first look at
    ``term.lost`` must say so, before its keeper thread has had a turn (it said "leading"
    for one more step of work, beside the new leader)."""
    first = child("lead", "--name", name, "--ttl", "2", "--work")
    first.expect("CAMPAIGNING")
    first.expect("LEADING")
    time.sleep(0.5)
    os.kill(first.process.pid, signal.SIGSTOP)
    time.sleep(2.5)  # the lease ran out
    resumed = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process (Linux)
    os.kill(first.process.pid, signal.SIGCONT)
    assert "paused" in first.expect("LOST", timeout=10)
    last_false = float(first.expect("LAST_FALSE", timeout=5))
    assert last_false < resumed, f"said leading {last_false - resumed:.4f} s after waking"


def test_resigning_hands_over_at_once_not_after_a_ttl(
    child: Callable[..., Child], name: str
) -> None:
    candidates = [child("lead", "--name", name, "--ttl", "30") for _ in range(2)]
    for each in candidates:
        each.expect("CAMPAIGNING")
    first, fence = leading(candidates, 60)
    other = next(c for c in candidates if c is not first)
    time.sleep(0.2)  # the other waits for it
    first.send("resign")
    first.expect("RESIGNED")
    resigned = time.monotonic()
    assert int(other.expect("LEADING", timeout=5)) > fence
    assert time.monotonic() - resigned < 2  # woken by the release, far below the 30 s TTL


def test_a_leader_whose_process_exits_cleanly_is_followed_at_once(
    child: Callable[..., Child], name: str
) -> None:
    """A term led from a daemon thread still in its block when the process exits: resigned
    at the exit (atexit), not left to run out its TTL."""
    first = child("lead", "--name", name, "--ttl", "30", "--in-thread")
    first.expect("CAMPAIGNING")
    assert first.expect("LEADING")
    other = child("lead", "--name", name, "--ttl", "30")
    other.expect("CAMPAIGNING")
    time.sleep(0.2)  # the other waits for it
    first.send("exit")
    assert first.process.wait(10) == 0
    exited = time.monotonic()
    other.expect("LEADING", timeout=5)
    assert time.monotonic() - exited < 3  # far below the 30 s TTL


def test_a_force_release_sets_term_lost_within_a_renewal_period(name: str) -> None:
    with leader(name, using="redis", ttl=3) as term:
        assert isinstance(term, Term) and not term.lost.is_set() and term.reason == ""
        term.check()
        assert locks["redis"].force_release(name)
        released = time.monotonic()
        assert term.lost.wait(2)
        assert time.monotonic() - released < 1 + 1  # a renewal every second (and a loaded machine)
        assert "expired or was released" in term.reason
        with pytest.raises(LockLost, match="ended"):
            term.check()
    # Leaving a lost term raises nothing: the loss was told by term.lost.


def test_leaving_resigns_and_current_leader_follows(name: str) -> None:
    assert current_leader(name, using="redis") is None
    with leader(name, using="redis", ttl=5) as term:
        now = current_leader(name, using="redis")
        assert now is not None and now.fence == term.fence and now.pid == os.getpid()
        with pytest.raises(LockNotAcquired), leader(name, using="redis", timeout=0.2):
            pass
    assert term.lost.is_set() and term.reason == "resigned"
    assert current_leader(name, using="redis") is None
    with leader(name, using="redis") as again:
        assert again.fence > term.fence


def test_async_with(name: str) -> None:
    async def main() -> tuple[int, bool]:
        async with leader(name, using="redis", ttl=3) as term:
            assert current_leader(name, using="redis") is not None
            return term.fence, term.lost.is_set()

    fence, lost = asyncio.run(main())
    assert fence > 0 and not lost
    assert current_leader(name, using="redis") is None


def test_async_with_cancelled_while_leaving_still_resigns(name: str) -> None:
    """A cancellation that lands while the block is left (a shutdown, an asyncio.timeout
    around it) skipped the release: the next candidate waited a whole TTL."""

    async def main() -> bool:
        me = asyncio.current_task()
        assert me is not None
        with pytest.raises(asyncio.CancelledError):
            async with leader(name, using="redis", ttl=30):
                asyncio.get_running_loop().call_soon(me.cancel)  # at the exit's first await
        if sys.version_info >= (3, 11):
            me.uncancel()  # the cancellation was taken: this task goes on
        try:
            async with leader(name, using="redis", timeout=1):
                return True
        except LockNotAcquired:
            return False

    assert asyncio.run(main()), "the next candidate did not lead at once"
    assert current_leader(name, using="redis") is None


def test_an_interrupt_while_resigning_still_releases(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C landing in the keeper's join while ``with`` resigns skipped the release; and
    the term, forgotten before its release, was not resigned at the exit either."""
    real_stop = Keeper.stop

    def stop_interrupted(self: Keeper) -> None:
        real_stop(self)
        raise KeyboardInterrupt  # the signal lands at the end of the join

    monkeypatch.setattr(Keeper, "stop", stop_interrupted)
    with pytest.raises(KeyboardInterrupt), leader(name, using="redis", ttl=30) as term:
        pass
    assert term.lost.is_set() and term.reason == "resigned"
    assert current_leader(name, using="redis") is None
    monkeypatch.undo()
    # Interrupted in the release itself: the exit's resignation finishes it.
    campaign = leader(name, using="redis", ttl=30)
    real_release = campaign.lock.release

    def release_interrupted(*args: object, **kwargs: object) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(campaign.lock, "release", release_interrupted)
    with pytest.raises(KeyboardInterrupt), campaign:
        pass
    assert current_leader(name, using="redis") is not None
    monkeypatch.setattr(campaign.lock, "release", real_release)
    _resign_all()  # what the interpreter's exit runs
    assert current_leader(name, using="redis") is None


def test_bad_arguments_fail_before_any_redis_call() -> None:
    with pytest.raises(ValueError, match="ttl"):
        leader("x", using="down", ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        leader("x", using="down", timeout=-1)
    with pytest.raises(TypeError):
        current_leader(5, using="down")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        run_as_leader("", lambda term: None, using="down")
    with pytest.raises(BackendUnavailable):
        current_leader("x", using="down")


def test_run_as_leader_campaigns_again_after_a_loss_until_stopped(name: str) -> None:
    stop = threading.Event()
    fences: list[int] = []

    def target(term: Term) -> None:
        fences.append(term.fence)
        if len(fences) < 3:
            locks["redis"].force_release(name)  # lose the first two terms
        elif len(fences) == 3:
            stop.set()
        while True:
            term.check()  # LockLost once lost or stopped: run_as_leader campaigns again
            time.sleep(0.01)

    thread = threading.Thread(
        target=run_as_leader, args=(name, target), kwargs={"using": "redis", "ttl": 3, "stop": stop}
    )
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    assert len(fences) == 3 and fences == sorted(set(fences))
    assert current_leader(name, using="redis") is None  # resigned when stopped


@pytest.fixture
def paused_alias(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "paused": config}):
        yield server
        server.resume()
        locks["paused"].close()


def test_a_backend_that_stops_answering_ends_the_term_before_the_hold_could_expire(
    paused_alias: RedisServer, name: str
) -> None:
    """No answer is not a loss for the lock; but a leader that cannot renew must stop
    before the hold could run out and another candidate lead."""
    with leader(name, using="paused", ttl=3) as term:
        paused_alias.pause()
        paused = time.monotonic()
        assert term.lost.wait(4)
        assert time.monotonic() - paused < 3  # by the TTL less a third after the last renewal sent
        assert "did not answer" in term.reason
        paused_alias.resume()  # the release at the end answered at once


def test_a_term_that_cannot_start_its_renewals_resigns(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_redlock.leader import Keeper

    def no_thread(self: Keeper) -> Keeper:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(Keeper, "start", no_thread)
    with pytest.raises(RuntimeError), leader(name, using="redis"):
        pass
    assert current_leader(name, using="redis") is None  # not held unrenewed for a TTL


def test_a_renewal_sent_after_a_stall_and_told_gone_says_this_process_was_paused(
    name: str,
) -> None:
    """A pause of the whole process between the keeper's last look and its renewal's send
    (SIGSTOP there): on waking the renewal goes out past the give-up point and the backend
    answers "gone". That is a loss (not unknown), and the reason says the process stalled,
    not just "released by someone else" (exec's loss message relies on it)."""
    from django_redlock import lock

    held = lock(name, using="redis", ttl=1, auto_renew=False)
    assert held.acquire(blocking=False)
    keeper = Keeper(held, margin=0.2, since=time.monotonic())  # never started: no thread
    time.sleep(1.3)  # the hold expired meanwhile; no look ended the term
    keeper._renew()  # what the renewal thread started right after the look does on waking
    assert keeper.lost.is_set() and not keeper.unknown
    assert "paused" in keeper.reason, keeper.reason


def test_a_take_whose_answer_came_late_is_counted_from_its_send(
    paused_alias: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold's TTL runs from when the server took it, before its answer arrived: a term
    must end before the hold could expire, counted from the take's send, not its answer."""
    campaign = leader(name, using="paused", ttl=2)
    take = campaign.lock.acquire

    def late(*args: object, **kwargs: object) -> bool:
        taken = take(*args, **kwargs)  # type: ignore[arg-type]
        time.sleep(1.0)  # the answer arrived late (or this process was slow to see it)
        return taken

    monkeypatch.setattr(campaign.lock, "acquire", late)
    with campaign as term:
        now = current_leader(name, using="paused")
        assert now is not None and now.ttl is not None
        expires = time.monotonic() + now.ttl
        paused_alias.pause()  # no renewal lands from now on
        try:
            assert term.lost.wait(3)
            assert time.monotonic() < expires - 0.1, (now.ttl, term.reason)
        finally:
            paused_alias.resume()


def test_an_async_take_whose_answer_came_late_is_confirmed_by_a_renewal(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    campaign = leader(name, using="redis", ttl=2)
    take = campaign.lock.aacquire

    async def late(*args: object, **kwargs: object) -> bool:
        taken = await take(*args, **kwargs)  # type: ignore[arg-type]
        await asyncio.sleep(0.6)  # more than a sixth of the TTL
        return taken

    monkeypatch.setattr(campaign.lock, "aacquire", late)

    async def main() -> float | None:
        async with campaign:
            now = current_leader(name, using="redis")
            return None if now is None else now.ttl

    left = asyncio.run(main())
    assert left is not None and left > 1.7  # renewed on entry, not 1.4 s left


def test_a_renewal_awaiting_its_answer_is_not_waited_for_by_spinning(
    paused_alias: RedisServer, name: str
) -> None:
    """While a renewal waits for an answer that does not come, the keeper sleeps until its
    give-up time: it does not spin a core (which on a loaded machine starves the rest)."""
    with leader(name, using="paused", ttl=3) as term:
        paused_alias.pause()
        try:
            cpu = time.process_time()
            assert term.lost.wait(4)
            used = time.process_time() - cpu
        finally:
            paused_alias.resume()
    assert used < 0.3, used  # a spinning keeper: most of the second between renewal and give-up


def test_a_forked_child_does_not_lead_and_its_exit_resigns_nothing(name: str) -> None:
    """A child forked inside the block is not the leader: its parent renews the hold. It
    must not believe it leads (it would for ever: no keeper of its own), nor release the
    parent's hold when it leaves the block."""
    read, write = os.pipe()
    said, pid = "", -1
    try:
        with leader(name, using="redis", ttl=3) as term:
            pid = os.fork()
            if pid == 0:  # the child looks, then leaves the block (resigning) and exits
                said = f"{term.lost.is_set()} {term.lost.wait(0.05)} {term.reason}"
                try:
                    term.check()
                except LockLost:
                    said += " | check raised"
            else:
                os.close(write)
                _, status = os.waitpid(pid, 0)
                with os.fdopen(read) as pipe:
                    said = pipe.read()
                assert status == 0
                assert not term.lost.is_set()  # the parent leads on
                now = current_leader(name, using="redis")
                assert now is not None and now.pid == os.getpid() and now.fence == term.fence
    except BaseException as exc:
        if pid == 0:
            said = f"error {exc!r}"
        else:
            raise
    if pid == 0:
        os.write(write, said.encode())
        os._exit(0)
    assert said.startswith("True True "), said
    assert "fork" in said and said.endswith("| check raised"), said


def test_resigning_on_a_backend_that_stopped_answering_takes_one_socket_timeout(
    paused_alias: RedisServer, name: str
) -> None:
    """A renewal awaiting its answer when the term ends is not waited for (it can only
    renew our own token, which the release ends): the resignation's BackendUnavailable
    comes within one socket timeout (2 s), not two."""
    campaign = leader(name, using="paused", ttl=3)  # a renewal every second
    term = campaign.campaign()
    time.sleep(0.8)
    paused_alias.pause()
    time.sleep(0.5)  # the renewal sent at 1 s awaits its answer
    resigning = time.monotonic()
    with pytest.raises(BackendUnavailable):
        campaign.resign()
    took = time.monotonic() - resigning
    assert term.lost.is_set() and term.reason == "resigned"
    assert took < 2.0 + 1.0, took  # waiting for the renewal too: 3.7 s
    paused_alias.resume()


TARGET_ERRORS = [
    ValueError("the target's"),
    LockNotAcquired("the target's own lock"),
    BackendUnavailable("the target's own backend"),
]


@pytest.mark.parametrize("error", TARGET_ERRORS)
def test_run_as_leader_resigns_and_raises_what_its_target_raises(
    name: str, error: Exception
) -> None:
    """The target's own errors end the campaign (resigned at once), even those that look
    like a campaign's (LockNotAcquired, BackendUnavailable): they were retried silently."""
    calls: list[int] = []

    def target(term: Term) -> None:
        calls.append(term.fence)
        raise error

    stop = threading.Event()
    outcome: list[BaseException] = []

    def campaign() -> None:
        try:
            run_as_leader(name, target, using="redis", ttl=3, stop=stop, retry=0.1)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=campaign)
    thread.start()
    thread.join(5)
    stop.set()
    thread.join(5)
    assert outcome == [error] and len(calls) == 1, (outcome, calls)
    assert current_leader(name, using="redis") is None


def test_a_renewal_that_cannot_get_a_thread_ends_the_term(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread for a renewal (a thread limit): the keeper died with the error, nothing
    renewed the hold, and a ``term.lost.wait()`` waited for ever after it expired."""
    start = threading.Thread.start

    def no_renewal_thread(self: threading.Thread) -> None:
        if self.name.startswith("redlock-keeper-renew"):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", no_renewal_thread)
    with leader(name, using="redis", ttl=1.5) as term:
        woke = threading.Event()
        waiter = threading.Thread(target=lambda: term.lost.wait() and woke.set(), daemon=True)
        start(waiter)
        assert woke.wait(3), "term.lost.wait() never returned"
        assert "thread" in term.reason, term.reason


def test_campaigning_again_after_a_term_ended_unanswered_leads_again(
    paused_alias: RedisServer, name: str
) -> None:
    """A term ended because the backend did not answer, its hold still there: the same
    object's next campaign() resigns it first, then leads (it refused: "already held by
    this object")."""
    election = leader(name, using="paused", ttl=1.5, timeout=5)
    term = election.campaign()
    paused_alias.pause()
    try:
        assert term.lost.wait(3) and "did not answer" in term.reason
    finally:
        paused_alias.resume()
    again = election.campaign()
    try:
        assert not again.lost.is_set() and again.fence > term.fence
    finally:
        election.resign()
    assert current_leader(name, using="paused") is None


def test_lost_replies_of_a_renewal_and_of_the_resignation(
    redis_server: RedisServer, name: str
) -> None:
    """A renewal whose reply is lost is sent again: the term goes on. A resignation whose
    reply is lost raises BackendUnavailable, but it ran: nobody leads, and the same object
    campaigns again (finishing that release first)."""
    from ..support.proxy import LossyProxy

    proxy = LossyProxy(redis_server.port)
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": proxy.url}
    try:
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "lossy": config}):
            with leader(name, using="lossy", ttl=1.5) as term:  # a renewal every 0.5 s
                proxy.lose_replies(1)  # the next renewal's
                assert not term.lost.wait(2.5), term.reason
            election = leader(name, using="lossy", ttl=30)  # no renewal within the test
            term = election.campaign()
            proxy.lose_replies(1)  # the release's
            with pytest.raises(BackendUnavailable):
                election.resign()
            assert term.lost.is_set() and term.reason == "resigned"
            assert current_leader(name, using="redis") is None  # it ran
            again = election.campaign()
            assert again.fence > term.fence and not again.lost.is_set()
            election.resign()
            assert current_leader(name, using="redis") is None
            locks["lossy"].close()
    finally:
        proxy.close()


def test_a_redis_restarted_empty_ends_the_term_within_a_renewal_period(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "restarted": config}):
        try:
            with leader(name, using="restarted", ttl=3) as term:
                server.restart()  # empty: the hold is gone
                restarted = time.monotonic()
                assert term.lost.wait(3)
                assert time.monotonic() - restarted < 1 + 1  # a renewal a second, a retry
                assert "expired or was released" in term.reason, term.reason
            assert current_leader(name, using="restarted") is None
        finally:
            locks["restarted"].close()


@contextlib.contextmanager
def _losses() -> Iterator[list[str]]:
    """The ``lock_lost`` notifications sent meanwhile (their reasons)."""
    from django_redlock.signals import lock_lost

    seen: list[str] = []

    def heard(sender: Any, lock: Any, reason: str, **_: Any) -> None:
        seen.append(reason)

    lock_lost.connect(heard, weak=False)
    try:
        yield seen
    finally:
        lock_lost.disconnect(heard)


def test_a_renewal_answered_after_the_resignation_began_is_no_loss(
    name: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper's renewal looked the hold up; the resignation's release ran on Redis, and
    before its reply was read the renewal reached Redis and was answered "gone" (the
    release's doing). No ``lock_lost``, no warning: the release was marked before it was
    sent."""
    election = leader(name, using="redis", ttl=30)  # no renewal of the keeper's own meanwhile
    term = election.campaign()
    held = election.lock
    renewal = held._extend(None)  # as the keeper's renewal thread runs it
    extend = next(renewal)  # the hold looked up, the extend about to be sent
    backend, raised = held.backend, []
    real = backend.execute

    def releasing(op: Any, *args: Any, **kwargs: Any) -> Any:
        reply = real(op, *args, **kwargs)  # the release ran; its reply is not read yet
        monkeypatch.setattr(backend, "execute", real)
        answer = real(extend)
        assert answer is False  # the renewal finds the token gone
        try:
            renewal.send(answer)
        except LockNotOwned as exc:
            raised.append(exc)
        return reply

    with _losses() as lost, caplog.at_level("WARNING", logger="django_redlock"):
        monkeypatch.setattr(backend, "execute", releasing)
        election.resign()
    assert lost == [], lost
    assert not [r for r in caplog.records if "lost" in r.getMessage()], caplog.text
    assert len(raised) == 1 and "was released" in str(raised[0]), raised  # told as released
    assert term.reason == "resigned" and held.lost is None
    assert current_leader(name, using="redis") is None


def test_a_loss_found_before_the_resignation_began_is_still_reported(name: str) -> None:
    election = leader(name, using="redis", ttl=30)
    term = election.campaign()
    held = election.lock
    renewal = held._extend(None)
    op = next(renewal)
    with _losses() as lost:
        assert locks["redis"].force_release(name)  # lost for real, before any resignation
        with pytest.raises(LockLost):
            renewal.send(held.backend.execute(op))
        election.resign()  # a lost term: nothing raised, nothing reported again
    assert len(lost) == 1 and "expired or was released" in lost[0], lost
    assert held.lost is not None and term.lost.is_set()


def test_a_real_loss_met_by_a_renewal_during_the_resignation_is_reported_once(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Force-released, then the renewal and the resignation's release both find the token
    gone, the renewal's answer read while the release is on its way: the release's answer
    (-1: gone before it) reports the loss, once."""
    election = leader(name, using="redis", ttl=30)
    term = election.campaign()
    held = election.lock
    renewal = held._extend(None)
    extend = next(renewal)
    backend = held.backend
    real = backend.execute

    def releasing(op: Any, *args: Any, **kwargs: Any) -> Any:
        reply = real(op, *args, **kwargs)
        monkeypatch.setattr(backend, "execute", real)
        with contextlib.suppress(LockNotOwned):
            renewal.send(real(extend))
        return reply

    with _losses() as lost:
        assert locks["redis"].force_release(name)
        monkeypatch.setattr(backend, "execute", releasing)
        election.resign()  # a lost term: nothing raised
    assert len(lost) == 1 and "expired or was released" in lost[0], lost
    assert held.lost is not None and term.lost.is_set()
