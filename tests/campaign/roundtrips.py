"""Round trips on a healthy, quiet Redlock: ``python -m tests.campaign.roundtrips CONFIG_JSON``.

Run by the harness after the clients stopped and every fault healed (the nodes' clocks stay
skewed: see ``harness.skews``): it takes and releases a lock of its own OPS times (after a
few to warm the connections up), and prints as JSON the script calls each node served
meanwhile (``INFO commandstats``, read straight from the nodes). A healthy Redlock answers an
acquire in one round trip to each node, a release in one more: 2 script calls per node per
acquire and release. ``CAMPAIGN_BREAK=roundtrips`` (a self-test) makes each acquire twice.
"""

from __future__ import annotations

import json
import sys
from typing import Any

WARM = 5
OPS = 40
SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def script_calls(node: Any) -> int:
    stats = node.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in SCRIPT_COMMANDS)


def main() -> None:
    config = json.loads(sys.argv[1])
    from .client import Inspector, setup

    setup(config)
    from django_redlock import lock

    nodes = Inspector(config).nodes
    name = f"{config['name']}:roundtrips"
    broken = config.get("break") == "roundtrips"

    def once() -> bool:
        lk = lock(name, ttl=float(config["ttl"]))
        if not lk.acquire(blocking=False):
            return False
        if broken:
            lock(name, ttl=float(config["ttl"])).acquire(blocking=False)  # a wasted call
        lk.release()
        return True

    for _ in range(WARM):
        once()
    before = [script_calls(n) for n in nodes]
    done = sum(once() for _ in range(OPS))
    after = [script_calls(n) for n in nodes]
    print(json.dumps({"ops": done, "calls": [b - a for a, b in zip(before, after, strict=True)]}))


if __name__ == "__main__":
    main()
