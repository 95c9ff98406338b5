"""Beat when a publish fails: the run stays due and is sent later, and other entries go on."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery.beat import PersistentScheduler, ScheduleEntry
from django.conf import settings
from django.test import override_settings

from django_redlock import locks
from django_redlock.contrib import beat
from django_redlock.testing import RedisServer

from ..support.proxy import LossyProxy


class Recording(beat.LockedScheduler):
    """A LockedScheduler that notes its sends instead of publishing them."""

    standby_wait = 0.05
    sent: list[tuple[str, datetime.datetime]]

    @property
    def producer(self) -> None:  # type: ignore[override]
        return None

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        self.sent.append((entry.name, entry.last_run_at))


@pytest.fixture
def paused_alias(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "paused": config}):
        yield server
        server.resume()
        locks["paused"].close()


class BrokerIsTheLockRedis(Recording):
    """Its first publish fails as Redis stops answering: the broker and the lock backend are
    one Redis (a common setup), so the claim cannot be taken back either."""

    server: RedisServer
    failures = 1

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        if self.failures:
            self.failures -= 1
            self.server.pause()
            raise ConnectionError("the broker is down")
        super().apply_async(entry, producer, advance)


def test_a_run_whose_claim_could_not_be_taken_back_is_sent_when_redis_answers(
    paused_alias: RedisServer, tmp_path: Path
) -> None:
    """The unclaim got no answer; once Redis answered, this leader found its own claim on
    record and took the run as sent by another beat: the run was lost until the next period."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    config = {"using": "paused", "ttl": 30, "name": "beat-unclaim"}
    with override_settings(DJANGO_REDLOCK_BEAT=config):
        one = BrokerIsTheLockRedis(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent, one.server = [], paused_alias
        try:
            entry = one.schedule["e"]
            entry.last_run_at -= datetime.timedelta(seconds=61)  # due now
            before = beat.to_micros(entry.last_run_at)
            deadline = time.monotonic() + 10
            while one.failures:  # leads, claims, fails to publish and to unclaim
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            paused_alias.resume()  # the unclaim timed out: Redis answers again
            deadline = time.monotonic() + 5
            while not one.sent:
                assert time.monotonic() < deadline, "the run was never sent"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert one.leads
            assert [beat.to_micros(at) for _, at in one.sent] == [before]  # that run, once
        finally:
            paused_alias.resume()
            one.close()


class Poisoned(Recording):
    """The publish of entry "poison" always fails (arguments the serializer refuses, a
    message over the broker's size limit)."""

    tries: int = 0

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        if entry.name == "poison":
            self.tries += 1
            raise TypeError("Object of type set is not JSON serializable")
        super().apply_async(entry, producer, advance)


def test_an_entry_whose_publish_always_fails_does_not_hold_back_the_others(
    tmp_path: Path,
) -> None:
    """The failed entry was put back due and the whole scheduler paused: on the rebuilt heap
    it came first again (first in the schedule, due as long as the others), failed again, and
    the entries behind it were never sent. Celery alone logs the error and sends the rest."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    schedule = {"poison": {"task": "tests.beat.poison", "schedule": 0.5}}
    schedule.update({f"good{i}": {"task": f"tests.beat.good{i}", "schedule": 0.5} for i in (0, 1)})
    app.conf.beat_schedule = schedule
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "local", "ttl": 5, "name": "beat-p"}):
        one = Poisoned(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent = []
        try:
            deadline = time.monotonic() + 2.6
            while time.monotonic() < deadline:
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            counts = {name: sum(1 for sent, _ in one.sent if sent == name) for name in schedule}
            assert counts["poison"] == 0
            assert counts["good0"] >= 3 and counts["good1"] >= 3, counts
            # Tried again with a growing delay (1 s, 2 s, ...), not at every tick.
            assert 1 <= one.tries <= 3, one.tries
        finally:
            one.close()


_ROWS: dict[str, SimpleNamespace] = {}


class _RowEntry(ScheduleEntry):
    """An entry with a row (``model``) shared by the entries that follow it, as
    django-celery-beat's: its reserve() counts the run on the row."""

    @property
    def model(self) -> SimpleNamespace:
        return _ROWS.setdefault(self.name, SimpleNamespace(total_run_count=0, last_run_at=None))


class CountedFailingOnce(beat.LeaderMixin, PersistentScheduler):
    """Counts each reserved run on the entry's row; its first publish fails (broker down)."""

    Entry = _RowEntry
    standby_wait = 0.05
    failures = 1
    sent: list[str]

    @property
    def producer(self) -> None:  # type: ignore[override]
        return None

    def reserve(self, entry: Any) -> Any:
        new_entry = super().reserve(entry)
        entry.model.total_run_count += 1
        return new_entry

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the broker is down")
        self.sent.append(entry.name)


def test_a_run_whose_publish_failed_is_not_counted_on_its_row(tmp_path: Path) -> None:
    """The claim's success dropped the count from before reserve(), so the failed publish had
    none to restore: a periodic row counted a run never sent, and a one-off (its count above
    0) was switched off by django-celery-beat as done, never sent."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    _ROWS.clear()
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "local", "ttl": 5, "name": "beat-count"}):
        one = CountedFailingOnce(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent = []
        try:
            one.schedule["e"].last_run_at -= datetime.timedelta(seconds=61)  # due now
            deadline = time.monotonic() + 5
            while one.failures:
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert _ROWS["e"].total_run_count == 0  # reserved, not sent: not counted
            while not one.sent:  # tried again after its 1 s delay
                assert time.monotonic() < deadline, "the run was never sent"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert _ROWS["e"].total_run_count == 1 and one.sent == ["e"]
        finally:
            one.close()


@pytest.fixture
def quick_alias(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    """An alias whose calls give up after 0.5 s (a term of 1.5 s ends within a second)."""
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
        "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    }  # fmt: skip
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "quick": config}):
        yield server
        locks["quick"].close()


class BrokerStopsPastTheTerm(Recording):
    """Its first publish fails as the one Redis (broker and lock backend) stops answering for
    2.5 s, past the leader's 1.5 s TTL. CLIENT PAUSE, not SIGSTOP: the calls that time out
    meanwhile are dropped with their connections, never run late."""

    server: RedisServer
    failures = 1

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        if self.failures:
            self.failures -= 1
            self.server.client().execute_command("CLIENT", "PAUSE", "2500", "ALL")
            raise ConnectionError("the broker is down")
        super().apply_async(entry, producer, advance)


def test_a_claim_not_taken_back_before_the_term_ended_is_taken_back_after(
    quick_alias: RedisServer, tmp_path: Path
) -> None:
    """The take-back got no answer, then the term ended: its note was dropped, the claim
    stayed on record, and the next leader (this beat, under a new token) read the run as
    sent: skipped until the next period."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    config = {"using": "quick", "ttl": 1.5, "name": "beat-takeback"}
    with override_settings(DJANGO_REDLOCK_BEAT=config):
        one = BrokerStopsPastTheTerm(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent, one.server = [], quick_alias
        try:
            entry = one.schedule["e"]
            entry.last_run_at -= datetime.timedelta(seconds=61)  # due now
            before = beat.to_micros(entry.last_run_at)
            deadline = time.monotonic() + 10
            while one.failures or one.leads:  # publish and take-back fail; the term ends
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            first = one._campaign.lock.token
            while not one.sent:
                assert time.monotonic() < deadline, "the run was never sent"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert one.leads and one._campaign.lock.token != first  # a new term
            assert [beat.to_micros(at) for _, at in one.sent] == [before]  # that run, once
        finally:
            one.close()


class FailingOnce(Recording):
    failures = 1

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the broker is down")
        super().apply_async(entry, producer, advance)


def test_a_new_term_does_not_keep_the_last_terms_publish_delay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delay after a failed publish carried over into the beat's next term: an entry due
    at once waited out the old term's backoff (up to 30 s)."""
    from celery import Celery

    monkeypatch.setattr(beat, "BACKOFF", 30.0)
    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    name = "beat-backoff"
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "local", "ttl": 1, "name": name}):
        one = FailingOnce(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent = []
        try:
            one.schedule["e"].last_run_at -= datetime.timedelta(seconds=61)  # due now
            deadline = time.monotonic() + 5
            while one.failures:  # failed: tried again in 30 s
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            backend = locks["local"]
            info = backend.inspect(name)
            assert info is not None
            backend.force_release(name, info.token, None)  # the term ends
            while one.leads:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            while not one.sent:  # the next term sends it at once
                assert time.monotonic() < deadline, "the run waited for the old term's delay"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
        finally:
            one.close()


@pytest.fixture
def lossy_alias(redis_server: RedisServer) -> Iterator[LossyProxy]:
    """Alias ``lossy``: the suite's Redis through a proxy that loses replies on demand."""
    proxy = LossyProxy(redis_server.port)
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": proxy.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "lossy": config}):
        try:
            yield proxy
        finally:
            locks["lossy"].close()
            proxy.close()


class ClaimReplyLost(Recording):
    """The reply to its first claim is lost (the claim took effect); then its hold is
    force-released, so its retry of that claim is refused: the term ends."""

    proxy: LossyProxy
    armed = True

    def reserve(self, entry: Any) -> Any:
        if self.armed:
            self.armed = False
            self.proxy.lose_replies(1)
        return super().reserve(entry)


def test_a_claim_whose_reply_was_lost_is_taken_back_when_the_term_ends(
    lossy_alias: LossyProxy, tmp_path: Path
) -> None:
    """The claim landed, its reply lost; the note to claim it again was dropped as the term
    ended, so the next leader (this beat, under a new token) read the run as sent."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    name = "beat-claim-lost"
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "lossy", "ttl": 30, "name": name}):
        one = ClaimReplyLost(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent, one.proxy = [], lossy_alias
        try:
            entry = one.schedule["e"]
            entry.last_run_at -= datetime.timedelta(seconds=61)  # due now
            before = beat.to_micros(entry.last_run_at)
            backend = locks["lossy"]
            # The claim script loaded first: the reply lost is the claim's, not a NOSCRIPT.
            backend.execute(beat.claim_op(backend, name, "nobody", "x", None, 1, 1000))
            deadline = time.monotonic() + 10
            while not lossy_alias.lost:
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert not one.sent
            recorded = backend.execute(beat.read_op(backend, name, "e"))
            assert recorded is not None and recorded > before  # the claim took effect
            info = backend.inspect(name)
            assert info is not None
            backend.force_release(name, info.token, None)  # the term ends
            while not one.sent:
                assert time.monotonic() < deadline, "the run was never sent"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert [beat.to_micros(at) for _, at in one.sent] == [before]  # that run, once
        finally:
            one.close()


def test_a_standby_that_led_first_sends_a_run_taken_back_after_it_read_it(
    quick_alias: RedisServer, tmp_path: Path
) -> None:
    """Redis answers again; the standby leads and reads the old leader's unpublished claim as
    sent before the old leader takes it back: the run waited for the next period."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    config = {"using": "quick", "ttl": 1.5, "name": "beat-takeback-late"}
    with override_settings(DJANGO_REDLOCK_BEAT=config):
        one = BrokerStopsPastTheTerm(app=app, schedule_filename=str(tmp_path / "a"))
        one.sent, one.server = [], quick_alias
        two = Recording(app=app, schedule_filename=str(tmp_path / "b"))
        two.sent = []
        try:
            for each in (one, two):
                each.schedule["e"].last_run_at -= datetime.timedelta(seconds=61)  # due now
            before = beat.to_micros(one.schedule["e"].last_run_at)
            deadline = time.monotonic() + 10
            while one.failures or one.leads:  # publish and take-back fail; the term ends
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            while not two.leads:  # the standby leads first: it reads the claim as sent
                assert time.monotonic() < deadline
                two.tick()
                time.sleep(0.05)
            assert not two.sent
            while one._unsure or one._takeback:  # then the old leader takes its claim back
                assert time.monotonic() < deadline
                one.tick()
            while not two.sent:
                assert time.monotonic() < deadline, "the run was never sent"
                time.sleep(max(0.0, min(two.tick(), 0.05)))
            assert [beat.to_micros(at) for _, at in two.sent] == [before] and not one.sent
        finally:
            one.close()
            two.close()


class StepsDown(beat.LockedScheduler):
    """Notes each term it ends."""

    standby_wait = 0.05
    ended: list[str]

    def _step_down(self, why: str) -> None:
        if self._term is not None:
            self.ended.append(why)
        super()._step_down(why)


def test_a_leader_whose_broker_hangs_mid_publish_resigns(
    redis_factory: Callable[..., RedisServer], tmp_path: Path, name: str
) -> None:
    """Celery's Redis broker has no socket timeout by default: a publish on a broker that
    stopped answering (paused here, after a first publish went through) waited forever while
    the keeper renewed the lead, so no standby could take over and nothing was sent. The
    publish is given half the TTL; then its claim is taken back and the lead resigned.
    Led again, the beat connects anew (a PING, which waits as long) in the publish's time."""
    from celery import Celery

    broker = redis_factory()
    app = Celery("in-process", set_as_current=False, broker=broker.url)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 1.0}}
    ttl = 3.0
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "redis", "ttl": ttl, "name": name}):
        one = StepsDown(app=app, schedule_filename=str(tmp_path / "s"))
        one.ended = []
        client = broker.client()
        stop = threading.Event()

        def ticks() -> None:
            while not stop.is_set():
                time.sleep(max(0.0, min(one.tick(), 0.05)))

        try:
            deadline = time.monotonic() + 10
            while not client.llen("celery"):  # leads, and a first publish goes through
                assert time.monotonic() < deadline, "nothing was sent"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert one.leads
            broker.pause()
            threading.Thread(target=ticks, daemon=True).start()
            for terms, what in ((1, "its publish"), (2, "connecting anew")):
                # The run falls due within a second (at once the second time); its publish is
                # abandoned half the TTL later (a loaded machine's second on top).
                deadline = time.monotonic() + 1 + ttl / 2 + 1.5
                while len(one.ended) < terms:
                    assert time.monotonic() < deadline, f"the leader still hangs in {what}"
                    time.sleep(0.01)
                assert "did not take 'e'" in one.ended[-1], one.ended
        finally:
            stop.set()
            broker.resume()
            time.sleep(0.5)  # a hung tick (before the fix) ends with the broker back
            one.close()


class ShutDownMidSend(Recording):
    """Celery's SIGTERM handler lands in its first send (``service.sync()`` closes the
    scheduler, then ``SystemExit``): in the publish, or as the claim's reply comes back.
    Each reserved run is counted on its row; ``synced``: the row's count at each write of
    the schedule's store once the signal came."""

    Entry = _RowEntry
    at = "nowhere yet"  # "publish", "claim"; "" once the signal came
    synced: list[int] = []

    def reserve(self, entry: Any) -> Any:
        new_entry = super().reserve(entry)
        entry.model.total_run_count += 1
        return new_entry

    def sync(self) -> None:
        if not self.at:
            self.synced.append(_ROWS["e"].total_run_count)
        super().sync()

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        if self.at == "publish":
            self.sigterm()
        super().apply_async(entry, producer, advance)

    def sigterm(self) -> None:
        self.at = ""
        self.close()
        raise SystemExit()


@pytest.mark.parametrize("at", ["publish", "claim"])
def test_a_shutdown_in_the_middle_of_a_send_leaves_the_run_to_the_next_leader(
    at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SystemExit is no Exception: nothing took the claim back, close() did not know it, and
    the standby, leading at once, read the run as sent: skipped until the next period."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    name = f"beat-shutdown-{at}-{os.getpid()}"
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "default", "ttl": 30, "name": name}):
        _ROWS.clear()
        one = ShutDownMidSend(app=app, schedule_filename=str(tmp_path / "a"))
        one.sent, one.at, one.synced = [], at, []
        two = Recording(app=app, schedule_filename=str(tmp_path / "b"))
        two.sent = []
        backend = locks["default"]
        real = backend.execute

        def execute(op: Any) -> Any:
            reply = real(op)
            if one.at == "claim" and op.parse is beat._claimed:
                one.sigterm()  # the claim ran on the server; its reply is cut off
            return reply

        monkeypatch.setattr(backend, "execute", execute)
        try:
            for each in (one, two):
                each.schedule["e"].last_run_at -= datetime.timedelta(seconds=61)  # due now
            before = beat.to_micros(one.schedule["e"].last_run_at)
            with pytest.raises(SystemExit):
                one.tick()  # leads, claims the run: the SIGTERM
            one.close()  # Celery's beat closes again on its way out
            assert one.synced and set(one.synced) == {0}  # the store: the run not sent
            deadline = time.monotonic() + 5
            while not two.sent:
                assert time.monotonic() < deadline, "the run was never sent"
                time.sleep(max(0.0, min(two.tick(), 0.05)))
            assert not one.sent
            assert [beat.to_micros(run) for _, run in two.sent] == [before]  # that run, once
        finally:
            one.close()
            two.close()


class PublishesAsSIGTERMLands(Recording):
    """Its publish (in the publish's thread) goes through 0.3 s after Celery's SIGTERM handler
    ran in the scheduler's thread, which waits for it: the handler closes the scheduler,
    then raises SystemExit there."""

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.3)  # the broker takes it meanwhile
        super().apply_async(entry, producer, advance)


def test_a_shutdown_during_a_publish_that_goes_through_leaves_the_run_sent(
    tmp_path: Path,
) -> None:
    """close() took back the claim of a publish still under way in its thread; the publish
    went through, and the standby, leading at once, sent the same run again."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    name = f"beat-shutdown-publishing-{os.getpid()}"
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "default", "ttl": 30, "name": name}):
        one = PublishesAsSIGTERMLands(app=app, schedule_filename=str(tmp_path / "a"))
        one.sent = []
        two = Recording(app=app, schedule_filename=str(tmp_path / "b"))
        two.sent = []

        def sigterm(signum: int, frame: Any) -> None:
            one.close()
            raise SystemExit()

        previous = signal.signal(signal.SIGUSR2, sigterm)
        try:
            for each in (one, two):
                each.schedule["e"].last_run_at -= datetime.timedelta(seconds=61)  # due now
            with pytest.raises(SystemExit):
                one.tick()  # leads, claims the run, publishes: the SIGTERM
            deadline = time.monotonic() + 5
            while not one.sent:  # it goes through (at once, once close() waited for it)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            one.close()  # Celery's beat closes again on its way out
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:  # the standby leads at once
                time.sleep(max(0.0, min(two.tick(), 0.05)))
            assert two.sent == [], "the run was sent twice"
        finally:
            signal.signal(signal.SIGUSR2, previous)
            one.close()
            two.close()


def test_a_shutdown_at_any_line_after_the_publish_went_through_leaves_the_run_sent(
    tmp_path: Path,
) -> None:
    """Celery's SIGTERM handler (close(), then SystemExit) at each line of the scheduler's
    thread from the broker taking the message to the end of apply_entry: once the publish
    returned, close() took the claim back (apply_entry had not popped it yet) and the
    standby, leading at once, sent the same run again."""
    from celery import Celery

    from tests.support.line_interrupts import LineInterrupter, every_point, interrupted

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 60.0}}
    watched = {beat.LeaderMixin.apply_entry.__code__, beat.LeaderMixin._publish.__code__}
    runs = [0]

    def case(tracer: LineInterrupter) -> None:
        runs[0] += 1
        name = f"beat-sigterm-sent-{os.getpid()}-{runs[0]}"
        with override_settings(DJANGO_REDLOCK_BEAT={"using": "default", "ttl": 30, "name": name}):
            one = Recording(app=app, schedule_filename=str(tmp_path / f"a{runs[0]}"))
            two = Recording(app=app, schedule_filename=str(tmp_path / f"b{runs[0]}"))
            one.sent, two.sent = [], []
            real_point = tracer._point

            def sigterm_at(frame: Any) -> None:
                if tracer.points + 1 == tracer.at:
                    one.close()  # Celery's handler closes, then raises there
                real_point(frame)

            tracer._point = sigterm_at  # type: ignore[method-assign]
            tracer.armed_when = lambda frame: bool(one.sent)  # the broker took it
            try:
                for each in (one, two):
                    each.schedule["e"].last_run_at -= datetime.timedelta(seconds=61)  # due now
                interrupted(one.tick, tracer)
                one.close()  # Celery's beat closes again on its way out
                assert one.sent, tracer.fired
                deadline = time.monotonic() + 5
                while not two.leads:  # the standby leads at once (one resigned)
                    assert time.monotonic() < deadline, "the standby never led"
                    two.tick()
                for _ in range(3):
                    two.tick()
                assert two.sent == [], f"the run was sent twice, SIGTERM at {tracer.fired}"
            finally:
                one.close()
                two.close()

    points = every_point(case, lambda at: LineInterrupter(at, watched, lambda frame: False))
    assert len(points) >= 3, points


def test_a_publish_raising_after_the_broker_took_it_leaves_the_run_sent(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A real publish (the suite's Redis as broker) whose ``after_task_publish`` receiver
    raises a BaseException (a signal handler's, in the publish's thread): the run was taken
    for not sent, and the standby, leading at once, sent it a second time."""
    from celery import Celery
    from celery.signals import after_task_publish

    queue = f"beat-after-publish-{os.getpid()}"
    app = Celery("in-process", set_as_current=False)
    app.conf.broker_url = redis_server.url.rsplit("/", 1)[0] + "/1"
    app.conf.beat_schedule = {
        "e": {"task": "tests.beat.tick", "schedule": 60.0, "options": {"queue": queue}}
    }
    broker = redis_server.client(db=1)
    broker.delete(queue)
    strikes = [1]

    def interrupt(**_: Any) -> None:
        if strikes:
            strikes.pop()
            raise SystemExit()  # what no receiver catches: Celery's SIGTERM handler's

    name = f"beat-after-publish-{os.getpid()}"
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "default", "ttl": 30, "name": name}):
        one = beat.LockedScheduler(app=app, schedule_filename=str(tmp_path / "a"))
        two = Recording(app=app, schedule_filename=str(tmp_path / "b"))
        two.sent = []
        after_task_publish.connect(interrupt, weak=False)
        try:
            for each in (one, two):
                each.schedule["e"].last_run_at -= datetime.timedelta(seconds=61)  # due now
            with pytest.raises(SystemExit):
                one.tick()  # leads, claims, publishes: the receiver raises
            one.close()
            assert broker.llen(queue) == 1
            deadline = time.monotonic() + 5
            while not two.leads:  # the standby leads at once (one resigned)
                assert time.monotonic() < deadline, "the standby never led"
                two.tick()
            for _ in range(3):
                two.tick()
            assert two.sent == [], "the run was sent twice"
        finally:
            after_task_publish.disconnect(interrupt)
            one.close()
            two.close()
            broker.delete(queue)
