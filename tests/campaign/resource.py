"""The fenced resource: a store on its own redis-server (the nemesis never touches it).

A write carries the writer's fence and its role:

* ``x`` (an exclusive hold: a lock, a write lock): accepted when the fence is at least the
  highest fence accepted so far, of any role (a new critical section begins, or the same one
  goes on), rejected when smaller;
* ``r`` (a read hold of a read-write lock): accepted when the fence is above the highest
  fence an exclusive writer has had accepted (readers share the resource; a writer granted
  after this read began means the read's lease had ended);
* ``s`` (a semaphore permit): fences of concurrent permits interleave, so they cannot order
  the permits; the write carries instead the permit's expiry on the lock server's clock, as
  read from that server just before (ms; one host, one clock), and is accepted only while
  the resource's clock is before it. A lease lives until its expiry unless its own holder
  releases it (renewals only move the expiry later), so an accepted permit write was made
  under a live permit; a holder paused past its expiry is rejected.

Every write, accepted or not, is appended to a log with the writer, its hold, the fence, the
role, the phase, the expiry (``s``) and the server's time: the checker's history. Fences go
into the log as text: cjson would round 16-digit numbers to 14 significant digits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

LAST = "resource:last"  # the highest fence accepted, any role
LAST_X = "resource:last-x"  # the highest fence accepted from an exclusive hold
LOG = "resource:log"

WRITE = """
local last_text = redis.call('GET', KEYS[1]) or '-1'
local last = tonumber(last_text)
local last_x = tonumber(redis.call('GET', KEYS[3]) or '-1')
local fence, role = tonumber(ARGV[3]), ARGV[5]
local expiry = tonumber(ARGV[6])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ok
if role == 's' then
  ok = expiry ~= nil and now < expiry
elseif role == 'r' then
  ok = fence > last_x
else
  ok = fence >= last
end
local verdict = 'rejected'
if ok then
  verdict = 'accepted'
  if role ~= 's' and fence > last then
    redis.call('SET', KEYS[1], ARGV[3])
  end
  if role == 'x' and fence > last_x then
    redis.call('SET', KEYS[3], ARGV[3])
  end
end
local n = redis.call('RPUSH', KEYS[2], cjson.encode({
  c = ARGV[1], h = tonumber(ARGV[2]), f = ARGV[3], p = ARGV[4], v = verdict, last = last_text,
  k = role, e = expiry or -1, ts = tonumber(t[1]), tu = tonumber(t[2])}))
return {verdict, last_text, n}
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
    role: str = "x"  # x exclusive, r read, s semaphore permit
    expiry: int = -1  # s: the permit's expiry read before the write (server ms; -1: unknown)


class Resource:
    """A client of the fenced store (used by the lock clients and by the checker)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.script = client.register_script(WRITE)

    def write(
        self,
        client_id: str,
        hold: int,
        fence: int,
        phase: str,
        role: str = "x",
        expiry: int | None = None,
    ) -> tuple[bool, int]:
        args = [client_id, hold, fence, phase, role, "" if expiry is None else expiry]
        verdict, last, _ = self.script(keys=[LAST, LOG, LAST_X], args=args)
        return (verdict == b"accepted", int(last))

    def history(self) -> list[Write]:
        entries = self.client.lrange(LOG, 0, -1)
        writes = []
        for i, raw in enumerate(entries):
            d = json.loads(raw)
            writes.append(
                Write(i, d["c"], int(d["h"]), int(d["f"]), d["p"], d["v"] == "accepted",
                      int(d["last"]), d["ts"] + d["tu"] / 1e6, d.get("k", "x"),
                      int(d.get("e", -1)))
            )  # fmt: skip
        return writes
