"""Beat when a publish fails: the run stays due and is sent later, and other entries go on."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import locks
from django_redlock.contrib import beat
from django_redlock.testing import RedisServer


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
