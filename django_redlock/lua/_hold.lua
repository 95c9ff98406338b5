-- Helpers for the lock's own key, spliced into scripts by `--! include _hold`.
-- A plain hold is a string 'token|fence|acquired-ms|holder' (SET NX PX);
-- a reentrant hold is a hash {owner = count, ':fence', ':at', ':meta'}.

local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end

-- How many holds `token` has on `lock` (0: none), and the hold's fence.
local function hold_mine(lock, token)
  local kind = redis.call('TYPE', lock).ok
  if kind == 'string' then
    local value = redis.call('GET', lock)
    if string.sub(value, 1, #token + 1) == token .. '|' then
      return 1, tonumber(string.match(value, '^[^|]*|(%d+)'))
    end
  elseif kind == 'hash' then
    local count = tonumber(redis.call('HGET', lock, token))
    if count then
      return count, tonumber(redis.call('HGET', lock, ':fence'))
    end
  end
  return 0, nil
end

-- Take a free lock: the next fence from a counter that never expires or goes backwards.
-- Returns the fence, or nil when the lock is held.
local function hold_take(lock, counter, token, ttl, meta, reentrant, now)
  local fence = (tonumber(redis.call('GET', counter)) or 0) + 1
  local at = string.format('%d', now)
  if reentrant then
    if redis.call('EXISTS', lock) == 1 then
      return nil
    end
    redis.call('HSET', lock, token, 1, ':fence', fence, ':at', at, ':meta', meta)
    redis.call('PEXPIRE', lock, ttl)
  elseif not redis.call('SET', lock, token .. '|' .. fence .. '|' .. at .. '|' .. meta,
                        'NX', 'PX', ttl) then
    return nil
  end
  redis.call('INCR', counter)
  return fence
end
