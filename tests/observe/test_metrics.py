"""Prometheus metrics: every metric moves by exactly what a scripted sequence of lock events
should move it, on real redis-servers; no label is ever a lock name."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from prometheus_client import REGISTRY

from django_redlock import BackendUnavailable, LockLost, lock, locks, observe
from django_redlock.testing import RedisServer

NAMES = ("obs:a", "obs:b", "obs:lost", "obs:renewed", "obs:down", "obs:gone")


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Snapshot:
    """Every redlock_* sample now, to compare with later."""

    def __init__(self) -> None:
        self.values = self.read()

    @staticmethod
    def read() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in REGISTRY.collect()
            if metric.name.startswith("redlock_")
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    def moved(self) -> dict[str, float]:
        """What changed: 'name{label=value,...}' -> delta (buckets left out)."""
        now = self.read()
        changes = {}
        for key, value in now.items():
            name, labels = key
            delta = value - self.values.get(key, 0.0)
            if delta and not name.endswith("_bucket"):
                text = ",".join(f"{k}={v}" for k, v in labels)
                changes[f"{name}{{{text}}}"] = round(delta, 6)
        return changes

    def moved_with(self, key: str, within: float = 10.0) -> dict[str, float]:
        """``moved()`` once ``key`` has moved: a loss the watchdog finds is announced (metric,
        signal) on its notifier thread, just after ``lost`` is set."""
        deadline = time.monotonic() + within
        while key not in (changes := self.moved()):
            assert time.monotonic() < deadline, f"{key} never moved: {changes}"
            time.sleep(0.02)
        return changes


#: redlock_held per backend when the test began (``holding``).
HELD_AT_START: dict[str, float] = {}


def holding(backend: str) -> float:
    """This test's holds on ``backend``: the gauge counts the process's, and an earlier
    test's may still be held (an object it kept, or one the collector had not reached)."""
    return sample("redlock_held", backend=backend) - HELD_AT_START.get(backend, 0.0)


@pytest.fixture(autouse=True)
def _observed() -> Iterator[None]:
    assert observe.configure() is not None  # prometheus_client is installed for the tests
    gc.collect()  # an earlier test's dropped holding Lock: the scrape below ends its hold
    HELD_AT_START.clear()
    for metric in REGISTRY.collect():
        if metric.name == "redlock_held":
            HELD_AT_START.update((s.labels["backend"], s.value) for s in metric.samples)
    yield


def test_a_scripted_sequence_moves_every_metric_by_exactly_what_happened(
    monkeypatch: pytest.MonkeyPatch, redis_factory: Any
) -> None:
    backend = locks["redis"]
    renewed: list[int] = []
    original = backend.renew_many

    def counting(renewals: Any) -> Any:  # the watchdog's own calls, counted as they return
        results = original(renewals)
        renewed.append(results.count(True))
        return results

    monkeypatch.setattr(backend, "renew_many", counting)
    before = Snapshot()
    renewals = sample("redlock_renewals_total", backend="redis", outcome="renewed")
    waits = sample("redlock_wait_seconds_sum", backend="redis", kind="plain")
    for _ in range(3):  # k = 3 acquisitions
        with lock("obs:a", using="redis"):
            pass
    with lock("obs:b", using="redis"):
        assert not lock("obs:b", using="redis").acquire(blocking=False)  # busy
        assert not lock("obs:b", using="redis").acquire(timeout=0.2)  # timeout
    held = lock("obs:lost", using="redis", auto_renew=False)
    held.acquire()
    assert locks["redis"].force_release("obs:lost")
    with pytest.raises(LockLost):
        held.release()  # a lost hold, found at release
    with lock("obs:renewed", using="redis", ttl=0.6):
        deadline = time.monotonic() + 10
        while sum(renewed) < 2:  # renewed by the watchdog (every 0.2 s)
            assert time.monotonic() < deadline
            time.sleep(0.05)
    while sample("redlock_renewals_total", backend="redis", outcome="renewed") - renewals < sum(
        renewed
    ):
        assert time.monotonic() < deadline  # the watchdog settles what it got back
        time.sleep(0.01)
    with pytest.raises(BackendUnavailable):
        lock("obs:down", using="down").acquire()  # a backend error
    # This test's backends only: the process's other holds (an earlier test's, on a server
    # it killed) may end meanwhile, on their own aliases (seen in a full run).
    moved = {k: v for k, v in before.moved().items() if re.search(r"backend=(redis|down)[,}]", k)}
    assert moved == {
        "redlock_acquisitions_total{backend=redis,kind=plain,outcome=acquired}": 6,
        "redlock_acquisitions_total{backend=redis,kind=plain,outcome=busy}": 1,
        "redlock_acquisitions_total{backend=redis,kind=plain,outcome=timeout}": 1,
        "redlock_acquisitions_total{backend=down,kind=plain,outcome=error}": 1,
        "redlock_wait_seconds_count{backend=redis,kind=plain}": 7,  # acquired + timed out
        "redlock_wait_seconds_sum{backend=redis,kind=plain}": moved[
            "redlock_wait_seconds_sum{backend=redis,kind=plain}"
        ],
        "redlock_hold_seconds_count{backend=redis,kind=plain}": 6,
        "redlock_hold_seconds_sum{backend=redis,kind=plain}": moved[
            "redlock_hold_seconds_sum{backend=redis,kind=plain}"
        ],
        "redlock_lost_total{backend=redis}": 1,
        "redlock_renewals_total{backend=redis,outcome=renewed}": sum(renewed),
        "redlock_backend_errors_total{backend=down}": 1,
    }
    waited = sample("redlock_wait_seconds_sum", backend="redis", kind="plain") - waits
    assert 0.2 <= waited < 5  # the timeout's 0.2 s is in it
    assert moved["redlock_hold_seconds_sum{backend=redis,kind=plain}"] >= 0.4  # renewed hold
    assert holding("redis") == 0  # every hold ended
    labels = {v for metric in REGISTRY.collect() if metric.name.startswith("redlock_")
              for s in metric.samples for v in s.labels.values()}  # fmt: skip
    assert not labels & set(NAMES)  # never a lock name


def test_held_counts_this_process_s_holds_and_a_renewal_finds_a_loss() -> None:
    before = Snapshot()
    first = lock("obs:gone", using="redis", ttl=0.6)
    first.acquire()
    second = lock("obs:b", using="redis", reentrant=True)
    second.acquire()
    second.acquire()  # a re-entry is not another hold
    assert holding("redis") == 2
    assert locks["redis"].force_release("obs:gone")
    deadline = time.monotonic() + 10
    while first.lost is None:  # the watchdog finds it gone
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert holding("redis") == 1
    second.release()
    second.release()
    moved = before.moved_with("redlock_lost_total{backend=redis}")
    assert moved["redlock_renewals_total{backend=redis,outcome=lost}"] == 1
    assert moved["redlock_lost_total{backend=redis}"] == 1
    assert moved["redlock_acquisitions_total{backend=redis,kind=reentrant,outcome=acquired}"] == 2
    assert moved["redlock_hold_seconds_count{backend=redis,kind=reentrant}"] == 1
    assert holding("redis") == 0


def test_renewals_that_get_no_answer_are_errors(redis_factory: Any) -> None:
    server: RedisServer = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
              "OPTIONS": {"socket_timeout": 0.3, "socket_connect_timeout": 0.3}}  # fmt: skip
    from django.conf import settings

    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "flaky": config}):
        before = Snapshot()
        held = lock("obs:flaky", using="flaky", ttl=0.9)
        held.acquire()
        server.kill()
        time.sleep(1.5)  # renewals get no answer past the TTL: errors, not yet a loss
        assert held.lost is None
        server.start()  # back, empty: the next renewal answers that the hold is gone
        deadline = time.monotonic() + 10
        while held.lost is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        moved = before.moved()
    assert moved["redlock_renewals_total{backend=flaky,outcome=error}"] >= 1
    errors = moved["redlock_backend_errors_total{backend=flaky}"]
    assert errors == moved["redlock_renewals_total{backend=flaky,outcome=error}"]
    assert moved["redlock_lost_total{backend=flaky}"] == 1


def test_asyncio_and_fair_kinds_are_labelled_by_kind() -> None:
    import asyncio

    before = Snapshot()

    async def main() -> None:
        async with lock("obs:a", using="local", fair=True):
            pass

    asyncio.run(main())
    moved = before.moved()
    assert moved["redlock_acquisitions_total{backend=local,kind=fair,outcome=acquired}"] == 1
    assert moved["redlock_hold_seconds_count{backend=local,kind=fair}"] == 1


def test_groups_map_names_to_a_few_families() -> None:
    groups = {"invoice:{id}": "invoice", "report:*:daily": "daily-report"}
    with override_settings(DJANGO_REDLOCK_LOCK_GROUPS=groups):
        for name in ("invoice:1", "invoice:2", "report:7:daily", "misc"):
            with lock(name, using="local"):
                pass
        got = {
            group: sample(
                "redlock_acquisitions_total",
                backend="local",
                kind="plain",
                outcome="acquired",
                group=group,
            )
            for group in ("invoice", "daily-report", "other")
        }
    assert got == {"invoice": 2, "daily-report": 1, "other": 1}
    # Back to the SPEC's labels without the setting.
    with lock("invoice:3", using="local"):
        pass
    assert sample("redlock_acquisitions_total", backend="local", kind="plain",
                  outcome="acquired") == 1  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("DJANGO_REDLOCK_METRICS", "yes", "must be True or False"),
        ("DJANGO_REDLOCK_LOCK_GROUPS", ["invoice"], "non-empty dict"),
        ("DJANGO_REDLOCK_LOCK_GROUPS", {"invoice:*": "in voice"}, "a group is 1-64"),
    ],
)
def test_bad_settings_are_refused(setting: str, value: Any, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message), override_settings(**{setting: value}):
        pass


def test_off_is_a_do_nothing_hook_and_moves_nothing() -> None:
    with override_settings(DJANGO_REDLOCK_METRICS=False, DJANGO_REDLOCK_TRACING=False):
        assert all(getattr(observe, hook) is observe._nothing for hook in observe.HOOKS)
        before = Snapshot()
        with lock("obs:a", using="redis"):
            assert not lock("obs:a", using="redis").acquire(blocking=False)
        assert before.moved() == {}
    assert observe.acquire_ended is not observe._nothing


def test_a_hold_whose_lock_object_was_collected_ends_its_gauge() -> None:
    leaked = lock("obs:leak", using="local", auto_renew=False)
    leaked.acquire()
    assert holding("local") == 1
    del leaked  # never released: the hold runs out at its TTL
    gc.collect()
    with lock("obs:next", using="local"):  # the next hook counts the abandoned hold as ended
        assert holding("local") == 1
    assert holding("local") == 0


def test_a_collected_holding_lock_ends_its_gauge_at_the_next_scrape() -> None:
    leaked = lock("obs:leak-scrape", using="local", auto_renew=False)
    leaked.acquire()
    assert holding("local") == 1
    del leaked
    gc.collect()
    # No other lock operation in this (quiet) process: the scrape itself settles it.
    assert holding("local") == 0


def test_a_release_that_got_no_answer_is_no_longer_counted_held(redis_factory: Any) -> None:
    server: RedisServer = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url,
              "OPTIONS": {"socket_timeout": 0.3, "socket_connect_timeout": 0.3}}  # fmt: skip
    from django.conf import settings

    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "mute": config}):
        before = Snapshot()
        held = lock("obs:mute", using="mute", ttl=5)
        held.acquire()
        assert holding("mute") == 1
        server.kill()
        with pytest.raises(BackendUnavailable):
            held.release()
        # Nobody renews it, nothing counts it: it runs out at its TTL at the latest.
        assert holding("mute") == 0
        assert before.moved()["redlock_hold_seconds_count{backend=mute,kind=plain}"] == 1
        server.start()  # back, empty: a retried release finds it gone, which is no loss
        held.release()
        moved = before.moved()
    assert holding("mute") == 0
    assert moved["redlock_hold_seconds_count{backend=mute,kind=plain}"] == 1
    assert "redlock_lost_total{backend=mute}" not in moved


def test_two_scrapes_at_once_never_read_the_gauge_below_zero() -> None:
    import threading

    stop, lowest = threading.Event(), [0.0]

    def scrape() -> None:
        while not stop.is_set():
            lowest[0] = min(lowest[0], holding("local"))

    scrapers = [threading.Thread(target=scrape) for _ in range(2)]
    for thread in scrapers:
        thread.start()
    try:
        for i in range(3000):
            with lock(f"obs:churn:{i % 7}", using="local", auto_renew=False):
                pass
    finally:
        stop.set()
        for thread in scrapers:
            thread.join()
    assert lowest[0] >= 0


def test_an_uncontended_hold_queues_one_metrics_event_to_take_and_one_to_end() -> None:
    """Metrics are counted at the scrape from queued events: an acquire that takes a new hold
    queues one (acquired, its wait and the gauge together), its release one; the scrape
    counts all three as before."""
    observe.events.apply()
    before = Snapshot()
    queued = len(observe.events.queue)
    with lock("obs:a", using="redis"):
        assert len(observe.events.queue) == queued + 1
    assert len(observe.events.queue) == queued + 2
    counted = {k: v for k, v in before.moved().items() if "_sum{" not in k}
    assert counted == {
        "redlock_acquisitions_total{backend=redis,kind=plain,outcome=acquired}": 1,
        "redlock_wait_seconds_count{backend=redis,kind=plain}": 1,
        "redlock_hold_seconds_count{backend=redis,kind=plain}": 1,
    }


def test_a_batch_of_observations_moves_a_histogram_as_one_observe_each() -> None:
    """The scrape counts a batch of waits or hold times into a histogram at once: every
    bucket, the count and the sum end as one ``observe`` per value would leave them."""
    from prometheus_client import CollectorRegistry, Histogram

    registry = CollectorRegistry()
    histogram = Histogram("batch", "batch", ["way"], registry=registry,
                          buckets=observe.WAIT_BUCKETS)  # fmt: skip
    values = [0.0, 0.0005, 0.0004, 0.001, 0.003, 0.0025, 1.0, 7.5, 1e9, -1.0, 0.02, 0.02]
    for value in values:
        histogram.labels("one by one").observe(value)
    observe.observe_all(histogram.labels("batch"), values)
    observe.observe_all(histogram.labels("batch of one"), values[4:5])

    def samples(way: str) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value for metric in registry.collect()
                for s in metric.samples if s.labels.get("way") == way
                and not s.name.endswith("_created")}  # fmt: skip

    assert samples("batch") == pytest.approx(samples("one by one"))
    assert samples("batch")[("batch_bucket", "0.001")] == 5  # cumulative; a bound is in its le
    assert samples("batch of one")[("batch_count", "")] == 1


def test_a_half_built_hold_record_is_collected_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt inside ``Held.__init__`` (a signal's exception at its first line) leaves
    an object with no attributes: collecting it printed "Exception ignored in Held.__del__:
    AttributeError" and counted nothing; it now counts nothing quietly."""
    import sys

    ignored: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    half = observe.Held.__new__(observe.Held)  # as if __init__ was cut short at once
    del half
    gc.collect()
    assert ignored == []
