"""The uncontended cycle with metrics and spans on, against everything off.

Run it last: it installs an OpenTelemetry SDK tracer provider for the rest of the process.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.harness import ROUNDS, SECONDS, rate


def observability(results: dict[str, Any]) -> None:
    """The uncontended cycle with metrics (and spans) on against everything off, the modes
    taking turns in one process. configure() binds the hooks for the whole process."""
    from django.test.utils import override_settings
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from django_redlock import lock, observe

    trace.set_tracer_provider(TracerProvider())  # recording spans, exported nowhere

    def cycle() -> None:
        with lock("o:ours"):
            pass

    modes = {
        "off": {"DJANGO_REDLOCK_METRICS": False, "DJANGO_REDLOCK_TRACING": False},
        "metrics": {"DJANGO_REDLOCK_METRICS": True, "DJANGO_REDLOCK_TRACING": False},
        "metrics + spans": {"DJANGO_REDLOCK_METRICS": True, "DJANGO_REDLOCK_TRACING": True},
    }
    # Short turns, many of them: the machine's load drifts over seconds, and each on/off
    # ratio is taken between neighbouring turns.
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(ROUNDS * 8):
        for mode, options in modes.items():
            with override_settings(**options):
                cycle()  # warm
                rates[mode].append(rate(cycle, SECONDS / 4))
    observe.configure()
    off = rates["off"]
    results["observability"] = {
        "rates": {mode: statistics.median(values) for mode, values in rates.items()},
        "metrics_ratio": statistics.median(
            m / o for m, o in zip(rates["metrics"], off, strict=True)
        ),
        "spans_ratio": statistics.median(
            m / o for m, o in zip(rates["metrics + spans"], off, strict=True)
        ),
    }
