"""Beat high availability: real ``celery beat`` processes on the suite's Redis, killed and
paused for real. Each message in the entry's queue (no worker reads it) is one send."""

from __future__ import annotations

import datetime
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import django
import pytest
from celery.beat import PersistentScheduler, ScheduleEntry
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_redlock import lock, locks
from django_redlock.contrib import beat
from django_redlock.testing import RedisServer

from ..conftest import ROOT

TTL = 2.0
SCHEDULERS = {
    "persistent": "django_redlock.contrib.beat.LockedScheduler",
    "database": "django_redlock.contrib.beat.LockedDatabaseScheduler",
}
_runs = itertools.count()


class Beat:
    """``celery beat`` in its own session."""

    def __init__(self, env: dict[str, str], scheduler: str, schedule: Path, log: Path) -> None:
        self.log = log
        command = [
            sys.executable, "-m", "celery", "-A", "tests.support.celery_beat_app", "beat",
            "-S", scheduler, "-s", str(schedule), "--pidfile=", "-l", "info",
        ]  # fmt: skip
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.pid = self.process.pid

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Sends:
    """Watches the entry's queue: (time first seen, pid of the beat that sent it)."""

    def __init__(self, client: Any, queue: str) -> None:
        self.client, self.queue = client, queue
        self.seen: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            new = self.client.llen(self.queue) - len(self.seen)
            if new <= 0:
                continue
            now = time.monotonic()
            for raw in reversed(self.client.lrange(self.queue, 0, new - 1)):  # LPUSHed
                origin = json.loads(raw)["headers"]["origin"]
                found = re.match(r"gen(\d+)@", origin)
                self.seen.append((now, int(found.group(1)) if found else -1))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def wait(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen) < count:
            assert time.monotonic() < deadline, f"only {len(self.seen)} sends"
            time.sleep(0.02)

    def between(self, start: float, end: float) -> list[tuple[float, int]]:
        return [s for s in self.seen if start <= s[0] < end]


def _beat_env(redis_server: RedisServer) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "REDLOCK_TEST_REDIS": redis_server.url,
        "DJANGO_SETTINGS_MODULE": "tests.support.celery_beat_settings",
    }


@pytest.fixture(scope="module")
def migrated_db(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """django-celery-beat's tables, migrated once per module: each test runs on a copy."""
    path = tmp_path_factory.mktemp("beat-db") / "beat.sqlite3"
    env = {**_beat_env(redis_server), "BEAT_DB": str(path)}
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT, env=env, check=True,
    )  # fmt: skip
    return path


@pytest.fixture
def start_beats(
    redis_server: RedisServer, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., tuple[list[Beat], Sends, str]]]:
    started: list[Beat] = []
    watchers: list[Sends] = []

    def start(kind: str, count: int) -> tuple[list[Beat], Sends, str]:
        run = next(_runs)
        queue, name = f"beat-q{run}", f"beat-test-{run}"
        env = {
            **_beat_env(redis_server),
            "BEAT_QUEUE": queue, "BEAT_LOCK": name, "BEAT_TTL": str(TTL),
        }  # fmt: skip
        if kind == "database":
            env["BEAT_DB"] = str(tmp_path / "beat.sqlite3")
            shutil.copyfile(request.getfixturevalue("migrated_db"), env["BEAT_DB"])
        broker = redis_server.client(db=1)
        broker.delete(queue)
        sends = Sends(broker, queue)
        watchers.append(sends)
        beats = [
            Beat(env, SCHEDULERS[kind], tmp_path / f"schedule-{run}-{i}", tmp_path / f"b{i}.log")
            for i in range(count)
        ]
        started.extend(beats)
        return beats, sends, name

    yield start
    for each in started:
        each.stop()
    for sends in watchers:
        sends.close()


def leader_pid(name: str) -> int:
    deadline = time.monotonic() + 30
    while True:
        info = locks["default"].inspect(name)
        if info is not None:
            return int(info.holder["p"])
        assert time.monotonic() < deadline, "no beat took the lead"
        time.sleep(0.05)


def logs(beats: list[Beat]) -> str:
    return "\n".join(b.log.read_text()[-2000:] for b in beats)


# django-celery-beat (2.9) requires Django < 6.1: tox's Django 6.1 environments go without it.
# Everywhere else (`make test` included) it is installed and the database scheduler is tested.
WITHOUT_DCB = importlib.util.find_spec("django_celery_beat") is None
DATABASE = pytest.param(
    "database",
    marks=pytest.mark.skipif(
        WITHOUT_DCB and django.VERSION >= (6, 1), reason="django-celery-beat needs Django < 6.1"
    ),
)


@pytest.mark.timeout(180)
def test_one_beat_of_three_sends_and_hands_over(
    start_beats: Callable[..., tuple[list[Beat], Sends, str]],
) -> None:
    # On Celery's own scheduler: the lead, its hand-over and a paused leader are LeaderMixin's,
    # the same on django-celery-beat's, whose hand-over the test after the next one checks.
    beats, sends, name = start_beats("persistent", 3)
    by_pid = {b.pid: b for b in beats}
    sends.wait(1, 60)
    start = sends.seen[0][0]
    time.sleep(3.2)
    counted = sends.between(start, start + 3)
    # 1-second entry for 3 s: 3 sends (one beat sending), not 6-9 (every beat sending).
    assert 2 <= len(counted) <= 4, (len(counted), logs(beats))
    first = leader_pid(name)
    assert {pid for _, pid in counted} == {first}

    # SIGKILL the leader: another sends within TTL + 2 s.
    by_pid[first].signal(signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + TTL + 2
    while not [s for s in sends.between(killed, deadline) if s[1] != first]:
        assert time.monotonic() < deadline, logs(beats)
        time.sleep(0.05)
    second = leader_pid(name)
    assert second != first and second in by_pid

    # SIGSTOP the new leader past its TTL: the third leads; woken, the paused one sends nothing.
    time.sleep(1.5)
    by_pid[second].signal(signal.SIGSTOP)
    stopped = time.monotonic()
    # Paused past its TTL: woken once the third has taken the lead and sent.
    time.sleep(TTL)
    while not [s for s in sends.between(stopped, time.monotonic()) if s[1] not in (first, second)]:
        assert time.monotonic() - stopped < TTL + 10, logs(beats)
        time.sleep(0.05)
    by_pid[second].signal(signal.SIGCONT)
    woke = time.monotonic()
    time.sleep(3.0)
    third = leader_pid(name)
    assert third not in (first, second)
    assert [s for s in sends.between(stopped, woke) if s[1] == third], logs(beats)
    assert not [s for s in sends.between(woke, time.monotonic()) if s[1] == second], logs(beats)
    assert "not leading any more" in by_pid[second].log.read_text()

    # Never two sends of one due run: consecutive sends are about a second apart.
    times = [t for t, _ in sends.seen]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) > 0.5, (gaps, logs(beats))
    assert len(times) <= (times[-1] - times[0]) + 2


def test_beat_settings_are_checked_at_startup() -> None:
    for bad, match in [
        ({"ttl": 0}, "ttl"),
        ({"ttl": "30"}, "ttl"),
        ({"using": 3}, "using"),
        ({"name": ""}, "name"),
        ({"lock": "x"}, "unknown keys"),
        ([], "must be a dict"),
    ]:
        with (
            override_settings(DJANGO_REDLOCK_BEAT=bad),
            pytest.raises(ImproperlyConfigured, match=match),
        ):
            beat.beat_settings()
    with (
        override_settings(DJANGO_REDLOCK_BEAT={"using": "nope"}),
        pytest.raises(ImproperlyConfigured, match="nope"),
    ):
        beat._backend(beat.beat_settings())
    assert beat.beat_settings() == beat.BeatSettings("default", 30.0, "celery-beat")


def test_claims_are_atomic_with_the_lead(alias: str) -> None:
    """The claim script (and LocMem's twin): only the holder claims, each run once."""
    backend = locks[alias]
    held = lock("beat-claims", ttl=30, using=alias, auto_renew=False)
    assert held.acquire(blocking=False)
    token = held.token
    assert token is not None

    def claim(tok: str, prev: int | None, new: int) -> tuple[int, int | None]:
        return backend.execute(beat.claim_op(backend, "beat-claims", tok, "e", prev, new, 60_000))

    assert claim("someone-else", None, 10) == (beat.NOT_LEADER, None)
    assert backend.execute(beat.read_op(backend, "beat-claims", "e")) is None
    assert claim(token, None, 10) == (beat.CLAIMED, None)
    assert claim(token, None, 10) == (beat.CLAIMED, None)  # the same claim again (lost reply)
    assert claim(token, 5, 11) == (beat.ALREADY_SENT, 10)  # decided from a stale run
    assert claim(token, 10, 20) == (beat.CLAIMED, None)
    assert backend.execute(beat.read_op(backend, "beat-claims", "e")) == 20
    held.release()
    assert claim(token, 20, 30) == (beat.NOT_LEADER, None)  # lost the lock: nothing sent
    assert backend.execute(beat.read_op(backend, "beat-claims", "e")) == 20


def test_redlock_is_refused_for_beat(redis_factory: Callable[..., RedisServer]) -> None:
    from ..redlock.test_redlock import quorum_alias

    nodes = [redis_factory() for _ in range(3)]
    with (
        quorum_alias("quorum", nodes),
        override_settings(DJANGO_REDLOCK_BEAT={"using": "quorum"}),
        pytest.raises(ImproperlyConfigured, match="single-master"),
    ):
        beat._backend(beat.beat_settings())


@pytest.mark.timeout(120)
class Recording(beat.LockedScheduler):
    """A LockedScheduler that notes its sends instead of publishing them."""

    standby_wait = 0.05
    sent: list[tuple[str, datetime.datetime]]

    @property
    def producer(self) -> None:  # type: ignore[override]
        return None

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        self.sent.append((entry.name, entry.last_run_at))


def test_schedulers_in_one_process_on_locmem(tmp_path: Path) -> None:
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 0.2}}
    config = {"using": "local", "ttl": 1, "name": "beat-local"}
    with override_settings(DJANGO_REDLOCK_BEAT=config):
        one, two = (Recording(app=app, schedule_filename=str(tmp_path / f"s{i}")) for i in (1, 2))
        one.sent, two.sent = [], []
        try:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                for scheduler in (one, two):
                    time.sleep(max(0.0, min(scheduler.tick(), 0.05)))
            assert one.leads and not two.leads
            assert 3 <= len(one.sent) <= 6 and two.sent == []
            one.close()  # a clean shutdown hands over at once, not at the TTL
            handed = time.monotonic()
            backend = locks["local"]
            recorded = backend.execute(beat.read_op(backend, "beat-local", "e"))
            while not two.sent:
                time.sleep(max(0.0, min(two.tick(), 0.05)))
            assert time.monotonic() - handed < 0.5
            assert two.leads
            # The new leader went on from one's last run on record (its own file knew none).
            assert beat.to_micros(two.sent[0][1]) == recorded
        finally:
            one.close()
            two.close()


class Failing(Recording):
    """Its first publish fails (a broker down)."""

    failures = 1

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the broker is down")
        super().apply_async(entry, producer, advance)


def test_a_run_whose_publish_failed_is_sent_later_not_skipped(tmp_path: Path) -> None:
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 30.0}}
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "local", "ttl": 5, "name": "beat-f"}):
        one = Failing(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent = []
        backend = locks["local"]
        try:
            entry = one.schedule["e"]
            entry.last_run_at -= datetime.timedelta(seconds=31)  # due now
            before = beat.to_micros(entry.last_run_at)
            one.tick()  # leads
            deadline = time.monotonic() + 5
            while not one.sent:
                assert time.monotonic() < deadline, "the failed run was never sent again"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            # Sent once, as the run due then (from the same last run), after one failure.
            assert one.failures == 0 and len(one.sent) == 1
            assert beat.to_micros(one.sent[0][1]) == before
            recorded = backend.execute(beat.read_op(backend, "beat-f", "e"))
            assert recorded is not None and recorded > before
        finally:
            one.close()


class Landed(Recording):
    """Its first publish raises after the broker stored the message (a lost reply)."""

    failures = 1
    ids: list[str | None]

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        self.ids.append(entry.options.get("task_id"))
        super().apply_async(entry, producer, advance)
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the reply was lost")


def test_a_publish_that_raised_after_it_landed_is_sent_again_under_the_same_task_id(
    tmp_path: Path,
) -> None:
    """Publishing is at least once: a publish that raised may have been stored. Its run was
    sent again under a new task id, which no consumer could tell from another run."""
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 30.0}}
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "local", "ttl": 5, "name": "beat-l"}):
        one = Landed(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent, one.ids = [], []
        try:
            entry = one.schedule["e"]
            entry.last_run_at -= datetime.timedelta(seconds=31)  # due now
            one.tick()  # leads
            deadline = time.monotonic() + 5
            while len(one.sent) < 2:
                assert time.monotonic() < deadline, "the failed run was never sent again"
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            assert one.sent[0] == one.sent[1]  # the same run
            assert one.ids[0] is not None and one.ids == [one.ids[0]] * 2, one.ids
            assert "task_id" not in one.schedule["e"].options  # the entry's own options kept
            time.sleep(0.2)
            one.tick()
            assert len(one.sent) == 2  # not a third time
        finally:
            one.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", [DATABASE])
def test_the_new_leader_keeps_the_pace_after_a_takeover(
    kind: str, start_beats: Callable[..., tuple[list[Beat], Sends, str]]
) -> None:
    """The beat that takes over from a SIGKILLed leader sends the 1-second entry every second.

    (django-celery-beat's scheduler keeps the entry it reserved in its schedule: a heap rebuilt
    from that entry found the run just sent due again, its claim refused, in a busy loop.
    Celery's own puts the next entry there: the first test's takeovers run on it.)
    """
    beats, sends, name = start_beats(kind, 2)
    by_pid = {b.pid: b for b in beats}
    sends.wait(3, 60)
    first = leader_pid(name)
    by_pid[first].signal(signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + TTL + 10
    while not [s for s in sends.between(killed, time.monotonic()) if s[1] != first]:
        assert time.monotonic() < deadline, logs(beats)
        time.sleep(0.05)
    took_over = next(t for t, pid in sends.seen if t >= killed and pid != first)
    time.sleep(5.5)
    counted = sends.between(took_over, took_over + 5)
    shown = ([round(t - took_over, 2) for t, _ in counted], logs(beats))
    assert 3 <= len(counted) <= 6, shown  # 5 (about 1 s apart) with room for a busy machine
    assert {pid for _, pid in counted} == {leader_pid(name)} != {first}
    gaps = [b - a for a, b in itertools.pairwise(t for t, _ in counted)]
    assert min(gaps) > 0.5, shown  # never one due run sent twice


def _clock_ahead() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=10)


def _clock() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@pytest.mark.parametrize("alias", ["local", "default"])
def test_a_leader_whose_clock_ran_ahead_makes_the_next_skip_nothing(
    tmp_path: Path, alias: str
) -> None:
    # The first leader's clock is 10 minutes ahead: its records are in the next leader's
    # future. Trusted, they held every run back for 10 minutes; taken as now, the next
    # leader keeps the 0.2 s pace.
    from celery import Celery
    from celery.schedules import schedule

    apps = []
    for now in (_clock_ahead, _clock):
        app = Celery("in-process", set_as_current=False)
        every = schedule(datetime.timedelta(seconds=0.2), nowfun=now, app=app)
        app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": every}}
        apps.append(app)
    name = f"beat-ahead-{next(_runs)}-{os.getpid()}"
    with override_settings(DJANGO_REDLOCK_BEAT={"using": alias, "ttl": 1, "name": name}):
        one, two = (
            Recording(app=app, schedule_filename=str(tmp_path / f"s{i}"))
            for i, app in enumerate(apps)
        )
        one.sent, two.sent = [], []
        try:
            deadline = time.monotonic() + 5
            while len(one.sent) < 2:
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            one.close()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                time.sleep(max(0.0, min(two.tick(), 0.05)))
            assert two.leads
            assert len(two.sent) >= 4, two.sent  # about 7
            backend = locks[alias]
            recorded = backend.execute(beat.read_op(backend, name, "e"))
            assert recorded is not None and recorded <= beat.to_micros(_clock())
        finally:
            one.close()
            two.close()


def _new_year() -> datetime.datetime:
    return datetime.datetime(2027, 1, 1, 0, 0, 5, tzinfo=datetime.timezone.utc)


def test_a_yearly_entry_s_run_stays_on_record_until_after_its_next_run(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # The record is the next leader's start: capped at 30 days, a yearly entry's was gone
    # eleven months before its next run, and a takeover then sent the last run again.
    from celery import Celery
    from celery.schedules import crontab

    utc = datetime.timezone.utc
    app = Celery("in-process", set_as_current=False)
    app.conf.timezone = "UTC"
    app.conf.result_expires = None  # no daily celery.backend_cleanup entry
    yearly = crontab(
        minute=0, hour=0, day_of_month=1, month_of_year=1,
        nowfun=_new_year,
    )  # fmt: skip
    app.conf.beat_schedule = {"yearly": {"task": "tests.beat.tick", "schedule": yearly}}
    name = f"beat-yearly-{next(_runs)}-{os.getpid()}"
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "default", "ttl": 1, "name": name}):
        one = Recording(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent = []
        try:
            one.schedule["yearly"].last_run_at = datetime.datetime(2026, 1, 1, tzinfo=utc)
            deadline = time.monotonic() + 5
            while not one.sent:
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            key = beat.record_key(locks["default"], name, "yearly")
            kept = redis_server.client().pttl(key) / 1000 / 86400
            assert kept >= 2 * 365 - 1, f"the run is on record for {kept:.1f} days"
        finally:
            one.close()


_ONE_OFF = """
import datetime, sys
import django
django.setup()
from django.utils import timezone
from django_celery_beat.models import ClockedSchedule, PeriodicTask
at = timezone.now() + datetime.timedelta(seconds=2)
PeriodicTask.objects.create(
    name="once", task="tests.beat.once", one_off=True, queue=sys.argv[1],
    clocked=ClockedSchedule.objects.create(clocked_time=at),
)
"""


@pytest.mark.timeout(180)
@pytest.mark.skipif(WITHOUT_DCB, reason="needs django-celery-beat")
def test_a_clocked_one_off_is_sent_once_across_a_takeover(
    start_beats: Callable[..., tuple[list[Beat], Sends, str]], tmp_path: Path,
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # The leader sends the one-off, then is killed while its database write switching it
    # off is under way (slowed to 10 s): the next leader must not send it again.
    monkeypatch.setenv("BEAT_SLOW_ONE_OFF_SAVE", "10")
    beats, sends, name = start_beats("database", 2)
    by_pid = {b.pid: b for b in beats}
    sends.wait(1, 60)
    once = Sends(redis_server.client(db=1), f"{sends.queue}-once")
    try:
        env = {**_beat_env(redis_server), "BEAT_DB": str(tmp_path / "beat.sqlite3")}
        env.pop("BEAT_SLOW_ONE_OFF_SAVE")
        subprocess.run([sys.executable, "-c", _ONE_OFF, once.queue], cwd=ROOT, env=env, check=True)
        once.wait(1, 30)
        first = leader_pid(name)
        time.sleep(1.0)  # its write switching the one-off off is under way
        by_pid[first].signal(signal.SIGKILL)
        killed = time.monotonic()
        while leader_pid(name) == first:
            assert time.monotonic() - killed < TTL + 10, logs(beats)
            time.sleep(0.05)
        time.sleep(5.0)  # the new leader looked at the one-off (still enabled in the table)
        assert len(once.seen) == 1, logs(beats)
        assert [pid for _, pid in once.seen] == [first]
    finally:
        once.close()
        for each in beats:  # not SIGTERM: its shutdown's sync saves the one-off, slowed to 10 s
            each.process.kill()


_ROWS: dict[str, SimpleNamespace] = {}


class _RowEntry(ScheduleEntry):
    """An entry with a row (``model``), shared by the entries that follow it, as
    django-celery-beat's."""

    @property
    def model(self) -> SimpleNamespace:
        return _ROWS.setdefault(self.name, SimpleNamespace(total_run_count=0, last_run_at=None))


class _Rows(PersistentScheduler):
    """As django-celery-beat's DatabaseScheduler keeps its rows: reserve() counts the run on
    the entry's row and marks it dirty; sync() writes the dirty rows (noted here)."""

    Entry = _RowEntry

    def setup_schedule(self) -> None:
        self._dirty: set[str] = set()
        self.written: list[str] = []
        super().setup_schedule()

    def reserve(self, entry: Any) -> Any:
        new_entry = super().reserve(entry)
        entry.model.total_run_count += 1
        self._dirty.add(entry.name)
        return new_entry

    def sync(self) -> None:
        self.written.extend(sorted(self._dirty))
        self._dirty.clear()
        super().sync()


class _RowsLocked(beat.LeaderMixin, _Rows):
    standby_wait = 0.05
    sent: list[str]

    @property
    def producer(self) -> None:  # type: ignore[override]
        return None

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **_: Any) -> None:
        self.sent.append(entry.name)


def test_a_beat_that_stepped_down_writes_no_stale_row(tmp_path: Path) -> None:
    # The leader lost its lock (paused past its TTL; another beat leads): the run it reserves
    # when it wakes is refused. It must not count it on the row, nor write its stale rows
    # over the leader's (django-celery-beat's rows are shared by every beat).
    from celery import Celery

    app = Celery("in-process", set_as_current=False)
    app.conf.beat_schedule = {"e": {"task": "tests.beat.tick", "schedule": 0.2}}
    name = f"beat-rows-{next(_runs)}"
    _ROWS.clear()
    with override_settings(DJANGO_REDLOCK_BEAT={"using": "local", "ttl": 1, "name": name}):
        one = _RowsLocked(app=app, schedule_filename=str(tmp_path / "s"))
        one.sent = []
        other = lock(name, ttl=30, using="local")
        try:
            deadline = time.monotonic() + 5
            while not one.sent:
                assert time.monotonic() < deadline
                time.sleep(max(0.0, min(one.tick(), 0.05)))
            one.sync()
            row = one.schedule["e"].model
            counted, sent = row.total_run_count, len(one.sent)
            assert counted == sent and one.written == ["e"]
            backend = locks["local"]
            info = backend.inspect(name)
            assert info is not None
            backend.force_release(name, info.token, None)  # its hold is gone...
            assert other.acquire(blocking=False)  # ...and another beat leads
            one._pause_until = 0.0
            one.schedule["e"].last_run_at -= datetime.timedelta(seconds=1)  # due now
            one._heap = None
            one.tick()  # reserves "e", its claim refused: steps down
            assert not one.leads and len(one.sent) == sent
            assert one.schedule["e"].model.total_run_count == counted  # not counted
            one.sync()
            assert one.written == ["e"]  # nothing written since it stepped down
        finally:
            if other.token is not None:
                other.release()
            one.close()
