"""The fenced resource: a store on its own redis-server (the nemesis never touches it).

A write carries the writer's fence. The store accepts it when the fence is greater than the
last one it accepted (a new critical section begins) or equal to it (the same section goes
on), and rejects a smaller one. Every write, accepted or not, is appended to a log with the
writer, its hold, the fence, the phase and the server's time: the checker's history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

LAST = "resource:last"
LOG = "resource:log"

WRITE = """
local last = tonumber(redis.call('GET', KEYS[1]) or '-1')
local fence = tonumber(ARGV[3])
local t = redis.call('TIME')
local verdict = 'rejected'
if fence >= last then
  verdict = 'accepted'
  if fence > last then
    redis.call('SET', KEYS[1], ARGV[3])
  end
end
local n = redis.call('RPUSH', KEYS[2], cjson.encode({
  c = ARGV[1], h = tonumber(ARGV[2]), f = fence, p = ARGV[4], v = verdict, last = last,
  ts = tonumber(t[1]), tu = tonumber(t[2])}))
return {verdict, last, n}
"""


@dataclass
class Write:
    """One entry of the resource's log, in the order the resource applied them."""

    seq: int
    client: str
    hold: int
    fence: int
    phase: str
    accepted: bool
    last: int  # the last accepted fence when this write came in
    t: float  # the resource server's clock (seconds since the epoch)


class Resource:
    """A client of the fenced store (used by the lock clients and by the checker)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.script = client.register_script(WRITE)

    def write(self, client_id: str, hold: int, fence: int, phase: str) -> tuple[bool, int]:
        verdict, last, _ = self.script(keys=[LAST, LOG], args=[client_id, hold, fence, phase])
        return (verdict == b"accepted", int(last))

    def history(self) -> list[Write]:
        entries = self.client.lrange(LOG, 0, -1)
        writes = []
        for i, raw in enumerate(entries):
            d = json.loads(raw)
            writes.append(
                Write(i, d["c"], int(d["h"]), int(d["f"]), d["p"], d["v"] == "accepted",
                      int(d["last"]), d["ts"] + d["tu"] / 1e6)
            )  # fmt: skip
        return writes
