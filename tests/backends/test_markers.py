"""The task dedupe's queue markers through django_redlock.backends.markers, the one way the
contrib and compat modules reach them: the same rules on every backend, one operation each
(one round trip on Redis), and a backend that keeps none refused before any I/O."""

from __future__ import annotations

import time
from typing import Any

import pytest

from django_redlock import locks
from django_redlock.backends import markers
from django_redlock.backends.base import BaseLockBackend, Op


@pytest.mark.parametrize("using", ["redis", "local"])
def test_mark_read_clear_and_list_follow_the_rules(using: str) -> None:
    backend = locks[using]
    assert markers.read(backend, "mk:a") is None
    assert markers.mark(backend, "mk:a", "t1", 60_000) is None  # noted now
    assert markers.mark(backend, "mk:a", "t2", 60_000) == "t1"  # t1 is queued already
    task_id, left = markers.read(backend, "mk:a") or ("", 0)
    assert task_id == "t1" and 0 < left <= 60_000
    assert markers.names(backend, "mk:*") == ["mk:a"]
    assert markers.clear(backend, "mk:a", "t2") is False  # not t2's to clear
    assert markers.clear(backend, "mk:a", "t1") is True
    assert markers.read(backend, "mk:a") is None and markers.names(backend, "mk:*") == []
    assert markers.mark(backend, "mk:b", "t3", 200) is None
    time.sleep(0.3)  # expired: the next task is noted
    assert markers.mark(backend, "mk:b", "t4", 60_000) is None
    assert markers.clear(backend, "mk:b", "t4") is True


def test_each_marker_operation_is_one_round_trip() -> None:
    backend = locks["redis"]
    before = backend.round_trips
    markers.mark(backend, "mk:rt", "t1", 60_000)
    markers.read(backend, "mk:rt")
    markers.clear(backend, "mk:rt", "t1")
    assert backend.round_trips - before == 3
    assert markers.queued_key(backend, "mk:rt") == f"{backend.key('mk:rt')}:queued"


class _NoMarkers(BaseLockBackend):
    needs_location = False

    def execute(self, op: Op[Any]) -> Any:
        raise AssertionError("no I/O")


def test_a_backend_without_markers_is_refused_before_any_io() -> None:
    backend = _NoMarkers("plain", {})
    for call in (
        lambda: markers.mark(backend, "n", "t", 1000),
        lambda: markers.clear(backend, "n", "t"),
        lambda: markers.read(backend, "n"),
        lambda: markers.names(backend),
    ):
        with pytest.raises(NotImplementedError, match=r"'plain' .* keeps no queue markers"):
            call()
