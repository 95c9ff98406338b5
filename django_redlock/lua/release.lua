-- Release one hold of the caller; free the lock when none are left, and wake its waiters
-- (lock_freed in _hold.lua, lock_wake in _queue.lua).
-- KEYS: lock, release channel (the lock's own key where nobody listens there: a key outside
--       the prefix would be refused to a Redis user limited to it), plain waiters, queue,
--       deadlines.
-- ARGV: token, inbox channel prefix[, the hold's kind: '0' plain, '1' reentrant (absent:
--       looked up)].
-- Returns the holds left (0: freed), or -1 when the caller holds none (not ours, or lost).
-- The helpers for waking are spliced in after the common case has returned: a release of a
-- lock nobody waits for never defines them.
--! include _hold
local lock, channel, waiting, queue, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if channel == lock then
  channel = ''
end
local token, inbox = ARGV[1], ARGV[2]
local count = hold_mine(lock, token, ARGV[3] == '1' and 'hash' or ARGV[3] == '0' and 'string'
                                     or nil)
if count == 0 then
  return -1
end
if count > 1 then
  return redis.call('HINCRBY', lock, token, -1)
end
redis.call('DEL', lock)
if not lock_freed(channel, waiting, queue, inbox) then
  return 0
end
--! include _wake
--! include _queue
lock_wake(waiting, queue, deadlines, inbox)
return 0
