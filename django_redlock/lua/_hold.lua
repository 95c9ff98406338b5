-- Helpers for the lock's own key, spliced into scripts by `--! include _hold`.
-- A plain hold is a string 'token|fence|acquired-ms|holder' (SET NX PX);
-- a reentrant hold is a hash {owner = count, ':fence', ':at', ':meta'}.

local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end

-- How many holds `token` has on `lock` (0: none), and the hold's fence. `kind`: the key's
-- TYPE, when the caller has it already.
local function hold_mine(lock, token, kind)
  kind = kind or redis.call('TYPE', lock).ok
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

-- The next fence of a name: above its counter, and at least the server's clock in ms x 1000.
-- So a counter lost with the data (restarted empty, flushed, failed over to a lagging replica)
-- starts again above every fence handed out before the loss, unless the server's clock went
-- back meanwhile, or one name was taken 1,000 times a millisecond. Always written and read
-- as integer text: a Lua number turned into text directly would lose digits ('1.76e+15').
local function fence_next(counter, now)
  local fence = math.max((tonumber(redis.call('GET', counter)) or 0) + 1, now * 1000)
  return fence, string.format('%d', fence)
end

-- Take a free lock with the next fence. Returns the fence, or nil when the lock is held.
local function hold_take(lock, counter, token, ttl, meta, reentrant, now)
  local at = string.format('%d', now)
  local fence, text = fence_next(counter, now)
  if reentrant then
    if redis.call('EXISTS', lock) == 1 then
      return nil
    end
    redis.call('HSET', lock, token, 1, ':fence', text, ':at', at, ':meta', meta)
    redis.call('PEXPIRE', lock, ttl)
  elseif not redis.call('SET', lock, token .. '|' .. text .. '|' .. at .. '|' .. meta,
                        'NX', 'PX', ttl) then
    return nil
  end
  redis.call('SET', counter, text)
  return fence
end
