-- Release one hold of the caller; free the lock when none are left, and wake its waiters
-- (lock_freed in _queue.lua).
-- KEYS: lock, release channel, plain waiters, queue, deadlines.
-- ARGV: token, inbox channel prefix.
-- Returns the holds left (0: freed), or -1 when the caller holds none (not ours, or lost).
--! include _hold
--! include _wake
--! include _queue
local lock, channel, waiting, queue, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local token, inbox = ARGV[1], ARGV[2]
local count = hold_mine(lock, token)
if count == 0 then
  return -1
end
if count > 1 then
  return redis.call('HINCRBY', lock, token, -1)
end
redis.call('DEL', lock)
lock_freed(channel, waiting, queue, deadlines, inbox)
return 0
