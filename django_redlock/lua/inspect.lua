-- Everything an operator needs about one lock in one round trip.
-- KEYS: lock, queue, plain waiters[, lease details, waiting writers].
-- Returns {type, pttl, value or flattened hash, waiters queued or registered}; for the
-- leases of a semaphore or read-write lock (a sorted set), the value is
-- {token, ms left, detail, ...} of the live leases and a fifth item is the limit.
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
if KEYS[3] then
  waiters = waiters + redis.call('ZCARD', KEYS[3])
end
if KEYS[5] then
  waiters = waiters + redis.call('ZCARD', KEYS[5])
end
return {kind, redis.call('PTTL', KEYS[1]), value, waiters, limit}
