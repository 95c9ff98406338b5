-- Release one hold of the caller; free the lock when none are left, and wake its waiters:
-- those that wait on the release channel (Redis Cluster, Redlock), the earliest registered
-- plain waiter, and the head of the fair queue if the name has one (whatever kind is
-- released: a plain try may have taken a free lock before a fair waiter queued).
-- Publishing to nobody costs nothing.
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
redis.call('PUBLISH', channel, 'released')
wake_first(waiting, inbox)
if redis.call('EXISTS', queue) == 1 then
  queue_prune(queue, deadlines, now_ms())
  queue_wake_head(queue, inbox)
end
return 0
