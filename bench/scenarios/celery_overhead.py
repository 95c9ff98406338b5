"""What ``@single_instance`` adds to a Celery task: round trips and time."""

from __future__ import annotations

from typing import Any

from bench.harness import interleaved


def celery_overhead(results: dict[str, Any]) -> None:
    from celery import Celery

    from django_redlock import locks, single_instance

    app = Celery("bench", broker="memory://", backend="cache+memory://", set_as_current=True)

    @app.task(bind=True)
    def plain(self: Any, n: int) -> int:
        return n

    @app.task(bind=True)
    @single_instance(key="celery:{n}", ttl=30)
    def guarded(self: Any, n: int) -> int:
        return n

    backend = locks["default"]
    before = backend.round_trips
    for i in range(200):
        guarded.apply(args=(i,))
    trips = (backend.round_trips - before) / 200
    rates = interleaved({"undecorated": lambda: plain.apply(args=(1,)),
                         "@single_instance": lambda: guarded.apply(args=(1,))})  # fmt: skip
    overhead_us = (1 / rates["@single_instance"] - 1 / rates["undecorated"]) * 1e6
    results["celery"] = {"round_trips": trips, "overhead_us": overhead_us, "rates": rates}
