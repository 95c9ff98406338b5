-- Replace a marker only if it still holds the expected value (compare-and-set), in one step:
-- a coalesced call's note replaced by a later one, or claimed by the follow-up that runs it,
-- is never absent in between (a soft time limit between a delete and a write lost it).
-- KEYS: marker.  ARGV: expected value, new value, TTL in ms.  Returns 1 if replaced.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
