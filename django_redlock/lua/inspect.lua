-- Everything an operator needs about one lock in one round trip.
-- KEYS: lock, queue, plain waiters.
-- Returns {type, pttl, value or flattened hash, waiters queued or registered,
--          ms the earliest registered plain waiter has waited (-1: none, or unknown)}.
local kind = redis.call('TYPE', KEYS[1]).ok
local value = false
if kind == 'string' then
  value = redis.call('GET', KEYS[1])
elseif kind == 'hash' then
  value = redis.call('HGETALL', KEYS[1])
end
local waiters = redis.call('LLEN', KEYS[2])
local longest = -1
if KEYS[3] then
  local registered = redis.call('ZCARD', KEYS[3])
  waiters = waiters + registered
  if registered > 0 then
    -- Plain waiters are scored by their arrival, server ms (fair ones keep no arrival).
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    local t = redis.call('TIME')
    longest = math.max(0, t[1] * 1000 + math.floor(t[2] / 1000) - tonumber(first[2]))
  end
end
return {kind, redis.call('PTTL', KEYS[1]), value, waiters, longest}
