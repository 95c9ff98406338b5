-- Delete a lock whoever holds it (operators only) and wake its waiters. The holder finds
-- the hold gone at its next renewal, extend or release.
-- KEYS: lock, release channel, queue, deadlines, plain waiters.
-- ARGV: inbox channel prefix, expected token, expected fence ('' or absent: any hold).
-- The expectation is the hold the operator was shown (a plain hold's token, a reentrant
-- hold's fence): a lock that changed hands since is left alone. Fences are compared as the
-- strings stored, never as Lua numbers, which print 2e15 as '2e+15'.
-- Returns 1 if the lock was deleted, 0 if it was not held, -1 if another hold has it.
--! include _hold
--! include _wake
--! include _queue
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then
  return 0
end
local token, fence = ARGV[2] or '', ARGV[3] or ''
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
redis.call('DEL', KEYS[1])
lock_freed(KEYS[2], KEYS[5], KEYS[3], KEYS[4], ARGV[1])
return 1
