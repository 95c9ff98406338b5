-- Delete a lock whoever holds it (operators only) and wake its waiters. The holder finds
-- the hold gone at its next renewal, extend or release.
-- KEYS: lock, release channel, queue, deadlines, plain waiters[, lease details,
--       waiting writers].
-- ARGV: inbox channel prefix, expected token, expected fence ('' or absent: any hold).
-- The expectation is the hold the operator was shown (a plain hold's token, a reentrant
-- hold's fence): a lock that changed hands since is left alone. Fences are compared as the
-- strings stored, never as Lua numbers, which print 2e15 as '2e+15'.
-- A semaphore or read-write lock (leases in a sorted set): with a token or a fence, only
-- that lease goes (one permit); with neither, every lease.
-- Returns 1 if the lock was deleted, 0 if it was not held, -1 if another hold has it.
--! include _may_publish
--! include _hold
--! include _wake
--! include _queue
--! include _permits
--! include _permits_wake
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then
  return 0
end
local token, fence = ARGV[2] or '', ARGV[3] or ''
if kind == 'zset' then
  local leases, details, now = KEYS[1], KEYS[6] or (KEYS[1] .. ':h'), now_ms()
  local writers = KEYS[7] or (KEYS[1] .. ':writers')
  local gone = {}
  if token ~= '' then
    local held = lease_mine(leases, details, token, now)
    local detail = redis.call('HGET', details, token) or ''
    if held == 0 then
      return -1
    end
    if fence ~= '' and string.match(detail, '^[^|]*') ~= fence then
      return -1
    end
    gone = {token}
  elseif fence ~= '' then -- the lease with this fence (`redlock release NAME --fence F`)
    for _, each in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
      local detail = redis.call('HGET', details, each) or ''
      if string.match(detail, '^[^|]*') == fence and lease_mine(leases, details, each, now) > 0 then
        gone = {each}
      end
    end
    if #gone == 0 then
      return -1
    end
  else
    gone = redis.call('ZRANGE', leases, 0, -1)
    if #gone == 0 then
      return 0
    end
  end
  -- leases_wake publishes after these writes: the ACL asked first.
  may_publish(ARGV[1], announces(KEYS[2], ARGV[1]) and KEYS[2])
  redis.call('ZREM', leases, unpack(gone))
  redis.call('HDEL', details, unpack(gone))
  local writer = redis.call('HGET', details, ':writer')
  if writer and redis.call('ZSCORE', leases, writer) == false then
    redis.call('HDEL', details, ':writer')
  end
  leases_wake(leases, details, KEYS[2], KEYS[5], KEYS[3], KEYS[4], writers, ARGV[1], now)
  leases_drop_if_empty(leases, details)
  leases_trim(leases, details, now)
  return 1
end
if token ~= '' or fence ~= '' then
  local held_token, held_fence = false, false
  if kind == 'string' then
    held_token, held_fence = string.match(redis.call('GET', KEYS[1]), '^([^|]*)|([^|]*)')
  elseif kind == 'hash' then
    held_fence = redis.call('HGET', KEYS[1], ':fence')
  end
  if (token ~= '' and held_token ~= token) or (fence ~= '' and held_fence ~= fence) then
    return -1
  end
end
if lock_freed(KEYS[1], KEYS[2], KEYS[5], KEYS[3], ARGV[1]) then
  lock_wake(KEYS[5], KEYS[3], KEYS[4], ARGV[1])
end
return 1
