"""A semaphore of 3 against the hand-rolled sorted-set recipe: rate, Redis cost, memory."""

from __future__ import annotations

from typing import Any

from bench.harness import CPU_CYCLES, command_usec, interleaved, redis_cost


def semaphores(results: dict[str, Any], url: str) -> None:
    """A semaphore of 3 against the hand-rolled sorted-set recipe (bench/), same Redis."""
    import redis

    from bench.sorted_set_semaphore import acquire, release
    from django_redlock import locks, semaphore

    backend = locks["default"]
    conn = redis.Redis.from_url(url)

    def ours() -> None:
        with semaphore("s:ours", 3):
            pass

    def recipe() -> None:
        identifier = acquire(conn, "s:recipe", 3)
        assert identifier is not None
        release(conn, "s:recipe", identifier)

    before, cycles = backend.round_trips, 200
    for _ in range(cycles):
        ours()
    trips = (backend.round_trips - before) / cycles
    rates = interleaved({"ours": ours, "sorted-set recipe": recipe})

    client = backend.client  # type: ignore[attr-defined]
    cost = redis_cost(client, {"ours": (ours, ("evalsha",)),
                               "sorted-set recipe": (recipe, ("multi", "exec", "zrem"))})  # fmt: skip
    names = [f"s:each:{i}" for i in range(CPU_CYCLES)]
    held = [semaphore(n, 3, auto_renew=False) for n in names]
    for each in held:  # a warm pass: fence counters in place
        with each:
            pass
    client.config_resetstat()
    for each in held:
        each.acquire()
    acquire_stats = command_usec(client, ("evalsha",))["evalsha"]
    client.config_resetstat()
    for each in held:
        each.release()
    release_stats = command_usec(client, ("evalsha",))["evalsha"]

    def usage(keys: list[str]) -> int:
        return sum(conn.memory_usage(k) or 0 for k in keys)

    ours_keys = [
        backend.key("exports"),
        backend.details_key("exports"),
        backend.fence_key("exports"),
    ]
    held = [semaphore("exports", 3) for _ in range(3)]
    held[0].acquire()
    one = usage(ours_keys)
    for each in held[1:]:
        each.acquire()
    three = usage(ours_keys)
    for each in held:
        each.release()
    ids = [acquire(conn, "exports-recipe", 3) for _ in range(3)]
    recipe_three = usage(["exports-recipe"])
    for identifier in ids:
        release(conn, "exports-recipe", str(identifier))
    results["semaphore"] = {
        "rates": rates,
        "round_trips": trips,
        "redis_cost": cost,
        "usec_per_call": {
            "permit_acquire.lua": acquire_stats[1] / max(acquire_stats[0], 1),
            "permit_release.lua": release_stats[1] / max(release_stats[0], 1),
        },
        "memory": {"ours_one_permit": one, "ours_per_permit": (three - one) / 2,
                   "recipe_three_permits": recipe_three},
    }  # fmt: skip
