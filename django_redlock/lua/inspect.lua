-- Everything an operator needs about one lock in one round trip.
-- KEYS: lock, queue, plain waiters[, lease details, waiting writers].
-- Returns {type, pttl, value or flattened hash, waiters queued or registered, limit,
--          ms the earliest registered plain waiter has waited (-1: none, or unknown)};
-- for the leases of a semaphore or read-write lock (a sorted set), the value is
-- {token, ms left, detail, ...} of the live leases and the limit is theirs (else false).
--! include _hold
local kind = redis.call('TYPE', KEYS[1]).ok
local value = false
local limit = false
if kind == 'string' then
  value = redis.call('GET', KEYS[1])
elseif kind == 'hash' then
  value = redis.call('HGETALL', KEYS[1])
elseif kind == 'zset' then
  local details = KEYS[4] or (KEYS[1] .. ':h')
  local now = now_ms()
  local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%d', now), '+inf',
                          'WITHSCORES')
  value = {}
  for i = 1, #live, 2 do
    value[#value + 1] = live[i]
    value[#value + 1] = string.format('%d', tonumber(live[i + 1]) - now)
    value[#value + 1] = redis.call('HGET', details, live[i]) or ''
  end
  limit = redis.call('HGET', details, ':limit')
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
if KEYS[5] then
  waiters = waiters + redis.call('ZCARD', KEYS[5])
end
return {kind, redis.call('PTTL', KEYS[1]), value, waiters, limit, longest}
