-- Acquire a plain lock: SET NX PX of our token, with the next fence from a counter that
-- never expires, and the holder's metadata, all in one atomic step.
-- KEYS: lock, fence counter.  ARGV: token, ttl ms, holder metadata.
-- Returns {1, fence} when held by us, {0, pttl} when held by someone else.
local lock, counter = KEYS[1], KEYS[2]
local token, ttl, meta = ARGV[1], ARGV[2], ARGV[3]
local mine = token .. '|'
local fence = (tonumber(redis.call('GET', counter)) or 0) + 1
local now = redis.call('TIME')
local at = string.format('%d', now[1] * 1000 + math.floor(now[2] / 1000))
if redis.call('SET', lock, mine .. fence .. '|' .. at .. '|' .. meta, 'NX', 'PX', ttl) then
  redis.call('INCR', counter)
  return {1, fence}
end
-- Our token is already there: the reply to an earlier try was lost, the hold is ours.
local held = redis.pcall('GET', lock)
if type(held) == 'string' and string.sub(held, 1, #mine) == mine then
  redis.call('PEXPIRE', lock, ttl)
  return {1, tonumber(string.match(held, '^[^|]*|(%d+)'))}
end
return {0, redis.call('PTTL', lock)}
