-- Redlock: raise a node's fencing counter to at least the fence the quorum granted, so every
-- later majority (which shares a node with this one) hands out a larger fence.
-- KEYS: fence counter.  ARGV: fence.  Returns 1.
if (tonumber(redis.call('GET', KEYS[1])) or 0) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
