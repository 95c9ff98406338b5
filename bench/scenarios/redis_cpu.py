"""Redis's CPU per uncontended cycle, ours against the raw floor, each script alone, and what
a script and each command inside one cost on this server (bench/calibration.py)."""

from __future__ import annotations

import secrets
from typing import Any

from bench.calibration import calibrate
from bench.harness import CPU_CYCLES, RELEASE_LUA, command_usec, redis_cost


def redis_cpu(results: dict[str, Any]) -> None:
    """Redis CPU per uncontended cycle, ours against the raw floor (SET NX PX + a
    compare-and-delete EVALSHA), and each of our two scripts on its own."""
    from django_redlock import lock, locks
    from django_redlock.backends.base import Kind

    backend = locks["default"]
    client = backend.client  # type: ignore[attr-defined]
    sha = client.script_load(RELEASE_LUA)

    def ours() -> None:
        with lock("cpu:ours"):
            pass

    def raw() -> None:
        token = secrets.token_urlsafe(16)
        client.set("cpu:raw", token, nx=True, px=30000)
        client.evalsha(sha, 1, "cpu:raw", token)

    cost = redis_cost(client, {"ours": (ours, ("evalsha",)), "raw": (raw, ("set", "evalsha"))})

    # Each script alone: acquire on free locks (their fence counters exist: a warm pass),
    # then release them, with the statistics reset in between.
    names = [f"cpu:each:{i}" for i in range(CPU_CYCLES)]
    token, meta = "bench-token", "bench|host|1|MainThread"
    for _ in range(2):
        client.config_resetstat()
        for name in names:
            backend.execute(backend.op_acquire(name, token, 30_000, meta, Kind()))
        acquire_stats = command_usec(client, ("evalsha",))["evalsha"]
        client.config_resetstat()
        for name in names:
            backend.execute(backend.op_release(name, token, Kind()))
        release_stats = command_usec(client, ("evalsha",))["evalsha"]
    client.config_resetstat()
    for name in names[:1000]:
        raw_token = secrets.token_urlsafe(16)
        client.set(name, raw_token, nx=True, px=30000)
        client.evalsha(sha, 1, name, raw_token)
    raw_stats = command_usec(client, ("set", "evalsha"))

    def per_call(entry: tuple[int, float]) -> float:
        return entry[1] / max(entry[0], 1)

    calibration = calibrate(client)
    print("bench: Redis's usec per EVALSHA call:", flush=True)
    for name, usec in calibration["usec_per_call"].items():
        print(f"bench:   {usec:5.2f}  {name}", flush=True)
    print(
        "bench: a command's usec inside a script (its probe less the empty script's):", flush=True
    )
    for name, usec in calibration["usec_in_script"].items():
        print(f"bench:   {usec:5.2f}  {name}", flush=True)
    results["redis_cpu"] = {
        **cost,
        "calibration": calibration,
        "usec_per_call": {
            "acquire.lua": per_call(acquire_stats),
            "release.lua": per_call(release_stats),
            "raw SET NX PX": per_call(raw_stats["set"]),
            "raw compare-and-delete": per_call(raw_stats["evalsha"]),
        },
    }
