-- Everything an operator needs about one lock in one round trip.
-- KEYS: lock, queue, plain waiters.
-- Returns {type, pttl, value or flattened hash, waiters queued or registered}.
local kind = redis.call('TYPE', KEYS[1]).ok
local value = false
if kind == 'string' then
  value = redis.call('GET', KEYS[1])
elseif kind == 'hash' then
  value = redis.call('HGETALL', KEYS[1])
end
local waiters = redis.call('LLEN', KEYS[2])
if KEYS[3] then
  waiters = waiters + redis.call('ZCARD', KEYS[3])
end
return {kind, redis.call('PTTL', KEYS[1]), value, waiters}
