-- The watchdog's batch: extend many holds in one call, each only if still ours
-- (compare-and-PEXPIRE, as extend.lua does for one).
-- KEYS: the locks.  ARGV[1]: their tokens joined by '|' (a token never holds one).
-- ARGV[2]: one ttl ms for all, or one per lock joined by '|'.
-- Two arguments, not two per lock: packing hundreds of arguments is the client's main cost.
-- Returns one 1 (extended) or 0 (not ours any more) per lock.
--! include _hold
local ttls = {}
for ttl in string.gmatch(ARGV[2], '[^|]+') do
  ttls[#ttls + 1] = ttl
end
local i = 0
local results = {}
for token in string.gmatch(ARGV[1], '[^|]+') do
  i = i + 1
  if hold_mine(KEYS[i], token) > 0 then
    results[i] = redis.call('PEXPIRE', KEYS[i], ttls[i] or ttls[1])
  else
    results[i] = 0
  end
end
return results
