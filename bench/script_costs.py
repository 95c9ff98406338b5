"""What Redis charges per call of acquire.lua and release.lua on the uncontended cycle (a
plain lock, free, nobody waiting, a one-off try; its release with nobody waiting), beside a
raw SET NX PX: ``python -m bench.script_costs [--against REV]``.

Starts its own redis-server (django_redlock.testing). Each round runs ``BLOCK`` acquires
(through our backend's ops: the real keys and arguments) then their releases, with
CONFIG RESETSTAT before each block and INFO commandstats after (bench/harness.py's
command_usec): µs per EVALSHA call. ``--against REV``: the scripts as they were at git
revision REV take turns with the working tree's, round by round (the order swapped every
other round: this machine's load drifts), each on names of its own. Prints the medians, and
with ``--against`` the median of each round's difference (REV's less ours). Rounds:
``SCRIPT_COSTS_ROUNDS`` (8)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from typing import Any

from bench.harness import ROOT, command_usec

ROUNDS = int(os.environ.get("SCRIPT_COSTS_ROUNDS", "8"))
BLOCK = 250  # ROUNDS x BLOCK = 2,000 cycles per version


def source_at(rev: str, name: str) -> str:
    """``name``'s script as scripts.script() splices it, from git revision ``rev``."""
    from django_redlock.scripts import INCLUDE

    def read(part: str) -> str:
        path = f"{rev}:django_redlock/lua/{part}.lua"
        return subprocess.run(
            ["git", "show", path], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    return "\n".join(
        read(line[len(INCLUDE) :].strip()) if line.startswith(INCLUDE) else line
        for line in read(name).splitlines()
    )


def per_call(client: Any, work: list[tuple[str, list[str], list[str]]], command: str) -> float:
    """µs per call of ``command`` over ``work`` (EVALSHA sha, keys, args; or SET's)."""
    client.config_resetstat()
    for sha, keys, args in work:
        if command == "evalsha":
            client.evalsha(sha, len(keys), *keys, *args)
        else:
            client.set(keys[0], args[0], nx=True, px=30000)
    calls, usec = command_usec(client, (command,))[command]
    return usec / max(calls, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="git revision whose scripts take turns with ours")
    options = parser.parse_args()

    from bench.harness import setup
    from django_redlock.testing import RedisServer

    server = RedisServer().start()
    try:
        setup(server.url, [server.url])
        from django_redlock import locks
        from django_redlock.backends.base import Kind
        from django_redlock.scripts import script

        backend = locks["default"]
        client = backend.client
        versions = {"ours": (script("acquire").source, script("release").source)}
        if options.against:
            versions[options.against] = (
                source_at(options.against, "acquire"), source_at(options.against, "release")
            )  # fmt: skip
        shas = {v: (client.script_load(a), client.script_load(r)) for v, (a, r) in versions.items()}
        token, meta = "bench-token-0123456789ab", "bench|host|1|MainThread"

        def calls(version: str, r: int) -> tuple[list[Any], list[Any]]:
            acquire_sha, release_sha = shas[version]
            acquires, releases = [], []
            for i in range(BLOCK):
                name = f"costs:{version}:{i}"
                a = backend.op_acquire(name, token, 30_000, meta, Kind()).request
                rel = backend.op_release(name, token, Kind()).request
                acquires.append((acquire_sha, list(a.keys), list(a.args)))
                releases.append((release_sha, list(rel.keys), list(rel.args)))
            return acquires, releases

        samples: dict[str, list[float]] = {}
        for r in range(ROUNDS + 1):  # round 0 warms up: connections, the fence counters
            order = list(versions) if r % 2 else list(versions)[::-1]
            for version in order:
                acquires, releases = calls(version, r)
                a = per_call(client, acquires, "evalsha")
                rel = per_call(client, releases, "evalsha")
                if r:
                    samples.setdefault(f"{version} acquire.lua", []).append(a)
                    samples.setdefault(f"{version} release.lua", []).append(rel)
            raw = [("", [f"costs:raw:{r}:{i}"], ["v" * 24]) for i in range(BLOCK)]
            if r:
                samples.setdefault("raw SET NX PX", []).append(per_call(client, raw, "set"))
            client.delete(*[keys[0] for _, keys, _ in raw])
        print(f"µs per call (INFO commandstats), median of {ROUNDS} rounds of {BLOCK}:")
        for name, values in samples.items():
            spread = f"{min(values):.2f}-{max(values):.2f}"
            print(f"  {statistics.median(values):6.2f}  {name}  (rounds: {spread})")
        if options.against:  # neighbouring turns share the machine's load: their difference
            for each in ("acquire.lua", "release.lua"):
                ours, theirs = samples[f"ours {each}"], samples[f"{options.against} {each}"]
                gain = statistics.median(b - a for a, b in zip(ours, theirs, strict=True))
                print(f"  {gain:6.2f}  {each} saved (median of the rounds' differences)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
