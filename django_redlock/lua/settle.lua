-- Set a reentrant owner's hold count to what its process believes, after a reply was lost
-- and the count may be one too many (an acquire that went through) or too few. Its process
-- counts every hold of the owner (a thread or task of its own), so its count is the truth.
-- 0 frees the lock and wakes its waiters, as a release does. An owner that holds nothing
-- (it expired, or someone else holds the lock) is left alone.
-- KEYS: lock, release channel (the lock's own key where nobody listens there), plain waiters,
--       queue, deadlines.
-- ARGV: owner, count, inbox channel prefix.  Returns the owner's count now (0: none).
--! include _hold
--! include _wake
--! include _queue
local lock, owner, count = KEYS[1], ARGV[1], tonumber(ARGV[2])
local channel = KEYS[2] ~= lock and KEYS[2] or ''
if hold_mine(lock, owner, 'hash') == 0 then
  return 0
end
if count > 0 then
  redis.call('HSET', lock, owner, count)
  return count
end
redis.call('DEL', lock)
if lock_freed(channel, KEYS[3], KEYS[4], ARGV[3]) then
  lock_wake(KEYS[3], KEYS[4], KEYS[5], ARGV[3])
end
return 0
