-- The watchdog's batch: extend many holds in one call, each only if still ours
-- (compare-and-PEXPIRE, as extend.lua does for one).
-- KEYS: the locks.  ARGV: token 1, ttl ms 1, token 2, ttl ms 2, ...
-- Returns one 1 (extended) or 0 (not ours any more) per lock.
--! include _hold
local results = {}
for i, lock in ipairs(KEYS) do
  if hold_mine(lock, ARGV[2 * i - 1]) > 0 then
    results[i] = redis.call('PEXPIRE', lock, ARGV[2 * i])
  else
    results[i] = 0
  end
end
return results
