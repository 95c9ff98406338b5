"""What every scenario shares: the knobs, Django's settings, the Redis servers, turns and
rates, percentiles and medians, and Redis's own cost of a cycle."""

from __future__ import annotations

import bisect
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "1.0"))
CONTENDERS = 8
CONTENDED_ROUNDS = int(os.environ.get("BENCH_CONTENDED_ROUNDS", "3"))
#: The Redis CPU figures: the cases take turns of CPU_BLOCK cycles, CPU_ROUNDS turns each (the
#: machine's load drifts over seconds; short turns share it out evenly), summed per case.
CPU_BLOCK = int(os.environ.get("BENCH_CPU_BLOCK", "250"))
CPU_ROUNDS = int(os.environ.get("BENCH_CPU_ROUNDS", str(ROUNDS * 8)))
#: Calls of each script on its own (its usec per call).
CPU_CYCLES = int(os.environ.get("BENCH_CPU_CYCLES", "2000"))
RELEASE_LUA = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def setup(single_url: str, node_urls: list[str]) -> None:
    import django
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench",
        USE_TZ=True,
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF="bench.urls",
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.messages",
            "django.contrib.sessions",
            "django_redlock",
        ],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        TEMPLATES=[
            {
                "BACKEND": "django.template.backends.django.DjangoTemplates",
                "APP_DIRS": True,
                "OPTIONS": {
                    "context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                    ]
                },
            }
        ],
        MESSAGE_STORAGE="django.contrib.messages.storage.cookie.CookieStorage",
        DJANGO_REDLOCK={
            "default": {
                "BACKEND": "django_redlock.backends.redis.RedisBackend",
                "LOCATION": single_url,
            },
            "quorum": {
                "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
                "LOCATION": node_urls,
            },
        },
        DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
    )
    django.setup()


def rate(work: Callable[[], Any], seconds: float) -> float:
    """Calls of ``work`` per second, over about ``seconds``."""
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(20):
            work()
        count += 20
    return count / elapsed


def interleaved(cases: dict[str, Callable[[], Any]], seconds: float = SECONDS) -> dict[str, float]:
    """Median rate of each case over ROUNDS rounds, the cases taking turns."""
    for work in cases.values():
        work()  # warm up: connections, scripts
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, work in cases.items():
            rates[name].append(rate(work, seconds))
    return {name: statistics.median(values) for name, values in rates.items()}


#: Paired turns: the cases take turns of PAIRED_TURN seconds, PAIRED_ROUNDS rounds.
PAIRED_TURN = float(os.environ.get("BENCH_PAIRED_TURN", "0.1"))
PAIRED_ROUNDS = int(os.environ.get("BENCH_PAIRED_ROUNDS", "40"))


def paired(
    cases: dict[str, Callable[[], Any]], subject: str, turn: float = PAIRED_TURN,
    rounds: int = PAIRED_ROUNDS,
) -> dict[str, float]:  # fmt: skip
    """``subject``'s rate over each other case's: the median over ``rounds`` of the ratio of
    neighbouring turns (the order reversed every other round). On a shared machine whose
    load drifts over seconds, a ratio of two medians taken seconds apart carries the drift;
    neighbouring turns share most of it."""
    for work in cases.values():
        work()  # warm up: connections, scripts
    names = list(cases)
    ratios: dict[str, list[float]] = {name: [] for name in names if name != subject}
    for i in range(rounds):
        rates = {name: rate(cases[name], turn) for name in (names if i % 2 else names[::-1])}
        for name in ratios:
            ratios[name].append(rates[subject] / rates[name])
    return {name: statistics.median(values) for name, values in ratios.items()}


@contextlib.contextmanager
def redis_servers() -> Iterator[tuple[Any, list[Any]]]:
    """One redis-server, and 5 for the quorum: (single, nodes), stopped on the way out."""
    from django_redlock.testing import RedisServer

    single = RedisServer().start()
    nodes = [RedisServer().start() for _ in range(5)]
    try:
        yield single, nodes
    finally:
        for server in [single, *nodes]:
            server.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def redis_seconds(client: Any) -> float:
    """CPU seconds the redis-server has used (INFO cpu: user + sys, all its threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def command_usec(client: Any, commands: tuple[str, ...]) -> dict[str, tuple[int, float]]:
    """INFO commandstats of ``commands``: calls and usec in all, since CONFIG RESETSTAT. Only
    commands the client sent itself: a script's own calls are inside EVALSHA's usec already."""
    stats = client.info("commandstats")
    out = {}
    for command in commands:
        entry = stats.get(f"cmdstat_{command}") or {"calls": 0, "usec": 0}
        out[command] = (int(entry["calls"]), float(entry["usec"]))
    return out


def redis_cost(
    client: Any, cases: dict[str, tuple[Callable[[], Any], tuple[str, ...]]]
) -> dict[str, Any]:
    """Redis's cost per cycle of each case, the cases taking turns: CPU (INFO cpu: user + sys
    of the server, all it does for a cycle: reading, parsing, running, replying) and the
    time inside the commands each case sends itself (INFO commandstats usec; a script's own
    calls are inside its EVALSHA's, a MULTI's commands inside its EXEC's)."""
    for work, _ in cases.values():
        work()  # warm up: connections, scripts
    cpu = dict.fromkeys(cases, 0.0)
    usec = dict.fromkeys(cases, 0.0)
    turns: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(CPU_ROUNDS):
        for name, (work, commands) in cases.items():
            stats = command_usec(client, commands)
            used = redis_seconds(client)
            for _ in range(CPU_BLOCK):
                work()
            used = redis_seconds(client) - used
            after = command_usec(client, commands)
            cpu[name] += used
            turns[name].append(used)
            usec[name] += sum(after[c][1] - stats[c][1] for c in commands)
    cycles = CPU_ROUNDS * CPU_BLOCK
    first, second = list(cases)[:2]
    ratios = sorted(a / b for a, b in zip(turns[first], turns[second], strict=True) if b > 0)
    return {
        "cycles": cycles,
        "cpu_us_per_cycle": {name: cpu[name] / cycles * 1e6 for name in cases},
        "cpu_ratio": cpu[first] / cpu[second],
        "cpu_ratio_of_turns_p10_p50_p90": [percentile(ratios, q) for q in (0.1, 0.5, 0.9)],
        "commandstats_us_per_cycle": {name: usec[name] / cycles for name in cases},
        "commandstats_ratio": usec[first] / usec[second],
    }


def summarise(outputs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    spans = sorted(tuple(s) for out in outputs for s in out["spans"])
    handoffs = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    # Each process's first wait is left out of the worst wait: it includes the process's
    # start-up (connections, script loading, subscriptions), not the lock's fairness.
    waits = [w for out in outputs for w in out["waits"][1:]]
    acquisitions = len(spans)
    # Wake-up latency, for semaphores too: from the last release before an acquisition that
    # had to wait (a release while it waited) to that acquisition.
    releases = sorted(end for _, end in spans)
    wakes = []
    for out in outputs:
        for (got, _), waited in zip(out["spans"], out["waits"], strict=False):
            before = [r for r in releases[: bisect.bisect_right(releases, got)][-1:]
                      if r >= got - waited]  # fmt: skip
            if before:
                wakes.append(got - before[0])
    return {
        "wake_p50_ms": percentile(wakes, 0.5) * 1000,
        "wake_p99_ms": percentile(wakes, 0.99) * 1000,
        "per_second": acquisitions / seconds,
        "handoff_p50_ms": percentile(handoffs, 0.5) * 1000,
        "handoff_p99_ms": percentile(handoffs, 0.99) * 1000,
        "worst_wait_ms": max(waits) * 1000 if waits else float("nan"),
        "wait_p99_ms": percentile(waits, 0.99) * 1000,
        "fifo_ideal_ms": (CONTENDERS - 1) * seconds / max(acquisitions, 1) * 1000,
        "commands_per_acquisition": sum(out["sent"] for out in outputs) / max(acquisitions, 1),
        "handoffs_ms": [h * 1000 for h in handoffs],
    }


def median_summary(values: list[dict[str, Any]]) -> dict[str, Any]:
    merged = {k: statistics.median(v[k] for v in values) for k in values[0] if k != "handoffs_ms"}
    merged["handoffs_ms"] = [h for v in values for h in v["handoffs_ms"]]
    return merged
