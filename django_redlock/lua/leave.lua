-- A waiter leaves a fair queue (timed out, cancelled). If the lock is free, the new head is
-- woken so the queue never stalls behind someone who left.
-- KEYS: lock, queue, deadlines.  ARGV: waiter id, wake channel prefix.
--! include _hold
--! include _queue
redis.call('LREM', KEYS[2], 0, ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
queue_prune(KEYS[2], KEYS[3], now_ms())
if redis.call('EXISTS', KEYS[1]) == 0 then
  queue_wake_head(KEYS[2], ARGV[2])
end
return 1
