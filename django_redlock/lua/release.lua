-- Release one hold of the caller; free the lock when none are left, and wake its waiters:
-- everyone on the release channel, and on a fair lock only the head of the queue.
-- KEYS: lock, release channel [, queue, deadlines].  ARGV: token [, wake channel prefix].
-- Returns the holds left (0: freed), or -1 when the caller holds none (not ours, or lost).
--! include _hold
--! include _queue
local lock, channel, queue, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token = ARGV[1]
local count = hold_mine(lock, token)
if count == 0 then
  return -1
end
if count > 1 then
  return redis.call('HINCRBY', lock, token, -1)
end
redis.call('DEL', lock)
redis.call('PUBLISH', channel, 'released')
if queue then
  queue_prune(queue, deadlines, now_ms())
  queue_wake_head(queue, ARGV[2])
end
return 0
