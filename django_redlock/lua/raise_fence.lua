-- Redlock: raise a node's fencing counter to at least the fence the quorum granted, so every
-- later majority (which shares a node with this one) hands out a larger fence.
-- KEYS: fence counter.  ARGV: fence.  Returns 1.
--! include _hold
local last, token = fence_read(KEYS[1])
if last < tonumber(ARGV[1]) then
  fence_keep(KEYS[1], ARGV[1], 0, token) -- the last hold stays the last
end
return 1
