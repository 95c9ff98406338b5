"""What Redis charges for a script and for each command inside one, measured on the bench's
own server (INFO commandstats usec of EVALSHA, per call): the cost model of
bench/README.md comes from these, not from a rule of thumb.

Each probe is a script run alone ``CPU_CYCLES`` times after CONFIG RESETSTAT; a command's
cost inside a script is its probe less the empty script of the same shape (one key, one
argument). The probes take turns over ``CALIBRATION_ROUNDS`` rounds; each figure is the
median of its rounds (the machine's load drifts over seconds)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.harness import CPU_CYCLES, command_usec

CALIBRATION_ROUNDS = 3

#: name -> (script, number of keys, number of arguments). The empty probes are the bases.
PROBES: dict[str, tuple[str, int, int]] = {
    "empty script, no keys or arguments": ("return 0", 0, 0),
    "empty script, 1 key and 1 argument": ("return 0", 1, 1),
    "empty script, 5 keys and 5 arguments (acquire.lua's shape)": ("return 0", 5, 5),
    "empty script, 5 keys and 3 arguments (release.lua's shape)": ("return 0", 5, 3),
    "SET PX": ("redis.call('SET', KEYS[1], ARGV[1], 'PX', 30000) return 0", 1, 1),
    "SET NX PX (on a held key: refused)": (
        "redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', 30000) return 0", 1, 1),
    "SET NX PX + DEL (a key made and dropped)": (
        "redis.call('SET', KEYS[1] .. ':n', ARGV[1], 'NX', 'PX', 30000)"
        " redis.call('DEL', KEYS[1] .. ':n') return 0", 1, 1),
    "TIME": ("redis.call('TIME') return 0", 1, 1),
    "SET PX GET (a write with a TTL that returns the old value)": (
        "redis.call('SET', KEYS[1], ARGV[1], 'PX', 30000, 'GET') return 0", 1, 1),
    "EXISTS": ("redis.call('EXISTS', KEYS[1]) return 0", 1, 1),
    "EXISTS of 3 keys (2 missing)": (
        "redis.call('EXISTS', KEYS[1] .. ':q', KEYS[1] .. ':q', KEYS[1] .. ':w') return 0", 1, 1),
    "GET": ("redis.call('GET', KEYS[1]) return 0", 1, 1),
    "DEL (of a missing key)": ("redis.call('DEL', KEYS[1] .. ':none') return 0", 1, 1),
    "PUBLISH (nobody listening)": ("redis.call('PUBLISH', KEYS[1], ARGV[1]) return 0", 1, 1),
}  # fmt: skip
#: The probe each command's probe is compared with.
BASE = "empty script, 1 key and 1 argument"


def _usec_per_call(client: Any, sha: str, keys: list[str], args: list[str]) -> float:
    client.config_resetstat()
    for _ in range(CPU_CYCLES):
        client.evalsha(sha, len(keys), *keys, *args)
    calls, usec = command_usec(client, ("evalsha",))["evalsha"]
    return usec / max(calls, 1)


def calibrate(client: Any) -> dict[str, Any]:
    """``{"usec_per_call": {probe: us}, "usec_in_script": {command: us}}``: each probe's
    EVALSHA usec per call, and each command's cost inside a script (its probe less
    :data:`BASE`). Also sets ``calib:key`` (a held key, for the probes that read it)."""
    shas = {name: client.script_load(source) for name, (source, _, _) in PROBES.items()}
    client.set("calib:key", "v" * 40, px=600_000)  # a held lock's value is about this long
    samples: dict[str, list[float]] = {name: [] for name in PROBES}
    for _ in range(CALIBRATION_ROUNDS):
        for name, (_, nkeys, nargs) in PROBES.items():
            keys = ["calib:key"] + [f"calib:k{i}" for i in range(1, nkeys)]
            args = ["v" * 40] * nargs
            samples[name].append(_usec_per_call(client, shas[name], keys[:nkeys], args))
    per_call = {name: statistics.median(values) for name, values in samples.items()}
    base = per_call[BASE]
    in_script = {name: per_call[name] - base for name, (_, nkeys, _) in PROBES.items()
                 if not name.startswith("empty")}  # fmt: skip
    client.delete("calib:key")
    return {
        "usec_per_call": per_call,
        "usec_in_script": in_script,
        "model": model(per_call, in_script),
    }


#: What an uncontended cycle's two scripts run, in the probes' terms (lua/acquire.lua and
#: lua/release.lua on a free plain lock that nobody waits for).
ACQUIRE_CALLS = ("TIME", "EXISTS", "GET", "SET PX")  # clock, fair queue, counter read, write
RELEASE_CALLS = ("GET", "EXISTS")  # the hold's value, anyone waiting
CYCLE_PAIR = "SET NX PX + DEL (a key made and dropped)"  # the lock's key: made, then dropped


def model(per_call: dict[str, float], in_script: dict[str, float]) -> dict[str, float]:
    """The cost model's prediction of an uncontended cycle's scripts, from the probes alone:
    each script's shape (its keys and arguments) plus its calls; the lock's own key, made by
    the acquire and dropped by the release, counted once for the pair. The scenario sets it
    beside what the scripts measure (the rest: the Lua between the calls)."""
    shape_a = per_call["empty script, 5 keys and 5 arguments (acquire.lua's shape)"]
    shape_r = per_call["empty script, 5 keys and 3 arguments (release.lua's shape)"]
    calls = sum(in_script[c] for c in ACQUIRE_CALLS) + sum(in_script[c] for c in RELEASE_CALLS)
    return {"acquire shape": shape_a, "release shape": shape_r, "calls": calls,
            "lock key made and dropped": in_script[CYCLE_PAIR],
            "cycle": shape_a + shape_r + calls + in_script[CYCLE_PAIR]}  # fmt: skip
