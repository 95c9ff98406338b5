-- A waiter leaves (timed out, cancelled): out of a fair queue or a plain lock's waiters. If
-- the lock is free, the next waiter is woken: the one leaving may have been woken already,
-- and nobody must stall behind someone who left.
-- KEYS: lock, queue, deadlines, plain waiters.  ARGV: waiter id, inbox channel prefix.
--! include _may_publish
--! include _hold
--! include _wake
--! include _queue
local lock, queue, deadlines, waiting = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
may_publish(ARGV[2]) -- the wake-ups below come after its writes: the ACL asked first
redis.call('LREM', queue, 0, ARGV[1])
redis.call('ZREM', deadlines, ARGV[1])
redis.call('ZREM', waiting, ARGV[1])
local now = now_ms()
queue_prune(queue, deadlines, now)
if redis.call('EXISTS', lock) == 0 then -- handed off with a bound, as at a release
  queue_wake_head(queue, deadlines, ARGV[2], true, now, waiting)
  wake_first(waiting, ARGV[2], false, true)
end
return 1
