"""``lock_all`` of 2 and of 10 names on one Redis against taking the same names one by one
(nested ``lock``, in sorted order): cycles per second, the two taking turns, and round trips
per cycle (one script for the set, one for its release: 2, whatever the size)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from bench.harness import interleaved

SIZES = (2, 10)


def lock_all_scenario(results: dict[str, Any]) -> None:
    from django_redlock import lock, lock_all, locks

    backend = locks["default"]
    figures: dict[str, Any] = {}
    for size in SIZES:
        names = [f"la:{size}:{i}" for i in range(size)]

        def together(names: list[str] = names) -> None:
            with lock_all(*names):
                pass

        def one_by_one(names: list[str] = names) -> None:
            with contextlib.ExitStack() as held:
                for name in names:
                    held.enter_context(lock(name))

        cases: dict[str, Callable[[], None]] = {"lock_all": together, "one by one": one_by_one}
        trips = {}
        for label, cycle in cases.items():
            before = backend.round_trips
            for _ in range(100):
                cycle()
            trips[label] = (backend.round_trips - before) / 100
        rates = interleaved(cases)
        figures[f"{size} names"] = {
            "rates": rates,
            "round_trips": trips,
            "ratio": rates["lock_all"] / rates["one by one"],
        }
    results["lock_all"] = figures
