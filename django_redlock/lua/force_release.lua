-- Delete a lock whoever holds it (operators only) and wake its waiters. The holder finds
-- the hold gone at its next renewal, extend or release.
-- KEYS: lock, release channel, queue, deadlines, plain waiters.  ARGV: inbox channel prefix.
-- Returns 1 if a lock was deleted.
--! include _hold
--! include _wake
--! include _queue
if redis.call('DEL', KEYS[1]) == 0 then
  return 0
end
redis.call('PUBLISH', KEYS[2], 'released')
wake_first(KEYS[5], ARGV[1])
queue_prune(KEYS[3], KEYS[4], now_ms())
queue_wake_head(KEYS[3], ARGV[1])
return 1
