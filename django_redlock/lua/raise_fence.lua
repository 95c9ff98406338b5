-- Redlock: raise a node's fencing counter to at least the fence the quorum granted, so every
-- later majority (which shares a node with this one) hands out a larger fence.
-- KEYS: fence counter.  ARGV: fence.  Returns 1.
--! include _hold
if (tonumber(redis.call('GET', KEYS[1])) or 0) < tonumber(ARGV[1]) then
  fence_keep(KEYS[1], ARGV[1], 0)
end
return 1
