-- Re-fence a hold that is still current, after the database refused its fence as older than
-- one it recorded (the server's clock went back while the name's counter was lost or expired).
-- Only while `token` still holds the key: the name's counter rises above the recorded fence,
-- and the hold itself (its value, hash or lease detail) takes that new fence. A token that
-- holds nothing is left alone: that hold is not current, and stays refused.
-- When the recorded fence is above the hold's (the clock went back), the new fence is also at
-- least ARGV[3], the client's wall clock in us plus a margin: the recorded fence says nothing
-- of fences handed out but never recorded (a holder whose key expired while it paused; a
-- fence counted up from the recorded one), and the counter that knew them is gone. Those
-- came from a server clock that was then at most real time (or counted up from a recorded
-- fence), so a fence above the client's clock + margin is above them too (see
-- docs/topics/fencing.md, "Clocks", for what it cannot cover). Not otherwise (the block only
-- asked whether the hold is current: the row's writer unknown): a counter left ahead of the
-- clock would hand out, after a restart empty within the margin, a fence below it.
-- KEYS: lock, fence counter.
-- ARGV: token, fence recorded in the database (or the hold's own, if larger), least new fence
--       when the recorded one is above the hold's (client's clock us + margin).
-- Returns the hold's new fence (as integer text); when the token holds none: -1 if another hold
-- has the lock now, 0 if nobody does (the hold expired or was released).
--! include _hold
--! include _permits
local lock, counter, token = KEYS[1], KEYS[2], ARGV[1]
local recorded, least = tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local kind = redis.call('TYPE', lock).ok

local ttl, detail, own
if kind == 'zset' then
  if lease_mine(lock, lock .. ':h', token, now) == 0 then
    return redis.call('ZCOUNT', lock, '(' .. ms_text(now), '+inf') > 0 and -1 or 0
  end
  detail = redis.call('HGET', lock .. ':h', token)
  own = tonumber(string.match(detail, '^(%d+)'))
  ttl = tonumber(redis.call('ZSCORE', lock, token)) - now
else
  local count
  count, own = hold_mine(lock, token, kind)
  if count == 0 then
    return kind == 'none' and 0 or -1
  end
  ttl = redis.call('PTTL', lock)
end

local fence = fence_next(counter) -- above the counter, and at least the server's clock
fence = math.max(fence, recorded + 1)
if recorded > (own or 0) then
  fence = math.max(fence, least)
end
local text = string.format('%d', fence)
if kind == 'zset' then
  redis.call('HSET', lock .. ':h', token, text .. string.match(detail, '^%d*(|.*)$'))
elseif kind == 'hash' then
  redis.call('HSET', lock, ':fence', text)
else
  local value = redis.call('GET', lock)
  local rest = string.match(value, '^[^|]*|%d+(|.*)$')
  -- SET drops the TTL: give back what was left (the key lives: PTTL > 0).
  redis.call('SET', lock, token .. '|' .. text .. rest, 'PX', math.max(ttl, 1))
end
-- The last hold given a fence is this one: current, so granted after every other.
fence_keep(counter, text, math.max(ttl, 1), token)
return text
