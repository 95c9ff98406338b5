"""Metrics from a real Celery prefork worker in prometheus_client's multiprocess mode: each
child writes its own file, and the multiprocess collector sums them."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from django_redlock.testing import RedisServer
from tests.support import celery_app, celery_tasks

from ..celery.test_celery import Worker


def test_a_prefork_worker_s_children_are_summed(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    celery_app.configure(redis_server.url)
    log = tmp_path_factory.mktemp("celery") / "metrics.log"
    # What a deployment sets for every process of the worker (see README, Observing locks).
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    started = Worker(redis_server.url, "prefork", 4, "metrics", log)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")  # this process keeps its own registry
    try:
        sent = [started.send(celery_tasks.keyed, i, kwargs={"seconds": 0.3}) for i in range(8)]
        assert [r.get(timeout=60) for r in sent] == ["ran"] * 8
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(metrics_dir))
        labels = {"backend": "default", "kind": "plain"}
        deadline = time.monotonic() + 10
        while registry.get_sample_value("redlock_hold_seconds_count", labels) != 8:
            assert time.monotonic() < deadline  # the last release follows the result
            time.sleep(0.05)
        acquired = {**labels, "outcome": "acquired"}
        assert registry.get_sample_value("redlock_acquisitions_total", acquired) == 8
        assert registry.get_sample_value("redlock_wait_seconds_count", labels) == 8
        assert registry.get_sample_value("redlock_held", {"backend": "default"}) == 0
        # Counted by the children, more than one: each writes counter_<pid>.db of its own.
        per_child = {}
        for path in metrics_dir.glob("counter_*.db"):
            alone = tmp_path / path.stem
            alone.mkdir()
            shutil.copy(path, alone / path.name)
            one = CollectorRegistry()
            MultiProcessCollector(one, path=str(alone))
            per_child[path.stem] = one.get_sample_value("redlock_acquisitions_total", acquired) or 0
        assert (
            f"counter_{started.process.pid}" not in per_child
            or not per_child[f"counter_{started.process.pid}"]
        )  # the main process takes no task's lock
        assert sum(per_child.values()) == 8
        assert len([count for count in per_child.values() if count]) >= 2, per_child
    finally:
        started.stop()
