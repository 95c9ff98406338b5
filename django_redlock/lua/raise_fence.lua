-- Redlock: raise a node's fencing counter to at least the fence the quorum granted, so every
-- later majority (which shares a node with this one) hands out a larger fence. Where `token`
-- still holds the lock here with a smaller fence, its hold takes that fence too: one hold,
-- one fence on every node, whichever nodes a reader hears from (inspect, `redlock list`,
-- a release by the fence shown: review rio2, 4). No extra round trip: the same call.
-- KEYS: fence counter, lock.  ARGV: fence, token.  Returns 1.
--! include _hold
local fence = tonumber(ARGV[1])
local count, held = hold_mine(KEYS[2], ARGV[2], 'string')
local last, prior = fence_read(KEYS[1])
if last < fence then
  -- The last hold stays the last; the counter lives as at the acquire: longer than the
  -- hold's TTL when that is longer (review rio4, 3).
  local ttl = count > 0 and redis.call('PTTL', KEYS[2]) or 0
  fence_keep(KEYS[1], ARGV[1], ttl, prior)
end
if count > 0 and held < fence then
  local rest = string.match(redis.call('GET', KEYS[2]), '^[^|]*|%d+(|.*)$')
  redis.call('SET', KEYS[2], ARGV[2] .. '|' .. ARGV[1] .. rest, 'KEEPTTL')
end
return 1
